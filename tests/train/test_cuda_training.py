"""Training on CUDA tensors over gloo: 2 and 3 ranks sharing one GPU parallelize a tiny HF model
on the GPU and take 20 AdamW steps with clipping, beside the unsharded model on the same GPU
taking torch.optim.AdamW's steps. Losses, gradient norms and the final state must agree. The CPU
case runs the same code, so that CI checks the test itself."""

import pytest
import torch

import autoshard
from multirank import run_on_ranks

STEPS = 20
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _train_beside_unsharded(kind: str, device: str) -> dict:
    from hf_models import build

    model, reference = build(kind, device=device).train(), build(kind, device=device).train()
    autoshard.parallelize(model)
    assert all(p.device.type == device for p in model.parameters())
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        ids = torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(100 + step % 2)).to(device)
        pair = []
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            pair.append(float(loss))
        losses.append(tuple(pair))
        norms.append((float(autoshard.clip_grad_norm_(model.parameters(), 0.5)),
                      float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))))
        opt.step()
        ref_opt.step()
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    return {"losses": losses, "norms": norms,
            "state": max(float((got[k].to(device) - want[k]).abs().max()) for k in want),
            "devices": sorted({t.device.type for t in got.values()})}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "gpt_bigcode"])
def test_adamw_steps_on_ranks_equal_unsharded(kind, world_size, device):
    results = run_on_ranks(_train_beside_unsharded, world_size, kind, device, timeout=600)
    for rank, result in enumerate(results):
        got, want = zip(*result["losses"])
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        got, want = zip(*result["norms"])
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank} gradient norms: {m}")
        assert result["state"] < 1e-4, (rank, result["state"])
    # Training moved the model: on the batch of step 0 (two batches in turn), step 18's loss is lower.
    assert results[0]["losses"][-2][1] < results[0]["losses"][0][1] - 0.1
    # Every rank computed the same losses (the ranks hold pieces of one model).
    assert all(r["losses"] == results[0]["losses"] for r in results)
