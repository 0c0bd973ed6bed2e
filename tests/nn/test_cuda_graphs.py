"""CUDA graphs: a parallelized model's forward is captured in a torch.cuda.CUDAGraph (over a
one-rank NCCL group, whose collectives can be captured) and replayed on new inputs, equal to the
unsharded model each time; and the custom ops are captured on their own. A custom op that syncs
with the host, allocates outside the graph's pool or launches on another stream fails here."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.core import distributed, ops
from multirank import run_on_ranks

pytestmark = pytest.mark.gpu


class TinyLM(nn.Module):
    """Embedding, an MLP and a head: vocabulary-parallel lookup, column and row layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(101, 48)
        self.up = nn.Linear(48, 70)
        self.down = nn.Linear(70, 48)
        self.head = nn.Linear(48, 101, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(F.gelu(self.up(h))))


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 101, (4, 9), generator=torch.Generator().manual_seed(seed)).cuda()


def _warm_up(fn, times: int = 3) -> None:
    # Allocations and lazy initialisation happen outside the capture, on a side stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def _captured_forward_replays() -> dict:
    group = dist.new_group([0], backend="nccl")
    distributed.set_default_group(group)
    try:
        torch.manual_seed(0)
        reference = TinyLM().cuda()
        model = copy.deepcopy(reference)
        static_ids = _ids(0)
        plan = autoshard.plan(model, example_inputs=(static_ids,))
        autoshard.parallelize(model, plan)
        with torch.no_grad():
            _warm_up(lambda: model(static_ids))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = model(static_ids)
            for seed in (1, 2, 3):
                ids = _ids(seed)
                static_ids.copy_(ids)
                graph.replay()
                torch.cuda.synchronize()
                torch.testing.assert_close(static_out, reference(ids), rtol=1e-5, atol=1e-5)
        return {layer.module: layer.style.value for layer in plan.layers}
    finally:
        distributed.set_default_group(None)
        dist.destroy_process_group(group)


def test_captured_sharded_forward_replays_equal_unsharded():
    styles = run_on_ranks(_captured_forward_replays, 1, timeout=300)[0]
    assert styles["up"] == "column" and styles["down"] == "row", styles


def test_custom_ops_are_capturable():
    x = torch.randn(10, 6, device="cuda")
    table = torch.randn(7, 5, device="cuda")
    ids = torch.randint(0, 20, (3, 4), device="cuda")
    params = [torch.randn(33, device="cuda") for _ in range(2)]
    grads = [torch.randn(33, device="cuda") for _ in range(2)]
    exp_avgs = [torch.zeros(33, device="cuda") for _ in range(2)]
    exp_avg_sqs = [torch.zeros(33, device="cuda") for _ in range(2)]

    def run():
        pieces = autoshard.array_split(x, 3, dim=0)
        looked_up = ops.vocab_parallel_lookup(ids, table, 7, 7, 20)
        return pieces, looked_up

    _warm_up(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pieces, looked_up = run()
    x.copy_(torch.randn(10, 6, device="cuda"))
    ids.copy_(torch.randint(0, 20, (3, 4), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(pieces, torch.tensor_split(x, 3, dim=0)):
        assert torch.equal(got, want)
    # The lookup replayed equals the op run eagerly on the new ids.
    assert torch.equal(looked_up, ops.vocab_parallel_lookup(ids, table, 7, 7, 20))

    # The fused AdamW kernel, with its hyperparameters fixed at capture.
    expected = [p.clone().requires_grad_() for p in params]
    for p, g in zip(expected, grads):
        p.grad = g.clone()
    torch.optim.AdamW(expected, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1).step()
    step_graph = torch.cuda.CUDAGraph()
    _warm_up(lambda: None)
    with torch.cuda.graph(step_graph):
        ops.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, 1e-2, 0.9, 0.999, 0.1, 1e-8, 1, False)
    step_graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
