"""SavedTensorCounter on a DTensor tensor-parallel MLP (torch's parallelize_module with
ColwiseParallel and RowwiseParallel, real gloo ranks), whose row layer returns torch's
functional collectives' AsyncCollectiveTensor: each rank's count against the bytes computed by
hand from its local shard sizes, and against the same counter on the plain MLP."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from multirank import run_on_ranks

BATCH, FEATURES, HIDDEN = 3, 6, 12  # DTensor fails on uneven row shards: 12 splits evenly on 2 and 3 ranks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, FEATURES))


def _count(model: nn.Module, x: torch.Tensor):
    """The counter's figures for one forward, the types autograd saves (in a forward of their
    own: only the innermost saved-tensor hooks see the tensors), and x's gradient."""
    kinds = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kinds.append(type(t).__name__) or t, lambda t: t):
        y = model(x)
        y * y
    with autoshard.SavedTensorCounter(ignore=model.parameters()) as saved:
        y = model(x)
        loss = (y * y).sum()
    loss.backward()
    return (saved.bytes, saved.tensors, saved.largest), kinds, x.grad


def _check() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(1))
    plain, plain_kinds, plain_grad = _count(_mlp(), x.clone().requires_grad_())
    sharded = _mlp()
    parallelize_module(sharded, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    counted, kinds, grad = _count(sharded, x.clone().requires_grad_())
    # DTensor splits the hidden features as torch.chunk does.
    local_hidden = torch.chunk(torch.arange(HIDDEN), world)[rank].numel()
    return {"plain": plain, "plain_kinds": plain_kinds, "counted": counted, "kinds": kinds,
            "local_hidden": local_hidden, "grad_error": (grad - plain_grad).abs().max().item()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_counts_a_dtensor_model_whose_collectives_return_async_tensors(world_size):
    results = run_on_ranks(_check, world_size, timeout=300)
    f = 4  # fp32
    for rank, r in enumerate(results):
        # The wrapper the counter must see through is really among the saved tensors.
        assert "AsyncCollectiveTensor" in r["kinds"], r["kinds"]
        # Saved activations: the input x (read by the column layer), the ReLU's output (this
        # rank's hidden features; the row layer's input is the same storage) and the MLP's
        # output, all-reduced (read twice by y * y). The weights are ignored.
        by_hand = BATCH * FEATURES * f + BATCH * r["local_hidden"] * f + BATCH * FEATURES * f
        assert r["counted"][0] == by_hand, (rank, r)
        # The plain MLP saves the same tensors with every hidden feature.
        assert r["plain"][0] == by_hand + BATCH * (HIDDEN - r["local_hidden"]) * f, (rank, r)
        assert r["counted"][2] == BATCH * max(FEATURES, r["local_hidden"]) * f, (rank, r)
        assert r["plain"][2] == BATCH * max(FEATURES, HIDDEN) * f, (rank, r)
        # Counting changed nothing: the input's gradient is the plain MLP's.
        assert r["grad_error"] < 1e-5, (rank, r)
    assert sum(r["local_hidden"] for r in results) == HIDDEN


def test_a_plain_tensor_counts_as_before():
    # The counter reads a wrapper's inner tensors; a plain tensor is its own holder.
    x = torch.randn(4, 5, requires_grad=True)
    with autoshard.SavedTensorCounter() as saved:
        x.sin().sum().backward()
    assert (saved.bytes, saved.tensors, saved.largest) == (4 * 5 * 4, 1, 4 * 5 * 4)
