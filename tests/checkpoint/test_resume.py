"""Resuming from a checkpoint repeats the uninterrupted run bit for bit, dropout included: each
rank's generator states are saved with the checkpoint and restored by load."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import resume_training
from autoshard import checkpoint
from autoshard.checkpoint import CheckpointCorruptError, rng
from checkpoint_models import build_toy, parallelize_toy
from checks import expect_errors
from local_ranks import free_port, rank_env
from multirank import run_on_ranks

SUPPORT_DIR = os.path.dirname(os.path.abspath(resume_training.__file__))
K, M = 3, 4


def _differences(expected, got) -> list:
    (expected_losses, expected_params), (losses, params) = expected, got
    differ = [f"loss {i}" for i, (a, b) in enumerate(zip(expected_losses, losses)) if not torch.equal(a, b)]
    if len(expected_losses) != len(losses) or expected_params.keys() != params.keys():
        return ["the runs have different steps or parameters"]
    return differ + [name for name in expected_params if not torch.equal(expected_params[name], params[name])]


def _resume_in_fresh_processes(path, world: int, out) -> list:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    port = free_port()
    script = os.path.join(SUPPORT_DIR, "resume_training.py")
    procs = [subprocess.Popen([sys.executable, script, str(path), str(M), str(out)],
                              env={**env, **rank_env(port, r, world), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outputs
    return [torch.load(os.path.join(out, f"rank-{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_in_fresh_processes_is_bitwise_equal_to_the_uninterrupted_run(tmp_path, world):
    expected = run_on_ranks(resume_training.uninterrupted, world, K, M)
    path = tmp_path / "step-3"
    run_on_ranks(resume_training.first_part, world, str(path), K)
    results = _resume_in_fresh_processes(path, world, tmp_path)
    for rank, result in enumerate(results):
        assert _differences(expected[rank], result["restored"]) == [], f"rank {rank}"
    # The control: without the saved generator states the same resume differs (so dropout and
    # the batches drawn from random and numpy matter), on every rank.
    for rank, result in enumerate(results):
        assert _differences(expected[rank], result["control"]), f"rank {rank}"
    # Each rank's own states were saved. The ranks drew different amounts inside the sharded
    # region, from generators of the region's own, so their torch generators, saved between
    # steps, agree.
    manifest = checkpoint.read_manifest(path)
    assert {k for k in manifest.tensors if k.startswith("rng/")} == {
        f"rng/rank-{r:05d}/{name}" for r in range(world) for name in ("torch", "python", "numpy")}
    states = [load_file(path / f"rank-{r:05d}.safetensors")[f"rng/rank-{r:05d}/torch"] for r in range(world)]
    assert all(torch.equal(states[0], other) for other in states[1:])


def _draws():
    return torch.rand(4), random.random(), random.gauss(0.0, 1.0), np.random.rand(3).tolist()


def test_load_restores_the_generators_of_a_one_process_save(tmp_path):
    model = build_toy(0)
    torch.manual_seed(7), random.seed(8), np.random.seed(9)
    random.gauss(0.0, 1.0)  # leaves a cached gaussian in Python's state
    checkpoint.save(tmp_path / "a", model)
    expected = _draws()
    checkpoint.load(tmp_path / "a", build_toy(1))
    got = _draws()
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]
    checkpoint.load(tmp_path / "a", build_toy(1), restore_rng=False)  # the generators go on
    assert not torch.equal(torch.rand(4), expected[0])
    expect_errors([(lambda: checkpoint.load(tmp_path / "a", model, restore_rng="yes"), TypeError,
                    ["restore_rng", "bool", "str"])])


def _save_toy(path: str) -> None:
    torch.manual_seed(dist.get_rank())
    checkpoint.save(path, parallelize_toy(build_toy(0)))


def test_another_world_size_restores_no_generator_and_says_so(tmp_path):
    run_on_ranks(_save_toy, 2, str(tmp_path / "a"))
    torch.manual_seed(11)
    state = torch.get_rng_state()
    model = build_toy(1)
    torch.set_rng_state(state)
    with pytest.warns(RuntimeWarning, match="saved by 2 ranks and is loaded by 1.*were not restored"):
        checkpoint.load(tmp_path / "a", model)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(model.up.weight, build_toy(0).up.weight)  # the model loaded all the same


@pytest.mark.parametrize("name, state, field", [
    ("torch", torch.zeros(7, dtype=torch.uint8), "uint8 of shape [5056]"),
    ("python", torch.tensor([2.0] * 628, dtype=torch.float64), "expected [3, 625 words"),
    ("python", torch.tensor([3.0] + [2.0 ** 33] * 625 + [0.0, 0.0], dtype=torch.float64), "[0, 2**32)"),
    ("numpy", torch.tensor([1.0] * 624 + [999.0, 0.0, 0.0], dtype=torch.float64), "pos must be"),
])
def test_a_bad_generator_state_is_refused_before_anything_changes(tmp_path, monkeypatch, name, state, field):
    capture = rng.capture
    monkeypatch.setattr(rng, "capture", lambda: {**capture(), name: state})
    checkpoint.save(tmp_path / "a", build_toy(0))
    monkeypatch.setattr(rng, "capture", capture)
    model = build_toy(1)
    generator = torch.get_rng_state()
    expect_errors([(lambda: checkpoint.load(tmp_path / "a", model), CheckpointCorruptError,
                    [str(tmp_path / "a"), f"rng/rank-00000/{name}", field])])
    assert torch.equal(model.up.weight, build_toy(1).up.weight)  # untouched
    assert torch.equal(torch.get_rng_state(), generator)
