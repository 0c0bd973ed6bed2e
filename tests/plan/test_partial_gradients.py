"""Replicated parameters applied inside a sharded region (QK-norm, a temperature, a scale
shared by every head, a replicated weight multiplying every head): each rank's gradient of
such a parameter is a partial sum, which the plan must predict and have summed over the
group. On 2 and 3 gloo ranks: logits, every parameter's gradient, the collectives counted
against the plan's prediction, and the parameters after one AdamW step, against the
unsharded model."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core.parallel_state import state_of
from gathered import forward_backward_as_planned
from multirank import run_on_ranks
from soundness_models import PARTIAL_GRADIENT_MODELS, build

NAMES = sorted(PARTIAL_GRADIENT_MODELS)


def _check(name: str) -> dict:
    world = dist.get_world_size()
    reference, model = build(name), build(name)
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, world_size=world, example_inputs=(ids,))
    autoshard.parallelize(model, plan)
    forward_backward_as_planned(model, reference, plan, lambda m: m(ids), rtol=1e-5, atol=1e-5)

    shards = state_of(model).shards()
    params = dict(model.named_parameters())
    for pname, ref in reference.named_parameters():
        local = params[pname]
        spec = shards.get(id(local), (None,))[0]
        want = ref.grad if spec is None else spec.take(ref.grad)
        torch.testing.assert_close(local.grad, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {pname}: {m}")

    norm = autoshard.clip_grad_norm_(model.parameters(), 1e9)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-5)
    autoshard.optim.AdamW(model.parameters(), lr=1e-2).step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    got = autoshard.full_state_dict(model)
    for pname, value in reference.state_dict().items():
        torch.testing.assert_close(got[pname], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{pname} after a step: {m}")
    return {"plan": str(plan), "partial": [p for g in plan.partial_gradients for p in g.params],
            "styles": {layer.module: layer.style for layer in plan.layers}}


def _check_all():
    return {name: _check(name) for name in NAMES}


@pytest.mark.parametrize("world_size", [2, 3])
def test_partial_gradients_equal_unsharded(world_size):
    results = run_on_ranks(_check_all, world_size, timeout=600)[0]
    # The attention stays sharded, its replicated parameters summed over the ranks ...
    for name, partial in (("qk_norm", {"attn.q_norm.weight", "attn.k_norm.weight"}),
                          ("scale", {"attn.temperature", "attn.value_scale"}), ("mix", {"attn.mix"})):
        assert results[name]["styles"]["attn.q"] == "column", results[name]["plan"]
        assert set(results[name]["partial"]) == partial, results[name]["plan"]
        assert "partial gradients" in results[name]["plan"]
    # ... unless a parameter is also used outside the sharded region: then the attention is not
    # split by heads (its projections held whole, or gathered where the plan would otherwise
    # leave a rank much more than its share).
    assert results["shared_temperature"]["styles"]["attn.q"] in ("replicate", "column_gather")
    assert results["shared_temperature"]["partial"] == []
