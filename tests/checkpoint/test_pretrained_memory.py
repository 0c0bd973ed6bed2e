"""While 2 ranks load a 1 GiB checkpoint into a model built on meta, each adds at most 0.6x
the checkpoint's size in private (anonymous) memory and reads about its own half of the
file, and the values it holds are the file's (read back with the safetensors library)."""

import gc
import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import autoshard
from multirank import run_on_ranks
from peak_memory import PeakMemory

# Column/row pairs whose row-parallel rows are H/2 float32 values = 1 MiB per rank: long
# enough that the reader reads each straight into the destination, so the bytes a rank reads
# can be counted against its share.
D, H, PAIRS = 128, 1 << 19, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(PAIRS)])

    def forward(self, x):
        return self.blocks(x)


def _chars_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _load_and_measure(path: str) -> dict:
    with torch.device("meta"):
        model = Stack()
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(torch.zeros(1, 2, D),))
    autoshard.parallelize(model, plan)
    gc.collect()
    read_before = _chars_read()
    with PeakMemory() as memory:
        autoshard.load_pretrained(model, path, progress=False)
    read = _chars_read() - read_before
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    styles = {}
    with safe_open(path, "pt") as f:
        for name, param in model.named_parameters():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            spec = module.shard_specs.get(attr)
            styles[module_name] = type(module).__name__
            if spec is None:
                expected = f.get_tensor(name)
            else:
                (start, length), = spec.local_ranges()
                index = [slice(None)] * param.dim()
                index[spec.dim] = slice(start, start + length)
                expected = f.get_slice(name)[tuple(index)]
            assert torch.equal(param, expected), name
    del model
    gc.collect()
    return {"peak_added": memory.added("RssAnon"), "read": read, "held": held, "styles": styles}


def test_two_ranks_load_a_1gb_checkpoint_in_their_share_of_memory(tmp_path):
    path = str(tmp_path / "big.safetensors")
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):  # only the names and shapes: no 1 GiB initialisation
        names = {n: tuple(p.shape) for n, p in Stack().named_parameters()}
    save_file({n: torch.randn(shape, generator=generator) for n, shape in names.items()}, path)
    size = os.path.getsize(path)
    assert size >= 1 << 30
    try:
        results = run_on_ranks(_load_and_measure, 2, path, timeout=600)
    finally:
        os.remove(path)
    for rank, r in enumerate(results):
        print(f"rank {rank}: peak added anonymous memory {r['peak_added'] / size:.3f}x the checkpoint "
              f"({size / 2**20:.0f} MiB), read {r['read'] / size:.3f}x, holds {r['held'] / size:.3f}x")
        assert set(r["styles"].values()) == {"ColumnParallelLinear", "RowParallelLinear"}, r["styles"]
        assert r["held"] < 0.51 * size, (rank, r)
        assert r["peak_added"] <= 0.6 * size, (rank, r["peak_added"] / size)
        # Its own share of the bytes, and little else (headers, windows around small runs).
        assert r["held"] <= r["read"] <= 0.52 * size, (rank, r["read"] / size)
