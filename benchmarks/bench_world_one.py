"""What parallelizing costs where there is nothing to split: a training step of an HF Llama
parallelized over a group of one (NCCL on a GPU, gloo on CPU) against the plain model, and
`torch.compile` of each against its eager run. Configurations take turns, one step each.

    python benchmarks/bench_world_one.py [--hidden 1024] [--layers 4] [--batch 8] [--seq 512]
                                         [--dtype bfloat16] [--repeats 30] [--no-compile]

Rows (median seconds per step, and the ratio to the plain model's eager step):
- plain: the unparallelized model, torch.optim.AdamW (fused on a GPU, foreach on CPU);
- autoshard, torch AdamW: parallelized at world 1, the same torch optimizer;
- autoshard: parallelized at world 1 with autoshard.optim.AdamW;
- plain and autoshard compiled with torch.compile (also as a ratio to their own eager step).

Prints a table and writes benchmarks/results/bench_world_one_<device>.json."""

import argparse
import statistics
import time

import torch

from common import device_label, print_table, save_json, save_text, table_text


def build(args, device, dtype, parallel: bool, ours: bool, compiled: bool):
    import autoshard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         vocab_size=args.vocab, max_position_embeddings=max(args.seq, 128))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if parallel:
        autoshard.parallelize(model)
    if ours:
        opt = autoshard.optim.AdamW(model.parameters(), lr=1e-4)
    elif device.type == "cuda":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    forward = torch.compile(model) if compiled else model
    return forward, opt


def step(forward, opt, ids) -> None:
    opt.zero_grad(set_to_none=True)
    forward(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def median_in_turns(contenders, ids, device, warmup: int, repeats: int):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(contenders)
    times = {name: [] for name in names}
    for i in range(warmup + repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            forward, opt = contenders[name]
            sync()
            start = time.perf_counter()
            step(forward, opt, ids)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--hidden", type=int, default=1024 if gpu else 256)
    parser.add_argument("--layers", type=int, default=4 if gpu else 2)
    parser.add_argument("--heads", type=int, default=16 if gpu else 8)
    parser.add_argument("--vocab", type=int, default=32000 if gpu else 4096)
    parser.add_argument("--batch", type=int, default=8 if gpu else 4)
    parser.add_argument("--seq", type=int, default=512 if gpu else 128)
    parser.add_argument("--dtype", default="bfloat16" if gpu else "float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30 if gpu else 10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parser.parse_args()

    import autoshard

    device = torch.device("cuda" if gpu else "cpu")
    autoshard.init_distributed()  # a group of one: NCCL for CUDA tensors, gloo for CPU ones
    dtype = getattr(torch, args.dtype)
    kinds = {"plain": (False, False), "autoshard, torch AdamW": (True, False), "autoshard": (True, True)}
    contenders = {name: build(args, device, dtype, parallel, ours, False) for name, (parallel, ours) in kinds.items()}
    failed = {}
    if not args.no_compile:
        for name in ("plain", "autoshard"):  # compiling takes a minute each
            parallel, ours = kinds[name]
            try:
                forward, opt = build(args, device, dtype, parallel, ours, True)
                step(forward, opt, torch.zeros(args.batch, args.seq, dtype=torch.long, device=device))
                contenders[f"{name}, compiled"] = (forward, opt)
            except Exception as error:  # a compile failure is a result to report, not a crash
                failed[f"{name}, compiled"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    timed = median_in_turns(contenders, ids, device, args.warmup, args.repeats)
    plain = timed["plain"][0]
    rows = []
    for name, (median, least) in timed.items():
        eager = timed.get(name.replace(", compiled", ""), (median,))[0]
        rows.append({"configuration": name, "median ms": median * 1e3, "min ms": least * 1e3,
                     "/ plain eager": median / plain, "/ own eager": median / eager})
    for name, why in failed.items():
        rows.append({"configuration": name, "failed": why})
    columns = ["configuration", "median ms", "min ms", "/ plain eager", "/ own eager", "failed"]
    setup = (f"{device_label(device)}, torch {torch.__version__}, HF Llama hidden {args.hidden}, {args.layers} layers, "
             f"{args.heads} heads / {args.heads // 2} KV, vocab {args.vocab}, batch {args.batch} x {args.seq}, "
             f"{args.dtype}, world 1, {args.repeats} steps each in turns")
    print(setup)
    print_table(rows, columns)
    save_text("bench_world_one", device, setup + "\n" + table_text(rows, columns))
    print("saved", save_json("bench_world_one", device, [{"setup": setup}] + rows))


if __name__ == "__main__":
    main()
