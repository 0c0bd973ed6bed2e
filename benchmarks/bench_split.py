"""array_split against the torch one-liner a user would write instead:
``[t.contiguous() for t in torch.tensor_split(x, sections, dim)]`` (same numpy size rule).
Where tensor_split's pieces are already contiguous that one-liner copies nothing and its
pieces alias the input, so the table also times ``t.clone()``, the copy that gives pieces
of their own, as array_split does.

    python benchmarks/bench_split.py [--size 8192] [--sections 3] [--device cuda]

Prints a table and writes benchmarks/results/bench_split_<device>.json. On a GPU it also
reports bandwidth against a plain device-to-device copy of the same bytes.
"""

import argparse

import torch

import autoshard
from common import device_label, median_seconds, print_table, save_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--sections", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    full = torch.randn(args.size, args.size, device=device)
    inputs = {"contiguous": full, "transposed": full.t()}
    rows = []
    for layout, x in inputs.items():
        for dim in range(x.dim()):
            ours = median_seconds(lambda: autoshard.array_split(x, args.sections, dim), device, repeats=args.repeats)
            theirs = median_seconds(
                lambda: [t.contiguous() for t in torch.tensor_split(x, args.sections, dim)], device, repeats=args.repeats
            )
            cloned = median_seconds(
                lambda: [t.clone(memory_format=torch.contiguous_format) for t in torch.tensor_split(x, args.sections, dim)],
                device,
                repeats=args.repeats,
            )
            moved = 2 * x.numel() * x.element_size()  # every byte read once and written once
            row = {
                "input": f"{tuple(x.shape)} fp32 {layout}",
                "dim": dim,
                "sections": args.sections,
                "autoshard_ms": ours * 1e3,
                "torch_contiguous_ms": theirs * 1e3,
                "torch_clone_ms": cloned * 1e3,
                "speedup_vs_contiguous": theirs / ours,
                "speedup_vs_clone": cloned / ours,
                "autoshard_GBps": moved / ours / 1e9,
            }
            if device.type == "cuda":
                dst = torch.empty_like(full)
                copy = median_seconds(lambda: dst.copy_(full), device, repeats=args.repeats)
                row["d2d_copy_GBps"] = moved / copy / 1e9
                row["fraction_of_copy"] = copy / ours
            rows.append(row)

    print(f"array_split on {device_label(device)}, torch {torch.__version__}")
    columns = ["input", "dim", "autoshard_ms", "torch_contiguous_ms", "torch_clone_ms", "speedup_vs_contiguous",
               "speedup_vs_clone", "autoshard_GBps"]
    if device.type == "cuda":
        columns += ["d2d_copy_GBps", "fraction_of_copy"]
    print_table(rows, columns)
    print("saved", save_json("bench_split", device, rows))


if __name__ == "__main__":
    main()
