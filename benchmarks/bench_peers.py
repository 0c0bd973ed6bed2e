"""autoshard against the tensor-parallel peers a user would pick instead, on one HF Llama and one
batch, at N gloo ranks, in the same run:

    autoshard                  autoshard.parallelize(model): sequence + loss parallelism, and the
                               column layers' input-gradient collective in flight while their
                               weight gradients are computed (the defaults)
    autoshard no overlap       the same with overlap_backward=False
    autoshard tp               autoshard.parallelize(model, sequence_parallel=False)
    autoshard tp no overlap    the same with overlap_backward=False
    dtensor tp                 torch.distributed.tensor.parallel: ColwiseParallel / RowwiseParallel on
                               q/k/v/o and gate/up/down, a row-split embedding and a column-split
                               lm_head with replicated logits, as torch's tutorials write it
    dtensor tp+sp              the same with SequenceParallel norms (bench_activation_memory's plan)
    hf tp_plan                 transformers' from_pretrained(..., tp_plan="auto") of the same weights,
                               saved with save_pretrained to a temporary directory first

    python benchmarks/bench_peers.py [--hidden 512 --intermediate 1376 --layers 4 --heads 8
        --kv-heads 4 --vocab 8192 --batch 4 --seq 256 --repeats 10 --world 2]

A step is zero_grad, forward, the model's own loss from labels, backward and an AdamW step
(autoshard.optim.AdamW for autoshard, torch.optim.AdamW for the peers; the same
hyperparameters). Every configuration starts from the same weights (torch.manual_seed(0)) and
takes the same batch; the first- and second-step losses of all of them are printed and compared.

Two phases, each in its own fresh gloo rank processes (one thread each):

- Memory and counts: resident memory is a process's, so the configurations are measured one at
  a time, each built, stepped three times and deleted before the next is built, in processes
  whose allocator hands freed blocks of 64 KiB and more back to the system at once
  (MALLOC_MMAP_THRESHOLD_), so that the resident size falls back between them. A first pass
  builds, steps and drops every configuration once before any is measured, so that what a
  process loads or caches once (code run the first time, the allocator's pools) is not counted
  on whichever configuration comes first. "peak RSS" is the rank's VmHWM over the
  configuration's build and steps (the mark reset through /proc/self/clear_refs before it), "RSS
  added" that peak less the resident size before the build: the configuration's own memory (the
  whole model is built on every rank and sharded, as torch's tutorials do; transformers loads it
  from the checkpoint), without the interpreter and libraries every configuration shares. The
  second step is counted: bytes saved for backward (autoshard.SavedTensorCounter, each storage
  once, parameters left out) and collectives, as the c10d ops that torch's profiler records on
  the rank (c10d::allreduce_, c10d::_allgather_base_, ...; barriers left out):
  torch.distributed's calls, torch's functional collectives (DTensor) and autoshard's comm ops
  all issue them (on gloo autoshard's reduce-scatters and all-gathers are rings: a send and a
  recv per ring step). autoshard's own
  CommCounter figures are in the JSON beside them (its comm ops alone: the calls its checks make
  through torch.distributed are not in them).
- Timing: one set of rank processes builds every configuration, runs a warm-up step of each,
  then --repeats rounds of one step of each configuration in turn, so that a change in the
  machine's load falls on all of them alike. A step's wall time (time.perf_counter) and CPU time
  (time.process_time) are the slowest rank's; the table gives the median and minimum wall time
  and the median CPU time over the steps, each also divided by DTensor TP's median step time.

Memory figures are the largest over the ranks.
Prints a table and writes benchmarks/results/bench_peers_cpu.json and .txt. A configuration that
fails is kept as a row with its error in place of figures.
"""

import argparse
import gc
import os
import statistics
import tempfile
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

import autoshard
from bench_activation_memory import dtensor_sequence_parallel
from common import run_on_gloo_ranks, save_json, save_text, table_text

logging.set_verbosity_error()

CONFIGS = ["autoshard", "autoshard no overlap", "autoshard tp", "autoshard tp no overlap", "dtensor tp", "dtensor tp+sp", "hf tp_plan"]
BASE = "dtensor tp"
NOT_COLLECTIVES = {"c10d::barrier", "c10d::monitored_barrier_"}


def llama_config(args) -> LlamaConfig:
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=max(args.seq, 2048), attention_dropout=0.0)
    config._attn_implementation = args.attn
    return config


def build(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(args)).float()


def dtensor_tensor_parallel(model: LlamaForCausalLM, world: int) -> None:
    """torch's tensor parallelism for Llama as its tutorials write it, without SequenceParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def hf_tp_plan(args) -> LlamaForCausalLM:
    """transformers' own tensor parallelism, loading the saved checkpoint of the same weights."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # older transformers: the standalone argument
        return LlamaForCausalLM.from_pretrained(args.checkpoint, tp_plan="auto", attn_implementation=args.attn,
                                                dtype=torch.float32)
    return LlamaForCausalLM.from_pretrained(args.checkpoint, distributed_config=DistributedConfig(tp_plan="auto"),
                                            attn_implementation=args.attn, dtype=torch.float32)


def build_config(name: str, args, world: int):
    """(model, optimizer) of configuration `name`."""
    if name == "hf tp_plan":
        model = hf_tp_plan(args)
    else:
        model = build(args)
        if name == "autoshard":
            autoshard.parallelize(model)
        elif name == "autoshard no overlap":
            autoshard.parallelize(model, overlap_backward=False)
        elif name == "autoshard tp":
            autoshard.parallelize(model, sequence_parallel=False)
        elif name == "autoshard tp no overlap":
            autoshard.parallelize(model, sequence_parallel=False, overlap_backward=False)
        elif name == "dtensor tp":
            dtensor_tensor_parallel(model, world)
        elif name == "dtensor tp+sp":
            dtensor_sequence_parallel(model, world)
        else:
            raise ValueError(f"unknown configuration {name!r}")
    model.train()
    optimizer_class = autoshard.optim.AdamW if name.startswith("autoshard") else torch.optim.AdamW
    return model, optimizer_class(model.parameters(), lr=args.lr)


def batch(args):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    return ids, labels


def step(model, optimizer, ids, labels, saved=None) -> float:
    """One training step; returns the loss. `saved` (a SavedTensorCounter) is active over forward."""
    optimizer.zero_grad(set_to_none=True)
    if saved is not None:
        with saved:
            loss = model(input_ids=ids, labels=labels).loss
    else:
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(time.strftime("%H:%M:%S"), message, flush=True)


def _preload() -> None:
    """Imports the peers' modules before anything is measured, so that no configuration's memory
    holds another one's code."""
    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers.integrations.tensor_parallel  # noqa: F401


# ---- timing: every configuration in one set of ranks, steps in turns ------------------------------


def _timing_rank(rank: int, world: int, args) -> dict:
    _preload()
    ids, labels = batch(args)
    built, errors = {}, {}
    for name in args.configs:
        try:
            model, optimizer = build_config(name, args, world)
            step(model, optimizer, ids, labels)  # warm-up
            built[name] = (model, optimizer)
        except Exception as exc:  # noqa: BLE001 - a peer that refuses is reported, not fatal
            if rank == 0:
                traceback.print_exc()
            errors[name] = _error(exc)
        _log(rank, f"built {name}")
    wall = {name: [] for name in built}
    cpu = {name: [] for name in built}
    for _ in range(args.repeats):
        for name, (model, optimizer) in built.items():
            dist.barrier()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step(model, optimizer, ids, labels)
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
        _log(rank, f"round {len(cpu[name])} of {args.repeats}")
    return {"wall": wall, "cpu": cpu, "errors": errors}


# ---- memory and counts: one configuration alive at a time ----------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_hwm() -> None:
    """Sets the process's resident high-water mark (VmHWM) to its resident size now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _collectives(prof) -> Counter:
    counts = Counter()
    for event in prof.events():
        if event.name.startswith("c10d::") and event.name not in NOT_COLLECTIVES:
            counts[event.name] += 1
    return counts


def _measure(name: str, world: int, args, ids, labels) -> dict:
    """Memory and counts of configuration `name`, built and stepped while no other one is alive."""
    gc.collect()
    _reset_hwm()
    before = _status_bytes("VmRSS")
    model, optimizer = build_config(name, args, world)
    losses = [step(model, optimizer, ids, labels)]
    saved = autoshard.SavedTensorCounter(ignore=list(model.parameters()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with autoshard.CommCounter() as comm:
            losses.append(step(model, optimizer, ids, labels, saved))
    step(model, optimizer, ids, labels)
    peak = _status_bytes("VmHWM")
    del model, optimizer
    return {"losses": losses, "saved": saved.bytes, "largest saved": saved.largest,
            "collectives": dict(_collectives(prof)), "commcounter": dict(comm.counts),
            "rss before": before, "peak rss": peak}


def _memory_rank(rank: int, world: int, args) -> dict:
    _preload()
    ids, labels = batch(args)
    # A first pass builds and steps every configuration once and drops it, so that what is
    # loaded or cached once per process (code paths run the first time, the allocator's pools)
    # is there before any configuration is measured, not counted on the first one alone.
    for name in args.configs:
        try:
            model, optimizer = build_config(name, args, world)
            step(model, optimizer, ids, labels)
            del model, optimizer
        except Exception:  # noqa: BLE001 - measured (and reported) below
            pass
    _log(rank, "first pass done")
    results = {}
    for name in args.configs:
        try:
            results[name] = _measure(name, world, args, ids, labels)
        except Exception as exc:  # noqa: BLE001 - a peer that refuses is reported, not fatal
            if rank == 0:
                traceback.print_exc()
            results[name] = {"error": _error(exc)}
        _log(rank, f"measured {name}")
    return results


# ---- the table ------------------------------------------------------------------------------------


def _slowest_rank(per_rank, kind, name):
    """Per step, the slowest rank's figure (a step ends when its last rank does)."""
    return [max(steps) for steps in zip(*(r[kind][name] for r in per_rank))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376, help="Llama's 11008 / 4096 of the hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--attn", default="sdpa", help="attention implementation of every configuration")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each configuration")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    args = parser.parse_args()
    if BASE not in args.configs:
        parser.error(f"--configs must include {BASE!r}, the configuration the ratios are taken against")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: nothing is looked up
    with tempfile.TemporaryDirectory() as checkpoint:
        args.checkpoint = checkpoint
        build(args).save_pretrained(checkpoint)
        # Freed blocks of 64 KiB and more go back to the system at once, so that the resident
        # size falls back when a configuration is deleted (the memory ranks only).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
        try:
            memory = run_on_gloo_ranks(_memory_rank, args.world, args)
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        timing = run_on_gloo_ranks(_timing_rank, args.world, args)

    rows = []
    for name in args.configs:
        row = {"config": name}
        measured = [r[name] for r in memory]
        error = next((r["error"] for r in measured if "error" in r), None) or timing[0]["errors"].get(name)
        if error is not None:
            row["error"] = error
            rows.append(row)
            continue
        wall, cpu = _slowest_rank(timing, "wall", name), _slowest_rank(timing, "cpu", name)
        collectives = Counter()
        for r in measured:
            collectives |= Counter(r["collectives"])  # the largest over the ranks, op by op
        row.update({
            "median s": statistics.median(wall), "min s": min(wall), "cpu s": statistics.median(cpu),
            "peak RSS MiB": max(r["peak rss"] for r in measured) / 2**20,
            "RSS added MiB": max(r["peak rss"] - r["rss before"] for r in measured) / 2**20,
            "RSS before MiB": max(r["rss before"] for r in measured) / 2**20,
            "saved MiB": max(r["saved"] for r in measured) / 2**20,
            "collectives": sum(collectives.values()),
            "collectives by op": dict(sorted(collectives.items())),
            "commcounter": [r["commcounter"] for r in measured],
            "losses": measured[0]["losses"],
            "step wall s": wall, "step cpu s": cpu,
        })
        rows.append(row)
    base = next((r for r in rows if r["config"] == BASE and "error" not in r), None)
    for row in rows:
        if base is not None and "error" not in row:
            row["median/dtp"] = row["median s"] / base["median s"]
            row["min/dtp"] = row["min s"] / base["median s"]
            row["cpu/dtp"] = row["cpu s"] / base["median s"]

    size = (f"N = {args.world} gloo ranks, HF Llama: hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, vocab {args.vocab}, "
            f"batch {args.batch} x {args.seq}, {args.attn} attention, fp32; {args.repeats} steps of each, in turns")
    columns = ["config", "median s", "min s", "cpu s", "median/dtp", "min/dtp", "cpu/dtp", "peak RSS MiB",
               "RSS added MiB", "saved MiB", "collectives"]
    lines = [size, table_text(rows, columns), "x/dtp: the figure divided by dtensor tp's median step time; RSS, saved "
             "bytes (activations) and collectives (c10d ops of one step) per rank, the largest over the ranks"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['config']}: not measured: {row['error']}")
    for row in rows:
        if "error" not in row:
            ops = ", ".join(f"{op.removeprefix('c10d::')} {n}" for op, n in row["collectives by op"].items())
            lines.append(f"{row['config']} collectives per step: {ops or 'none'}")
    losses = {row["config"]: row["losses"] for row in rows if "error" not in row}
    if losses:
        reference = losses.get(BASE, next(iter(losses.values())))
        for i, label in enumerate(["first", "second"]):
            worst = max(abs(v[i] - reference[i]) for v in losses.values())
            verdict = "agree" if worst <= 1e-4 else "DIFFER"
            listed = ", ".join(f"{name} {v[i]:.6f}" for name, v in losses.items())
            lines.append(f"{label}-step losses {verdict} (max |diff| {worst:.1e}): {listed}")
    text = "\n".join(lines)
    print(text)
    for row in rows:
        row["size"] = size
    print("saved", save_json("bench_peers", torch.device("cpu"), rows), save_text("bench_peers", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
