"""Rank functions for dropout inside and after a sharded region at an uneven split."""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard.core import region_generators

HEADS, HEAD_DIM, HIDDEN = 10, 4, 12


class Block(nn.Module):
    """An attention-like column layer (10 heads of 4) with dropout on its output, a row layer,
    then dropout on the replicated output."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.inner = nn.Dropout(0.5)
        self.down = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.outer = nn.Dropout(0.5)

    def forward(self, x):
        return self.outer(self.down(self.inner(self.up(x))))


def _sharded_block() -> Block:
    torch.manual_seed(0)
    block = Block().train()
    block.up = autoshard.nn.ColumnParallelLinear.from_linear(block.up, units=HEAD_DIM)
    block.down = autoshard.nn.RowParallelLinear.from_linear(block.down, units=HEAD_DIM)
    return block


def replicated_outputs(steps: int = 3):
    """The outputs of the replicated region (after the outer dropout) at each of `steps` forwards,
    with the column layer split on whole heads (4, 3, 3 at 3 ranks), on this rank."""
    block = _sharded_block()
    torch.manual_seed(1)  # the same generator state on every rank
    x = torch.ones(2, HIDDEN)
    return [block(x).detach() for _ in range(steps)]


def checkpointed_training(checkpointed: bool, use_reentrant: bool, start_inside: bool, steps: int = 2):
    """`steps` forwards and backwards of two blocks in a row, the second one recomputed in backward
    (activation checkpointing) when `checkpointed`: the whole block, or with `start_inside` only
    from the column layer's output on (the recomputation starts inside the region and leaves
    it). On this rank: each forward's output, each step's gradients, and the generator's state
    after each step."""
    first, second = _sharded_block(), _sharded_block()
    torch.manual_seed(1)
    x = torch.randn(3, HIDDEN, requires_grad=True)

    def rest(h):
        return second.outer(second.down(second.inner(h)))

    outputs, gradients, states = [], [], []
    for _ in range(steps):
        h = first(x)
        if not checkpointed:
            y = second(h)
        elif start_inside:
            y = checkpoint(rest, second.up(h), use_reentrant=use_reentrant)
        else:
            y = checkpoint(second, h, use_reentrant=use_reentrant)
        y = second.outer(y)  # one more dropout after the checkpointed block, as the next block's would be
        y.pow(2).sum().backward()
        outputs.append(y.detach())
        gradients.append({name: p.grad.clone() for name, p in [*first.named_parameters(prefix="first"),
                                                               *second.named_parameters(prefix="second")]}
                         | {"x": x.grad.clone()})
        for p in [x, *first.parameters(), *second.parameters()]:
            p.grad = None
        states.append(torch.get_rng_state())
    return outputs, gradients, states


def _region_mechanics(device: str):
    """What the region's edges do to the generator of `device`, on this rank: returns a dict of
    named checks (True where they hold), and this rank's mask inside a region."""
    group = dist.group.WORLD.group_name
    if device != "cpu":
        torch.cuda.init()  # the CUDA generators exist only once CUDA is initialised
    generator = torch.default_generator if device == "cpu" else torch.cuda.default_generators[torch.device(device).index or 0]
    x = torch.ones(64, device=device)
    checks = {}

    def state():
        return generator.get_state().clone()

    def dropout(t, count=1):
        for _ in range(count):
            t = nn.functional.dropout(t, 0.5)
        return t

    torch.manual_seed(5)
    if device != "cpu":
        torch.cuda.manual_seed_all(5)
    start = state()
    region_generators.leave(region_generators.enter(x, group, training=False))
    checks["evaluation leaves the generator alone"] = torch.equal(state(), start)

    def through_region(inside_draws: int, entries: int = 1):
        generator.set_state(start)
        for _ in range(entries):
            region_generators.enter(x, group, training=True)
        mask = dropout(x, inside_draws)
        region_generators.leave(mask)
        return state(), mask

    after_one, mask = through_region(1)
    after_three, _ = through_region(3)
    after_entered_thrice, _ = through_region(2, entries=3)
    checks["the state after a region is the same whatever was drawn inside"] = (
        torch.equal(after_one, after_three) and torch.equal(after_one, after_entered_thrice))
    checks["a region that drew advances the synchronised generator"] = not torch.equal(after_one, start)
    after_none, _ = through_region(0, entries=2)
    checks["a region that drew nothing leaves the synchronised generator as it found it"] = torch.equal(
        after_none, start)
    generator.set_state(start)
    region_generators.enter(x, group, training=True)
    region_generators.resynchronise()
    checks["resynchronise after a region that drew nothing leaves the generator as it was"] = torch.equal(
        state(), start)
    generator.set_state(start)
    checks["the mask inside a region is not the synchronised generator's"] = not torch.equal(mask, dropout(x))

    generator.set_state(start)
    region_generators.enter(x, group, training=True)
    dropout(x, 2)
    region_generators.resynchronise()
    checks["resynchronise ends a region left open"] = torch.equal(state(), after_one)

    generator.set_state(start)
    with torch.no_grad():
        region_generators.enter(x, group, training=True)
        inside = dropout(x)
        region_generators.leave(inside)
    checks["under no_grad a region in training swaps all the same"] = (
        torch.equal(inside, mask) and torch.equal(state(), after_one))

    generator.set_state(start)
    outer = region_generators.enter(x, group, training=True)
    region_generators.enter(dropout(outer), group, training=True)  # nested: the same region goes on
    region_generators.leave(region_generators.leave(dropout(outer)))
    checks["a nested region ends with the outer one"] = torch.equal(state(), after_one)

    # Activation checkpointing: a block that starts inside a region and leaves it, recomputed.
    def block(h):
        return dropout(region_generators.leave(dropout(h) * 3.0))

    gradients = []
    for recomputed in (False, True):
        generator.set_state(start)
        h = region_generators.enter(torch.ones(64, device=device, requires_grad=True), group, training=True)
        h.retain_grad()
        y = checkpoint(block, h, use_reentrant=False) if recomputed else block(h)
        y.sum().backward()
        gradients.append((h.grad.clone(), y.detach(), state()))
    checks["a recomputed block repeats its masks and its region's end"] = all(
        torch.equal(a, b) for a, b in zip(*gradients))
    return checks, mask.cpu()


def region_mechanics_cpu():
    return _region_mechanics("cpu")


def region_mechanics_cuda():
    return _region_mechanics("cuda")


def _hf_training(kind: str, seq: int, steps: int, record: str, **config):
    """`steps` training forwards and backwards of a tiny `kind` model with dropout everywhere it
    has some, parallelized with the defaults (loss parallelism, and sequence parallelism where
    the plan takes it); on this rank: the output of the module `record` at each forward, the
    generator's state after each forward, and the model's state (its loss parallelism)."""
    from hf_models import build

    model = build(kind, seed=0, **config).train()
    ids = torch.randint(0, 101, (2, seq), generator=torch.Generator().manual_seed(3))
    model = autoshard.parallelize(model)
    recorded = []
    model.get_submodule(record).register_forward_hook(lambda module, args, output: recorded.append(
        (output[0] if isinstance(output, tuple) else output).detach().clone()))
    torch.manual_seed(1)
    states = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        states.append(torch.get_rng_state())
    state = model.autoshard_state
    return recorded, states, (state.loss_parallel.enabled, any(layer.sequence for layer in state.plan.layers))


def gpt2_after_an_open_head_region(steps: int = 3):
    """GPT-2 (5 heads: 2, 2, 1 at 3 ranks) with dropout 0.3 on its embeddings, attention and
    residual stream, its head's vocabulary shard feeding the loss (a region never closed inside
    the model): the embeddings' dropout output (replicated) at each forward, on this rank."""
    return _hf_training("gpt2", 8, steps, "transformer.drop", embd_pdrop=0.3, attn_pdrop=0.3, resid_pdrop=0.3)


def llama_with_sequence_parallelism(steps: int = 3):
    """Llama with 5 heads (2, 2, 1 at 3 ranks) and attention dropout 0.3, 7 tokens (3, 2, 2,
    sequence parallelism on): the first layer's attention output (this rank's tokens) at each
    forward, on this rank."""
    return _hf_training("llama", 7, steps, "model.layers.0.self_attn", attention_dropout=0.3, hidden_size=40,
                        num_attention_heads=5, num_key_value_heads=5)
