"""One rank of test_memory_pressure, run under torchrun: trains a small sharded MLP, then lowers
its own address-space limit (RLIMIT_AS) to what it uses plus MARGIN bytes: enough for a
training step (the gradients), not for an asynchronous save's snapshot of the parameters and
the optimizer's two moments. It records what the failed save raised, the snapshot bytes kept
afterwards, the losses of the steps trained under the same limit, and whether a save of the
parameters alone (a lower footprint) and then, with the limit raised again, a full save commit.

    python memory_pressure_worker.py DIRECTORY
"""

import ctypes
import gc
import json
import os
import resource
import sys

import torch
from torch import nn

SIZE, HIDDEN = 1024, 8192  # each rank holds two 16 MiB weight shards: 32 MiB of parameters
MARGIN = 48 << 20  # a step needs its 32 MiB of gradients; the snapshot needs 96 MiB


def _return_freed_memory() -> None:
    """Every allocation of 1 MiB or more gets its own mapping, unmapped when freed (glibc's
    mallopt(M_MMAP_THRESHOLD); a fixed threshold also stops glibc from raising it after frees),
    so the address space measured below is what is in use, not freed memory kept for reuse."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(-3, 1 << 20) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(directory: str) -> None:
    import autoshard
    from autoshard import checkpoint
    from autoshard.checkpoint import snapshot

    _return_freed_memory()
    rank, world = autoshard.init_distributed(timeout=120)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, SIZE)
    model = nn.Sequential(nn.Linear(SIZE, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, SIZE))
    model = autoshard.parallelize(model, autoshard.plan(model, world_size=world, example_inputs=(x,)))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    for _ in range(2):
        step()
    # One save before the limit: the writer thread and the checkpoint group exist (a thread's
    # stack is address space too); its kept buffers are released.
    checkpoint.save(os.path.join(directory, "warm"), model, optimizer, async_save=True).wait()
    checkpoint.release_snapshot_buffers()
    gc.collect()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + MARGIN
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    result = {"rank": rank, "limit": limit, "margin": MARGIN,
              "held": sum(p.numel() * p.element_size() for p in model.parameters())}
    result["before"] = [step() for _ in range(2)]  # a step fits under the limit

    error = None
    try:
        checkpoint.save(os.path.join(directory, "full"), model, optimizer, async_save=True).wait()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    result["error"] = error
    result["kept_bytes"] = snapshot.kept_bytes()
    result["after"] = [step() for _ in range(5)]  # training goes on under the same limit

    try:
        checkpoint.save(os.path.join(directory, "model-only"), model, async_save=True).wait()
        result["model_only"] = "committed"
    except Exception as e:
        result["model_only"] = f"{type(e).__name__}: {e}"
    checkpoint.release_snapshot_buffers()
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    checkpoint.save(os.path.join(directory, "full-after"), model, optimizer, async_save=True).wait()
    result["full_after"] = "committed"
    with open(os.path.join(directory, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
