"""The shard I/O primitive: C++ slice arithmetic against numpy indexing, and safetensors
byte-range reads and checksummed writes against the safetensors package."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.library import opcheck

from autoshard.core import ops
from autoshard.checkpoint import (
    CheckpointCorruptError,
    SafetensorsReader,
    full_selection,
    model_targets,
    selection_of,
    write_safetensors,
)
from autoshard.tensor_io import BLOCK_SIZE, Selection, byte_runs
from autoshard.core.spec import ShardSpec
from checks import expect_errors


def random_runs(size, rng):
    """Up to three disjoint runs of [0, size) in a random local order (possibly none)."""
    cuts = sorted(rng.choice(np.arange(size + 1), size=min(size + 1, 4), replace=False).tolist())
    runs = [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:]) if b > a and rng.random() < 0.8]
    rng.shuffle(runs)
    return tuple((int(a), int(n)) for a, n in runs)


def indices(selection):
    return [np.concatenate([np.arange(s, s + n) for s, n in runs]) if runs else np.zeros(0, dtype=np.int64)
            for runs in selection.runs]


def local_of(full, selection):
    return full[np.ix_(*indices(selection))]


def apply_runs(runs, src, dst):
    src_bytes, dst_bytes = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for s, d, n in runs.tolist():
        dst_bytes[d:d + n] = src_bytes[s:s + n]


@pytest.mark.parametrize("seed", range(40))
def test_copy_runs_moves_exactly_the_overlap(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 7, size=rng.integers(1, 4)))
    src = Selection(shape, tuple(random_runs(n, rng) for n in shape))
    dst = Selection(shape, tuple(random_runs(n, rng) if rng.random() < 0.6 else ((0, n),) for n in shape))
    full = np.arange(1, np.prod(shape) + 1, dtype=np.int32).reshape(shape)
    # The expected destination: each element holds its full-tensor value when the source
    # selection holds that element too, else stays 0.
    in_src = np.zeros(shape, dtype=bool)
    in_src[np.ix_(*indices(src))] = True
    expected = np.where(local_of(in_src, dst), local_of(full, dst), 0)
    out = np.zeros(dst.local_shape, dtype=np.int32)
    runs = byte_runs(src, dst, 4)
    apply_runs(runs, np.ascontiguousarray(local_of(full, src)), out)
    np.testing.assert_array_equal(out, expected)
    assert runs[:, 2].sum() == 4 * int(local_of(in_src, dst).sum())  # nothing read twice
    assert torch.equal(runs[:, 0], runs[:, 0].sort().values)


def test_copy_runs_row_slice_is_one_run_and_column_slice_one_per_row():
    shape = (1000, 64, 8)
    rows = selection_of(ShardSpec(0, 1000, 1, 3), shape)
    assert byte_runs(full_selection(shape), rows, 2).tolist() == [[334 * 64 * 8 * 2, 0, 333 * 64 * 8 * 2]]
    columns = selection_of(ShardSpec(1, 64, 0, 2), shape)
    runs = byte_runs(full_selection(shape), columns, 4)
    assert runs.shape == (1000, 3) and set(runs[:, 2].tolist()) == {32 * 8 * 4}


@pytest.mark.parametrize("full_size,world_size,units,parts", [
    (10, 3, None, None), (96, 5, 3, None), (96 * 3, 4, 6, (96, 96, 96)), (64 + 32 + 32, 3, 4, (64, 32, 32)),
    (7, 7, None, None), (5, 8, None, None)])
def test_shard_ranges_follow_array_split(full_size, world_size, units, parts):
    parts_list = list(parts or (full_size,))
    for rank in range(world_size):
        expected, offset = [], 0
        for size in parts_list:
            count = units or size
            granule = size // count
            pieces = np.array_split(np.arange(count), world_size)
            start = sum(len(p) for p in pieces[:rank])  # an empty piece starts where the last one ended
            expected.append((offset + start * granule, len(pieces[rank]) * granule))
            offset += size
        assert ops.shard_ranges(full_size, world_size, rank, units, parts) == expected


@pytest.mark.parametrize("kv_heads,q_heads,world_size", [(2, 6, 4), (2, 6, 3), (3, 6, 4), (2, 4, 4), (1, 4, 2)])
def test_shard_ranges_give_each_rank_the_kv_heads_its_query_heads_use(kv_heads, q_heads, world_size):
    head_dim = 8
    for rank in range(world_size):
        queries = np.array_split(np.arange(q_heads), world_size)[rank]
        used = sorted({int(h) // (q_heads // kv_heads) for h in queries})
        assert used == list(range(used[0], used[-1] + 1))
        expected = [(used[0] * head_dim, len(used) * head_dim)]
        assert ops.shard_ranges(kv_heads * head_dim, world_size, rank, kv_heads, None, q_heads // kv_heads) == expected


def test_slice_arithmetic_rejects_bad_input():
    expect_errors([
        (lambda: ops.shard_ranges(10, 0, 0), ValueError, ["world_size"]),
        (lambda: ops.shard_ranges(10, 2, 2), ValueError, ["rank"]),
        (lambda: ops.shard_ranges(10, 2, 0, 3), ValueError, ["whole units"]),
        (lambda: ops.shard_ranges(10, 2, 0, None, [4, 4]), ValueError, ["parts", "full_size"]),
        (lambda: ops.shard_ranges(16, 4, 0, 1, None, 2), ValueError, ["units * repeat", "4 ranks"]),
        (lambda: ops.shard_ranges(16, 2, 0, None, None, 2), ValueError, ["repeat", "units"]),
        (lambda: ops.copy_runs([4], 4, [1, 2, 3], [1, 0, 4]), ValueError, ["src", "outside"]),
        (lambda: ops.copy_runs([4, 2], 4, [1, 0, 4], [1, 0, 4]), ValueError, ["fewer dims"]),
        (lambda: Selection((4,), (((3, 2),),)), ValueError, ["outside"]),
        (lambda: Selection((4,), (((0, 2), (1, 2)),)), ValueError, ["overlap"]),
        (lambda: byte_runs(full_selection((4,)), full_selection((5,)), 4), ValueError, ["full shapes"]),
    ])


def sample_tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(300, 24, generator=gen),
        "proj.weight": torch.randn(40, 96, generator=gen).to(torch.bfloat16),
        "proj.bias": torch.randn(40, generator=gen).half(),
        "cube": torch.randint(-9, 9, (6, 10, 12), generator=gen),
        "scalar": torch.tensor(3.5),
        "flags": torch.rand(17, generator=gen) > 0.5,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_reader_reads_each_shard_of_a_safetensors_file(tmp_path, world_size):
    tensors = sample_tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with SafetensorsReader(path) as reader:
        assert set(reader.tensors) == set(tensors)
        for name, full in tensors.items():
            assert torch.equal(reader.read(name), full)
            for dim in range(full.dim()):
                for rank in range(world_size):
                    spec = ShardSpec(dim, full.shape[dim], rank, world_size)
                    dest = torch.empty(spec.local_shape(full.shape), dtype=full.dtype)
                    before = reader.bytes_read
                    reader.read_into(name, dest, selection_of(spec, full.shape))
                    assert torch.equal(dest, spec.take(full))
                    if dim == 0:  # a row slice reads its own bytes (through at most one window)
                        assert reader.bytes_read - before <= max(dest.numel() * dest.element_size(), 0) + BLOCK_SIZE


def test_reader_casts_reads_fused_parts_and_reshards(tmp_path):
    weight = torch.randn(3 * 8, 10)
    path = tmp_path / "fused.safetensors"
    save_file({"qkv": weight}, str(path))
    spec = ShardSpec(0, 24, 1, 2, units=2, parts=(8, 8, 8))
    with SafetensorsReader(path) as reader:
        dest = torch.empty(spec.local_shape(weight.shape), dtype=torch.float64)
        reader.read_into("qkv", dest, selection_of(spec, weight.shape))
        assert torch.equal(dest, spec.take(weight).double())
    # A shard saved on 2 ranks read into the pieces of 3 ranks.
    for rank3 in range(3):
        new = ShardSpec(1, 10, rank3, 3)
        dest = torch.zeros(new.local_shape(weight.shape))
        for rank2 in range(2):
            old = ShardSpec(1, 10, rank2, 2)
            shard_path = tmp_path / f"rank{rank2}.safetensors"
            save_file({"w": old.take(weight)}, str(shard_path))
            with SafetensorsReader(shard_path) as reader:
                reader.read_into("w", dest, selection_of(new, weight.shape), selection_of(old, weight.shape))
        assert torch.equal(dest, new.take(weight))


def test_writer_output_loads_in_safetensors_and_checksums_catch_a_flipped_byte(tmp_path):
    tensors = sample_tensors()
    tensors["big"] = torch.arange(3 * BLOCK_SIZE // 4 + 5, dtype=torch.float32)  # several blocks
    path = tmp_path / "rank-00000.safetensors"
    record = write_safetensors(path, tensors, {"format": "pt"})
    assert record.size == os.path.getsize(path) and len(record.block_crc32) == -(-record.size // BLOCK_SIZE)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with SafetensorsReader(path, record.block_crc32) as reader:
        assert torch.equal(reader.read("big"), tensors["big"])
    with open(path, "r+b") as f:
        f.seek(record.size - 1000)
        byte = f.read(1)
        f.seek(record.size - 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    with SafetensorsReader(path, record.block_crc32) as reader:
        assert torch.equal(reader.read("embed"), tensors["embed"])  # an intact block still reads
        with pytest.raises(CheckpointCorruptError, match="rank-00000.safetensors"):
            reader.read("big")


def test_reader_names_the_file_when_it_is_broken(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(64)}, str(good))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-10])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    expect_errors([
        (lambda: SafetensorsReader(tmp_path / "missing.safetensors"), FileNotFoundError, ["missing.safetensors"]),
        (lambda: SafetensorsReader(truncated), CheckpointCorruptError, ["truncated.safetensors", "'w'"]),
        (lambda: SafetensorsReader(garbage), CheckpointCorruptError, ["garbage.safetensors", "header"]),
        (lambda: SafetensorsReader(good).read("nope"), KeyError, ["good.safetensors", "nope"]),
        (lambda: SafetensorsReader(good).read_into("w", torch.empty(3), full_selection((64,))), ValueError, ["dest"]),
    ])


def test_model_targets_name_tied_tensors_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10), torch.nn.BatchNorm1d(10))
    model[1].weight = model[0].weight  # tied, as in a language model head
    targets = model_targets(model)
    assert targets["0.weight"].aliases == ["0.weight", "1.weight"]
    assert "1.weight" not in targets and "2.running_mean" in targets and "2.num_batches_tracked" in targets
    assert all(t.selection.is_full() for t in targets.values())


def test_copy_byte_runs_copies_the_part_of_each_run_inside_the_window():
    rng = np.random.default_rng(0)
    file_bytes = torch.from_numpy(rng.integers(0, 256, 4000, dtype=np.uint8))
    runs = torch.tensor([[10, 0, 50], [95, 50, 30], [300, 80, 400], [1900, 480, 20]])
    expected = torch.cat([file_bytes[s:s + n] for s, _, n in runs.tolist()])
    dst = torch.zeros(500, dtype=torch.uint8)
    for window_start in range(0, 4000, 128):  # windows cut runs anywhere
        ops.copy_byte_runs_(dst, file_bytes[window_start:window_start + 128].clone(), runs, window_start)
    assert torch.equal(dst, expected)
    opcheck(torch.ops.autoshard.copy_byte_runs_.default, (torch.zeros(500, dtype=torch.uint8), file_bytes[:256].clone(), runs, 0))
    expect_errors([
        (lambda: ops.copy_byte_runs_(torch.zeros(10, dtype=torch.uint8), file_bytes, runs, 0), ValueError, ["run 0", "10 bytes"]),
        (lambda: ops.copy_byte_runs_(torch.zeros(10), file_bytes, runs, 0), ValueError, ["dst", "uint8"]),
        (lambda: ops.copy_byte_runs_(dst, file_bytes, runs[:, :2], 0), ValueError, ["runs", "[n, 3]"]),
    ])
