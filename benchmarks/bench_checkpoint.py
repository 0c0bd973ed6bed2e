"""How long a checkpoint save blocks training: autoshard.checkpoint.save asynchronous against
synchronous, and torch.distributed.checkpoint (DCP) ``save`` / ``async_save``, the peer a user
would pick, on the same shards.

    python benchmarks/bench_checkpoint.py [--layers 16] [--hidden 2048] [--repeats 3] [--dir /tmp]

Two gloo ranks on this machine hold a tensor-parallel stack of ``layers`` Linear layers
(hidden x hidden, fp32; 16 x 2048 is 268 MB in all, half per rank). For each method, the
blocking time is how long the call takes to return, and the total time how long until the
checkpoint is durable (``wait()`` / ``result()``); the median over ``repeats`` saves, each to
a fresh directory, with the methods taking turns (each round starting with the next method,
so that none always follows the same one). DCP saves the same local shards as plain tensors
under per-rank keys. A last row times the copy of each rank's tensors into kept host buffers
alone: the floor of an asynchronous save's blocking time on a CPU. Ratios are against
autoshard's synchronous save (blocking ratio below 1: the caller is held for that fraction of
it). Prints a table and writes benchmarks/results/bench_checkpoint_cpu.json.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard import checkpoint
from common import print_table, run_on_gloo_ranks, save_json

# Not a save: copying this rank's tensors into buffers kept between rounds, all that an
# asynchronous save must do before it returns on a CPU (the floor of its blocking time).
FLOOR = "host copy of each rank's tensors"


def _model(layers: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=True) for _ in range(layers)])
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(torch.zeros(2, hidden),))
    return autoshard.parallelize(model, plan)


def _methods(model, root):
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    local = {f"rank{rank}/{k}": v for k, v in model.state_dict().items()}

    def ours(async_save):
        def run(path):
            start = time.perf_counter()
            handle = checkpoint.save(path, model, async_save=async_save)
            blocked = time.perf_counter() - start
            handle.wait()
            return blocked, time.perf_counter() - start
        return run

    def peer(async_save):
        def run(path):
            start = time.perf_counter()
            if async_save:
                future = dcp.async_save(local, checkpoint_id=path)
                blocked = time.perf_counter() - start
                future.result()
            else:
                dcp.save(local, checkpoint_id=path)
                blocked = time.perf_counter() - start
            dist.barrier()
            return blocked, time.perf_counter() - start
        return run

    tensors = [t.detach() for t in model.state_dict().values()]
    kept = [torch.empty_like(t) for t in tensors]

    def host_copy(path):
        start = time.perf_counter()
        torch._foreach_copy_(kept, tensors)
        took = time.perf_counter() - start
        return took, took

    return {"autoshard save": ours(False), "autoshard save(async_save=True)": ours(True),
            "DCP save": peer(False), "DCP async_save": peer(True), FLOOR: host_copy}


def _rank_main(rank: int, world: int, args):
    """On rank 0, this rank's parameter bytes and each method's median (blocking, total) seconds."""
    model = _model(args.layers, args.hidden)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    methods = _methods(model, args.dir)
    times = {name: [] for name in methods}
    for repeat in range(args.repeats + 1):  # the first round warms up (pinned pools, groups, imports)
        order = list(methods.items())
        order = order[repeat % len(order):] + order[:repeat % len(order)]  # each method in every position
        for index, (name, run) in enumerate(order):
            path = os.path.join(args.dir, f"bench-{repeat}-{index}")
            dist.barrier()
            blocked, total = run(path)
            dist.barrier()
            if repeat:
                times[name].append((blocked, total))
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        return local_bytes, {n: (statistics.median(b for b, _ in t), statistics.median(s for _, s in t))
                             for n, t in times.items()}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    owned = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="bench_checkpoint_") if owned else args.dir
    try:
        local_bytes, medians = run_on_gloo_ranks(_rank_main, 2, args)[0]
    finally:
        if owned:
            shutil.rmtree(args.dir, ignore_errors=True)
    baseline = medians["autoshard save"][1]
    rows = [{"method": name, "model MB": round(2 * local_bytes / 1e6), "blocking s": blocked, "total s": total,
             "blocking / autoshard sync": blocked / baseline, "total / autoshard sync": total / baseline}
            for name, (blocked, total) in medians.items()]
    columns = ["method", "model MB", "blocking s", "total s", "blocking / autoshard sync", "total / autoshard sync"]
    print_table(rows, columns)
    print("saved", save_json("bench_checkpoint", torch.device("cpu"), rows))


if __name__ == "__main__":
    main()
