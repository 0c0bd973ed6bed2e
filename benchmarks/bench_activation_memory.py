"""Activation memory of sequence parallelism: the bytes each rank saves for backward, the
largest single saved tensor and the step time (forward, loss and backward) of a Llama-style
model, per rank, on N = 2 and 4 gloo ranks in the same run, for:

    unsharded                  the model on one rank (what every rank would hold without autoshard)
    tp                         autoshard.parallelize(model, sequence_parallel=False)
    tp+sp                      autoshard.parallelize(model)  (sequence parallelism, the default)
    dtensor tp+sp              torch.distributed.tensor.parallel with a hand-written
                               SequenceParallel plan (the peer a user would pick instead)

    tp+sp+loss parallel        autoshard.parallelize(model) with the model's own loss from labels:
                               the head keeps its vocabulary shard (vocab_parallel_cross_entropy)

The other configurations compute the loss from whole logits (F.cross_entropy), which is what
they hold.

    python benchmarks/bench_activation_memory.py [--hidden 1024 --layers 8 --heads 16
        --vocab 32000 --batch 2 --seq 512 --intermediate 2816 --repeats 2 --worlds 2 4]

Saved bytes count each storage once (autoshard.SavedTensorCounter, over torch's
saved_tensors_hooks), parameters included where autograd saves them (a Linear saves its
weight). The step time is the median of --repeats steps after a first one; the parallel
configurations are held together and timed in turns, so that the machine's load falls on each
alike, and "step / tp" compares each with tensor parallelism alone. Prints a table and writes
benchmarks/results/bench_activation_memory_cpu.json and .txt.
"""

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

import autoshard
from common import run_on_gloo_ranks, save_json, save_text, table_text

logging.set_verbosity_error()

# name -> keyword arguments of autoshard.parallelize (None: the model is not parallelized).
CONFIGS = {
    "unsharded": None,
    "tp": {"sequence_parallel": False, "loss_parallel": False},
    "tp+sp": {"sequence_parallel": True, "loss_parallel": False},
    "tp+sp+loss parallel": {"sequence_parallel": True, "loss_parallel": True},
}
PEER = "dtensor tp+sp"


def build(args) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=max(args.seq, 2048), attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def dtensor_sequence_parallel(model: LlamaForCausalLM, world: int) -> None:
    """torch's tensor parallelism with sequence parallelism, written by hand for Llama."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    # The embedding output stays whole (Llama reads its length for the position ids) and is
    # cut to this rank's tokens where the first block receives it.
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": SequenceParallel(use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(use_local_output=True),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _step(model, ids, labels, model_loss: bool, counter=None) -> None:
    """One forward, loss and backward; with `model_loss` the loss is the model's own from labels
    (loss parallelism), else F.cross_entropy of the whole logits."""
    model.zero_grad(set_to_none=True)
    with counter if counter is not None else contextlib.nullcontext():
        if model_loss:
            loss = model(input_ids=ids, labels=labels).loss
        else:
            logits = _local(model(ids).logits)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()


def _timed_step(model, ids, labels, model_loss: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    _step(model, ids, labels, model_loss)
    return time.perf_counter() - start


def _build_config(name, options, args, world):
    model = build(args)
    if options == "peer":
        dtensor_sequence_parallel(model, world)
    elif options is not None:
        autoshard.parallelize(model, **options)
    return model, isinstance(options, dict) and options.get("loss_parallel", False)


def _rank_main(rank: int, world: int, args) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    configs = list(CONFIGS.items()) + [(PEER, "peer")]
    # Bytes saved for backward (parameters included where autograd saves them), each storage once.
    memory, models = {}, {}
    for name, options in configs:
        model, model_loss = _build_config(name, options, args, world)
        counter = autoshard.SavedTensorCounter()
        _step(model, ids, labels, model_loss, counter)
        memory[name] = (counter.bytes, counter.largest)
        if options is None:
            # The unsharded model is timed on its own, then dropped: it is the largest by far.
            unsharded_times = [_timed_step(model, ids, labels, False) for _ in range(args.repeats)]
            del model
        else:
            models[name] = (model, model_loss)
    # The parallel configurations are timed in turns, so that a change in the machine's load
    # falls on all of them alike.
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, (model, model_loss) in models.items():
            times[name].append(_timed_step(model, ids, labels, model_loss))
    times["unsharded"] = unsharded_times
    return {name: (*memory[name], statistics.median(times[name])) for name, _ in configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        per_rank = run_on_gloo_ranks(_rank_main, world, args)
        # The figures of the rank that saves the most (rank 0 holds the extra token when uneven).
        for name in list(CONFIGS) + [PEER]:
            saved = max(r[name][0] for r in per_rank)
            largest = max(r[name][1] for r in per_rank)
            seconds = max(r[name][2] for r in per_rank)
            rows.append({"N": world, "config": name, "saved MiB/rank": saved / 2**20,
                         "largest saved MiB": largest / 2**20, "step s": seconds})
        base = {r["config"]: r for r in rows if r["N"] == world}
        for row in rows:
            if row["N"] == world:
                row["saved / tp"] = row["saved MiB/rank"] / base["tp"]["saved MiB/rank"]
                row["saved / dtensor"] = row["saved MiB/rank"] / base[PEER]["saved MiB/rank"]
                row["step / dtensor"] = row["step s"] / base[PEER]["step s"]
                row["step / tp"] = row["step s"] / base["tp"]["step s"]
    size = (f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
            f"batch {args.batch}, seq {args.seq}, intermediate {args.intermediate}")
    text = size + "\n" + table_text(rows, ["N", "config", "saved MiB/rank", "largest saved MiB", "step s", "saved / tp",
                                            "saved / dtensor", "step / tp", "step / dtensor"])
    print(text)
    for row in rows:
        row["size"] = size
    print("saved", save_json("bench_activation_memory", torch.device("cpu"), rows),
          save_text("bench_activation_memory", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
