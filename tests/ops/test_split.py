"""array_split / shard / split_sizes against numpy.array_split, opcheck and gradcheck."""


import numpy as np
import pytest
import torch
from torch.library import opcheck

import autoshard
from autoshard.core import _library

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


def random_tensor(shape, dtype, rng):
    if dtype == torch.bool:
        return torch.from_numpy(rng.random(shape) > 0.5)
    if dtype == torch.int64:
        return torch.from_numpy(rng.integers(-1000, 1000, size=shape))
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


def as_numpy(t):
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def maybe_non_contiguous(x, rng):
    """Half of the time, the same values behind a non-contiguous layout."""
    kind = rng.integers(0, 4)
    if kind == 0 or x.dim() < 2:
        if kind == 1:  # every other element of a larger tensor
            big = torch.zeros((x.shape[0] * 2,) + tuple(x.shape[1:]), dtype=x.dtype)
            big[::2] = x
            return big[::2]
        return x
    if kind == 2:  # transposed storage
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    big = torch.zeros(tuple(x.shape[:-1]) + (x.shape[-1] * 3,), dtype=x.dtype)
    big[..., 1::3] = x
    return big[..., 1::3]


def random_case(rng):
    ndim = int(rng.integers(1, 5))
    shape = tuple(int(s) for s in rng.integers(0, 7, size=ndim))
    dim = int(rng.integers(-ndim, ndim))
    if rng.random() < 0.5:
        arg = int(rng.integers(1, 10))  # often more sections than elements: empty pieces
    else:
        length = shape[dim]
        count = int(rng.integers(0, 5))
        # Out-of-range, negative, repeated and decreasing indices all occur.
        arg = [int(i) for i in rng.integers(-length - 3, length + 4, size=count)]
    dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
    return shape, dim, arg, dtype


def test_array_split_matches_numpy_on_random_cases():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(1500):
        shape, dim, arg, dtype = random_case(rng)
        x = maybe_non_contiguous(random_tensor(shape, dtype, rng), rng)
        expected = np.array_split(as_numpy(x), arg, axis=dim)
        pieces = autoshard.array_split(x, arg, dim=dim)
        assert len(pieces) == len(expected), (shape, dim, arg)
        for piece, want in zip(pieces, expected):
            assert piece.dtype == x.dtype
            assert piece.is_contiguous()
            assert tuple(piece.shape) == want.shape, (shape, dim, arg)
            np.testing.assert_array_equal(as_numpy(piece), want)
        checked += 1
    assert checked == 1500


def test_split_sizes_matches_numpy():
    for length in range(0, 40):
        for sections in range(1, 12):
            expected = [len(p) for p in np.array_split(np.arange(length), sections)]
            assert autoshard.split_sizes(length, sections) == expected
    assert autoshard.split_sizes(10, 3) == [4, 3, 3]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_is_one_piece_of_array_split(world_size, dim):
    x = torch.randn(5, 11, 3)
    pieces = autoshard.array_split(x, world_size, dim=dim)
    for rank in range(world_size):
        piece = autoshard.shard(x, rank, world_size, dim=dim)
        assert piece.is_contiguous()
        torch.testing.assert_close(piece, pieces[rank], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(pieces, dim=dim), x, rtol=0, atol=0)


def test_large_contiguous_split_uses_every_row():
    # Big enough that the CPU kernel's parallel row and block paths both run.
    x = torch.randn(700, 1000)
    for dim in (0, 1):
        for got, want in zip(autoshard.array_split(x, 3, dim), np.array_split(x.numpy(), 3, axis=dim)):
            np.testing.assert_array_equal(got.numpy(), want)


def test_accepts_numpy_and_tensor_arguments():
    x = torch.arange(10)
    want = np.array_split(np.arange(10), [2, 5])
    for indices in ([2, 5], (2, 5), np.array([2, 5]), torch.tensor([2, 5])):
        got = autoshard.array_split(x, indices)
        assert [p.tolist() for p in got] == [w.tolist() for w in want]
    assert [p.tolist() for p in autoshard.array_split(x, np.int64(3))] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert len(autoshard.array_split(x, torch.tensor(3))) == 3


def test_gradient_lands_in_place():
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    pieces = autoshard.array_split(x, 3, dim=1)
    weights = [torch.randn_like(p) for p in pieces]
    sum(((p * w).sum() for p, w in zip(pieces, weights))).backward()
    torch.testing.assert_close(x.grad, torch.cat(weights, dim=1), rtol=0, atol=0)


def test_unused_pieces_get_zero_gradient():
    x = torch.randn(10, requires_grad=True)
    autoshard.array_split(x, 3)[1].sum().backward()
    assert x.grad.tolist() == [0.0] * 4 + [1.0] * 3 + [0.0] * 3


@pytest.mark.parametrize(
    "call",
    [
        lambda x: autoshard.array_split(x, 3, dim=1),
        lambda x: autoshard.array_split(x, 7, dim=0),
        lambda x: autoshard.array_split(x, [1, 4, 2, -1, 20], dim=1),  # overlapping pieces and a gap
        lambda x: autoshard.array_split(x, [], dim=-1),
        lambda x: (autoshard.shard(x, 2, 3, dim=1),),
        lambda x: (autoshard.shard(x, 0, 2, dim=0),),
    ],
)
def test_gradcheck(call):
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: tuple(call(t)), (x,))
    assert torch.autograd.gradgradcheck(lambda t: tuple(call(t)), (x,))


def opcheck_cases(device):
    x = torch.randn(5, 7, device=device, requires_grad=True)
    xt = torch.randn(7, 5, device=device, requires_grad=True).t()
    ops = torch.ops.autoshard
    return [
        (ops.array_split.default, (x, 3, 1)),
        (ops.array_split.default, (xt, 4, 0)),
        (ops.array_split.default, (torch.randn(4, 3, 2, device=device).to(torch.bfloat16), 2, -1)),
        (ops.array_split.indices, (x, [2, 1, 9], 1)),
        (ops.array_split.indices, (xt, [-2], 0)),
        (ops.shard.default, (x, 1, 3, -1)),
        (ops.shard.default, (torch.arange(10, device=device), 2, 3, 0)),
        (ops.unsplit.default, ([torch.randn(5, 2, device=device, requires_grad=True),
                                torch.randn(5, 3, device=device, requires_grad=True)], [0, 1], 7, 1)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck_cpu(case):
    op, args = opcheck_cases("cpu")[case]
    opcheck(op, args)


def test_meta_kernels_give_shapes_without_memory():
    x = torch.empty(10, 4096, 4096, device="meta")
    pieces = autoshard.array_split(x, 3)
    assert [tuple(p.shape) for p in pieces] == [(4, 4096, 4096), (3, 4096, 4096), (3, 4096, 4096)]
    assert all(p.device.type == "meta" for p in pieces)
    assert autoshard.shard(x, 2, 4, dim=-1).shape == (10, 4096, 1024)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: autoshard.array_split(torch.ones(4), 0), ValueError, ["sections", "positive", "0"]),
        (lambda: autoshard.array_split(torch.ones(4), -2), ValueError, ["sections", "-2"]),
        (lambda: autoshard.array_split(torch.ones(4, 2), 2, dim=2), IndexError, ["dim", "[-2, 2)", "2"]),
        (lambda: autoshard.array_split(torch.ones(4, 2), 2, dim=-3), IndexError, ["dim", "-3"]),
        (lambda: autoshard.array_split(torch.tensor(1.0), 2), IndexError, ["self", "0-d"]),
        (lambda: autoshard.array_split([1, 2, 3], 2), TypeError, ["x", "torch.Tensor", "list"]),
        (lambda: autoshard.array_split(torch.ones(4), 2.5), TypeError, ["sections_or_indices", "float"]),
        (lambda: autoshard.array_split(torch.ones(4), [1.5]), TypeError, ["sections_or_indices", "float"]),
        (lambda: autoshard.array_split(torch.ones(4), 2, dim="0"), TypeError, ["dim", "str"]),
        (lambda: autoshard.shard(torch.ones(4), 3, 3), IndexError, ["rank", "[0, 3)", "3"]),
        (lambda: autoshard.shard(torch.ones(4), 0, 0), ValueError, ["world_size", "positive", "0"]),
        (lambda: autoshard.shard(None, 0, 2), TypeError, ["x", "NoneType"]),
        (lambda: autoshard.split_sizes(10, 0), ValueError, ["sections", "0"]),
        (lambda: autoshard.split_sizes(-1, 2), ValueError, ["length", "-1"]),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_library_built_for_another_torch_is_refused(monkeypatch):
    from autoshard import _build_info

    monkeypatch.setattr(_build_info, "TORCH_VERSION", "0.0.1")
    with pytest.raises(ImportError, match="built for torch 0.0.1"):
        _library.load()


# ---- CUDA: the one-launch kernel against the CPU kernel (skipped without a GPU)


@pytest.mark.gpu
def test_cuda_matches_cpu_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(400):
        shape, dim, arg, dtype = random_case(rng)
        x = maybe_non_contiguous(random_tensor(shape, dtype, rng), rng)
        want = autoshard.array_split(x, arg, dim=dim)
        got = autoshard.array_split(x.cuda(), arg, dim=dim)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.is_cuda and g.is_contiguous()
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_many_pieces_and_complex():
    x = torch.randn(200, 33, dtype=torch.complex128)
    want = autoshard.array_split(x, 150)  # more pieces than one launch's table holds
    got = autoshard.array_split(x.cuda(), 150)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(8))
def test_opcheck_cuda(case):
    op, args = opcheck_cases("cuda")[case]
    opcheck(op, args)
