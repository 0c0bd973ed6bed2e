"""Command line: ``python -m autoshard plan --model-type llama --world-size 4 [--config cfg.json]
[--batch B --seq S]`` prints the sharding plan and its cost for a Hugging Face architecture built
on meta, and the memory each rank needs for one training step (see planner/memory_prediction.py), at
that world size and at the largest one the model splits over."""

import argparse
import json
import sys
import time
import torch
from .planner.api import plan
from .planner.make_plan import plan_keeping_whole
from .planner import sequence_choice
from .planner.largest_world import largest_world_size
from .planner.memory_prediction import table


def _plan_command(args) -> int:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: PLC0415  (transformers is optional)
    from transformers.utils import logging  # noqa: PLC0415  (transformers is optional)


    logging.set_verbosity_error()
    config_values = {}
    if args.config:
        with open(args.config) as f:
            config_values = json.load(f)
    for item in args.set or []:
        key, _, value = item.partition("=")
        config_values[key] = json.loads(value) if value[:1] in "0123456789[{tf-" else value
    config = AutoConfig.for_model(args.model_type, **config_values)
    start = time.perf_counter()
    with torch.device("meta"):
        for auto in (AutoModelForCausalLM, AutoModelForMaskedLM, AutoModel):
            try:
                model = auto.from_config(config)
                break
            except ValueError:
                continue
        else:
            print(f"autoshard plan: no model class for model type {args.model_type!r}", file=sys.stderr)
            return 2
    built = time.perf_counter()
    if args.sequence_parallel == "auto":
        budget = None if args.memory_budget is None else int(args.memory_budget * 2**30)
        tokens_split, why = sequence_choice.choose(model, args.world_size, None, None, budget, args.backend,
                                                   _memory_options(args))
        result = plan_keeping_whole(model, args.world_size, None, None, tokens_split, {}, sequence_choice=why)
    else:
        result = plan(model, world_size=args.world_size, sequence_parallel=args.sequence_parallel == "on")
    planned = time.perf_counter()
    if args.json:
        print(result.to_json())
    else:
        print(f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
              f"built on meta in {built - start:.2f} s, planned in {planned - built:.2f} s")
        print(result)
        if not args.no_memory:
            _print_memory(model, result, args)
    return 0


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _memory_options(args) -> dict:
    return dict(batch=args.batch, seq=args.seq, optimizer=None if args.optimizer == "none" else args.optimizer,
                master_weights={"auto": None, "on": True, "off": False}[args.master_weights],
                dtype=None if args.dtype is None else getattr(torch, _DTYPES[args.dtype]))


def _print_memory(model, result, args) -> None:
    options = _memory_options(args)
    start = time.perf_counter()
    prediction = result.memory(**options)
    print()
    print("\n".join(table(prediction)))
    largest, largest_plan = largest_world_size(lambda n: plan(model, world_size=n), args.world_size)
    if largest_plan is not None:
        at_largest = largest_plan.memory(**options)
        print(f"at {largest} ranks, the largest world size at which every layer split here stays split, "
              f"the rank with the highest peak:")
        print("\n".join(table(at_largest, ranks=[at_largest.largest().rank])[1:]))
    else:
        print(f"{args.world_size} ranks is the largest world size at which every layer split here stays split")
    print(f"(predicted on meta in {time.perf_counter() - start:.2f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard", description="autoshard command line")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="print the sharding plan of a Hugging Face architecture built on meta")
    p.add_argument("--model-type", required=True, help="a transformers model type: llama, gpt2, bert, ...")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--config", help="a JSON file of config values (e.g. a checkpoint's config.json)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="one config value, e.g. num_hidden_layers=4")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (no memory prediction)")
    memory = p.add_argument_group(
        "memory per rank", "bytes of parameters, gradients, optimizer state, activations saved for backward and the "
        "peak of one training step (their sum plus the largest transient), per rank, at --world-size and at the "
        "largest world size the model splits over")
    memory.add_argument("--batch", type=int, help="batch size (default: the plan's example inputs, 2)")
    memory.add_argument("--seq", type=int, help="sequence length in tokens (default: the plan's example inputs)")
    memory.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                        help="optimizer state counted: AdamW (2 moments), SGD with momentum (1), none")
    memory.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype (default: the config's)")
    memory.add_argument("--master-weights", choices=("auto", "on", "off"), default="auto",
                        help="fp32 master weights as autoshard.optim keeps them (auto: for bf16/fp16 parameters)")
    memory.add_argument("--no-memory", action="store_true", help="print the plan alone")
    sequence = p.add_argument_group("sequence parallelism")
    sequence.add_argument("--sequence-parallel", choices=("on", "off", "auto"), default="on",
                          help="split the tokens between layers where valid (on, the default), never (off), or "
                               "where it pays (auto: always on NCCL; on gloo where the predicted peak at --batch "
                               "and --seq exceeds --memory-budget)")
    sequence.add_argument("--memory-budget", type=float, metavar="GIB",
                          help="GiB per rank the step must fit in (with --sequence-parallel auto)")
    sequence.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                          help="the backend the job will run on, which prices the collectives (default: nccl)")
    args = parser.parse_args(argv)
    if args.memory_budget is not None and (args.sequence_parallel != "auto" or args.memory_budget <= 0):
        parser.error("--memory-budget must be a positive number of GiB, given with --sequence-parallel auto")
    if args.world_size <= 0:
        parser.error(f"--world-size must be a positive integer, got {args.world_size}")
    for name in ("batch", "seq"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be a positive integer, got {value}")
    return _plan_command(args)


if __name__ == "__main__":
    sys.exit(main())
