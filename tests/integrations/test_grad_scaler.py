"""torch.amp.GradScaler with a parallelized model: a gradient that overflows in one rank's shard
only must make every rank skip the step and lower its scale, as the unsharded model does
(runtime/grad_scaler_agreement.py). Checked on 2 and 3 gloo ranks with torch's and autoshard's AdamW
against the unsharded model under its own GradScaler; and with the agreement switched off, the
ranks are shown to part (the failure the test guards against)."""

import pytest
import torch
from torch import nn

import autoshard
from autoshard.runtime import grad_scaler_agreement
from multirank import run_on_ranks

OVERFLOW_STEPS = (0, 3)  # the steps whose gradient overflows in one element
STEPS = 6
ROW = 9  # the element's row of up.weight: held by the last rank at 2 and 3 ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 10), nn.GELU(), nn.Linear(10, 8))


def _overflow(weight_grad: torch.Tensor, rows: range) -> None:
    """Puts inf into global row ROW of up.weight's gradient, if this rank holds it."""
    if ROW in rows:
        weight_grad[ROW - rows.start, 0] = float("inf")


def _train(optimizer_kind: str, agree: bool = True) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = _model(), _model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, example_inputs=(x,))
    autoshard.parallelize(model, plan)
    sizes = autoshard.split_sizes(10, world)
    mine = range(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    make = autoshard.optim.AdamW if optimizer_kind == "autoshard" else torch.optim.AdamW
    optimizer, ref_optimizer = make(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) for _ in range(2))
    assert grad_scaler_agreement.is_installed()  # while a parallelized model lives
    original = grad_scaler_agreement._ORIGINAL["_unscale_grads_"]
    if not agree:  # torch's own method, as without autoshard's agreement
        torch.amp.GradScaler._unscale_grads_ = original
    try:
        scales, ref_scales = [], []
        for step in range(STEPS):
            batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + step))
            for m, opt, s, rows in ((model, optimizer, scaler, mine), (reference, ref_optimizer, ref_scaler, range(10))):
                opt.zero_grad()
                s.scale(m(batch).square().mean()).backward()
                if step in OVERFLOW_STEPS:
                    _overflow(m[0].weight.grad, rows)
                s.step(opt)
                s.update()
            scales.append(scaler.get_scale())
            ref_scales.append(ref_scaler.get_scale())
    finally:
        torch.amp.GradScaler._unscale_grads_ = grad_scaler_agreement._unscale_grads_
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    return {"scales": scales, "ref_scales": ref_scales,
            "difference": max(float((got[k] - want[k]).abs().max()) for k in want)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer_kind", ["torch", "autoshard"])
def test_an_overflow_in_one_shard_skips_the_step_on_every_rank(optimizer_kind, world_size):
    results = run_on_ranks(_train, world_size, optimizer_kind)
    for rank, result in enumerate(results):
        # The unsharded model's scaler halved at each overflow: the same scales on every rank.
        assert result["scales"] == result["ref_scales"], (rank, result)
        assert result["difference"] < 1e-5, (rank, result)
    assert results[0]["ref_scales"][0] == 512.0  # the first step overflowed and was skipped


def test_without_the_agreement_the_ranks_part():
    results = run_on_ranks(_train, 2, "torch", False)
    # The rank without the overflowing element stepped and kept its scale: the ranks differ
    # from each other and from the unsharded model.
    assert results[0]["scales"] != results[1]["scales"], results
    assert results[1]["scales"] == results[1]["ref_scales"]
    assert results[0]["difference"] > 1e-3
