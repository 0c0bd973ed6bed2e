"""autoshard.optim.AdamW / SGD steps against the torch optimizers a user would pick instead:
``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``, ``torch.optim.SGD(foreach=True)`` and
``(fused=True)``, all stepping the same parameters: a 10-layer transformer's worth, 100 fp32
tensors of 320 to 409,600 elements, 12.3M in all.

    python benchmarks/bench_optim.py [--device cpu|cuda] [--threads 2] [--repeats 20]

Times whole ``optimizer.step()`` calls (Python included), taking the median over repeats
after warm-up, with the optimizers taking turns so that a busy machine slows all alike.
Ratios are torch time / autoshard time (above 1: autoshard is faster). Bandwidth counts the
bytes a step must move: 28 per parameter for fp32 AdamW (read param, grad, exp_avg,
exp_avg_sq; write param, exp_avg, exp_avg_sq), 20 for SGD with momentum. Prints a table and
writes benchmarks/results/bench_optim_<device>.json.
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

import autoshard
from common import device_label, print_table, save_json

LAYERS = 10
HIDDEN = 320
BYTES_PER_PARAMETER = {"AdamW": 28, "SGD momentum": 20}


def transformer_shapes() -> List[tuple]:
    """Per layer: fused QKV, output projection, MLP up and down (weights and biases), two norms."""
    h = HIDDEN
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]
    return layer * LAYERS


def interleaved_medians(steps: Dict[str, Callable[[], None]], device: torch.device, warmup: int,
                        repeats: int) -> Dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for step in steps.values():
            step()
    sync()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    shapes = transformer_shapes()
    # One set of parameters and gradients that every optimizer steps (each keeps its own state).
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(device)
    numel = sum(p.numel() for p in params)

    adamw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    sgd = dict(lr=1e-2, momentum=0.9)
    contenders = {
        "AdamW": {
            "autoshard": autoshard.optim.AdamW(params, **adamw),
            "torch_fused": torch.optim.AdamW(params, fused=True, **adamw),
            "torch_foreach": torch.optim.AdamW(params, foreach=True, **adamw),
        },
        "SGD momentum": {
            "autoshard": autoshard.optim.SGD(params, **sgd),
            "torch_fused": torch.optim.SGD(params, fused=True, **sgd),
            "torch_foreach": torch.optim.SGD(params, foreach=True, **sgd),
        },
    }

    rows = []
    for name, optimizers in contenders.items():
        medians = interleaved_medians({k: opt.step for k, opt in optimizers.items()}, device, args.warmup, args.repeats)
        ours = medians["autoshard"]
        bytes_moved = BYTES_PER_PARAMETER[name] * numel
        rows.append({
            "optimizer": name,
            "tensors": len(params),
            "parameters": numel,
            "autoshard_ms": ours * 1e3,
            "torch_fused_ms": medians["torch_fused"] * 1e3,
            "torch_foreach_ms": medians["torch_foreach"] * 1e3,
            "fused_over_autoshard": medians["torch_fused"] / ours,
            "foreach_over_autoshard": medians["torch_foreach"] / ours,
            "autoshard_GBps": bytes_moved / ours / 1e9,
            "torch_fused_GBps": bytes_moved / medians["torch_fused"] / 1e9,
        })

    print(f"optimizer steps on {device_label(device)}, torch {torch.__version__}, "
          f"median of {args.repeats} after {args.warmup} warm-up")
    columns = ["optimizer", "tensors", "parameters", "autoshard_ms", "torch_fused_ms", "torch_foreach_ms",
               "fused_over_autoshard", "foreach_over_autoshard", "autoshard_GBps", "torch_fused_GBps"]
    print_table(rows, columns)
    print("saved", save_json("bench_optim", device, rows))


if __name__ == "__main__":
    main()
