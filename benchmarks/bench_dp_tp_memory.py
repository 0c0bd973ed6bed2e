"""Memory per rank of data x tensor parallelism on a 2 x 2 ("dp", "tp") mesh: parameters and AdamW
state (and gradients, after backward) that each rank holds, as a fraction of what the unsharded
model holds, for

- autoshard's mesh path, ``parallelize(model, mesh=mesh)`` (each replica holds its tensor-parallel
  shards whole; the replicated parameters' optimizer state is partitioned over "dp");
- the mesh path with ``fully_shard=True`` (FSDP2 over "dp", applied by parallelize);
- FSDP2 over "dp" applied by hand after ``parallelize(model, mesh=mesh["tp"])``;
- the peer: torch's FSDP2 over "dp" with torch's DTensor tensor parallelism over "tp"
  (``parallelize_module`` with ColwiseParallel / RowwiseParallel, torch.optim.AdamW).

    python benchmarks/bench_dp_tp_memory.py [--hidden 64 --layers 2]

The model is a Hugging Face Llama built from a config (nothing downloaded): 4 heads over 2 KV
heads, intermediate size 2 x hidden, vocabulary 256. Bytes are those of the tensors each rank
holds after one training step (a DTensor's local tensor; FSDP's padding of uneven pieces not
counted); the step counters of AdamW are left out. Prints a table (the largest rank's fraction)
and writes benchmarks/results/bench_dp_tp_memory_cpu.json and .txt.
"""

import argparse

import torch

from common import run_on_gloo_ranks, save_json, save_text, table_text

CONTENDERS = ("autoshard mesh path", "autoshard mesh path, fully_shard=True", "fully_shard over dp + autoshard tp",
              "torch FSDP2 + DTensor TP")


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen or t.dim() == 0:
            continue
        seen.add(id(t))
        local = getattr(t, "_local_tensor", t)
        total += local.numel() * local.element_size()
    return total


def _torch_tensor_parallel(model, mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}."
        plan.update({prefix + name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")})
        plan.update({prefix + name: RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")})
    parallelize_module(model, mesh["tp"], plan)


def _contender(name: str, args, mesh):
    import autoshard
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args))
    if name == CONTENDERS[0]:
        autoshard.parallelize(model, mesh=mesh)
    elif name == CONTENDERS[1]:
        autoshard.parallelize(model, mesh=mesh, fully_shard=True)
    elif name == CONTENDERS[2]:
        autoshard.parallelize(model, mesh=mesh["tp"])
    else:
        _torch_tensor_parallel(model, mesh)
    if name in CONTENDERS[2:]:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    make = torch.optim.AdamW if name == CONTENDERS[3] else autoshard.optim.AdamW
    return model, make(model.parameters(), lr=1e-3)


def _rank_main(rank: int, world: int, args) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from autoshard.core.distributed import set_default_group

    # The peer's HF Llama under DTensor TP returns a view of its logits, which FSDP2 warns about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = LlamaForCausalLM(_config(args))
    unsharded = _local_bytes(whole.parameters())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    result = {}
    for name in CONTENDERS:
        model, opt = _contender(name, args, mesh)
        model(input_ids=ids, labels=ids).loss.backward()
        grads = _local_bytes(p.grad for p in model.parameters())
        opt.step()
        params = _local_bytes(model.parameters())
        state = _local_bytes(v for s in opt.state.values() for v in s.values())
        result[name] = dict(params=params / unsharded, state=state / (2 * unsharded),
                            total=(params + state) / (3 * unsharded), grads=grads / unsharded)
        set_default_group(None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    per_rank = run_on_gloo_ranks(_rank_main, 4, args)
    rows = []
    for name in CONTENDERS:
        row = {"path": name}
        for key in ("params", "state", "total", "grads"):
            row[key] = max(r[name][key] for r in per_rank)
        rows.append(row)
    setup = (f"4 gloo ranks, a 2 x 2 ('dp', 'tp') mesh; HF Llama hidden {args.hidden}, {args.layers} layers, 4 heads / "
             "2 KV, vocab 256. Per rank (the largest), as a fraction of the unsharded model's: parameters, AdamW "
             "state, the two together (params + state), and gradients after backward")
    text = setup + "\n" + table_text(rows, ["path", "params", "state", "total", "grads"])
    print(text)
    for row in rows:
        row["setup"] = setup
    print("saved", save_json("bench_dp_tp_memory", torch.device("cpu"), rows),
          save_text("bench_dp_tp_memory", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
