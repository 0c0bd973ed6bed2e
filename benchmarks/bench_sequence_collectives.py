"""What sequence parallelism pays in collectives: where tensor parallelism alone all-reduces a
row layer's (batch, seq, hidden) output, sequence parallelism reduce-scatters it over the
tokens and later all-gathers the tokens for the next column layer. On NCCL the pair costs one
all-reduce (a ring all-reduce is a reduce-scatter then an all-gather). On gloo torch's pair
costs more, since gloo's reduce-scatter sums the whole tensor on every rank; autoshard's runs
both as rings of point-to-point transfers there (csrc/comm/ring.h), along the tokens axis
itself, without moving it to the front of a copy, in messages of about 1 MiB that are added to
and passed on while the next ones arrive.

    python benchmarks/bench_sequence_collectives.py [--batch 2 --seq 512 --hidden 1024 --worlds 2 4]

Times, per rank on gloo, the median of --repeats calls (each after a barrier, the three in turns) of:

    all_reduce (torch)       torch.distributed.all_reduce of the tensor (what tp alone runs)
    rs + ag (torch)          torch.distributed reduce_scatter_tensor + all_gather_into_tensor
    rs + ag (autoshard)      autoshard.comm.reduce_scatter_to_sequence + all_gather_from_sequence
    rs + ag (autoshard, batch x tokens)
                             the same two on the tensor viewed as (batch x tokens, hidden), each
                             rank's piece one run of memory: what the pair costs on a contiguous
                             axis (a reference: sequence parallelism cuts the tokens axis today)

and the ratios against the all-reduce. Prints a table and writes
benchmarks/results/bench_sequence_collectives_cpu.json and .txt.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import autoshard
from common import run_on_gloo_ranks, save_json, save_text, table_text


def _timed_in_turns(calls: dict, repeats: int) -> dict:
    """The median seconds of each call, the calls taken in turns (each after a barrier) so that
    a slow spell of the machine falls on all of them alike."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def _rank_main(rank: int, world: int, args) -> dict:
    x = torch.randn(args.batch, args.seq, args.hidden)
    # torch's calls split the leading axis, so the tokens lead there; autoshard's take the axis.
    tokens_first = x.transpose(0, 1).contiguous()
    piece = torch.empty(args.seq // world, args.batch, args.hidden)
    whole = torch.empty_like(tokens_first)

    # torch 2.13 renamed the flat collectives (the old names warn there); older torch has only those.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def torch_pair():
        reduce_scatter(piece, tokens_first)
        all_gather(whole, piece)

    def autoshard_pair():
        local = autoshard.comm.reduce_scatter_to_sequence(x, 1)
        autoshard.comm.all_gather_from_sequence(local, 1, args.seq)

    # The same pair on the flattened batch x tokens axis, where each rank's piece is one run of
    # memory: what cutting a contiguous axis would cost, beside the tokens axis's pieces in runs.
    rows = x.view(-1, args.hidden)

    def autoshard_pair_flat():
        local = autoshard.comm.reduce_scatter_to_sequence(rows, 0)
        autoshard.comm.all_gather_from_sequence(local, 0, rows.shape[0])

    return _timed_in_turns({
        "all_reduce (torch)": lambda: dist.all_reduce(x.clone()),
        "rs + ag (torch)": torch_pair,
        "rs + ag (autoshard)": autoshard_pair,
        "rs + ag (autoshard, batch x tokens)": autoshard_pair_flat,
    }, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    for world in args.worlds:
        if args.seq % world:
            parser.error(f"--seq {args.seq} must divide evenly over {world} ranks (torch's calls need it)")
    rows = []
    for world in args.worlds:
        per_rank = run_on_gloo_ranks(_rank_main, world, args)
        base = max(r["all_reduce (torch)"] for r in per_rank)
        for name in per_rank[0]:
            seconds = max(r[name] for r in per_rank)
            rows.append({"N": world, "collectives": name, "ms": seconds * 1e3, "/ all_reduce": seconds / base})
    size = f"a ({args.batch}, {args.seq}, {args.hidden}) float32 tensor, {args.batch * args.seq * args.hidden * 4 / 2**20:.1f} MiB"
    text = size + "\n" + table_text(rows, ["N", "collectives", "ms", "/ all_reduce"])
    print(text)
    for row in rows:
        row["size"] = size
    print("saved", save_json("bench_sequence_collectives", torch.device("cpu"), rows),
          save_text("bench_sequence_collectives", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
