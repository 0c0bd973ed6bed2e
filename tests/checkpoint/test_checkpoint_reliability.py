"""Checkpoints under concurrent writers, full disks, crafted manifests and damaged neighbours.

Ground truth is the saving model itself: a checkpoint either loads back equal to the model that
a save reported as committed, or is refused with an error that names the file and the field,
before the model or optimizer changes; and a failed save leaves nothing behind.
"""

import errno
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard import checkpoint
from autoshard.checkpoint import CheckpointCorruptError, CheckpointSaveError
from checkpoint_models import build_toy, parallelize_toy, toy_ids
from checks import expect_errors
from multirank import run_on_ranks

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
manifest_module = importlib.import_module("autoshard.checkpoint.manifest")
save_module = importlib.import_module("autoshard.checkpoint.save")


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal_states(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _claim_by_hand(partial, pid=None, host=None, created=None) -> str:
    """Another job's claim on ``partial``, as its save makes it (a directory holding OWNER)."""
    token = uuid.uuid4().hex
    os.makedirs(partial)
    owner = {"token": token, "host": host or socket.gethostname(), "pid": pid or os.getpid(),
             "created": created or time.time()}
    with open(os.path.join(partial, "OWNER"), "w") as f:
        json.dump(owner, f)
    return token


def _owner_token(partial):
    with open(os.path.join(partial, "OWNER")) as f:
        return json.load(f)["token"]


# --- 1. two jobs, one path ------------------------------------------------------------------------

def _save_and_report(path: str, seed: int, async_save: bool):
    try:
        checkpoint.save(path, parallelize_toy(build_toy(seed)), async_save=async_save).wait()
    except CheckpointSaveError as error:
        return str(error)
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_to_a_path_another_job_holds_fails_on_every_rank(tmp_path, async_save):
    path = str(tmp_path / "ckpt")
    token = _claim_by_hand(path + ".partial")
    messages = run_on_ranks(_save_and_report, 2, path, 0, async_save)
    assert all(m is not None and path + ".partial" in m and "in progress" in m for m in messages), messages
    assert _owner_token(path + ".partial") == token  # the other job's directory is untouched
    assert not os.path.exists(path)


def _save_while_partial_is_taken_over(path: str):
    """Rank 0's write is followed by another job removing this save's .partial and claiming it."""
    original = save_module.write_safetensors

    def write_then_lose_the_claim(file_path, tensors):
        record = original(file_path, tensors)
        # Every rank's file is written before the takeover: a rank still writing could otherwise
        # make the directory again between the other job's removal and its claim.
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path + ".partial")
            _claim_by_hand(path + ".partial")
        dist.barrier()
        return record

    save_module.write_safetensors = write_then_lose_the_claim
    try:
        return _save_and_report(path, 0, False), (_owner_token(path + ".partial") if dist.get_rank() == 0 else None)
    finally:
        save_module.write_safetensors = original


def test_a_save_checks_its_claim_before_it_commits(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_on_ranks(_save_while_partial_is_taken_over, 2, path)
    assert all(m is not None and "no longer this save's" in m for m, _ in results), results
    assert not os.path.exists(path)
    assert _owner_token(path + ".partial") == results[0][1]  # the new owner's claim survives


def _slow_save(path: str, started: str, go: str):
    """Saves the seed-0 model; rank 0 stops after writing its file until ``go`` exists."""
    original = save_module.write_safetensors

    def write_and_wait(file_path, tensors):
        record = original(file_path, tensors)
        if dist.get_rank() == 0:
            open(started, "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
        return record

    save_module.write_safetensors = write_and_wait
    try:
        model = parallelize_toy(build_toy(0))
        return _save_and_report(path, 0, False), {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}
    finally:
        save_module.write_safetensors = original


def test_two_jobs_saving_to_one_path_at_once(tmp_path):
    """A 2-rank job is half way through its save when a 3-rank job saves to the same path."""
    path, started, go = str(tmp_path / "ckpt"), str(tmp_path / "started"), str(tmp_path / "go")
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("results", run_on_ranks(_slow_save, 2, path, started, go)))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(started) and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
        assert os.path.exists(started)
        second = run_on_ranks(_save_and_report, 3, path, 1, False)
    finally:
        open(go, "w").close()
        thread.join()
    assert all(m is not None and "in progress" in m for m in second), second
    messages = [m for m, _ in first["results"]]
    assert messages == [None, None], messages
    loaded = build_toy(5)
    checkpoint.load(path, loaded)
    assert _equal_states(loaded.state_dict(), first["results"][0][1])


def test_manager_removes_dead_leftovers_and_keeps_live_claims(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    _claim_by_hand(tmp_path / "step-1.partial", pid=dead_pid)
    (tmp_path / "step-2.partial").mkdir()  # no owner record: never a claim in progress
    live = _claim_by_hand(tmp_path / "step-3.partial")  # this process: alive
    _claim_by_hand(tmp_path / "step-4.partial", host="another-host", created=time.time() - 10)
    _claim_by_hand(tmp_path / "step-5.partial", host="another-host", created=time.time() - 7200)
    with pytest.warns(RuntimeWarning, match="step-3.partial"):
        checkpoint.CheckpointManager(tmp_path, stale_after=3600)
    assert sorted(os.listdir(tmp_path)) == ["step-3.partial", "step-4.partial"]
    assert _owner_token(tmp_path / "step-3.partial") == live


# --- 3. disk full while committing --------------------------------------------------------------

def _full_disk_at(target: str):
    """A manifest writer (or directory fsync) that raises ENOSPC at ``target``."""
    write, fsync = manifest_module.write_durably, manifest_module.fsync_directory

    def failing_write(path, data):
        if os.path.basename(path) == target:
            with open(path, "wb") as f:  # part of it reached the disk
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, data)

    def failing_fsync(path):
        if target == "fsync" and path.endswith(".partial"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return fsync(path)

    return failing_write, failing_fsync


@pytest.mark.parametrize("target", ["manifest.json", "COMMITTED", "fsync"])
def test_disk_full_while_committing_leaves_nothing(tmp_path, monkeypatch, target):
    path = tmp_path / "ckpt"
    model = build_toy(0)
    failing_write, failing_fsync = _full_disk_at(target)
    monkeypatch.setattr(manifest_module, "write_durably", failing_write)
    monkeypatch.setattr(manifest_module, "fsync_directory", failing_fsync)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        checkpoint.save(path, model)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    checkpoint.save(path, model)  # the space is back and the path is free
    loaded = build_toy(1)
    checkpoint.load(path, loaded)
    assert _equal_states(loaded.state_dict(), model.state_dict())


def _save_with_full_disk_on_rank0(path: str, target: str):
    failing_write, failing_fsync = _full_disk_at(target)
    write, fsync = manifest_module.write_durably, manifest_module.fsync_directory
    manifest_module.write_durably, manifest_module.fsync_directory = failing_write, failing_fsync
    try:
        return _save_and_report(path, 0, True)
    finally:
        manifest_module.write_durably, manifest_module.fsync_directory = write, fsync


@pytest.mark.parametrize("target", ["manifest.json", "COMMITTED"])
def test_disk_full_while_committing_fails_every_rank(tmp_path, target):
    path = str(tmp_path / "ckpt")
    messages = run_on_ranks(_save_with_full_disk_on_rank0, 2, path, target)
    assert all(m is not None and "No space left" in m for m in messages), messages
    assert os.listdir(tmp_path) == []


_FSIZE_SCRIPT = r"""
import os, resource, signal, sys
sys.path.insert(0, {support!r})
import autoshard
from autoshard import checkpoint
from checkpoint_models import build_toy
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    # The extra makes the manifest the one file over the limit: the rank file is written.
    checkpoint.save({path!r}, build_toy(0), extra={{"notes": "x" * {extra}}})
except checkpoint.CheckpointSaveError as error:
    print("refused:", error)
"""


def test_file_size_limit_while_writing_the_manifest(tmp_path):
    path = str(tmp_path / "out" / "ckpt")
    os.makedirs(tmp_path / "out")
    limit = 200_000
    script = _FSIZE_SCRIPT.format(support=SUPPORT_DIR, path=path, limit=limit, extra=2 * limit)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "File too large" in done.stdout, done.stdout
    assert os.listdir(tmp_path / "out") == []


# --- 2 and 5. crafted manifests -----------------------------------------------------------------

def _rewrite_manifest(path, edit) -> None:
    """Edits manifest.json and vouches for the edit in COMMITTED, as a crafted checkpoint would."""
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        data = json.load(f)
    edit(data)
    raw = json.dumps(data).encode()
    with open(manifest_path, "wb") as f:
        f.write(raw)
    with open(os.path.join(path, "COMMITTED"), "w") as f:
        json.dump({"manifest_size": len(raw), "manifest_crc32": zlib.crc32(raw)}, f)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def two_saved(tmp_path):
    """A checkpoint of the seed-0 model, and one of the seed-1 model (the 'secret' elsewhere)."""
    model = build_toy(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(toy_ids(0)).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "good", model, optimizer)
    checkpoint.save(tmp_path / "secret", build_toy(1))
    return tmp_path


def _point_outside(file_name):
    def edit(data):
        entry = data["files"].pop("rank-00000.safetensors")
        data["files"][file_name] = entry
        for record in data["tensors"].values():
            for piece in record["pieces"]:
                piece["file"] = file_name
    return edit


def _borrow_secret_sizes(tmp_path):
    with open(tmp_path / "secret" / "manifest.json") as f:
        return json.load(f)["files"]["rank-00000.safetensors"]


@pytest.mark.parametrize("name", ["../secret/rank-00000.safetensors", "ABSOLUTE"])
def test_manifest_file_names_stay_inside_the_checkpoint(two_saved, name):
    tmp_path = two_saved
    if name == "ABSOLUTE":
        name = str(tmp_path / "secret" / "rank-00000.safetensors")
    crafted = _copy(tmp_path / "good", tmp_path / "crafted")
    entry = _borrow_secret_sizes(tmp_path)

    def edit(data):
        _point_outside(name)(data)
        data["files"][name] = entry
        data["optimizer"] = None
        data["tensors"] = {k: v for k, v in data["tensors"].items() if not k.startswith("optimizer/")}

    _rewrite_manifest(crafted, edit)
    model = build_toy(2)
    before = _state(model)
    expect_errors([
        (lambda: checkpoint.load(crafted, model), CheckpointCorruptError, [str(crafted / "manifest.json"), "file"]),
        (lambda: checkpoint.consolidate(crafted, tmp_path / "out"), CheckpointCorruptError,
         [str(crafted / "manifest.json"), "file"]),
    ])
    assert _equal_states(model.state_dict(), before)
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_a_rank_file_that_links_outside_is_refused(two_saved):
    tmp_path = two_saved
    crafted = _copy(tmp_path / "good", tmp_path / "crafted")
    entry = _borrow_secret_sizes(tmp_path)
    os.remove(crafted / "rank-00000.safetensors")
    os.symlink(tmp_path / "secret" / "rank-00000.safetensors", crafted / "rank-00000.safetensors")

    def edit(data):
        data["files"]["rank-00000.safetensors"] = entry
        data["optimizer"] = None
        data["tensors"] = {k: v for k, v in data["tensors"].items() if not k.startswith("optimizer/")}

    _rewrite_manifest(crafted, edit)
    model = build_toy(2)
    before = _state(model)
    with pytest.raises(CheckpointCorruptError, match="not a file inside"):
        checkpoint.load(crafted, model)
    assert _equal_states(model.state_dict(), before)


def _save_sharded(path: str):
    model = parallelize_toy(build_toy(0))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint.save(path, model, optimizer)


def test_overlapping_pieces_whose_sizes_add_up_are_refused(tmp_path):
    saved = str(tmp_path / "sharded")
    run_on_ranks(_save_sharded, 2, saved)
    crafted = _copy(saved, tmp_path / "crafted")
    changed = []

    def edit(data):
        for name, record in data["tensors"].items():
            pieces = record["pieces"]
            if len(pieces) == 2 and pieces[0]["runs"] != pieces[1]["runs"] and not changed:
                shapes = [[sum(n for _, n in dim) for dim in p["runs"]] for p in pieces]
                if shapes[0] == shapes[1]:
                    pieces[1]["runs"] = pieces[0]["runs"]  # same size, same place: half never read
                    changed.append(name)

    _rewrite_manifest(crafted, edit)
    assert changed
    model = build_toy(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model)
    with pytest.raises(CheckpointCorruptError, match="overlap") as caught:
        checkpoint.load(crafted, model, optimizer)
    assert str(crafted / "manifest.json") in str(caught.value) and changed[0] in str(caught.value)
    assert _equal_states(model.state_dict(), before) and not optimizer.state


def test_a_dtype_that_differs_from_the_file_is_refused(two_saved):
    tmp_path = two_saved
    crafted = _copy(tmp_path / "good", tmp_path / "crafted")
    _rewrite_manifest(crafted, lambda data: data["tensors"]["up.weight"].update(dtype="float16"))
    model = build_toy(2)
    model.up.half()
    before = _state(model)
    expect_errors([
        (lambda: checkpoint.load(crafted, model), CheckpointCorruptError,
         [str(crafted / "rank-00000.safetensors"), "up.weight", "float32", "float16"]),
        (lambda: checkpoint.consolidate(crafted, tmp_path / "out"), CheckpointCorruptError,
         ["rank-00000.safetensors", "up.weight", "float16"]),
    ])
    assert _equal_states(model.state_dict(), before)
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def _malformed_cases():
    def set_path(*keys_and_value):
        *keys, value = keys_and_value

        def edit(data):
            node = data
            for key in keys[:-1]:
                node = node[key] if not callable(key) else key(node)
            node[keys[-1]] = value
        return edit

    first_piece = lambda data: data["tensors"]["up.weight"]["pieces"][0]
    return [
        ("tensors is a list", set_path("tensors", []), "tensors"),
        ("a record is a list", set_path("tensors", "up.weight", []), "tensors['up.weight']"),
        ("a file entry is a list", set_path("files", "rank-00000.safetensors", [1, 2]), "files['rank-00000.safetensors']"),
        ("world_size is text", set_path("world_size", "two"), "world_size"),
        ("shape holds text", set_path("tensors", "up.weight", "shape", ["30", 20]), "tensors['up.weight'].shape"),
        ("pieces is an object", set_path("tensors", "up.weight", "pieces", {}), "tensors['up.weight'].pieces"),
        ("a run outside the shape", lambda d: first_piece(d).update(runs=[[[0, 99]], [[0, 20]]]),
         "tensors['up.weight'].pieces[0].runs[0]"),
        ("a negative run", lambda d: first_piece(d).update(runs=[[[-5, 30]], [[0, 20]]]),
         "tensors['up.weight'].pieces[0].runs[0]"),
        ("runs for too few dims", lambda d: first_piece(d).update(runs=[[[0, 30]]]),
         "tensors['up.weight'].pieces[0].runs"),
        ("a file not listed", lambda d: first_piece(d).update(file="rank-00007.safetensors"),
         "tensors['up.weight'].pieces[0].file"),
        ("an unknown dtype", set_path("tensors", "up.weight", "dtype", "float99"), "tensors['up.weight'].dtype"),
        ("optimizer is a list", set_path("optimizer", []), "optimizer"),
        ("param_groups is an object", set_path("optimizer", "param_groups", {}), "optimizer.param_groups"),
        ("a state entry with a bad layout",
         lambda d: d["optimizer"]["state"]["up.weight"]["exp_avg"].update(layout="sideways"),
         "optimizer.state['up.weight']['exp_avg'].layout"),
        ("an unknown field", set_path("surprise", 1), "surprise"),
    ]


@pytest.mark.parametrize("case", _malformed_cases(), ids=lambda c: c[0])
def test_malformed_manifests_name_the_file_and_field(two_saved, case):
    tmp_path = two_saved
    _, edit, field = case
    crafted = _copy(tmp_path / "good", tmp_path / "crafted")
    _rewrite_manifest(crafted, edit)
    model = build_toy(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _state(model)
    expect_errors([
        (lambda: checkpoint.load(crafted, model, optimizer), CheckpointCorruptError,
         [str(crafted / "manifest.json"), field]),
        (lambda: checkpoint.consolidate(crafted, tmp_path / "out"), CheckpointCorruptError,
         [str(crafted / "manifest.json"), field]),
    ])
    assert _equal_states(model.state_dict(), before) and not optimizer.state


@pytest.mark.parametrize("key,value", [("lr", -5), ("betas", [2, 3]), ("eps", "small"), ("lr", 1e999),
                                       ("weight_decay", -0.1), ("betas", [0.9]), ("maximize", 1)])
def test_hyperparameters_in_a_manifest_are_checked(two_saved, key, value):
    tmp_path = two_saved
    crafted = _copy(tmp_path / "good", tmp_path / "crafted")
    _rewrite_manifest(crafted, lambda data: data["optimizer"]["param_groups"][0].update({key: value}))
    model = build_toy(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hyperparameters = lambda: [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    before, groups = _state(model), hyperparameters()
    with pytest.raises(CheckpointCorruptError, match=f"param_groups\\[0\\]\\['{key}'\\]") as caught:
        checkpoint.load(crafted, model, optimizer)
    assert str(crafted / "manifest.json") in str(caught.value)
    assert _equal_states(model.state_dict(), before) and not optimizer.state
    assert hyperparameters() == groups


# --- 4. CheckpointManager -------------------------------------------------------------------------

def _corrupt_manifest(path):
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))


def test_manager_retention_skips_a_damaged_checkpoint_and_reports_it_once(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, max_to_keep=2, keep_best="loss")
    model = build_toy(0)
    manager.save(0, model, metrics={"loss": 1.0})
    _corrupt_manifest(tmp_path / "step-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 5):
            manager.save(step, model, metrics={"loss": 5.0 - step}, async_save=step % 2 == 0).wait()
    reports = [w for w in caught if "step-0'" in str(w.message)]
    assert len(reports) == 1 and "cannot read" in str(reports[0].message), [str(w.message) for w in caught]
    # The damaged one is left for a person to look at; retention went on for the others.
    assert manager.steps() == [0, 3, 4]


def test_manager_leaves_a_hand_made_directory_alone(tmp_path):
    hand_made = tmp_path / "step-1"
    hand_made.mkdir()
    (hand_made / "COMMITTED").write_text("mine")
    (hand_made / "notes.txt").write_text("results I care about")
    for keep_best in (None, "loss"):
        manager = checkpoint.CheckpointManager(tmp_path, max_to_keep=1, keep_best=keep_best)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (2, 3):
                manager.save(step + (10 if keep_best else 0), build_toy(0), metrics={"loss": 1.0})
        assert (hand_made / "notes.txt").read_text() == "results I care about"
        assert sum("step-1'" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]


def test_manager_cleans_an_old_uncommitted_step_directory(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, max_to_keep=3)
    manager.save(1, build_toy(0))
    os.remove(tmp_path / "step-1" / "COMMITTED")  # e.g. copied in part, or from an old version
    manager.save(2, build_toy(0))
    assert sorted(os.listdir(tmp_path)) == ["step-2"]
