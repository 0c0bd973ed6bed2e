"""What the shard guard costs: a training step of a small Hugging Face Llama on 2 gloo ranks with
its sharded parameters guarded (parallelize's default, see python/autoshard/runtime/shard_guard.py)
against the same step with them made plain tensors again, with autoshard.optim.AdamW and with
torch.optim.AdamW (whose foreach update, called from torch, goes through the guard's check, and
whose moments, made zeros_like a guarded shard, are guarded too). Also the cost per op of the
designs weighed for it: an add called from outside autoshard on a guarded shard, on a plain
tensor, and on a DTensor sharded over the two ranks (the other design: DTensor-typed parameters).

    python benchmarks/bench_shard_guard.py [--batch 4 --seq 128 --hidden 64 --layers 2 --repeats 30]

Models of the same seed take turns, one step each after a barrier; each rank keeps the median
of --repeats steps after warm-up and the table shows the slower rank's. Prints a table and writes
benchmarks/results/bench_shard_guard_cpu.json and .txt.
"""

import argparse
import time

import torch

from common import (add_small_llama_arguments, median_steps_in_turns, run_on_gloo_ranks, save_json, save_text,
                    small_llama, small_llama_setup, table_text)


def _per_op(tensor: torch.Tensor, other: torch.Tensor, repeats: int = 2000) -> float:
    """Seconds of one torch.add(tensor, other), the best of 5 runs of `repeats` calls."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            torch.add(tensor, other)
        times.append((time.perf_counter() - start) / repeats)
    return min(times)


def _rank_main(rank: int, world: int, args) -> dict:
    from autoshard.runtime import shard_guard

    contenders = {}
    for optimizer in ("autoshard AdamW", "torch AdamW"):
        for guarded in (True, False):
            model, opt = small_llama(args)
            if optimizer == "torch AdamW":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if not guarded:
                shard_guard.remove(model)
            contenders[f"{optimizer}, guard {'on' if guarded else 'off'}"] = (model, opt)
    guarded = sum(type(p) is shard_guard.ShardParameter for p in contenders["autoshard AdamW, guard on"][0].parameters())
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    result = median_steps_in_turns(contenders, ids, args.warmup, args.repeats)
    weight = contenders["autoshard AdamW, guard on"][0].lm_head.weight
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.no_grad():
        piece = shard_guard.local(weight).detach()
        ones = torch.ones_like(piece)
        result["op on a guarded shard"] = _per_op(weight, ones)
        result["op on a plain tensor"] = _per_op(piece, ones)
        result["op on a DTensor"] = _per_op(DTensor.from_local(piece, mesh, [Shard(0)]),
                                            DTensor.from_local(ones, mesh, [Shard(0)]))
    result["guarded parameters"] = guarded
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_llama_arguments(parser)
    args = parser.parse_args()
    per_rank = run_on_gloo_ranks(_rank_main, 2, args)
    rows = []
    for optimizer in ("autoshard AdamW", "torch AdamW"):
        off = max(r[f"{optimizer}, guard off"] for r in per_rank)
        for state in ("off", "on"):
            seconds = max(r[f"{optimizer}, guard {state}"] for r in per_rank)
            rows.append({"what": f"step, {optimizer}, guard {state}", "ms": seconds * 1e3, "/ guard off": seconds / off})
    plain = max(r["op on a plain tensor"] for r in per_rank)
    for name in ("op on a plain tensor", "op on a guarded shard", "op on a DTensor"):
        seconds = max(r[name] for r in per_rank)
        rows.append({"what": f"torch.add, {name[6:]}", "ms": seconds * 1e3, "/ guard off": seconds / plain})
    setup = (f"{small_llama_setup(args)}; batch {args.batch} x {args.seq} tokens; median of {args.repeats} training "
             f"steps; {per_rank[0]['guarded parameters']} guarded parameters per rank")
    text = setup + "\n" + table_text(rows, ["what", "ms", "/ guard off"])
    print(text)
    for row in rows:
        row["setup"] = setup
    print("saved", save_json("bench_shard_guard", torch.device("cpu"), rows),
          save_text("bench_shard_guard", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
