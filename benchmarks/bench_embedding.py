"""The fused vocab-parallel lookup against the same masked lookup written in torch ops, as a
user would without it:

    mask = (ids >= start) & (ids < end)
    out = F.embedding((ids - start).clamp(0, rows - 1), local) * mask[..., None]

Both compute one rank's partial output (held rows, zeros elsewhere) and, with --backward, the
gradient of its local table. Times forward, and forward + backward, for the first and the
last rank's share of a vocabulary split --world ways.

    python benchmarks/bench_embedding.py [--vocab 50000] [--world 2] [--dim 1024] [--tokens 8192] [--device cuda]

Prints a table and writes benchmarks/results/bench_embedding_<device>.json.
"""

import argparse

import torch
import torch.nn.functional as F

import autoshard
from autoshard.core import ops
from common import device_label, median_seconds, print_table, save_json


def torch_lookup(ids, local, start):
    rows = local.shape[0]
    mask = (ids >= start) & (ids < start + rows)
    return F.embedding((ids - start).clamp(0, rows - 1), local) * mask[..., None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (8, args.tokens // 8), generator=g).to(device)
    grad = torch.randn(*ids.shape, args.dim, generator=g).to(device)
    sizes = autoshard.split_sizes(args.vocab, args.world)
    rows = []
    for rank in sorted({0, args.world - 1}):
        start = sum(sizes[:rank])
        local = torch.randn(sizes[rank], args.dim, generator=g).to(device).requires_grad_()

        def ours():
            return ops.vocab_parallel_lookup(ids, local, start, -1, args.vocab)

        def theirs():
            return torch_lookup(ids, local, start)

        def with_backward(lookup):
            def run():
                local.grad = None
                lookup().backward(grad)

            return run

        with torch.no_grad():
            torch.testing.assert_close(ours(), theirs(), rtol=0, atol=0)
        for name, a, b in [
            ("forward", lambda: ours().detach(), lambda: theirs().detach()),
            ("forward+backward", with_backward(ours), with_backward(theirs)),
        ]:
            if name == "forward":
                with torch.no_grad():
                    t_ours = median_seconds(a, device, repeats=args.repeats)
                    t_torch = median_seconds(b, device, repeats=args.repeats)
            else:
                t_ours = median_seconds(a, device, repeats=args.repeats)
                t_torch = median_seconds(b, device, repeats=args.repeats)
            rows.append({
                "pass": name,
                "rank": f"{rank}/{args.world}",
                "table": f"{sizes[rank]}x{args.dim} fp32",
                "tokens": ids.numel(),
                "autoshard_ms": t_ours * 1e3,
                "torch_ops_ms": t_torch * 1e3,
                "speedup": t_torch / t_ours,
            })

    print(f"vocab-parallel lookup on {device_label(device)}, torch {torch.__version__}, vocab {args.vocab}")
    print_table(rows, ["pass", "rank", "table", "tokens", "autoshard_ms", "torch_ops_ms", "speedup"])
    print("saved", save_json("bench_embedding", device, rows))


if __name__ == "__main__":
    main()
