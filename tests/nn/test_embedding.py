"""The vocab-parallel lookup ops against F.embedding on a masked table, opcheck and gradcheck;
VocabParallelEmbedding on 1-4 gloo ranks against the unsharded nn.Embedding."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.library import opcheck

import autoshard
import autoshard.nn
from autoshard.core import ops
from multirank import run_on_ranks

VOCAB, DIM = 1001, 11


def masked_table(full, start, rows):
    """The full table with every row this rank does not hold zeroed."""
    masked = torch.zeros_like(full)
    masked[start : start + rows] = full[start : start + rows]
    return masked


def random_ids(shape, vocab, generator, dtype=torch.int64):
    return torch.randint(0, vocab, shape, generator=generator).to(dtype)


# ---- the ops, one process


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("ids_shape", [(37,), (4, 9), (2, 3, 5), (0,)])
def test_lookup_matches_embedding_on_masked_table(id_dtype, dtype, ids_shape):
    g = torch.Generator().manual_seed(0)
    vocab, dim = 50, 7
    full = (torch.randn(vocab, dim, generator=g) * 10).to(dtype)
    for start, rows in [(0, 17), (17, 17), (34, 16), (0, 50), (20, 0)]:
        ids = random_ids(ids_shape, vocab, g, id_dtype)
        got = ops.vocab_parallel_lookup(ids, full[start : start + rows], start, -1, vocab)
        want = F.embedding(ids, masked_table(full, start, rows))
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_lookup_reads_non_contiguous_inputs():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(30, 8, generator=g)
    local_t = full[10:20].t().contiguous().t()  # same values, column-major
    ids = random_ids((6, 10), 30, g).t()
    got = ops.vocab_parallel_lookup(ids, local_t, 10, -1, 30)
    torch.testing.assert_close(got, F.embedding(ids, masked_table(full, 10, 10)), rtol=0, atol=0)


def test_partial_lookups_sum_to_full_lookup():
    g = torch.Generator().manual_seed(2)
    full = torch.randn(VOCAB, DIM, generator=g)
    ids = random_ids((8, 33), VOCAB, g)
    total = torch.zeros(8, 33, DIM)
    start = 0
    for rows in autoshard.split_sizes(VOCAB, 3):
        total += ops.vocab_parallel_lookup(ids, full[start : start + rows], start, -1, VOCAB)
        start += rows
    torch.testing.assert_close(total, F.embedding(ids, full), rtol=0, atol=0)


def embedding_grad(ids, grad_out, vocab, dim, padding_idx, dtype=torch.float64):
    """The full table's gradient, from nn.Embedding's own backward."""
    table = torch.zeros(vocab, dim, dtype=dtype, requires_grad=True)
    F.embedding(ids, table, padding_idx=padding_idx).backward(grad_out.to(dtype))
    return table.grad


@pytest.mark.parametrize("padding_idx", [None, 0, 23, 49])
def test_backward_matches_embedding_gradient(padding_idx):
    g = torch.Generator().manual_seed(3)
    vocab, dim = 50, 6
    ids = random_ids((5, 40), vocab, g)
    ids[0, :10] = 23  # many repeats of one row (and of the padding row)
    grad_out = torch.randn(5, 40, dim, generator=g, dtype=torch.float64)
    want = embedding_grad(ids, grad_out, vocab, dim, padding_idx)
    pad = -1 if padding_idx is None else padding_idx
    for start, rows in [(0, 17), (17, 17), (34, 16), (0, 50), (5, 0)]:
        got = ops.vocab_parallel_lookup_backward(grad_out, ids, rows, start, pad)
        torch.testing.assert_close(got, want[start : start + rows], rtol=1e-12, atol=1e-12)
        # The same through autograd on the lookup.
        local = torch.randn(rows, dim, dtype=torch.float64, requires_grad=True)
        ops.vocab_parallel_lookup(ids, local, start, pad, vocab).backward(grad_out)
        torch.testing.assert_close(local.grad, want[start : start + rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backward_low_precision_is_summed_in_float(dtype):
    g = torch.Generator().manual_seed(4)
    ids = torch.full((4000,), 3)  # 4000 contributions to one row: rounding would show at once
    ids[::7] = 5
    grad_out = torch.rand(4000, 8, generator=g).to(dtype)
    got = ops.vocab_parallel_lookup_backward(grad_out, ids, 6, 0, -1)
    want = embedding_grad(ids, grad_out.double(), 6, 8, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)


def test_backward_does_not_depend_on_thread_count():
    g = torch.Generator().manual_seed(5)
    ids = random_ids((20000,), 300, g)
    grad_out = torch.randn(20000, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.vocab_parallel_lookup_backward(grad_out, ids, 150, 100, 120)
        torch.set_num_threads(2)
        two = ops.vocab_parallel_lookup_backward(grad_out, ids, 150, 100, 120)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, embedding_grad(ids, grad_out, 300, 64, 120).float()[100:250])


def test_gradcheck_lookup():
    g = torch.Generator().manual_seed(6)
    ids = random_ids((3, 7), 12, g)
    ids[0, :3] = 5  # repeated rows
    local = torch.randn(5, 4, dtype=torch.float64, requires_grad=True, generator=g)
    # A padding row that is not held: held padding rows are read but get no gradient, as in
    # nn.Embedding, which numerical differentiation would (rightly) disagree with.
    fn = lambda w: ops.vocab_parallel_lookup(ids, w, 4, 11, 12)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (local,))
    assert torch.autograd.gradgradcheck(fn, (local,))


def test_gradcheck_lookup_backward():
    g = torch.Generator().manual_seed(7)
    ids = random_ids((3, 7), 12, g)
    ids[1, :4] = 6  # the padding row, held
    grad_out = torch.randn(3, 7, 4, dtype=torch.float64, requires_grad=True, generator=g)
    fn = lambda grad: ops.vocab_parallel_lookup_backward(grad, ids, 5, 4, 6)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (grad_out,))
    assert torch.autograd.gradgradcheck(fn, (grad_out,))


def opcheck_cases(device):
    g = torch.Generator().manual_seed(8)
    ids = random_ids((4, 6), 20, g).to(device)
    lookup = torch.ops.autoshard.vocab_parallel_lookup.default
    backward = torch.ops.autoshard.vocab_parallel_lookup_backward.default

    def table(rows, dim=5, dtype=torch.float32):
        t = torch.randn(rows, dim, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(dtype.is_floating_point)

    def grad(dim=5):
        return torch.randn(4, 6, dim, generator=g).to(device).requires_grad_()

    return [
        (lookup, (ids, table(7), 7, -1, 20)),
        (lookup, (ids, table(7), 7, 9, 20)),
        (lookup, (ids.int(), table(20, dtype=torch.float64), 0, 0, 20)),
        (lookup, (ids[:, :0], table(3), 2, -1, 20)),
        (lookup, (ids, table(4, dtype=torch.int32), 16, -1, 20)),
        (backward, (grad(), ids, 7, 7, -1)),
        (backward, (grad(), ids.int(), 7, 7, 9)),
        (backward, (grad(3), ids, 0, 20, -1)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck_cpu(case):
    op, args = opcheck_cases("cpu")[case]
    opcheck(op, args)


def test_meta_kernels_give_shapes_without_memory():
    ids = torch.empty(8, 4096, dtype=torch.int64, device="meta")
    table = torch.empty(64000, 8192, device="meta", dtype=torch.bfloat16)
    out = ops.vocab_parallel_lookup(ids, table, 64000, -1, 128000)
    assert out.device.type == "meta" and out.shape == (8, 4096, 8192) and out.dtype == torch.bfloat16
    grad = ops.vocab_parallel_lookup_backward(out, ids, 64000, 64000, 5)
    assert grad.device.type == "meta" and grad.shape == (64000, 8192)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: ops.vocab_parallel_lookup(torch.tensor([3, 10, 2]), torch.ones(4, 2), 2, -1, 10), IndexError,
         ["ids", "[0, vocab_size) = [0, 10)", "10", "position 1"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([[3, 4], [-1, 2]]), torch.ones(4, 2), 2, -1, 10), IndexError,
         ["ids", "-1", "position 2"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([1.0]), torch.ones(4, 2), 2, -1, 10), TypeError,
         ["ids", "integer", "Float"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([1]), torch.ones(4), 2, -1, 10), ValueError,
         ["weight", "2-d", "1-d"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([1]), torch.ones(4, 2), 8, -1, 10), ValueError,
         ["vocab_start", "[8, 12)", "[0, 10)"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([1]), torch.ones(4, 2), -1, -1, 10), ValueError,
         ["vocab_start", "-1"]),
        (lambda: ops.vocab_parallel_lookup(torch.tensor([1]), torch.ones(4, 2), 2, 10, 10), ValueError,
         ["padding_idx", "[0, 10)", "10"]),
        (lambda: ops.vocab_parallel_lookup_backward(torch.ones(3, 2), torch.tensor([1, 2]), 4, 0, -1), ValueError,
         ["grad", "ids.shape"]),
        (lambda: ops.vocab_parallel_lookup_backward(torch.ones(2, 2, dtype=torch.int64), torch.tensor([1, 2]), 4, 0,
                                                    -1), TypeError, ["grad", "floating"]),
        (lambda: ops.vocab_parallel_lookup_backward(torch.ones(2, 2), torch.tensor([1, 2]), -4, 0, -1), ValueError,
         ["num_rows", "-4"]),
        (lambda: ops.vocab_parallel_lookup_backward(torch.ones(2, 2), torch.tensor([1, 2]), 4, 0, -3), ValueError,
         ["padding_idx", "-3"]),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_layer_needs_initialised_distributed():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        autoshard.nn.VocabParallelEmbedding(VOCAB, DIM)


def test_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm.*not supported"):
        autoshard.nn.VocabParallelEmbedding(VOCAB, DIM, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        autoshard.nn.VocabParallelEmbedding.from_embedding(nn.Embedding(VOCAB, DIM, max_norm=2.0))
    with pytest.raises(ValueError, match="sparse"):
        autoshard.nn.VocabParallelEmbedding.from_embedding(nn.Embedding(VOCAB, DIM, sparse=True))
    with pytest.raises(TypeError, match="nn.Embedding"):
        autoshard.nn.VocabParallelEmbedding.from_embedding(nn.Linear(3, 4))


# ---- the layer, on 1-4 gloo ranks (sizes that divide nothing)


def _embedding_matches_unsharded(padding_idx):
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
    layer = autoshard.nn.VocabParallelEmbedding.from_embedding(full)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (6, 17), generator=g)
    ids[0, :5] = full.padding_idx
    # Every rank's first and last row (all ranks must see the same ids).
    starts = np.cumsum([0] + autoshard.split_sizes(VOCAB, torch.distributed.get_world_size()))
    edges = sorted({int(s) for s in starts[:-1]} | {int(s) - 1 for s in starts[1:]})
    ids[1, : len(edges)] = torch.tensor(edges)
    grad_out = torch.randn(6, 17, DIM, generator=g)
    want = full(ids)
    want.backward(grad_out)
    with autoshard.CommCounter() as forward:
        got = layer(ids)
    with autoshard.CommCounter() as backward:
        got.backward(grad_out)
    spec = layer.shard_specs["weight"]
    return {
        "comm": (forward.counts, backward.counts),
        "out_error": (got - want).abs().max().item(),
        "grad_error": (layer.weight.grad - full.weight.grad[layer.vocab_start : layer.vocab_end]).abs().max().item(),
        "padding_grad": full.weight.grad[full.padding_idx].abs().max().item(),
        "rows": tuple(layer.weight.shape),
        "spec": (spec.dim, spec.full_size, spec.rank, spec.world_size),
        "start": layer.vocab_start,
        "padding_idx": layer.padding_idx,
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_embedding_with_padding_matches_unsharded(world_size):
    results = run_on_ranks(_embedding_matches_unsharded, world_size, -2)
    sizes = autoshard.split_sizes(VOCAB, world_size)
    for rank, r in enumerate(results):
        assert r["out_error"] <= 1e-5 and r["grad_error"] <= 1e-5, r
        assert r["padding_grad"] == 0.0
        assert r["rows"] == (sizes[rank], DIM)
        assert r["start"] == sum(sizes[:rank])
        assert r["spec"] == (0, VOCAB, rank, world_size)
        assert r["padding_idx"] == VOCAB - 2  # normalised like nn.Embedding
        # One all-reduce of the partial lookups; backward needs none.
        assert r["comm"] == (({"all_reduce": 1} if world_size > 1 else {}), {})


def _constructed_layer(padding_idx, dtype):
    torch.manual_seed(dist_rank := torch.distributed.get_rank())
    layer = autoshard.nn.VocabParallelEmbedding(VOCAB, DIM, padding_idx=padding_idx, dtype=dtype)
    held = layer.vocab_start <= layer.padding_idx < layer.vocab_end
    padding_row = layer.weight[layer.padding_idx - layer.vocab_start].abs().max().item() if held else None
    # Each rank's share of the full lookup is its own rows: compare against the gathered table.
    rows = [torch.empty(s, DIM, dtype=dtype) for s in autoshard.split_sizes(VOCAB, torch.distributed.get_world_size())]
    padded = max(r.shape[0] for r in rows)
    local = torch.zeros(padded, DIM, dtype=dtype)
    local[: layer.weight.shape[0]] = layer.weight.detach()
    gathered = [torch.empty(padded, DIM, dtype=dtype) for _ in rows]
    torch.distributed.all_gather(gathered, local)
    table = torch.cat([g[: r.shape[0]] for g, r in zip(gathered, rows)])
    ids = torch.arange(VOCAB).reshape(7, 143)
    return {
        "rank": dist_rank,
        "padding_row": padding_row,
        "error": (layer(ids) - F.embedding(ids, table)).abs().max().item(),
        "dtype": layer.weight.dtype,
    }


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_constructed_layer_looks_up_every_row(world_size):
    results = run_on_ranks(_constructed_layer, world_size, 500, torch.float64)
    assert sum(r["padding_row"] is not None for r in results) == 1
    for r in results:
        assert r["error"] == 0.0 and r["dtype"] == torch.float64
        assert r["padding_row"] in (None, 0.0)


def _meta_in_meta_out():
    with torch.device("meta"):
        full = nn.Embedding(128000, 4096, padding_idx=0)
    layer = autoshard.nn.VocabParallelEmbedding.from_embedding(full)
    out = layer(torch.zeros(2, 5, dtype=torch.int64, device="meta"))
    return layer.weight.device.type, tuple(layer.weight.shape), out.device.type, tuple(out.shape)


def test_from_meta_embedding_stays_on_meta():
    results = run_on_ranks(_meta_in_meta_out, 3)
    sizes = autoshard.split_sizes(128000, 3)
    assert results == [("meta", (s, 4096), "meta", (2, 5, 4096)) for s in sizes]


# ---- CUDA: the one-launch kernels against the CPU kernels (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_matches_cpu(dtype):
    g = torch.Generator().manual_seed(9)
    for start, rows in [(0, 334), (334, 334), (668, 333), (0, VOCAB)]:
        local = torch.randn(rows, 129, generator=g).to(dtype)
        ids = random_ids((16, 300), VOCAB, g)
        for id_dtype in (torch.int64, torch.int32):
            want = ops.vocab_parallel_lookup(ids.to(id_dtype), local, start, 7, VOCAB)
            got = ops.vocab_parallel_lookup(ids.to(id_dtype).cuda(), local.cuda(), start, 7, VOCAB)
            assert got.is_cuda
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
        grad_out = torch.randn(16, 300, 129, generator=g).to(dtype)
        want = ops.vocab_parallel_lookup_backward(grad_out, ids, rows, start, 7)
        got = ops.vocab_parallel_lookup_backward(grad_out.cuda(), ids.cuda(), rows, start, 7)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(8))
def test_opcheck_cuda(case):
    op, args = opcheck_cases("cuda")[case]
    opcheck(op, args)
