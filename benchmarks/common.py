"""Shared benchmark plumbing: timing, gloo ranks, a printed table, and a JSON record per run.

Importing it puts tests/support on sys.path: the helpers the tests share with the benchmarks
(free ports and rank environments, peak memory) live there."""

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
SUPPORT_DIR = os.path.join(os.path.dirname(HERE), "tests", "support")
if SUPPORT_DIR not in sys.path:
    sys.path.append(SUPPORT_DIR)

from local_ranks import free_port, rank_env  # noqa: E402


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 10) -> float:
    """Median wall time of fn() over `repeats` runs, synchronising the GPU around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table_text(rows: List[Dict[str, object]], columns: List[str]) -> str:
    cells = [[_format(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def print_table(rows: List[Dict[str, object]], columns: List[str]) -> None:
    print(table_text(rows, columns))


def save_text(name: str, device: torch.device, text: str) -> str:
    """The printed table beside the JSON, for reading without tools."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}_{device.type}.txt")
    with open(path, "w") as f:
        f.write(text + "\n")
    return path


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)


def save_json(name: str, device: torch.device, rows: List[Dict[str, object]]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}_{device.type}.json")
    record = {
        "benchmark": name,
        "device": device_label(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path


def _gloo_rank(rank: int, rank_main: Callable, world: int, port: int, queue, args) -> None:
    import torch.distributed as dist

    os.environ.update(rank_env(port, rank, world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = rank_main(rank, world, *args)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def run_on_gloo_ranks(rank_main: Callable, world: int, *args) -> list:
    """What `rank_main(rank, world, *args)` returns on each of `world` spawned gloo ranks (one
    thread each), in rank order. `rank_main` must be a module-level function."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gloo_rank, args=(rank_main, world, free_port(), queue, args), nprocs=world)
    return queue.get()


# ---- the small training step the agreement-check benchmarks time (bench_agreement_checks,
# bench_input_check, bench_replica_check)

def add_small_llama_arguments(parser) -> None:
    """The model size, batch and repeats those benchmarks share."""
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)


def small_llama(args, **parallelize_kwargs):
    """A Hugging Face Llama from a config (4 heads over 2 KV heads, vocabulary 256), seeded,
    parallelized over the world with `parallelize_kwargs`, and its autoshard AdamW."""
    import autoshard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=max(args.seq, 128))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    autoshard.parallelize(model, **parallelize_kwargs)
    return model, autoshard.optim.AdamW(model.parameters(), lr=1e-3)


def median_steps_in_turns(contenders: Dict[str, tuple], ids: torch.Tensor, warmup: int, repeats: int) -> Dict[str, float]:
    """Median seconds of a training step (zero_grad, forward with labels, backward, step) of
    each (model, optimizer, ...) in `contenders`, taking turns one step each after a barrier, so
    that a busy machine slows all alike; each round starts one later in the order, so that
    no configuration always runs right after the same one."""
    import torch.distributed as dist

    times = {name: [] for name in contenders}
    names = list(contenders)
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, opt, *_ = contenders[name]
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def small_llama_setup(args) -> str:
    return (f"2 gloo ranks (1 thread each), HF Llama hidden {args.hidden}, {args.layers} layers, 4 heads / 2 KV, "
            f"vocab 256")
