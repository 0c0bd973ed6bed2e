"""What the replica fingerprint costs: a training step of a small Hugging Face Llama on 2 gloo
ranks with parallelize's check_replicas_every=1 (the fingerprint at every forward, the worst
case) against the same step with it off (check_replicas_every=0); the default (100) costs
1/100 of the difference per step.

    python benchmarks/bench_replica_check.py [--batch 4 --seq 128 --hidden 64 --layers 2 --repeats 30]

A step is zero_grad, forward with labels, backward and autoshard.optim.AdamW's step; the two
models (same seed) take turns, one step each after a barrier, and each rank keeps the median
of --repeats steps after warm-up (the table shows the slower rank's). The fingerprint alone
(two int64 hashes per replicated parameter and one all-gather) is also timed. Prints a table
and writes benchmarks/results/bench_replica_check_cpu.json and .txt.
"""

import argparse
import statistics
import time

import torch

from common import (add_small_llama_arguments, median_steps_in_turns, run_on_gloo_ranks, save_json, save_text,
                    small_llama, small_llama_setup, table_text)


def _rank_main(rank: int, world: int, args) -> dict:
    import torch.distributed as dist

    from autoshard.core.parallel_state import state_of
    from autoshard.runtime.replica_check import check_replicas, replicated_parameters

    contenders = {"fingerprint every step": small_llama(args, check_replicas_every=1),
                  "fingerprint off": small_llama(args, check_replicas_every=0)}
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    medians = median_steps_in_turns(contenders, ids, args.warmup, args.repeats)
    model = contenders["fingerprint every step"][0]
    group = state_of(model).forward_checks.group
    alone = []
    for i in range(args.warmup + args.repeats):
        dist.barrier()
        start = time.perf_counter()
        check_replicas(model, group)
        if i >= args.warmup:
            alone.append(time.perf_counter() - start)
    result = dict(medians)
    result["fingerprint alone"] = statistics.median(alone)
    result["replicated parameters"] = len(replicated_parameters(model))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_llama_arguments(parser)
    args = parser.parse_args()
    per_rank = run_on_gloo_ranks(_rank_main, 2, args)
    off = max(r["fingerprint off"] for r in per_rank)
    rows = []
    for name in ("fingerprint off", "fingerprint every step", "fingerprint alone"):
        seconds = max(r[name] for r in per_rank)
        rows.append({"what": name, "ms": seconds * 1e3, "/ step without": seconds / off})
    alone = max(r["fingerprint alone"] for r in per_rank)
    rows.append({"what": "default, every 100 steps (alone / 100)", "ms": alone * 10, "/ step without": alone / 100 / off})
    setup = (f"{small_llama_setup(args)}, {per_rank[0]['replicated parameters']} replicated parameters; batch {args.batch} x "
             f"{args.seq} tokens; median of {args.repeats} training steps")
    text = setup + "\n" + table_text(rows, ["what", "ms", "/ step without"])
    print(text)
    for row in rows:
        row["setup"] = setup
    print("saved", save_json("bench_replica_check", torch.device("cpu"), rows),
          save_text("bench_replica_check", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
