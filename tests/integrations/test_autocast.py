"""CPU bf16 autocast on a parallelized tiny Llama at 2 gloo ranks: within autocast's own rounding of
the unsharded model under the same autocast, not equal to it. The yardstick is the unsharded model
itself summing in another order (its batch in two halves, the gradients added): the sharded model's
gradients must be as close to the unsharded ones as that, within a factor of 4, and its loss within
1e-4 (relative). Without autocast the same comparison is float32 rounding (1e-6)."""

import pytest
import torch

import autoshard
from gathered import gathered_grads
from hf_models import build
from multirank import run_on_ranks


def _worst_gradient(model, reference_grads) -> float:
    return max(float((g - reference_grads[name]).abs().max() / reference_grads[name].abs().max())
               for name, g in model.items())


def _against_unsharded(autocast: bool) -> dict:
    ids = torch.randint(3, 101, (4, 16), generator=torch.Generator().manual_seed(1))
    reference, model, halves = (build("llama", seed=0).train() for _ in range(3))
    autoshard.parallelize(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want, got = reference(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
        split = (halves(input_ids=ids[:2], labels=ids[:2]).loss + halves(input_ids=ids[2:], labels=ids[2:]).loss) / 2
    for loss in (want, got, split):
        loss.backward()
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    return {"loss": abs(float(got - want)) / abs(float(want)),
            "sharded": _worst_gradient(gathered_grads(model), reference_grads),
            "halves": _worst_gradient({n: p.grad for n, p in halves.named_parameters()}, reference_grads)}


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_autocast_is_within_its_own_rounding_of_the_unsharded_model(autocast):
    for rank, r in enumerate(run_on_ranks(_against_unsharded, 2, autocast, timeout=600)):
        if autocast:
            assert r["loss"] < 1e-4 and r["sharded"] < 4 * r["halves"], f"rank {rank}: {r}"
        else:
            assert r["loss"] < 1e-6 and r["sharded"] < 1e-5, f"rank {rank}: {r}"
