"""What the ranks' agreement checks cost per training step, each alone and together, against a
step with none, in one run: a small Hugging Face Llama on 2 gloo ranks.

    python benchmarks/bench_agreement_checks.py [--batch 4 --seq 128 --hidden 64 --layers 2 --repeats 30
                                                 --sequence-parallel off]

The checks (docs/with-other-tools.md and the README's guarantees):
- input check (parallelize's check_inputs, on by default): each forward's input shapes and a
  fingerprint of their values, one all-gather before the first collective;
- replica fingerprint (check_replicas_every, default 100): two hashes per replicated parameter,
  one all-gather, every N forwards; timed at every forward (the worst case) and at the default;
- non-finite agreement (always on with autoshard's optimizers): at the end of each backward, the
  non-finite element counts of the replicated gradients no backward collective sums, one
  all-reduce of 2 integers per parameter (autoshard/runtime/nonfinite.py). It has no switch: "off"
  removes its gradient hooks after the optimizer installed them, as nothing a user calls does.

A step is zero_grad, forward with labels, backward and autoshard.optim.AdamW's step. The models
(same seed, same batch) take turns, one step each after a barrier, so that a busy machine slows
all alike; each rank keeps the median of --repeats steps after warm-up and the table shows the
slower rank's, divided by the step with no check. The agreement is also timed alone, as the
end of a backward runs it; the input check and the fingerprint alone are in bench_input_check.py
and bench_replica_check.py. Prints a table and writes
benchmarks/results/bench_agreement_checks_cpu.json and .txt.
"""

import argparse
import statistics
import time

import torch

from common import (add_small_llama_arguments, median_steps_in_turns, run_on_gloo_ranks, save_json, save_text,
                    small_llama, small_llama_setup, table_text)

# name -> (check_inputs, check_replicas_every, non-finite agreement)
CONFIGURATIONS = {
    "no check": (False, 0, False),
    "input check": (True, 0, False),
    "replica fingerprint every forward": (False, 1, False),
    "replica fingerprint every 100 (default)": (False, 100, False),
    "non-finite agreement": (False, 0, True),
    "defaults (all three)": (True, 100, True),
}


def _model(args, check_inputs: bool, every: int, nonfinite: bool):
    from autoshard.runtime.nonfinite import agreements_for

    model, opt = small_llama(args, check_inputs=check_inputs, check_replicas_every=every,
                             sequence_parallel=args.sequence_parallel == "on")
    agreements = agreements_for(list(model.parameters()))
    if not nonfinite:
        for agreement in agreements:
            agreement.remove()
    return model, opt, sum(len(a.params) for a in agreements)


def _rank_main(rank: int, world: int, args) -> dict:
    contenders = {name: _model(args, *flags) for name, flags in CONFIGURATIONS.items()}
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    result = median_steps_in_turns(contenders, ids, args.warmup, args.repeats)
    result["checked parameters"] = contenders["defaults (all three)"][2]
    # The agreement alone, as the end of each backward runs it (the gradients of the last step
    # are still there): counting the non-finite elements and one all-reduce.
    import torch.distributed as dist
    from autoshard.runtime.nonfinite import agreements_for

    model = contenders["non-finite agreement"][0]
    agreements = agreements_for(list(model.parameters()))
    alone = []
    for i in range(args.warmup + args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for agreement in agreements:
            agreement.record()
        if i >= args.warmup:
            alone.append(time.perf_counter() - start)
    result["non-finite agreement alone"] = statistics.median(alone)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_small_llama_arguments(parser)
    # Off by default: with sequence parallelism every norm's gradient is summed in backward
    # already, and the non-finite agreement has nothing to count.
    parser.add_argument("--sequence-parallel", choices=("on", "off"), default="off")
    args = parser.parse_args()
    per_rank = run_on_gloo_ranks(_rank_main, 2, args)
    none = max(r["no check"] for r in per_rank)
    rows = [{"configuration": name, "ms per step": max(r[name] for r in per_rank) * 1e3,
             "/ no check": max(r[name] for r in per_rank) / none}
            for name in (*CONFIGURATIONS, "non-finite agreement alone")]
    setup = (f"{small_llama_setup(args)}, sequence parallelism {args.sequence_parallel}; "
             f"{per_rank[0]['checked parameters']} replicated parameters under the non-finite agreement; batch {args.batch} x {args.seq} tokens; median of {args.repeats} training steps, configurations in turns")
    text = setup + "\n" + table_text(rows, ["configuration", "ms per step", "/ no check"])
    print(text)
    for row in rows:
        row["setup"] = setup
    print("saved", save_json("bench_agreement_checks", torch.device("cpu"), rows),
          save_text("bench_agreement_checks", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
