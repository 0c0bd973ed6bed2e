"""Command line: ``python -m autoshard plan --model-type llama --world-size 4 [--config cfg.json]``
prints the sharding plan and its cost for a Hugging Face architecture built on meta."""

import argparse
import json
import sys
import time


def _plan_command(args) -> int:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM
    from transformers.utils import logging

    from .plan import plan

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
    result = plan(model, world_size=args.world_size)
    planned = time.perf_counter()
    if args.json:
        print(result.to_json())
    else:
        print(f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
              f"built on meta in {built - start:.2f} s, planned in {planned - built:.2f} s")
        print(result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard", description="autoshard command line")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="print the sharding plan of a Hugging Face architecture built on meta")
    p.add_argument("--model-type", required=True, help="a transformers model type: llama, gpt2, bert, ...")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--config", help="a JSON file of config values (e.g. a checkpoint's config.json)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="one config value, e.g. num_hidden_layers=4")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    if args.world_size <= 0:
        parser.error(f"--world-size must be a positive integer, got {args.world_size}")
    return _plan_command(args)


if __name__ == "__main__":
    sys.exit(main())
