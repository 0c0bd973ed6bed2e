"""Train a small language model with tensor parallelism.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_lm.py [--model gpt2]

Every rank builds the same model (same seed: a Llama by default, or a GPT-2), autoshard plans
how to split it, parallelize() swaps its layers for sharded ones, and the ranks train it
together on the same batches: each holds a slice of every large weight and the collectives
stitch the computation back into the unsharded model's. Between the blocks' sharded layers
the Llama's tokens are split over the ranks (sequence parallelism), and its loss is computed
over the vocabulary shards (loss parallelism), so no rank holds the whole logits; the run
prints the activation memory each rank saves for backward beside the unsharded model's.
Bytes are the tokens (a vocabulary of 256), so no tokenizer is needed, and the text is
whatever is already on the machine. Sharded checkpoints are saved in the background while
training goes on. At the end the last checkpoint is consolidated into an ordinary Hugging Face
directory, and the model that transformers loads from it must compute what the sharded model
computes.

NCCL when every rank on the machine has a GPU of its own (autoshard.init_distributed() picks
it), gloo on CPU otherwise.

``--dtype bf16`` (or ``DTYPE=bf16`` in the environment, as ``make demo DTYPE=bf16`` sets it)
trains in bfloat16: weights, activations and gradients in bf16, while autoshard.optim.AdamW
keeps an fp32 master copy of every weight shard and fp32 moments (14 bytes per parameter).
"""

import argparse
import contextlib
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from transformers.utils import logging as hf_logging

import autoshard

EXAMPLE_DIR = Path(__file__).resolve().parent
# Plain text found on every Debian/Ubuntu machine; the project's own README otherwise.
LICENSES = Path("/usr/share/common-licenses")
README = EXAMPLE_DIR.parent / "README.md"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama",
                        help="the architecture (default: llama; gpt2 keeps its tokens whole between layers)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (every rank sees the same ones)")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (at most the context, 128)")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (warm-up, then cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip the gradients' global norm to this (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    parser.add_argument("--text", type=Path, nargs="+", default=None,
                        help=f"text files, or folders of them, to train on (default: {LICENSES}, else {README})")
    parser.add_argument("--save-every", type=int, default=100,
                        help="save a sharded checkpoint every this many steps, and after the last one")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=os.environ.get("DTYPE") or "fp32",
                        help="the model's dtype (default: $DTYPE, else fp32); bf16 trains with fp32 master weights")
    parser.add_argument("--out", type=Path, default=EXAMPLE_DIR / "out",
                        help="folder for the loss curve and the checkpoints (its checkpoints/ and hf/ are replaced)")
    if parser.get_default("dtype") not in DTYPES:
        parser.error(f"DTYPE must be one of {sorted(DTYPES)}, got {parser.get_default('dtype')!r}")
    args = parser.parse_args()
    if not 2 <= args.seq_len <= 128:
        parser.error(f"--seq-len must be between 2 and the model's context of 128, got {args.seq_len}")
    if args.save_every < 1:
        parser.error(f"--save-every must be at least 1, got {args.save_every}")
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive")
    return args


# 5 heads over 2 ranks: autoshard splits whole heads unevenly (3 and 2), which is normal.
MODELS = {
    "llama": lambda: LlamaConfig(vocab_size=256, max_position_embeddings=128, hidden_size=240, intermediate_size=640,
                                 num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
                                 attention_dropout=0.0, bos_token_id=None, eos_token_id=None),
    "gpt2": lambda: GPT2Config(vocab_size=256, n_positions=128, n_embd=240, n_layer=4, n_head=5,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
}


def build_model(name: str, seed: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    # Every rank must start from the same weights: parallelize() keeps each rank's slice of them.
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(MODELS[name]()).to(device, dtype)


def text_files(paths):
    if paths is None:
        paths = [LICENSES] if LICENSES.is_dir() else [README]
    files = []
    for path in paths:
        if path.is_dir():
            # Some licenses are links to others: read each file once.
            files += sorted({p.resolve() for p in path.iterdir() if p.is_file()})
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"--text: {path} is neither a file nor a folder")
    if not files:
        raise SystemExit(f"--text: no files in {[str(p) for p in paths]}")
    return files


def load_bytes(paths) -> torch.Tensor:
    data = b"\n\n".join(p.read_bytes() for p in text_files(paths))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """Random windows of the text. Tensor parallelism needs the same batch on every rank of
    the group, so the sampler is seeded identically everywhere rather than split by rank."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def save_loss_curve(losses, smoothed, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss")
    ax.plot(steps, smoothed, color="tab:blue", linewidth=2, label="smoothed")
    ax.axhline(math.log(256), color="gray", linestyle="--", linewidth=1, label="ln 256 (uniform bytes)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(f"{title}, tensor parallel over {dist.get_world_size()} ranks")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    hf_logging.set_verbosity_error()
    # Two ranks cannot share one GPU under NCCL: with fewer GPUs than local ranks, train on CPU.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    rank, world_size = autoshard.init_distributed(None if on_gpus else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpus else torch.device("cpu")
    leader = rank == 0

    def say(*values):
        if leader:
            print(*values, flush=True)

    data = load_bytes(args.text)
    held_out = data[-max(len(data) // 20, args.seq_len + 1):]
    train = data[:len(data) - len(held_out)]
    if len(train) <= args.seq_len:
        raise SystemExit(f"--text: {len(data):,} bytes is too little text for --seq-len {args.seq_len}")

    dtype = DTYPES[args.dtype]
    model = build_model(args.model, args.seed, device, dtype)
    unsharded_bytes = parameter_bytes(model)
    example = {"input_ids": torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)}
    # What one step of the unsharded model keeps for backward, beside the sharded model's below.
    unsharded_saved = autoshard.SavedTensorCounter(ignore=model.parameters())
    with unsharded_saved:
        loss = model(input_ids=example["input_ids"].to(device), labels=example["input_ids"].to(device)).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    plan = autoshard.plan(model, world_size=world_size, example_inputs=example)
    autoshard.parallelize(model, plan)
    say(model.autoshard_state)  # the plan, and the collectives of a call with labels (loss over vocabulary shards)
    say(model.autoshard_state.loss_parallel)
    model.train()

    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, parameter_bytes(model))
    say(f"\nparameters: {unsharded_bytes / 2**20:.2f} MiB unsharded; "
        + ", ".join(f"rank {r} holds {b / 2**20:.2f} MiB ({b / unsharded_bytes:.0%})" for r, b in enumerate(per_rank)))

    say(f"text: {len(data):,} bytes ({len(train):,} to train on); {args.steps} steps of "
        f"{args.batch_size} x {args.seq_len} bytes on {world_size} ranks ({dist.get_backend()}, {device.type}, "
        f"{args.dtype}{' with fp32 master weights' if dtype != torch.float32 else ''})")

    if args.clip <= 0:
        say("gradient clipping: off (--clip 0)")
    opt = autoshard.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))

    # The demo's own output folders start empty, so that every run saves its own checkpoints.
    checkpoints, hf_dir = args.out / "checkpoints", args.out / "hf"
    if leader:
        for folder in (checkpoints, hf_dir):
            shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    manager = autoshard.checkpoint.CheckpointManager(checkpoints, max_to_keep=2)
    save_blocked = []  # seconds the loop waited for each asynchronous save to start

    def train_step(step: int, input_ids: torch.Tensor, saved=contextlib.nullcontext()) -> float:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        with saved:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if args.clip > 0:
            autoshard.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, smoothed = [], []
    average, beta = 0.0, 0.95
    counter = autoshard.CommCounter()
    saved = autoshard.SavedTensorCounter(ignore=model.parameters())
    stream = batches(train, args.batch_size, args.seq_len, args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(args.steps), disable=not leader, mininterval=1.0, dynamic_ncols=True, desc="training")
    start = time.perf_counter()
    for step in bar:
        input_ids = next(stream).to(device)
        if step == min(1, args.steps - 1):  # the first step pays for warm-up; any later one is typical
            with counter:
                loss = train_step(step, input_ids, saved)
        else:
            loss = train_step(step, input_ids)
        losses.append(loss)
        average = beta * average + (1 - beta) * loss
        smoothed.append(average / (1 - beta ** (step + 1)))  # debiased, so the first value is the first loss
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{smoothed[-1]:.3f}", tok_s=f"{tokens_per_step * (step + 1) / elapsed:,.0f}",
                        refresh=False)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            began = time.perf_counter()
            manager.save(step + 1, model, opt, extra={"step": step + 1, "loss": smoothed[-1]}, async_save=True)
            save_blocked.append(time.perf_counter() - began)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    bar.close()

    say(f"\nloss: {smoothed[0]:.3f} -> {smoothed[-1]:.3f} (smoothed; ln 256 = {math.log(256):.3f})")
    say(f"time: {elapsed:.1f} s for {args.steps} steps, {tokens_per_step * args.steps / elapsed:,.0f} tokens/s "
        f"({elapsed / args.steps * 1000:.0f} ms per step)")
    state = model.autoshard_state
    say(f"collectives per step: {counter.counts} (planned: "
        f"forward {state.collectives('forward', labels=True)}, backward {state.collectives('backward')})")
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, (saved.bytes, saved.largest))
    say(f"activations saved for backward per step: {unsharded_saved.bytes / 2**20:.2f} MiB unsharded (largest "
        f"tensor {unsharded_saved.largest / 2**20:.2f} MiB); "
        + ", ".join(f"rank {r} holds {b / 2**20:.2f} MiB ({b / unsharded_saved.bytes:.0%}; largest tensor "
                    f"{largest / 2**20:.2f} MiB)" for r, (b, largest) in enumerate(per_rank)))

    manager.wait()
    say(f"checkpoints: {', '.join(f'step-{n}' for n in manager.steps())} kept in {checkpoints}; each asynchronous "
        f"save held the training loop for {1000 * max(save_blocked):.0f} ms at most")

    # The invariant: the last checkpoint, consolidated into an ordinary Hugging Face
    # directory and loaded by transformers, computes what the sharded model computes.
    check_ids = next(batches(held_out, args.batch_size, args.seq_len, args.seed + 1)).to(device)
    model.eval()
    with torch.no_grad():
        sharded = model(input_ids=check_ids, labels=check_ids)  # a collective too
        # With labels the logits are this rank's vocabulary shard (loss parallelism): made whole.
        sharded_logits = autoshard.gather_logits(model, sharded.logits)
    if leader:
        autoshard.checkpoint.consolidate(manager.latest(), hf_dir)
        print(f"consolidated step-{manager.latest_step()} into {hf_dir}")
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
        reference.eval()
        with torch.no_grad():
            unsharded = reference(input_ids=check_ids, labels=check_ids)
        difference = (sharded_logits.float() - unsharded.logits.float()).abs().max().item()
        print(f"held-out loss: {unsharded.loss.item():.3f} (unsharded copy), {sharded.loss.item():.3f} (sharded)")
        print(f"sharded vs unsharded logits: max abs difference {difference:.2e}")
        path = args.out / "loss_curve.png"
        save_loss_curve(losses, smoothed, path, type(reference).__name__)
        print(f"loss curve: {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
