"""The random number generators at the edges of the regions where each rank holds its own piece.

Dropout draws from the default generator of its tensor's device. Where every rank holds an
activation whole (the residual stream with tensor parallelism alone), every rank must draw the
same mask, so the ranks' generators must stay in the same state: seeded alike, they stay so as
long as every rank draws the same amounts. Inside a region (from a column layer's input copy to
the row layer's sum, where a rank holds its own heads or features; with sequence parallelism,
from a reduce-scatter to the next gather, where it holds its own tokens) a rank must draw masks
of its own, and it draws as many values as its piece holds: at an uneven split (10 heads over 3
ranks: 4, 3, 3) the ranks would advance by different amounts and part ways for good.

So a region gets generator states of its own:

- where it starts (``enter``), the synchronised generator gives one number, the same on every
  rank, which advances it alike on every rank; its state after that draw is kept, and the
  generator is seeded from the number and the rank in the region's group, so that ranks draw
  independent masks there, and each region (and each step) other masks than the last;
- where it ends (``leave``), the kept state comes back: the draws inside, however many, leave
  no trace on the synchronised generator.

Which kept state a region's end brings back is read from the generator itself: a region's
generator is seeded with a seed of its own, which ``initial_seed()`` returns, and the kept
states are found by it. A region entered again before it ends (q, k and v, each with its input
copy) or one nested in another goes on drawing from the region's generator. Activation
checkpointing saves the generator's state before a block and sets it again to recompute it,
seed included, so a recomputed block finds the same region (or draws the same number and gets
the same seed) and leaves it to the same kept state: its masks repeat the first forward's bit
for bit. A region that never ends inside the model (a column head whose logits go to a
vocabulary-parallel loss) is ended by ``resynchronise``, which ``parallelize`` runs before and
after each forward of the model, so that the code between forwards and the next forward draw
from the synchronised generator.

Only a module in training enters a region: in evaluation (and ``generate()`` in evaluation) no
generator is touched, and a region never entered ends with no effect. Nothing here issues a
collective. Covered are the CPU generator for CPU tensors and the CUDA generator of a CUDA
tensor's device; a traced or compiled call, fake and meta tensors, and CUDA graph capture are
left alone.
"""

from collections import OrderedDict
from typing import Hashable, Optional, Tuple

import torch
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import is_fake

__all__ = ["enter", "leave", "leave_and_enter", "resynchronise", "install"]

_MASK_64 = (1 << 64) - 1
# The kept states of this many regions, the most recently entered ones: enough for the
# recomputation of any block of the forwards whose backward has not run yet.
_KEPT_REGIONS = 1024
# (generator key, region seed) -> the synchronised state the region's end restores.
_kept_states: "OrderedDict[Tuple[Hashable, int], torch.Tensor]" = OrderedDict()
# A CUDA generator's offsets advance in multiples of 4; one step stands for the draw.
_CUDA_OFFSET_STEP = 4


def _mix(value: int) -> int:
    """splitmix64's finaliser: every bit of the result depends on every bit of `value`."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


def _generator_of(x) -> Tuple[Optional[torch.Generator], Optional[Hashable]]:
    """The default generator that dropout on `x` draws from, and a key naming it; (None, None)
    where the region's generators are left alone."""
    if not isinstance(x, torch.Tensor) or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None, None
    if type(x) is not torch.Tensor and is_fake(x):  # is_fake costs microseconds: plain tensors skip it
        return None, None
    device = x.device
    if device.type == "cpu":
        return torch.default_generator, "cpu"
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():  # a captured graph replays its own offsets
            return None, None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index], ("cuda", index)
    return None, None


def _draw(generator: torch.Generator, key: Hashable) -> int:
    """One number from the synchronised `generator`, the same on every rank, advancing it alike."""
    if key == "cpu":
        return int(torch.randint(0, 1 << 62, (), device="cpu", generator=generator))
    # A CUDA generator's state (seed, offset) is on the host: reading a drawn number back from
    # the device would wait for it, so the number is made from the state, and the offset moved
    # on as a draw moves it.
    offset = generator.get_offset()
    generator.set_offset(offset + _CUDA_OFFSET_STEP)
    return _mix(generator.initial_seed() ^ _mix(offset))


def _region_seed(draw: int, rank: int) -> int:
    # The CPU generator seeds its Mersenne Twister from the low 32 bits, CUDA's Philox from all
    # 64: both get bits that depend on the draw and the rank alike.
    return _mix(_mix(draw) ^ rank)


def _kept_state(generator: torch.Generator, key: Hashable) -> Optional[torch.Tensor]:
    """The synchronised state kept for the region `generator` is in; None outside regions."""
    name = (key, generator.initial_seed())
    kept = _kept_states.get(name)
    if kept is not None:
        _kept_states.move_to_end(name)  # a region in use is never the first forgotten
    return kept


def enter(x: torch.Tensor, group_name: str, training: bool) -> torch.Tensor:
    """`x` starts a region of the group `group_name`: a module in `training` draws inside it
    from a generator of this rank's own. Returns `x`."""
    if not training:
        return x
    generator, key = _generator_of(x)
    if generator is None or _kept_state(generator, key) is not None:
        return x  # already inside a region: it goes on
    draw = _draw(generator, key)
    seed = _region_seed(draw, c10d._resolve_process_group(group_name).rank())
    _kept_states[(key, seed)] = generator.get_state()
    while len(_kept_states) > _KEPT_REGIONS:
        _kept_states.popitem(last=False)
    generator.manual_seed(seed)
    return x


def leave(x: torch.Tensor) -> torch.Tensor:
    """`x` ends the region it was computed in (every rank holds it whole now): the generator
    of its device gets its synchronised state back. Outside a region, nothing changes. Returns `x`."""
    generator, key = _generator_of(x)
    if generator is not None:
        kept = _kept_state(generator, key)
        if kept is not None:
            generator.set_state(kept)
    return x


def leave_and_enter(x: torch.Tensor, group_name: str, training: bool) -> torch.Tensor:
    """`x` ends one region and starts another (a reduce-scatter: from a rank's own features to
    its own tokens). Returns `x`."""
    return enter(leave(x), group_name, training)


def resynchronise() -> None:
    """Ends any region left open on the CPU generator and on the CUDA generators."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    generators = [(torch.default_generator, "cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        generators += [(g, ("cuda", index)) for index, g in enumerate(torch.cuda.default_generators)]
    for generator, key in generators:
        kept = _kept_state(generator, key)
        if kept is not None:
            generator.set_state(kept)


def _resynchronise_hook(*_) -> None:
    resynchronise()


def install(model: torch.nn.Module) -> None:
    """Ends any open region before and after each forward of `model` (after one that raised too)."""
    model.register_forward_pre_hook(_resynchronise_hook)
    model.register_forward_hook(_resynchronise_hook, always_call=True)
