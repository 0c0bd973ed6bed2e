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

The bf16 rows step the same parameters held in bf16 with fp32 master weights. autoshard's
step (master_weights on by default for bf16) is one fused pass moving 28 bytes per parameter
for AdamW (read bf16 grad 2, master 4, exp_avg 4, exp_avg_sq 4; write master, exp_avg,
exp_avg_sq 12, bf16 param 2) and 20 for SGD with momentum. Its peer is what a user writes
with torch: fp32 master parameters stepped by ``torch.optim.AdamW(fused=True)`` (or SGD), the
bf16 gradients copied into the masters' fp32 gradients before and the masters copied
(rounded) into the bf16 parameters after, all with foreach copies: 6 + 28 + 6 = 40 bytes per
parameter (32 for SGD). Bandwidth is each contender's own bytes over its own time; the ratio
is torch time / autoshard time for the same update.
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
# bf16 parameters with fp32 masters: (autoshard's fused step, torch's step with the user's casts)
BF16_BYTES_PER_PARAMETER = {"AdamW": (28, 40), "SGD momentum": (20, 32)}


class MasterWeightsByHand:
    """What a torch user writes for bf16 parameters with fp32 master weights: a torch optimizer
    steps fp32 copies; gradients are widened into them before, and the result is rounded back
    into the bf16 parameters after."""

    def __init__(self, params, make_optimizer):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.optimizer = make_optimizer(self.masters)

    @torch.no_grad()
    def step(self):
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.optimizer.step()
        torch._foreach_copy_([p.data for p in self.params], self.masters)


def bf16_rows(shapes, device, adamw, sgd, warmup, repeats):
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter((torch.randn(s, generator=generator) * 0.02).to(device, torch.bfloat16))
              for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(device, torch.bfloat16)
    numel = sum(p.numel() for p in params)
    contenders = {
        "AdamW": {
            "autoshard": autoshard.optim.AdamW(params, **adamw),
            "torch_fused": MasterWeightsByHand(params, lambda m: torch.optim.AdamW(m, fused=True, **adamw)),
            "torch_foreach": MasterWeightsByHand(params, lambda m: torch.optim.AdamW(m, foreach=True, **adamw)),
        },
        "SGD momentum": {
            "autoshard": autoshard.optim.SGD(params, **sgd),
            "torch_fused": MasterWeightsByHand(params, lambda m: torch.optim.SGD(m, fused=True, **sgd)),
            "torch_foreach": MasterWeightsByHand(params, lambda m: torch.optim.SGD(m, foreach=True, **sgd)),
        },
    }
    rows = []
    for name, optimizers in contenders.items():
        medians = interleaved_medians({k: opt.step for k, opt in optimizers.items()}, device, warmup, repeats)
        ours, theirs = BF16_BYTES_PER_PARAMETER[name]
        rows.append({
            "optimizer": f"{name} bf16+master",
            "tensors": len(params),
            "parameters": numel,
            "autoshard_ms": medians["autoshard"] * 1e3,
            "torch_fused_ms": medians["torch_fused"] * 1e3,
            "torch_foreach_ms": medians["torch_foreach"] * 1e3,
            "fused_over_autoshard": medians["torch_fused"] / medians["autoshard"],
            "foreach_over_autoshard": medians["torch_foreach"] / medians["autoshard"],
            "autoshard_bytes_per_param": ours,
            "torch_bytes_per_param": theirs,
            "autoshard_GBps": ours * numel / medians["autoshard"] / 1e9,
            "torch_fused_GBps": theirs * numel / medians["torch_fused"] / 1e9,
        })
    return rows


def transformer_shapes(hidden: int = HIDDEN, layers: int = LAYERS) -> List[tuple]:
    """Per layer: fused QKV, output projection, MLP up and down (weights and biases), two norms."""
    h = hidden
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]
    return layer * layers


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
    # A GPU steps the CPU's 12M parameters in tens of microseconds, where launches dominate.
    parser.add_argument("--hidden", type=int, default=None, help=f"default {HIDDEN} on CPU, 1536 on a GPU")
    parser.add_argument("--layers", type=int, default=None, help=f"default {LAYERS} on CPU, 16 on a GPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    gpu = device.type == "cuda"
    shapes = transformer_shapes(args.hidden or (1536 if gpu else HIDDEN), args.layers or (16 if gpu else LAYERS))
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
            "autoshard_bytes_per_param": BYTES_PER_PARAMETER[name],
            "torch_bytes_per_param": BYTES_PER_PARAMETER[name],
            "autoshard_GBps": bytes_moved / ours / 1e9,
            "torch_fused_GBps": bytes_moved / medians["torch_fused"] / 1e9,
        })
    if device.type == "cuda":
        # The GPU's memory bandwidth as a device-to-device copy reaches it, measured here.
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / interleaved_medians({"copy": lambda: dst.copy_(src)}, device, args.warmup,
                                                          args.repeats)["copy"] / 1e9
        del src, dst
        for row in rows:
            row["d2d_copy_GBps"] = copy_gbps
            row["autoshard_fraction_of_copy"] = row["autoshard_GBps"] / copy_gbps
    del contenders  # the fp32 states; the bf16 rows keep their own
    rows += bf16_rows(shapes, device, adamw, sgd, args.warmup, args.repeats)

    print(f"optimizer steps on {device_label(device)}, torch {torch.__version__}, "
          f"median of {args.repeats} after {args.warmup} warm-up")
    columns = ["optimizer", "tensors", "parameters", "autoshard_ms", "torch_fused_ms", "torch_foreach_ms",
               "fused_over_autoshard", "foreach_over_autoshard", "autoshard_bytes_per_param", "torch_bytes_per_param",
               "autoshard_GBps", "torch_fused_GBps"] + (["d2d_copy_GBps", "autoshard_fraction_of_copy"] if gpu else [])
    print_table(rows, columns)
    print("saved", save_json("bench_optim", device, rows))


if __name__ == "__main__":
    main()
