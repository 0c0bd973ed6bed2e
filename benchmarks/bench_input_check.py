"""What the input check costs: a training step of a small Hugging Face Llama on 2 gloo ranks
with parallelize's check_inputs on (the default) against the same step with it off.

    python benchmarks/bench_input_check.py [--batch 4 --seq 128 --hidden 64 --layers 2 --repeats 30]

The model is built from a config (nothing downloaded): 4 heads over 2 KV heads, intermediate
size 2 x hidden, vocabulary 256. A step is zero_grad, forward with labels, backward and
autoshard.optim.AdamW's step. The two models (same seed) take turns, one step each after a
barrier, so that a busy machine slows both alike; each rank keeps the median of --repeats
steps after warm-up, and the table shows the slower rank's. The check itself (fingerprint of
the inputs, one all-gather of 4 int64 per rank, the wrapper check) is also timed alone, as
the forward pre-hook runs it. Prints a table and writes
benchmarks/results/bench_input_check_cpu.json and .txt.
"""

import argparse
import statistics
import time

import torch

from common import (add_small_llama_arguments, median_steps_in_turns, run_on_gloo_ranks, save_json, save_text,
                    small_llama, small_llama_setup, table_text)


def _rank_main(rank: int, world: int, args) -> dict:
    import torch.distributed as dist

    from autoshard.runtime.forward_checks import tensor_inputs
    from autoshard.core.parallel_state import state_of

    contenders = {"check on": small_llama(args, check_inputs=True), "check off": small_llama(args, check_inputs=False)}
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    medians = median_steps_in_turns(contenders, ids, args.warmup, args.repeats)
    checks = state_of(contenders["check on"][0]).forward_checks
    names, tensors = tensor_inputs((), {"input_ids": ids, "labels": ids})
    alone = []
    for i in range(args.warmup + args.repeats):
        dist.barrier()
        start = time.perf_counter()
        checks.run(names, tensors)
        if i >= args.warmup:
            alone.append(time.perf_counter() - start)
    result = dict(medians)
    result["check alone"] = statistics.median(alone)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_llama_arguments(parser)
    args = parser.parse_args()
    per_rank = run_on_gloo_ranks(_rank_main, 2, args)
    off = max(r["check off"] for r in per_rank)
    rows = []
    for name in ("check off", "check on", "check alone"):
        seconds = max(r[name] for r in per_rank)
        rows.append({"what": name, "ms": seconds * 1e3, "/ step without check": seconds / off})
    setup = (f"{small_llama_setup(args)}; batch {args.batch} x {args.seq} tokens; median of {args.repeats} training steps")
    text = setup + "\n" + table_text(rows, ["what", "ms", "/ step without check"])
    print(text)
    for row in rows:
        row["setup"] = setup
    print("saved", save_json("bench_input_check", torch.device("cpu"), rows),
          save_text("bench_input_check", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
