"""Per-rank ``extra``: each rank saves a value of its own (``rank_extra``) in its own file and
gets it back from ``load(..., return_rank_extra=True)`` at the same world size; another world
size is refused before anything changes."""

import os

import pytest
import torch
import torch.distributed as dist

from autoshard import checkpoint
from checkpoint_models import build_toy, parallelize_toy
from checks import expect_errors
from multirank import run_on_ranks


def _own(rank: int) -> dict:
    return {"rank": rank, "cursor": [rank * 10, rank * 10 + 1], "name": f"shard-{rank}"}


def _save_then_load(directory: str) -> list:
    rank = dist.get_rank()
    model = parallelize_toy(build_toy(0))
    mine = _own(rank)
    handle = checkpoint.save(os.path.join(directory, "a"), model, extra={"step": 3}, rank_extra=mine, async_save=True)
    mine["cursor"].append(99)  # the save holds a copy
    handle.wait()
    manager = checkpoint.CheckpointManager(os.path.join(directory, "run"))
    manager.save(5, model, extra={"step": 5}, rank_extra={"rank": rank, "step": 5}).wait()
    fresh = parallelize_toy(build_toy(1))
    loaded = checkpoint.load(os.path.join(directory, "a"), fresh, return_rank_extra=True)
    plain = checkpoint.load(os.path.join(directory, "a"), fresh)
    restored = manager.restore(fresh, return_rank_extra=True)
    none_saved = checkpoint.load(os.path.join(directory, "run", "step-5"), fresh, return_rank_extra=False)
    return [loaded, plain, restored, none_saved]


def test_each_rank_gets_its_own_rank_extra_back(tmp_path):
    results = run_on_ranks(_save_then_load, 2, str(tmp_path))
    for rank, (loaded, plain, restored, none_saved) in enumerate(results):
        assert loaded == ({"step": 3}, _own(rank))
        assert plain == {"step": 3}
        assert restored == ({"step": 5}, {"rank": rank, "step": 5})
        assert none_saved == {"step": 5}
    manifest = checkpoint.read_manifest(tmp_path / "a")
    assert {k for k in manifest.tensors if k.startswith("rank_extra/")} == {"rank_extra/rank-00000",
                                                                           "rank_extra/rank-00001"}
    assert {p.file for p in manifest.tensors["rank_extra/rank-00001"].pieces} == {"rank-00001.safetensors"}


def test_another_world_size_refuses_rank_extra_before_anything_changes(tmp_path):
    run_on_ranks(_save_then_load, 2, str(tmp_path))
    model = build_toy(1)
    expect_errors([(lambda: checkpoint.load(tmp_path / "a", model, return_rank_extra=True), ValueError,
                    [str(tmp_path / "a"), "per-rank extra saved by 2 ranks", "1 ranks load it",
                     "return_rank_extra=False"])])
    assert torch.equal(model.up.weight, build_toy(1).up.weight)  # untouched
    with pytest.warns(RuntimeWarning, match="were not restored"):
        assert checkpoint.load(tmp_path / "a", model) == {"step": 3}  # the rest loads
    assert torch.equal(model.up.weight, build_toy(0).up.weight)


def test_rank_extra_in_one_process_and_without_any(tmp_path):
    model = build_toy(0)
    checkpoint.save(tmp_path / "a", model, rank_extra=[1, "two", {"three": 3.5}])
    checkpoint.save(tmp_path / "b", model, extra={"step": 1})
    assert checkpoint.load(tmp_path / "a", build_toy(1), return_rank_extra=True) == (None, [1, "two", {"three": 3.5}])
    assert checkpoint.load(tmp_path / "b", build_toy(1), return_rank_extra=True) == ({"step": 1}, None)
    manager = checkpoint.CheckpointManager(tmp_path / "empty")
    assert manager.restore(build_toy(1), return_rank_extra=True) == (None, None)
    checkpoint.consolidate(tmp_path / "a", tmp_path / "hf")  # per-rank values are not model tensors
    expect_errors([
        (lambda: checkpoint.load(tmp_path / "a", model, return_rank_extra=1), TypeError, ["return_rank_extra", "bool"]),
        (lambda: checkpoint.save(tmp_path / "c", model, rank_extra={"x": {1, 2}}), Exception,
         ["rank 0", "rank_extra", "JSON"]),
    ])
    assert not os.path.exists(tmp_path / "c")


def _bad_on_rank_1(path: str) -> str:
    rank = dist.get_rank()
    model = parallelize_toy(build_toy(0))
    try:
        checkpoint.save(path, model, rank_extra={"rank": rank} if rank == 0 else {"bad": object()})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_bad_rank_extra_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    outcomes = run_on_ranks(_bad_on_rank_1, 2, str(tmp_path / "a"))
    for outcome in outcomes:
        assert "rank 1" in outcome and "rank_extra" in outcome and "JSON" in outcome, outcomes
    assert not os.path.exists(tmp_path / "a")
