"""autoshard.checkpoint against independent ground truth: a model and its AdamW state saved on
2 ranks reload on 3 ranks and on one unsharded torch model (with torch.optim.AdamW) with equal
parameters, outputs and next training step; killed saves, flipped bytes, failing writers,
retention, and consolidation into a checkpoint that safetensors and transformers load."""

import importlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import autoshard
from autoshard import checkpoint
from autoshard.checkpoint import CheckpointCorruptError, CheckpointSaveError, UncommittedCheckpointError
from checkpoint_models import build_toy, parallelize_toy, toy_ids
from checks import expect_errors
from hf_models import build
from local_ranks import free_port, rank_env
from multirank import run_on_ranks

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
STEPS_BEFORE_SAVE = 2


def _make(kind: str, seed: int):
    return build("gpt2", seed=seed) if kind == "gpt2" else build_toy(seed)


def _ids(kind: str, step: int):
    if kind == "gpt2":
        return torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(100 + step))
    return toy_ids(step)


def _logits(model, kind: str, ids):
    return model(input_ids=ids).logits if kind == "gpt2" else model(ids)


def _train_step(model, optimizer, kind: str, step: int) -> None:
    ids = _ids(kind, step)
    optimizer.zero_grad()
    logits = _logits(model, kind, ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    optimizer.step()


def _full_state(model, sharded: bool = True):
    """A copy (state dicts share the live parameters' storage, which the next step changes)."""
    state = autoshard.full_state_dict(model) if sharded else model.state_dict()
    return {name: value.clone() for name, value in state.items()}


def _parallelize(model, kind: str):
    return autoshard.parallelize(model) if kind == "gpt2" else parallelize_toy(model)


def _train_and_save(kind: str, path: str):
    """Trains the sharded model, saves asynchronously, and takes one more step while the save
    is in flight (which the checkpoint must not see)."""
    model = _parallelize(_make(kind, seed=0), kind)
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    for step in range(STEPS_BEFORE_SAVE):
        _train_step(model, optimizer, kind, step)
    saved = _full_state(model)
    logits = _logits(model, kind, _ids(kind, 99)).detach()
    handle = checkpoint.save(path, model, optimizer, extra={"step": STEPS_BEFORE_SAVE, "kind": kind}, async_save=True)
    _train_step(model, optimizer, kind, STEPS_BEFORE_SAVE)
    assert handle.wait() == path
    return saved, logits, _full_state(model)


def _load_and_step(kind: str, path: str, sharded: bool = True):
    """Loads into a model built from other weights, with an optimizer built with other
    hyperparameters; returns extra, the loaded state, logits, and the state after one step."""
    model = _make(kind, seed=1)
    if sharded:
        _parallelize(model, kind)
        optimizer = autoshard.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.0)
    extra = checkpoint.load(path, model, optimizer)
    loaded = _full_state(model, sharded)
    logits = _logits(model, kind, _ids(kind, 99)).detach()
    _train_step(model, optimizer, kind, STEPS_BEFORE_SAVE)
    return extra, loaded, logits, _full_state(model, sharded)


@pytest.fixture(scope="module", params=["gpt2", "toy"])
def saved_on_two_ranks(request, tmp_path_factory):
    kind = request.param
    path = str(tmp_path_factory.mktemp(f"{kind}-2ranks") / "ckpt")
    saved, logits, stepped = run_on_ranks(_train_and_save, 2, kind, path, timeout=600)[0]
    return kind, path, saved, logits, stepped


def _assert_round_trip(kind, saved, logits, stepped, result):
    extra, loaded, got_logits, got_stepped = result
    assert extra == {"step": STEPS_BEFORE_SAVE, "kind": kind}
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name  # loading is a copy of bytes: exact
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
    for name, value in stepped.items():
        torch.testing.assert_close(got_stepped[name], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    # The step changed the model (the comparison above is not between two unchanged copies).
    assert any(not torch.equal(stepped[n], saved[n]) for n in saved)


def test_reload_on_three_ranks(saved_on_two_ranks):
    kind, path, saved, logits, stepped = saved_on_two_ranks
    results = run_on_ranks(_load_and_step, 3, kind, path, timeout=600)
    _assert_round_trip(kind, saved, logits, stepped, results[0])


def test_reload_unsharded_with_torch_adamw(saved_on_two_ranks):
    kind, path, saved, logits, stepped = saved_on_two_ranks
    _assert_round_trip(kind, saved, logits, stepped, _load_and_step(kind, path, sharded=False))


def test_reload_whole_in_another_dtype(saved_on_two_ranks):
    """Each whole tensor is read from both ranks' pieces through a staging buffer of the file's
    dtype (as on a GPU): every piece lands, none is overwritten by the next one's buffer."""
    kind, path, saved, _, _ = saved_on_two_ranks
    model = _make(kind, seed=1).double()
    checkpoint.load(path, model)
    loaded = model.state_dict()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value.double()), name  # float32 to float64 is exact


def test_manifest_records_world_plan_and_pieces(saved_on_two_ranks):
    kind, path, saved, _, _ = saved_on_two_ranks
    manifest = checkpoint.read_manifest(path)
    assert manifest.world_size == 2 and manifest.tp_ranks == [0, 1]
    assert autoshard.ShardingPlan.from_json(manifest.plan).world_size == 2
    assert sorted(manifest.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    for name, value in saved.items():
        stored = manifest.aliases.get(name, name)
        assert manifest.tensors[stored].shape == list(value.shape), name
    assert manifest.optimizer["param_groups"][0]["lr"] == 2e-3
    # Each piece is written once: a sharded tensor in two pieces, a replicated one in one.
    pieces = {len(r.pieces) for r in manifest.tensors.values()}
    assert pieces == {1, 2}


def test_consolidate_matches_unsharded_state_and_loads_in_transformers(saved_on_two_ranks, tmp_path):
    kind, path, saved, logits, _ = saved_on_two_ranks
    tied = {"gpt2": "lm_head.weight", "toy": "head.weight"}[kind]
    total_bytes = sum(v.numel() * v.element_size() for n, v in saved.items() if n != tied)
    for max_shard_size in (None, total_bytes // 4):
        out = tmp_path / f"hf-{max_shard_size}"
        written = checkpoint.consolidate(path, out, max_shard_size=max_shard_size)
        shards = sorted(p for p in written if p.endswith(".safetensors"))
        assert len(shards) == 1 if max_shard_size is None else len(shards) > 2, shards
        tensors = {}
        for shard in shards:
            tensors.update(load_file(shard))
        # Tied weights are stored once, as save_pretrained does.
        assert set(tensors) == set(saved) - {tied}
        for name, value in tensors.items():
            assert torch.equal(value, saved[name]), name
        if kind != "gpt2":
            continue
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name
        torch.testing.assert_close(model(input_ids=_ids("gpt2", 99)).logits.detach(), logits, rtol=1e-5, atol=1e-5)


def _mesh_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 37, (4, 7), generator=torch.Generator().manual_seed(700 + step))


def _loss(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _mesh_model_and_optimizer(seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_toy(build_toy(seed), mesh=mesh)  # partitions replicated parameters' state over dp
    return model, autoshard.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), mesh.get_local_rank("dp")


def _mesh_step(model, optimizer, dp_rank: int, step: int) -> None:
    optimizer.zero_grad()
    _loss(model, _mesh_batch(step).chunk(2)[dp_rank]).backward()  # each replica: half the batch
    optimizer.step()


def _reference_step(model, optimizer, step: int) -> None:
    optimizer.zero_grad()
    _loss(model, _mesh_batch(step)).backward()
    optimizer.step()


def _train_on_mesh_and_save(path: str):
    """Two AdamW steps on a 2 x 2 dp x tp mesh (replicated parameters' optimizer state
    partitioned over dp), saved; and the same two steps of torch.optim.AdamW on the full batch."""
    try:
        model, optimizer, dp_rank = _mesh_model_and_optimizer(0)
        reference = build_toy(0)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            _mesh_step(model, optimizer, dp_rank, step)
            _reference_step(reference, reference_optimizer, step)
        checkpoint.save(path, model, optimizer)
        written = os.path.exists(os.path.join(path, f"rank-{dist.get_rank():05d}.safetensors"))
        return written, _named_state(reference, reference_optimizer)
    finally:
        autoshard.core.distributed.set_default_group(None)


def _named_state(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return ({n: v.clone() for n, v in model.state_dict().items()},
            {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()})


def _load_on_mesh_and_step(path: str):
    try:
        model, optimizer, dp_rank = _mesh_model_and_optimizer(1)
        checkpoint.load(path, model, optimizer)
        _mesh_step(model, optimizer, dp_rank, 2)
        return _full_state(model)
    finally:
        autoshard.core.distributed.set_default_group(None)


def test_mesh_with_partitioned_optimizer_state_reloads_anywhere(tmp_path):
    path = str(tmp_path / "mesh")
    results = run_on_ranks(_train_on_mesh_and_save, 4, path, timeout=300)
    params, states = results[0][1]
    manifest = checkpoint.read_manifest(path)
    for name in params:
        stored = manifest.aliases.get(name, name)
        sharded = name in ("embed.weight", "up.weight", "up.bias", "down.weight", "head.weight")
        # Each piece once: the tp shards from one replica, a replicated tensor from one rank.
        assert len(manifest.tensors[stored].pieces) == (2 if sharded else 1), name
        if name in states and not sharded:
            # Partitioned moments: each dp replica's piece of the flattened tensor.
            record = manifest.tensors[f"optimizer/{name}/exp_avg"]
            assert record.shape == [params[name].numel()] and len(record.pieces) == 2, name
    assert sum(written for written, _ in results) >= 3  # the writing is spread over the ranks

    # Unsharded, into torch.optim.AdamW: equal to full-batch training with torch's AdamW.
    model = build_toy(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.load(path, model, optimizer)
    got_params, got_states = _named_state(model, optimizer)
    for name, value in params.items():
        # 1e-4 as in test_train: AdamW turns rounding differences of tiny gradients into larger ones.
        torch.testing.assert_close(got_params[name], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    for name, state in states.items():
        for key, value in state.items():
            torch.testing.assert_close(got_states[name][key], value, rtol=1e-3, atol=1e-8,
                                       msg=lambda m: f"{name} {key}: {m}")
    # Back onto a mesh, one more step equals one more full-batch step of torch's AdamW.
    stepped = run_on_ranks(_load_on_mesh_and_step, 4, path, timeout=300)[0]
    _reference_step(model, optimizer, 2)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(stepped[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_existing_path_is_never_overwritten(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, build_toy(0))
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(FileExistsError, match=str(path)):
        checkpoint.save(path, build_toy(1), async_save=True)
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    assert not os.path.exists(str(path) + ".partial")


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path):
    model = build_toy(0)
    cases = []

    def damaged(name, damage):
        path = tmp_path / name
        checkpoint.save(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
        damage(path)
        return path

    shard = "rank-00000.safetensors"
    size = os.path.getsize(damaged("probe", lambda p: None) / shard)
    data_byte = damaged("data", lambda p: _flip_byte(p / shard, size - 3))
    header_byte = damaged("header", lambda p: _flip_byte(p / shard, 20))
    truncated = damaged("truncated", lambda p: os.truncate(p / shard, size - 1))
    manifest_byte = damaged("manifest", lambda p: _flip_byte(p / "manifest.json", 30))
    uncommitted = damaged("uncommitted", lambda p: os.remove(p / "COMMITTED"))
    for path, error, named in ((data_byte, CheckpointCorruptError, data_byte / shard),
                               (header_byte, CheckpointCorruptError, header_byte / shard),
                               (truncated, CheckpointCorruptError, truncated / shard),
                               (manifest_byte, CheckpointCorruptError, manifest_byte / "manifest.json"),
                               (uncommitted, UncommittedCheckpointError, uncommitted)):
        cases.append((lambda p=path: checkpoint.load(p, build_toy(1)), error, [str(named)]))
        cases.append((lambda p=path: checkpoint.consolidate(p, tmp_path / f"out-{p.name}"), error, [str(named)]))
    assert len(expect_errors(cases)) == 10
    # The undamaged copy loads.
    fresh = build_toy(1)
    checkpoint.load(tmp_path / "probe", fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_background_error_surfaces_at_wait_and_at_next_save(tmp_path, monkeypatch):
    # A parent that is no directory is refused by save itself now: the claim fails in the background.
    claim_module = importlib.import_module("autoshard.checkpoint.claim")
    original = claim_module.claim

    def claim_fails_under_blocker(partial):
        if "blocker" in partial:
            raise OSError(13, "Permission denied")
        return original(partial)

    monkeypatch.setattr(claim_module, "claim", claim_fails_under_blocker)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    handle = checkpoint.save(blocker / "ckpt", build_toy(0), async_save=True)
    with pytest.raises(CheckpointSaveError, match="cannot create"):
        handle.wait()
    checkpoint.save(tmp_path / "after-wait", build_toy(0)).wait()  # surfaced once: the next save works

    checkpoint.save(blocker / "again", build_toy(0), async_save=True)
    with pytest.raises(CheckpointSaveError, match="previous asynchronous save"):
        checkpoint.save(tmp_path / "next", build_toy(0))
    assert not os.path.exists(tmp_path / "next")
    checkpoint.save(tmp_path / "next", build_toy(0))
    assert checkpoint.read_manifest(tmp_path / "next").world_size == 1


def _one_rank_fails_to_write(path: str):
    save_module = importlib.import_module("autoshard.checkpoint.save")  # the module, not the function

    original = save_module.write_safetensors

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 1:
        save_module.write_safetensors = full_disk
    try:
        handle = checkpoint.save(path, parallelize_toy(build_toy(0)), async_save=True)
        try:
            handle.wait()
        except CheckpointSaveError as error:
            return str(error)
        return None
    finally:
        save_module.write_safetensors = original


def test_a_failing_rank_fails_the_save_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    messages = run_on_ranks(_one_rank_fails_to_write, 2, path)
    assert all(m is not None and "rank 1" in m and "No space left" in m for m in messages), messages
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")


@pytest.mark.parametrize("slow_writer", [True, False])
def test_killed_async_save_leaves_previous_checkpoint_intact(tmp_path, slow_writer):
    """Two real ranks save step-1, change every parameter, start an async save of step-2, and
    are SIGKILLed while step-2.partial exists (with a writer held back, before it can commit;
    without, wherever the save happens to be)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    port = free_port()
    script = os.path.join(SUPPORT_DIR, "checkpoint_kill_worker.py")
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path), str(int(slow_writer))],
                              env={**env, **rank_env(port, r, 2), "LOCAL_RANK": str(r)}) for r in range(2)]
    partial = tmp_path / "step-2.partial"
    try:
        deadline = time.monotonic() + 240
        while not (partial / "rank-00000.safetensors" if slow_writer else partial).exists():
            assert all(p.poll() is None for p in procs), "a rank exited before the save started"
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.002)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
    first = build_toy(1)
    assert checkpoint.load(tmp_path / "step-1", first) == {"step": 1}
    for name, value in build_toy(0).state_dict().items():
        assert torch.equal(first.state_dict()[name], value), name
    if slow_writer:
        assert not (tmp_path / "step-2").exists()
    if (tmp_path / "step-2").exists():  # it committed before the kill: then it loads exactly
        second = build_toy(1)
        assert checkpoint.load(tmp_path / "step-2", second) == {"step": 2}
        for name, value in build_toy(0).state_dict().items():
            assert torch.equal(second.state_dict()[name], value + 1), name
    else:
        expect_errors([(lambda: checkpoint.load(tmp_path / "step-2", build_toy(1)), FileNotFoundError,
                        [str(tmp_path / "step-2")])])
    if partial.exists():
        expect_errors([(lambda: checkpoint.load(partial, build_toy(1)), UncommittedCheckpointError, [str(partial)])])
    checkpoint.CheckpointManager(tmp_path)  # cleans up the leftover
    assert not partial.exists() and (tmp_path / "step-1").exists()


def test_manager_keeps_last_and_best_and_resumes(tmp_path):
    (tmp_path / "step-99.partial").mkdir()  # leftover of an interrupted save
    manager = checkpoint.CheckpointManager(tmp_path, max_to_keep=2, keep_best="loss", mode="min", save_every=2)
    assert not (tmp_path / "step-99.partial").exists() and manager.latest() is None
    model = build_toy(0)
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    losses = {0: 5.0, 2: 1.0, 4: 3.0, 6: 4.0, 8: 2.0, 10: 6.0}
    for step in range(11):
        _train_step(model, optimizer, "toy", step)
        handle = manager.save(step, model, optimizer, metrics={"loss": losses.get(step, 9.0)},
                              extra={"step": step}, async_save=step % 4 == 0)
        assert (handle is None) == (step % 2 == 1)
    manager.wait()
    assert manager.steps() == [2, 8, 10] and manager.latest() == str(tmp_path / "step-10")
    assert sorted(os.listdir(tmp_path)) == ["step-10", "step-2", "step-8"]
    resumed = build_toy(1)
    resumed_optimizer = autoshard.optim.AdamW(resumed.parameters(), lr=1e-2)
    assert checkpoint.CheckpointManager(tmp_path).restore(resumed, resumed_optimizer) == {"step": 10}
    for (name, value), got in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, value), name
    # Resumed training continues exactly as uninterrupted training does.
    _train_step(model, optimizer, "toy", 11)
    _train_step(resumed, resumed_optimizer, "toy", 11)
    for (name, value), got in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(got, value), name
    maximizing = checkpoint.CheckpointManager(tmp_path / "max", max_to_keep=1, keep_best="acc", mode="max")
    for step, acc in enumerate([0.1, 0.9, 0.5, 0.2]):
        maximizing.save(step, model, metrics={"acc": acc})
    assert maximizing.steps() == [1, 3]


def test_bad_input(tmp_path):
    model = build_toy(0)
    checkpoint.save(tmp_path / "ok", model)
    gpt2 = build("gpt2")
    expect_errors([
        (lambda: checkpoint.save(3, model), TypeError, ["path", "str"]),
        (lambda: checkpoint.save(tmp_path / "x", "model"), TypeError, ["model", "torch.nn.Module"]),
        (lambda: checkpoint.save(tmp_path / "x", model, optimizer=1), TypeError, ["optimizer"]),
        (lambda: checkpoint.save(tmp_path / "x", model, extra={"a": object()}), TypeError, ["extra", "JSON"]),
        (lambda: checkpoint.save(tmp_path / "x", model, async_save="yes"), TypeError, ["async_save", "bool"]),
        (lambda: checkpoint.save(tmp_path / "x.partial", model), ValueError, [".partial"]),
        (lambda: checkpoint.load(tmp_path / "none", model), FileNotFoundError, [str(tmp_path / "none")]),
        (lambda: checkpoint.load(tmp_path / "ok", gpt2), ValueError, ["missing", "transformer.wte.weight"]),
        (lambda: checkpoint.load(tmp_path / "ok", model, torch.optim.SGD(model.parameters(), lr=1)), ValueError,
         ["no optimizer state"]),
        (lambda: checkpoint.consolidate(tmp_path / "ok", tmp_path / "o", max_shard_size="lots"), ValueError,
         ["max_shard_size"]),
        (lambda: checkpoint.CheckpointManager(tmp_path / "m", max_to_keep=0), ValueError, ["max_to_keep"]),
        (lambda: checkpoint.CheckpointManager(tmp_path / "m", mode="best"), ValueError, ["mode", "'min'"]),
        (lambda: checkpoint.CheckpointManager(tmp_path / "m", keep_best="loss").save(0, model), ValueError,
         ["metrics", "'loss'"]),
    ])
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "x.partial")
    with torch.device("meta"):
        on_meta = build_toy(0)
    expect_errors([(lambda: checkpoint.load(tmp_path / "ok", on_meta), ValueError, ["meta", "to_empty"]),
                   (lambda: checkpoint.save(tmp_path / "y", on_meta), ValueError, ["meta"])])


def test_a_refused_load_changes_nothing(tmp_path):
    # Three 4 MiB weights span several checksum blocks; the damaged byte is in the last one,
    # which a load that wrote as it read would reach only after overwriting the others.
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])

    checkpoint.save(tmp_path / "ckpt", build(0))
    shard = tmp_path / "ckpt" / "rank-00000.safetensors"
    _flip_byte(shard, os.path.getsize(shard) - 5)
    untouched = build(1)
    before = {k: v.clone() for k, v in untouched.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match="rank-00000.safetensors"):
        checkpoint.load(tmp_path / "ckpt", untouched)
    assert all(torch.equal(before[k], v) for k, v in untouched.state_dict().items())
