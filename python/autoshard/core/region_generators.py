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

- where it starts (``enter``), the synchronised generator's state is kept, and the generator is
  seeded from that state and the rank in the region's group, so that ranks draw independent
  masks there; nothing is drawn from the synchronised generator to make the seed;
- where it ends (``leave``), the kept state comes back: the draws inside, however many, leave
  no trace on the synchronised generator. A region in which something was drawn then advances
  the synchronised generator by one number, alike on every rank, so that the next region (and
  the next step) is seeded from another state and draws other masks than the last; a region in
  which nothing was drawn (no dropout, or a dropout of probability 0) leaves it exactly as it
  found it, so a seeded run's later draws (sampling in ``generate()``, a shuffle) are the
  unsharded model's.

Only a module in training enters a region: in evaluation (and ``generate()`` in evaluation) no
generator is touched, and a region never entered ends with no effect. Nothing here issues a
collective. Covered are the CPU generator for CPU tensors and the CUDA generator of a CUDA
tensor's device; a traced or compiled call, fake and meta tensors, and CUDA graph capture are
left alone.
"""

from collections import OrderedDict
from typing import Hashable, Optional, Tuple

import hashlib

import torch
import torch.distributed.distributed_c10d as c10d
from torch._subclasses.fake_tensor import is_fake

__all__ = ["enter", "leave", "leave_and_enter", "resynchronise", "install"]

_MASK_64 = (1 << 64) - 1
# The kept states of this many regions, the most recently entered ones: enough for the
# recomputation of any block of the forwards whose backward has not run yet.
_KEPT_REGIONS = 1024
# (generator key, region seed) -> the synchronised state the region's end restores, and the
# region generator's state before anything was drawn inside (None for CUDA: its offset says).
_kept_states: "OrderedDict[Tuple[Hashable, int], Tuple[torch.Tensor, Optional[torch.Tensor]]]" = OrderedDict()
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


def _state_number(generator: torch.Generator, key: Hashable) -> int:
    """A number read from the synchronised `generator`'s state, the same on every rank, that
    differs between states; reading it draws nothing."""
    if key == "cpu":
        digest = hashlib.blake2b(generator.get_state().numpy().tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little")
    # A CUDA generator's state (seed, offset) is on the host.
    return _mix(generator.initial_seed() ^ _mix(generator.get_offset()))


def _advance(generator: torch.Generator, key: Hashable) -> None:
    """Moves the synchronised `generator` on by one draw, alike on every rank."""
    if key == "cpu":
        torch.randint(0, 1 << 62, (), device="cpu", generator=generator)
    else:  # no kernel, no wait: a CUDA generator's offsets advance in multiples of 4
        generator.set_offset(generator.get_offset() + _CUDA_OFFSET_STEP)


def _drew(generator: torch.Generator, key: Hashable, fresh: Optional[torch.Tensor]) -> bool:
    """Whether anything was drawn from the region generator `generator` since it was seeded."""
    if key == "cpu":
        return not torch.equal(generator.get_state(), fresh)
    return generator.get_offset() != 0  # seeding sets the offset to 0


def _region_seed(number: int, rank: int) -> int:
    # The CPU generator seeds its Mersenne Twister from the low 32 bits, CUDA's Philox from all
    # 64: both get bits that depend on the synchronised state and the rank alike.
    return _mix(_mix(number) ^ rank)


def _kept_state(generator: torch.Generator, key: Hashable):
    """(the synchronised state kept for the region `generator` is in, the region generator's
    state when it was seeded); None outside regions."""
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
    seed = _region_seed(_state_number(generator, key), c10d._resolve_process_group(group_name).rank())
    kept = generator.get_state()
    generator.manual_seed(seed)
    _kept_states[(key, seed)] = (kept, generator.get_state() if key == "cpu" else None)
    while len(_kept_states) > _KEPT_REGIONS:
        _kept_states.popitem(last=False)
    return x


def _end(generator: torch.Generator, key: Hashable) -> None:
    kept = _kept_state(generator, key)
    if kept is not None:
        synchronised, fresh = kept
        drew = _drew(generator, key, fresh)
        generator.set_state(synchronised)
        if drew:
            _advance(generator, key)


def leave(x: torch.Tensor) -> torch.Tensor:
    """`x` ends the region it was computed in (every rank holds it whole now): the generator
    of its device gets its synchronised state back, moved on by one draw if anything was drawn
    inside. Outside a region, nothing changes. Returns `x`."""
    generator, key = _generator_of(x)
    if generator is not None:
        _end(generator, key)
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
        _end(generator, key)


def install(model: torch.nn.Module) -> None:
    """Ends any open region before and after each forward of `model` (after one that raised too)."""
    model.register_forward_pre_hook(lambda *_: resynchronise())
    model.register_forward_hook(lambda *_: resynchronise(), always_call=True)
