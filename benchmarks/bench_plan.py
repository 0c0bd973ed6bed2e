"""Planning time: autoshard.plan on Llama-7B, Llama-70B, Mixtral-8x7B, Falcon-7B and a
StarCoder-size GPT-BigCode (both multi-query) configs built on the meta device (world size 8),
against the time of the model's own forward on meta, its peer: the capture runs each kind of
block once and records identical blocks again without running them.
The models keep every default setting (fp32, the default attention and expert implementations);
Mixtral's default grouped expert matmul has no fp32 meta kernel, so its peer forward runs in
bf16 (peer_dtype). sharded_params is the fraction of the parameters in sharded layers.

    python benchmarks/bench_plan.py [--world-size 8] [--repeats 3]

Prints a table and writes benchmarks/results/bench_plan_cpu.json.
"""

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging

import autoshard
from common import print_table, save_json

logging.set_verbosity_error()

CONFIGS = {
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "llama-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2)),
    # One KV head fused beside the query heads in one Linear (held whole on every rank).
    "falcon-7b": ("falcon", dict(hidden_size=4544, num_attention_heads=71, num_hidden_layers=32, vocab_size=65024,
                                 multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False)),
    "starcoder-15b": ("gpt_bigcode", dict(n_embd=6144, n_head=48, n_layer=40, vocab_size=49152, n_positions=8192,
                                          multi_query=True)),
}


def build(kind: str, overrides: dict):
    config = AutoConfig.for_model(kind, **overrides)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def meta_forward(model, ids, repeats: int):
    """(seconds, dtype) of the model's forward on meta: in its own dtype, else in bf16."""
    try:
        model(input_ids=ids)
    except RuntimeError:
        model = model.to(torch.bfloat16)
    return best_of(lambda: model(input_ids=ids), repeats), str(next(model.parameters()).dtype).replace("torch.", "")


def sharded_fraction(plan) -> float:
    total = sum(_numel(record.shape) for record in plan.parameters.values())
    return sum(_numel(plan.parameters[name].shape) for name in plan.param_specs(0)) / total


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, (kind, overrides) in CONFIGS.items():
        model = build(kind, overrides)
        ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
        forward, peer_dtype = meta_forward(model, ids, args.repeats)
        planning = best_of(lambda: autoshard.plan(model, world_size=args.world_size), args.repeats)
        p = autoshard.plan(model, world_size=args.world_size)
        styles = {}
        for layer in p.layers:
            styles[layer.style] = styles.get(layer.style, 0) + 1
        rows.append({"model": name, "world_size": args.world_size, "plan_s": planning, "meta_forward_s": forward,
                     "peer_dtype": peer_dtype, "ratio": planning / forward, "layers": len(p.layers),
                     "sharded_params": sharded_fraction(p), "held_rank0": p.held_fraction(0),
                     "styles": " ".join(f"{k}={v}" for k, v in sorted(styles.items()))})
    print_table(rows, ["model", "world_size", "plan_s", "meta_forward_s", "peer_dtype", "ratio", "layers",
                       "sharded_params", "held_rank0", "styles"])
    print(f"saved {save_json('bench_plan', torch.device('cpu'), rows)}")


if __name__ == "__main__":
    main()
