"""Asynchronous saves against the state at the moment ``save`` was called.

The ground truth is a clone of each rank's local parameters, buffers and AdamW state taken just
before ``save``; training changes all of them right after ``save`` returns (the writers are held
back until it has, so the files are written from what changed). Each checkpoint must load back,
on the same plan, equal to its clone byte for byte. Failures in the background leave no
``.partial`` and the next save works; what ``save`` refused before returning it still refuses
before returning, on every rank, also once the ranks' agreement is reused from the last save.
"""

import errno
import gc
import importlib
import os
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.state.state_views import unwrap_shard_views
from autoshard import checkpoint
from autoshard.checkpoint import CheckpointSaveError
from checkpoint_models import build_toy, parallelize_toy, toy_ids
from multirank import run_on_ranks

save_module = importlib.import_module("autoshard.checkpoint.save")
manifest_module = importlib.import_module("autoshard.checkpoint.manifest")
snapshot_module = importlib.import_module("autoshard.checkpoint.snapshot")
pending_module = importlib.import_module("autoshard.checkpoint.pending")


def _train_step(model, optimizer, step: int) -> None:
    ids = toy_ids(step)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    optimizer.step()


def _local_state(model, optimizer):
    """This rank's tensors as they are now: parameters and buffers, and AdamW state by parameter name."""
    state = {name: t.detach().clone() for name, t in unwrap_shard_views(model.state_dict()).items()}
    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"optimizer/{names[id(p)]}/{key}"] = value.detach().clone()
    return state


def _differences(expected, got):
    if expected.keys() != got.keys():
        return [f"keys differ: {sorted(expected.keys() ^ got.keys())}"]
    return [name for name in expected if not torch.equal(expected[name], got[name])]


def _hold_writers_back(released):
    """Makes the rank file of a save to ``path`` wait until ``released[path]`` is set (training
    has changed the tensors); returns the writer to put back."""
    original = save_module.write_safetensors

    def held_back(file_path, tensors):
        path = os.path.dirname(file_path).removesuffix(".partial")
        assert released[path].wait(60), "the test never released the writer"
        return original(file_path, tensors)

    save_module.write_safetensors = held_back
    return original


def _saves_while_training(directory: str):
    model = parallelize_toy(build_toy(0))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected, extras, released = {}, {}, {}
    original = _hold_writers_back(released)
    try:
        # step-0 has no optimizer state yet; step-1 has: the ranks must plan their writes again.
        handles = []
        for step in range(3):
            path = os.path.join(directory, f"step-{step}")
            extra = {"step": step, "seen": list(range(step))}
            expected[path], extras[path] = _local_state(model, optimizer), {"step": step, "seen": list(range(step))}
            released[path] = threading.Event()
            handles.append(checkpoint.save(path, model, optimizer, extra=extra, async_save=True))
            # Right after save returns: everything it must have captured changes.
            extra["seen"].append("changed after save")
            extra["step"] = -1
            _train_step(model, optimizer, step)
            with torch.no_grad():
                model.temperature.mul_(1.25)
            optimizer.param_groups[0]["lr"] *= 0.5
            released[path].set()
            # The next save is called without waiting: it waits for this one itself.
        for handle in handles:
            handle.wait()
    finally:
        save_module.write_safetensors = original
    results = {}
    for path in expected:
        fresh = parallelize_toy(build_toy(7))
        fresh_optimizer = autoshard.optim.AdamW(fresh.parameters(), lr=1.0)
        extra = checkpoint.load(path, fresh, fresh_optimizer)
        results[path] = (extra == extras[path], _differences(expected[path], _local_state(fresh, fresh_optimizer)),
                         fresh_optimizer.param_groups[0]["lr"])
    return results


def test_async_saves_hold_the_state_of_the_moment_save_was_called(tmp_path):
    results = run_on_ranks(_saves_while_training, 2, str(tmp_path), timeout=300)
    for rank, per_path in enumerate(results):
        assert len(per_path) == 3
        for step, (path, (extra_equal, differences, lr)) in enumerate(sorted(per_path.items())):
            assert extra_equal, (rank, path)
            assert differences == [], (rank, path, differences)
            assert lr == pytest.approx(1e-2 * 0.5 ** step), (rank, path, lr)
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-1", "step-2"]


def _failures_then_success(directory: str):
    model = parallelize_toy(build_toy(0))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, 0)
    checkpoint.save(os.path.join(directory, "warm"), model, optimizer, async_save=True).wait()
    path = os.path.join(directory, "ckpt")
    messages = []

    # A copy that fails (rank 1), a rank file that cannot be written (rank 1), then a manifest
    # that cannot be (rank 0).
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_host_memory(*args, **kwargs):
        raise RuntimeError("cannot allocate host memory")

    write_file, write_durably, snapshot = save_module.write_safetensors, manifest_module.write_durably, \
        save_module.take_snapshot

    def manifest_full(file_path, data):
        if os.path.basename(file_path) == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device", file_path)
        return write_durably(file_path, data)

    for patch in ("copy", "rank file", "manifest"):
        if patch == "copy" and dist.get_rank() == 1:
            save_module.take_snapshot = no_host_memory
        if patch == "rank file" and dist.get_rank() == 1:
            save_module.write_safetensors = full_disk
        if patch == "manifest" and dist.get_rank() == 0:
            manifest_module.write_durably = manifest_full
        try:
            handle = checkpoint.save(path, model, optimizer, async_save=True)
            _train_step(model, optimizer, 1)
            try:
                handle.wait()
                messages.append(None)
            except CheckpointSaveError as error:
                messages.append(str(error))
        finally:
            save_module.write_safetensors, manifest_module.write_durably = write_file, write_durably
            save_module.take_snapshot = snapshot
        dist.barrier()
        messages.append(sorted(os.listdir(directory)))
    expected = _local_state(model, optimizer)
    handle = checkpoint.save(path, model, optimizer, async_save=True)
    _train_step(model, optimizer, 2)
    handle.wait()
    fresh = parallelize_toy(build_toy(3))
    fresh_optimizer = autoshard.optim.AdamW(fresh.parameters(), lr=1.0)
    checkpoint.load(path, fresh, fresh_optimizer)
    return messages, _differences(expected, _local_state(fresh, fresh_optimizer))


def test_a_failed_background_save_leaves_nothing_and_the_next_one_works(tmp_path):
    for rank, (messages, differences) in enumerate(run_on_ranks(_failures_then_success, 2, str(tmp_path),
                                                                timeout=300)):
        copy_error, after_copy, file_error, after_file, manifest_error, after_manifest = messages
        assert copy_error is not None and "rank 1" in copy_error and "host memory" in copy_error, copy_error
        assert file_error is not None and "rank 1" in file_error and "No space left" in file_error, file_error
        assert manifest_error is not None and "No space left" in manifest_error, manifest_error
        assert after_copy == after_file == after_manifest == ["warm"], (rank, after_copy, after_file, after_manifest)
        assert differences == [], (rank, differences)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "warm"]


def _out_of_memory(where: str, fail_on: int):
    """Makes rank ``fail_on``'s next asynchronous save run out of memory ``where`` ("copy": after
    allocating new buffers for three tensors; "write": at its rank file); returns weak
    references to every host buffer that save used, and the functions to put back."""
    buffers = pending_module.WRITER.snapshot_buffers
    kept = [weakref.ref(buffer) for buffer, _ in buffers.buffers.values()]
    originals = buffers.buffer, save_module.write_safetensors
    if dist.get_rank() != fail_on:
        return kept, originals
    if where == "copy":
        allocated = []

        def buffer(key, like):
            if len(allocated) == 3:
                raise MemoryError(f"no host memory left for {key!r}")
            new = torch.empty(like.shape, dtype=like.dtype)
            allocated.append(new)
            kept.append(weakref.ref(new))
            buffers.buffers[key] = (new, False)
            return new
        buffers.buffer = buffer
    else:
        def write(file_path, tensors):
            raise MemoryError(f"no memory left to write {file_path!r}")
        save_module.write_safetensors = write
    return kept, originals


def _failed_save_releases_its_buffers(directory: str, where: str):
    model = parallelize_toy(build_toy(0))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, 0)
    good = os.path.join(directory, "good")
    checkpoint.save(good, model, optimizer, async_save=True).wait()
    expected = _local_state(model, optimizer)
    kept_after_good = snapshot_module.kept_bytes()
    _train_step(model, optimizer, 1)
    gc.collect()
    gc.disable()  # what is freed must be freed by reference counting, not by a collection
    try:
        kept, originals = _out_of_memory(where, fail_on=1)
        try:
            handle = checkpoint.save(os.path.join(directory, "failed"), model, optimizer, async_save=True)
            try:
                handle.wait()
                error = None
            except CheckpointSaveError as e:
                error = str(e)
        finally:
            vars(pending_module.WRITER.snapshot_buffers).pop("buffer", None)  # the class's own method again
            save_module.write_safetensors = originals[1]
        alive = sum(ref() is not None for ref in kept)
        kept_after_failure = snapshot_module.kept_bytes()
    finally:
        gc.enable()
    fresh = parallelize_toy(build_toy(3))
    fresh_optimizer = autoshard.optim.AdamW(fresh.parameters(), lr=1.0)
    checkpoint.load(good, fresh, fresh_optimizer)
    differences = _differences(expected, _local_state(fresh, fresh_optimizer))
    checkpoint.save(os.path.join(directory, "next"), model, optimizer, async_save=True).wait()
    return error, len(kept), alive, kept_after_good, kept_after_failure, differences


@pytest.mark.parametrize("where", ["copy", "write"])
def test_a_save_that_runs_out_of_memory_releases_its_buffers(tmp_path, where):
    results = run_on_ranks(_failed_save_releases_its_buffers, 2, str(tmp_path), where, timeout=300)
    for rank, (error, buffers, alive, kept_after_good, kept_after_failure, differences) in enumerate(results):
        assert error is not None and "rank 1" in error and "memory" in error, (rank, error)
        assert buffers > 0 and kept_after_good > 0, (rank, buffers, kept_after_good)
        # Every rank's save failed, so every rank dropped its buffers: none is referenced any more.
        assert (alive, kept_after_failure) == (0, 0), (rank, alive, kept_after_failure)
        assert differences == [], (rank, differences)
    assert sorted(os.listdir(tmp_path)) == ["good", "next"]


def _refusals_after_a_save(directory: str):
    """After a save has made the ranks' agreement reusable: what save must refuse before it
    returns, as (error type, message, whether the handle was ever returned) per case."""
    model = parallelize_toy(build_toy(0))
    first = os.path.join(directory, "first")
    checkpoint.save(first, model, async_save=True).wait()
    cases = {
        "exists": first,
        "different paths": os.path.join(directory, f"rank-{dist.get_rank()}"),
    }
    outcomes = {}
    for name, path in cases.items():
        try:
            checkpoint.save(path, model, async_save=True)
            outcomes[name] = (None, None)
        except (ValueError, FileExistsError, CheckpointSaveError) as error:
            outcomes[name] = (type(error).__name__, str(error))
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(directory, "claimed.partial"))
        with open(os.path.join(directory, "claimed.partial", "OWNER"), "w") as f:
            f.write('{"token": "another job", "host": "h", "pid": 1, "created": 0}')
    dist.barrier()
    try:
        checkpoint.save(os.path.join(directory, "claimed"), model, async_save=True)
        outcomes["claimed"] = (None, None)
    except CheckpointSaveError as error:
        outcomes["claimed"] = (type(error).__name__, str(error))
    second = os.path.join(directory, "second")
    checkpoint.save(second, model, async_save=True).wait()  # the ranks still agree
    return outcomes


def test_refusals_are_raised_by_save_itself_on_every_rank(tmp_path):
    for outcomes in run_on_ranks(_refusals_after_a_save, 2, str(tmp_path)):
        kind, message = outcomes["exists"]
        assert kind == "FileExistsError" and "already exists" in message, outcomes
        kind, message = outcomes["different paths"]
        assert kind == "ValueError" and "same path" in message, outcomes
        kind, message = outcomes["claimed"]
        assert kind == "CheckpointSaveError" and "claimed.partial" in message, outcomes
    assert sorted(os.listdir(tmp_path)) == ["claimed.partial", "first", "second"]


@pytest.mark.gpu
def test_cuda_async_save_copies_before_later_kernels_change_the_tensors(tmp_path):
    """Tensors large enough that the device-to-host copies are still running when the next
    kernels are queued; a copy taken on the wrong stream, or not waited for, sees them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 2048, device="cuda")).square().mean().backward()
    optimizer.step()
    for side in (False, True):  # the caller on the default stream, then on a stream of its own
        expected = _local_state(model, optimizer)
        stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            handle = checkpoint.save(tmp_path / f"ckpt-{side}", model, optimizer, async_save=True)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0).add_(1.0)
            optimizer.step()
        handle.wait()
        torch.cuda.synchronize()
        fresh = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1.0)
        checkpoint.load(tmp_path / f"ckpt-{side}", fresh, fresh_optimizer)
        assert _differences(expected, _local_state(fresh, fresh_optimizer)) == []
