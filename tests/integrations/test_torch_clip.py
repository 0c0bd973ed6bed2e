"""torch.nn.utils.clip_grad_norm_ on a parallelized model: the norm of the unsharded model's
gradients, the same clipping factor on every rank, and the same weights after the steps as the
unsharded model clipped by torch. A call mixing a parallelized model's parameters with others is
refused; a model autoshard does not know is clipped by torch's own code."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from gathered import gathered_grads
from hf_models import build
from multirank import run_on_ranks

MAX_NORM = 0.05  # below every norm here: clipping scales every step
# Llama's RMSNorm computes in float32 even in a float64 model: its rounding, not a defect, bounds
# the agreement (a clipping factor from one rank's norm alone is off by a third and more).
RTOL, ATOL = 1e-5, 1e-9


def _batch(step: int):
    return torch.randint(1, 101, (2, 7), generator=torch.Generator().manual_seed(step))


def _clipped_training(steps: int = 3):
    from torch.nn.utils import clip_grad_norm_  # the name a script imports: the same function

    reference = build("llama", seed=3).double()
    model = autoshard.parallelize(build("llama", seed=3).double())
    norms, want_norms = [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(steps):
        ids = _batch(step)
        model(ids, labels=ids).loss.backward()
        reference(ids, labels=ids).loss.backward()
        norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        clipped = gathered_grads(model)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(clipped[name], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    full = autoshard.full_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    # Mixing two models in one call is refused; an unparallelized model keeps torch's own code.
    other = torch.nn.Linear(3, 3).double()
    other(torch.ones(1, 3, dtype=torch.double)).sum().backward()
    model(_batch(9), labels=_batch(9)).loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(other.parameters()), MAX_NORM)
        mixed = None
    except ValueError as error:
        mixed = str(error)
    plain = float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1e9))
    want_plain = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in other.parameters()])))
    return norms, want_norms, mixed, (plain, want_plain), dist.get_rank()


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_clip_grad_norm_is_the_global_norm(world_size):
    results = run_on_ranks(_clipped_training, world_size)
    for norms, want_norms, mixed, (plain, want_plain), rank in results:
        assert norms == pytest.approx(want_norms, rel=1e-6), (rank, norms, want_norms)
        assert all(n > MAX_NORM for n in want_norms)
        assert mixed is not None and "autoshard.clip_grad_norm_" in mixed, mixed
        assert plain == pytest.approx(want_plain, rel=1e-12)
