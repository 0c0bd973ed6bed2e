"""Sharded layers on a group of one rank against the plain PyTorch they replace, forward
and backward: what autoshard costs where it has nothing to split.

    python benchmarks/bench_layers.py [--tokens 4096] [--in-features 1024] [--out-features 4096]
                                      [--repeats 5] [--device cpu|cuda] [--dtype float32]

Prints a table (ratio = autoshard time / PyTorch time) and writes
benchmarks/results/bench_layers_<device>.json. Each case is one entry of CASES: a name and
a function that builds both sides and returns their forward+backward steps.
"""

import argparse
import statistics
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from common import device_label, median_seconds, print_table, save_json

Step = Callable[[], None]


@dataclass
class Case:
    name: str
    # (args, device, dtype) -> (input shape described, autoshard step, PyTorch step)
    build: Callable[[argparse.Namespace, torch.device, torch.dtype], Tuple[str, Step, Step]]


def _forward_backward(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: List[torch.Tensor]):
    def step() -> None:
        for t in [x, *params]:
            t.grad = None
        y = forward(x)
        y.backward(torch.ones_like(y))
    return step


def _linear_case(parallel_cls) -> Callable:
    def build(args, device, dtype):
        reference = nn.Linear(args.in_features, args.out_features, device=device, dtype=dtype)
        layer = parallel_cls.from_linear(reference)
        x = torch.randn(args.tokens, args.in_features, device=device, dtype=dtype, requires_grad=True)
        w, b = reference.weight, reference.bias
        shape = f"{args.tokens} x {args.in_features} -> {args.out_features}"
        return (shape, _forward_backward(layer, x, list(layer.parameters())),
                _forward_backward(lambda t: F.linear(t, w, b), x, [w, b]))
    return build


def _mlp_case(args, device, dtype):
    fc1 = nn.Linear(args.in_features, args.out_features, device=device, dtype=dtype)
    fc2 = nn.Linear(args.out_features, args.in_features, device=device, dtype=dtype)
    column = autoshard.nn.ColumnParallelLinear.from_linear(fc1)
    row = autoshard.nn.RowParallelLinear.from_linear(fc2)
    x = torch.randn(args.tokens, args.in_features, device=device, dtype=dtype, requires_grad=True)
    shape = f"{args.tokens} x {args.in_features} -> {args.out_features} -> {args.in_features}"
    ours = _forward_backward(lambda t: row(F.gelu(column(t))), x, [*column.parameters(), *row.parameters()])
    theirs = _forward_backward(lambda t: F.linear(F.gelu(F.linear(t, fc1.weight, fc1.bias)), fc2.weight, fc2.bias),
                               x, [*fc1.parameters(), *fc2.parameters()])
    return shape, ours, theirs


def _vocab_lookup_case(args, device, dtype):
    """The fused masked lookup of one rank's half of a vocabulary, against the same lookup
    written in torch ops (bench_embedding.py has the fuller comparison)."""
    from bench_embedding import torch_lookup

    vocab, dim = 50_000, args.in_features
    start, rows = 0, vocab // 2
    table = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (args.tokens,), device=device)
    shape = f"{args.tokens} ids, rows [{start}, {rows}) of {vocab} x {dim}"
    ours = _forward_backward(lambda i: autoshard.ops.vocab_parallel_lookup(i, table, start, -1, vocab), ids, [table])
    theirs = _forward_backward(lambda i: torch_lookup(i, table, start), ids, [table])
    return shape, ours, theirs


CASES: List[Case] = [
    Case("ColumnParallelLinear vs F.linear", _linear_case(autoshard.nn.ColumnParallelLinear)),
    Case("RowParallelLinear vs F.linear", _linear_case(autoshard.nn.RowParallelLinear)),
    Case("column -> GELU -> row vs the same in F.linear", _mlp_case),
    Case("vocab-parallel lookup vs masked F.embedding", _vocab_lookup_case),
]


def interleaved_medians(ours: Step, theirs: Step, device: torch.device, repeats: int) -> Tuple[float, float]:
    """Median times of both steps, measured alternately so that load from other processes
    drifts over both alike."""
    median_seconds(ours, device, warmup=1, repeats=1)
    median_seconds(theirs, device, warmup=1, repeats=1)
    ours_times, theirs_times = [], []
    for _ in range(repeats):
        ours_times.append(median_seconds(ours, device, warmup=0, repeats=1))
        theirs_times.append(median_seconds(theirs, device, warmup=0, repeats=1))
    return statistics.median(ours_times), statistics.median(theirs_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    autoshard.init_distributed()  # a group of one when not started by torchrun
    if autoshard.comm.world_size() != 1:
        raise SystemExit("bench_layers measures a group of one rank; run it without torchrun")
    torch.manual_seed(0)
    rows = []
    for case in CASES:
        shape, ours, theirs = case.build(args, device, dtype)
        with autoshard.CommCounter() as counter:
            ours()
        ours_s, theirs_s = interleaved_medians(ours, theirs, device, args.repeats)
        rows.append({
            "case": case.name,
            "shape": shape,
            "dtype": args.dtype,
            "autoshard_ms": ours_s * 1e3,
            "torch_ms": theirs_s * 1e3,
            "ratio": ours_s / theirs_s,
            "collectives": sum(counter.counts.values()),
        })

    print(f"forward+backward on a group of one rank, {device_label(device)}, torch {torch.__version__}, "
          f"median of {args.repeats}")
    print_table(rows, ["case", "shape", "dtype", "autoshard_ms", "torch_ms", "ratio", "collectives"])
    print("saved", save_json("bench_layers", device, rows))


if __name__ == "__main__":
    main()
