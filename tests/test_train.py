"""Training steps of parallelized models against the unsharded model with torch's own
optimizers and clipping: fused AdamW and SGD, global-norm clipping, and a 2 x 2 data x tensor
parallel mesh against full-batch single-process training."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from hf_models import build
from multirank import run_on_ranks

MAX_NORM = 0.5  # small enough that clipping acts on these random models


def _batch(step: int, rows: int = 4, seq: int = 8):
    return torch.randint(0, 101, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _optimizers(kind: str, model, reference):
    if kind == "adamw":
        return (autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1),
                torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1))
    options = dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01)
    return autoshard.optim.SGD(model.parameters(), **options), torch.optim.SGD(reference.parameters(), **options)


def _compare(model, reference, live):
    """Parameters against the reference, except elements whose exact gradient is zero.

    GPT-2's key bias adds the same q.b to every score of a query, which softmax ignores: its
    gradient is rounding noise (~1e-9), and AdamW, which divides by the gradient's own size,
    turns noise into steps of about lr. Those elements (`live` is False) are left out."""
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    worst, noise_driven = 0.0, {}
    for k in want:
        mask = live.get(k, torch.ones_like(want[k], dtype=torch.bool))
        if not bool(mask.all()):
            noise_driven[k.rsplit(".", 3)[-2] + "." + k.rsplit(".", 1)[-1]] = int((~mask).sum())
        torch.testing.assert_close(got[k][mask], want[k][mask], rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
        worst = max(worst, float((got[k] - want[k])[mask].abs().max()) if mask.any() else 0.0)
    return worst, noise_driven


def _track_live(reference, largest):
    """`largest` keeps each element's largest gradient so far; turned into the `live` mask by
    _live: elements whose gradient was never exactly zero yet never above 1e-6 are noise."""
    for name, p in reference.named_parameters():
        if p.grad is not None:
            largest[name] = torch.maximum(largest.get(name, torch.zeros_like(p)), p.grad.abs())


def _live(largest):
    return {name: (g == 0) | (g > 1e-6) for name, g in largest.items()}


def _train(model_kind: str, optimizer_kind: str, steps: int = 20):
    model, reference = build(model_kind, seed=0), build(model_kind, seed=0)
    autoshard.parallelize(model)
    opt, ref_opt = _optimizers(optimizer_kind, model, reference)
    norms, live = [], {}
    for step in range(steps):
        ids = _batch(step)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        _track_live(reference, live)
        norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norms.append((float(norm), float(ref_norm)))
        opt.step()
        ref_opt.step()
    worst, noise_driven = _compare(model, reference, _live(live))
    return norms, worst, noise_driven


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_training_matches_unsharded(model_kind, optimizer_kind, world_size):
    norms, worst, noise_driven = run_on_ranks(_train, world_size, model_kind, optimizer_kind, timeout=600)[0]
    assert worst < 1e-4
    # Only GPT-2's key bias (a third of c_attn.bias) may be left out.
    assert set(noise_driven) <= {"c_attn.bias"}, noise_driven
    assert all(count <= 60 for count in noise_driven.values()), noise_driven
    assert any(ref > MAX_NORM for _, ref in norms), "clipping never acted"
    for got, ref in norms:
        assert abs(got - ref) <= 1e-5 * ref, (got, ref)


def _train_on_mesh(steps: int = 10):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, reference = build("gpt2", seed=0), build("gpt2", seed=0)
    autoshard.parallelize(model, mesh=mesh)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
    live = {}
    for step in range(steps):
        ids = _batch(step)
        half = ids.chunk(2)[dp_rank]  # each replica trains on its half of the batch
        opt.zero_grad()
        model(input_ids=half, labels=half).loss.backward()
        autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        ref_opt.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        _track_live(reference, live)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
    return _compare(model, reference, _live(live))[0]


def test_data_by_tensor_parallel_mesh_matches_full_batch():
    worst = run_on_ranks(_train_on_mesh, 4, timeout=600)
    assert max(worst) < 1e-4


def test_clip_grad_norm_bad_input():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        autoshard.clip_grad_norm_([p], -1.0)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        autoshard.clip_grad_norm_([p], 1.0, norm_type=0)
    # Without any sharded parameter it is torch's clipping.
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.ones(3)
    assert torch.allclose(autoshard.clip_grad_norm_([p], 1.0), torch.nn.utils.clip_grad_norm_([q], 1.0))
    assert torch.allclose(p.grad, q.grad)
