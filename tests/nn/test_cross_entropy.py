"""vocab_parallel_cross_entropy against torch's cross_entropy of the whole logits, on 1 (opcheck),
2, 3 and 4 gloo ranks, with vocabulary sizes the ranks do not divide: every reduction,
ignore_index, label_smoothing, float32, float64 and bfloat16, the gradient against autograd
through torch's loss, the collectives counted, and bad input.

Every rank rebuilds the whole logits from a seed and keeps its split_sizes piece, so torch's
loss on the whole tensor is the ground truth on each rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.nn.functional import vocab_parallel_cross_entropy
from checks import expect_errors, opcheck_all
from multirank import run_on_ranks

VOCABS = (50, 13, 7)  # 50 over 3 ranks is [17, 17, 16]; 13 and 7 divide evenly by none of 2, 3, 4
SHAPE = (3, 5)  # batch x sequence: 15 rows


def _full_logits(vocab, dtype, seed=0):
    # A spread of magnitudes, and large offsets, so that an unshifted exp would overflow.
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*SHAPE, vocab, generator=generator, dtype=torch.float64) * 4
    x += 80.0 * torch.randn(*SHAPE, 1, generator=generator, dtype=torch.float64)
    return x.to(dtype)


def _labels(vocab, ignore_index, seed=1):
    labels = torch.randint(0, vocab, SHAPE, generator=torch.Generator().manual_seed(seed))
    labels[0, 1] = ignore_index
    labels[2, 4] = ignore_index
    labels[1, 0] = vocab - 1  # the last rank's last column
    labels[1, 1] = 0
    return labels


def _upstream(reduction, rows, seed=2):
    generator = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.randn(rows, generator=generator, dtype=torch.float64)
    return torch.tensor(1.7, dtype=torch.float64)


def _tolerance(dtype):
    return {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[dtype]


def _check_against_torch():
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for vocab in VOCABS:
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            full = _full_logits(vocab, dtype)
            for ignore_index in (-100, 3):
                labels = _labels(vocab, ignore_index)
                for smoothing in (0.0, 0.1):
                    for reduction in ("mean", "sum", "none"):
                        # Ground truth: torch on the whole logits, in float64 for bf16 inputs (our
                        # loss is computed in float32 and rounded once), and torch in the same dtype.
                        ref_dtype = torch.float64 if dtype == torch.bfloat16 else dtype
                        whole = full.to(ref_dtype).clone().requires_grad_()
                        want = F.cross_entropy(whole.view(-1, vocab), labels.view(-1), ignore_index=ignore_index,
                                               label_smoothing=smoothing, reduction=reduction)
                        upstream = _upstream(reduction, labels.numel())
                        want.backward(upstream.to(ref_dtype))
                        want_grad = autoshard.shard(whole.grad, rank, world, dim=-1)

                        shard = autoshard.shard(full, rank, world, dim=-1).clone().requires_grad_()
                        got = vocab_parallel_cross_entropy(shard, labels, ignore_index=ignore_index,
                                                           label_smoothing=smoothing, reduction=reduction)
                        assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
                        what = f"V={vocab} {dtype} ignore={ignore_index} eps={smoothing} {reduction}"
                        torch.testing.assert_close(got.to(ref_dtype), want.detach(), **_tolerance(dtype),
                                                   msg=lambda m: f"loss {what}: {m}")
                        if dtype == torch.bfloat16:
                            same_dtype = F.cross_entropy(full.view(-1, vocab), labels.view(-1),
                                                         ignore_index=ignore_index, label_smoothing=smoothing,
                                                         reduction=reduction)
                            torch.testing.assert_close(got, same_dtype, rtol=2e-2, atol=5e-2)
                        got.backward(upstream.to(dtype))
                        assert shard.grad.dtype == dtype and shard.grad.shape == shard.shape
                        torch.testing.assert_close(shard.grad.to(ref_dtype), want_grad, **_tolerance(dtype),
                                                   msg=lambda m: f"grad {what}: {m}")
                        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_torch_cross_entropy(world_size):
    cases = len(VOCABS) * 3 * 2 * 2 * 3
    assert run_on_ranks(_check_against_torch, world_size, timeout=600) == [cases] * world_size


def _all_ignored():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full_logits(50, torch.float32)
    labels = torch.full(SHAPE, -100)
    for smoothing in (0.0, 0.2):
        whole = full.clone().requires_grad_()
        want = F.cross_entropy(whole.view(-1, 50), labels.view(-1), label_smoothing=smoothing)
        want.backward()
        shard = autoshard.shard(full, rank, world, dim=-1).clone().requires_grad_()
        got = vocab_parallel_cross_entropy(shard, labels, label_smoothing=smoothing)
        assert torch.isnan(want) and torch.isnan(got), (want, got)
        got.backward()
        torch.testing.assert_close(shard.grad, autoshard.shard(whole.grad, rank, world, dim=-1), rtol=0, atol=0)
        for reduction in ("sum", "none"):
            want = F.cross_entropy(full.view(-1, 50), labels.view(-1), label_smoothing=smoothing, reduction=reduction)
            got = vocab_parallel_cross_entropy(shard.detach(), labels, label_smoothing=smoothing,
                                               reduction=reduction)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world_size", [1, 3])
def test_all_ignored_batch_matches_torch(world_size):
    assert run_on_ranks(_all_ignored, world_size) == [True] * world_size


def _collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full_logits(50, torch.float32)
    labels = _labels(50, -100)
    rows = labels.numel()
    result = {}
    for smoothing in (0.0, 0.1):
        shard = autoshard.shard(full, rank, world, dim=-1).clone().requires_grad_()
        with autoshard.CommCounter() as forward:
            loss = vocab_parallel_cross_entropy(shard, labels, label_smoothing=smoothing)
        with autoshard.CommCounter() as backward:
            loss.backward()
        # Row maxima with every rank's shard size; the exponentials' sums; the target logits
        # (and the smoothing sums).
        assert forward.bytes == {"all_reduce": 4 * ((rows + world) + rows + rows * (2 if smoothing else 1))}
        result[smoothing] = (forward.counts, backward.counts)
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_three_all_reduces_forward_none_backward(world_size):
    for result in run_on_ranks(_collectives, world_size):
        assert result == {0.0: ({"all_reduce": 3}, {}), 0.1: ({"all_reduce": 3}, {})}


def _opcheck_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    name = dist.group.WORLD.group_name
    cases = []
    for dtype in (torch.float32, torch.float64):
        shard = autoshard.shard(_full_logits(13, dtype), rank, world, dim=-1).clone().requires_grad_()
        labels = _labels(13, -100)
        for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.0), ("none", 0.3)):
            cases.append((torch.ops.autoshard.vocab_parallel_cross_entropy.default,
                          (shard, labels, name, -100, smoothing, reduction)))
        cases.append((torch.ops.autoshard.vocab_parallel_cross_entropy.default,
                      (shard[0], _labels(13, 3)[0].to(torch.int32), name, 3, 0.0, "mean")))
        loss, lse, vocab_range = torch.ops.autoshard.vocab_parallel_cross_entropy.default(
            shard.detach(), labels, name, -100, 0.1, "none")
        cases.append((torch.ops.autoshard.vocab_parallel_cross_entropy_backward.default,
                      (torch.ones_like(loss), shard.detach(), labels, lse, vocab_range, -100, 0.1, "none")))
    return cases


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(world_size):
    assert run_on_ranks(opcheck_all, world_size, _opcheck_cases, timeout=600) == [12] * world_size


def _bad_input():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _full_logits(13, torch.float32)
    shard = autoshard.shard(full, rank, world, dim=-1)
    labels = _labels(13, -100)
    out_of_range = labels.clone()
    out_of_range[2, 2] = 13
    uneven = full[..., : 3 if rank == 0 else 5]  # 3 + 5 = 8 columns: split_sizes(8, 2) is [4, 4]
    return expect_errors([
        (lambda: vocab_parallel_cross_entropy(shard, labels, reduction="average"), ValueError, ["reduction"]),
        (lambda: vocab_parallel_cross_entropy(shard, labels, label_smoothing=1.5), ValueError,
         ["label_smoothing", "[0, 1]"]),
        (lambda: vocab_parallel_cross_entropy(shard, labels[:, :4]), ValueError, ["labels", "shape"]),
        (lambda: vocab_parallel_cross_entropy(shard, labels.float()), TypeError, ["labels", "integer"]),
        (lambda: vocab_parallel_cross_entropy(labels, labels), TypeError, ["logits", "floating-point"]),
        (lambda: vocab_parallel_cross_entropy(shard, out_of_range), IndexError, ["labels", "[0, 13)", "13",
                                                                                  "flat position 12"]),
        (lambda: vocab_parallel_cross_entropy(uneven, labels), ValueError, ["split_sizes", "[4, 4]", "[3, 5]"]),
    ])


def test_bad_input_is_refused_on_every_rank():
    assert run_on_ranks(_bad_input, 2) == [["ValueError", "ValueError", "ValueError", "TypeError", "TypeError",
                                            "IndexError", "ValueError"]] * 2


def _second_derivative_refused():
    shard = autoshard.shard(_full_logits(13, torch.float64), dist.get_rank(), dist.get_world_size(), -1)
    shard = shard.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, _labels(13, -100))
    (grad,) = torch.autograd.grad(loss, shard, create_graph=True)
    try:
        grad.sum().backward()
    except RuntimeError as error:
        return "second derivative is not supported" in str(error)
    return False


def test_second_derivative_is_refused():
    assert run_on_ranks(_second_derivative_refused, 2) == [True, True]
