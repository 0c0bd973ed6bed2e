"""Checkpoints with CUDA tensors: `load_pretrained` of a Hugging Face checkpoint onto the GPU of
ranks that built the model on meta, and an asynchronous save (pinned host snapshots, taken on a
side stream) of a model and optimizer on the GPU at 2 ranks, reloaded on the GPU at 3 ranks and
on the CPU in one process. The CPU case runs the same code, so that CI checks the test itself."""

import pytest
import torch

import autoshard
from autoshard import checkpoint
from hf_models import build
from multirank import run_on_ranks

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))


def _load_pretrained_on(path: str, device: str) -> dict:
    reference = build("llama", seed=11).to(device)
    model = build("llama", device="meta")
    autoshard.parallelize(model)
    autoshard.load_pretrained(model, path, device=device, progress=False)
    placed = sorted({t.device.type for t in list(model.parameters()) + list(model.buffers())})
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS.to(device)).logits, reference(input_ids=IDS.to(device)).logits,
                                   rtol=1e-5, atol=1e-5)
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    unequal = [name for name in want if not torch.equal(got[name].to(device), want[name])]
    return {"placed": placed, "unequal": unequal}


@pytest.mark.parametrize("device", DEVICES)
def test_load_pretrained_onto_the_device(tmp_path, device):
    path = str(tmp_path / "llama")
    build("llama", seed=11).save_pretrained(path, max_shard_size="20KB")
    for result in run_on_ranks(_load_pretrained_on, 2, path, device, timeout=600):
        assert result == {"placed": [device], "unequal": []}, result


def _step(model, optimizer, step: int, device: str) -> None:
    ids = torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(100 + step)).to(device)
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _state(model) -> dict:
    return {name: value.detach().cpu().clone() for name, value in autoshard.full_state_dict(model).items()}


def _train_and_save_async(path: str, device: str):
    """Two steps, an asynchronous save, then a step and in-place changes while the save is in
    flight: the checkpoint must hold the state of the moment save was called."""
    model = autoshard.parallelize(build("llama", seed=0, device=device).train())
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    for step in range(2):
        _step(model, optimizer, step, device)
    saved = _state(model)
    handle = checkpoint.save(path, model, optimizer, extra={"step": 2}, async_save=True)
    _step(model, optimizer, 2, device)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    assert handle.wait() == path
    return saved


def _load_and_step(path: str, device: str, ranks: bool):
    model = build("llama", seed=1, device=device).train()
    if ranks:
        autoshard.parallelize(model)
        optimizer = autoshard.optim.AdamW(model.parameters(), lr=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    extra = checkpoint.load(path, model, optimizer)
    loaded = _state(model) if ranks else {n: v.detach().cpu().clone() for n, v in model.state_dict().items()}
    on_device = all(p.device.type == device for p in model.parameters())
    _step(model, optimizer, 2, device)
    stepped = _state(model) if ranks else {n: v.detach().cpu().clone() for n, v in model.state_dict().items()}
    return extra, loaded, stepped, on_device


def _reference_after_three_steps(device: str) -> dict:
    model = build("llama", seed=0, device=device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    for step in range(3):
        _step(model, optimizer, step, device)
    return {n: v.detach().cpu().clone() for n, v in model.state_dict().items()}


@pytest.mark.filterwarnings("ignore:load.*random number generator states:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_async_save_at_two_reloads_at_three_and_unsharded(tmp_path, device):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_train_and_save_async, 2, path, device, timeout=600)[0]
    want = _reference_after_three_steps(device)
    for extra, loaded, stepped, on_device in (run_on_ranks(_load_and_step, 3, path, device, True, timeout=600)[0],
                                              _load_and_step(path, device, False)):
        assert extra == {"step": 2} and on_device
        assert loaded.keys() == saved.keys()
        assert [n for n in saved if not torch.equal(loaded[n], saved[n])] == []
        # The step after loading lands where three uninterrupted unsharded steps do.
        for name, value in want.items():
            torch.testing.assert_close(stepped[name], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
