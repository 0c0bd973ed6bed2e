"""Loading a GPT-2 (124M parameters, fp32, ~0.5 GB) Hugging Face checkpoint: autoshard on 2
tensor-parallel ranks (model built on meta, parallelized, load_pretrained) against
transformers' from_pretrained of the same checkpoint in one process, the way a user would
load it without tensor parallelism.

    python benchmarks/bench_load.py [--repeats 3] [--layers 12] [--keep DIR]

The checkpoint is written once by save_pretrained (several files, max_shard_size 200MB) with
random weights. Every load runs in a fresh process (torchrun for autoshard's 2 ranks), the
two sides taking turns; figures are medians over repeats. Each process first builds the
model once on meta, so that importing the model's code counts on neither side. Time is the
wall time of the loading calls (autoshard: build on meta + plan + parallelize +
load_pretrained; transformers: from_pretrained), then of reading every parameter once (a
sum), since from_pretrained maps the files and reads a page only when it is touched. Memory is the peak resident memory the
process adds meanwhile, sampled every millisecond by a thread: private (anonymous,
RssAnon) and all (VmRSS, which also counts checkpoint file pages a process maps instead of
copying). Ratios: transformers / autoshard (time; above 1: autoshard is faster) and
autoshard / transformers (resident and private memory per process). Prints a table and writes
benchmarks/results/bench_load_cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import device_label, print_table, save_json  # puts tests/support on sys.path
from local_ranks import torchrun_command
from peak_memory import PeakMemory


def _warm_up(config) -> None:
    """Builds the model once on meta: importing its code and setting up its classes (about
    90 MiB of Python objects for GPT-2) then counts on neither side."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def _touch(model) -> None:
    """Reads every parameter once: from_pretrained maps checkpoint files into memory, and a
    mapped page is only read from the file (and resident) once something touches it."""
    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def _record(out: str, rank: int, seconds: float, load_seconds: float, memory: PeakMemory, model) -> None:
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"seconds": seconds, "load_seconds": load_seconds, "peak_added": memory.added("RssAnon"),
                   "peak_added_rss": memory.added("VmRSS"), "held": held}, f)


def _worker_autoshard(path: str, out: str) -> None:
    import autoshard
    from transformers import AutoConfig, AutoModelForCausalLM

    autoshard.init_distributed()
    config = AutoConfig.from_pretrained(path)
    _warm_up(config)
    start = time.perf_counter()
    with PeakMemory() as memory:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        autoshard.parallelize(model)
        built = time.perf_counter()
        autoshard.load_pretrained(model, path, progress=False)
        _touch(model)
    end = time.perf_counter()
    _record(out, torch.distributed.get_rank(), end - start, end - built, memory, model)
    torch.distributed.destroy_process_group()


def _worker_transformers(path: str, out: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    _warm_up(AutoConfig.from_pretrained(path))
    start = time.perf_counter()
    with PeakMemory() as memory:
        model = AutoModelForCausalLM.from_pretrained(path)
        _touch(model)
    end = time.perf_counter()
    _record(out, 0, end - start, end - start, memory, model)


def _run(side: str, path: str, scratch: str) -> list:
    out = os.path.join(scratch, side)
    script = [os.path.abspath(__file__), "--worker", side, "--path", path, "--out", out]
    if side == "autoshard":
        command, ranks = torchrun_command(*script), 2
    else:
        command, ranks = [sys.executable, *script], 1
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    for rank in range(ranks):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
        os.remove(f"{out}.{rank}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    parser.add_argument("--worker", choices=["autoshard", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "autoshard":
        return _worker_autoshard(args.path, args.out)
    if args.worker == "transformers":
        return _worker_transformers(args.path, args.out)

    from transformers import AutoConfig, AutoModelForCausalLM

    scratch = tempfile.mkdtemp(prefix="bench_load_")
    path = args.keep or os.path.join(scratch, "gpt2")
    torch.manual_seed(0)
    # GPT-2 small: 768 wide, 12 heads, 50257 tokens.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=args.layers))
    model.save_pretrained(path, max_shard_size="200MB")
    del model
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)

    runs = {"autoshard": [], "transformers": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(_run(side, path, scratch))

    def median(side: str, key: str, rank: int = 0) -> float:
        return statistics.median(run[rank][key] for run in runs[side])

    theirs_seconds, theirs_peak = median("transformers", "seconds"), median("transformers", "peak_added")
    theirs_rss = median("transformers", "peak_added_rss")
    rows = []
    for rank in range(2):
        rows.append({
            "loader": f"autoshard rank {rank} of 2",
            "seconds": median("autoshard", "seconds", rank),
            "load_pretrained_s": median("autoshard", "load_seconds", rank),
            "peak_private_MiB": median("autoshard", "peak_added", rank) / 2**20,
            "peak_rss_MiB": median("autoshard", "peak_added_rss", rank) / 2**20,
            "params_MiB": median("autoshard", "held", rank) / 2**20,
            "private_over_checkpoint": median("autoshard", "peak_added", rank) / size,
            "time_ratio": theirs_seconds / median("autoshard", "seconds", rank),
            "rss_ratio": median("autoshard", "peak_added_rss", rank) / theirs_rss,
            "private_ratio": median("autoshard", "peak_added", rank) / theirs_peak,
        })
    rows.append({
        "loader": "transformers from_pretrained",
        "seconds": theirs_seconds,
        "peak_private_MiB": theirs_peak / 2**20,
        "peak_rss_MiB": theirs_rss / 2**20,
        "params_MiB": median("transformers", "held") / 2**20,
        "private_over_checkpoint": theirs_peak / size,
        "time_ratio": 1.0,
        "rss_ratio": 1.0,
        "private_ratio": 1.0,
    })
    device = torch.device("cpu")
    print(f"GPT-2 ({args.layers} layers) checkpoint of {size / 2**20:.0f} MiB in {len(files)} files, "
          f"{device_label(device)}, torch {torch.__version__}; median of {args.repeats} fresh processes per side")
    print_table(rows, ["loader", "seconds", "load_pretrained_s", "peak_private_MiB", "peak_rss_MiB", "params_MiB",
                       "private_over_checkpoint", "time_ratio", "rss_ratio", "private_ratio"])
    print("time_ratio: transformers seconds / this loader's; rss_ratio and private_ratio: this loader's peak "
          "resident (all, private) memory / transformers'. On the CPU, from_pretrained maps the checkpoint files "
          "instead of copying them, so its parameters are file pages (resident, not private).")
    for row in rows:
        row["checkpoint_MiB"] = size / 2**20
        row["files"] = len(files)
    print("saved", save_json("bench_load", device, rows))
    if not args.keep:
        for f in os.listdir(path):
            os.remove(os.path.join(path, f))
        os.rmdir(path)
    os.rmdir(scratch)


if __name__ == "__main__":
    main()
