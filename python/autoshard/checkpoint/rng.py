"""What each rank saves for itself, in its own file (so checksummed like every tensor, and each
rank reads only its own): its random number generator states, restored by ``load``, and its
per-rank ``extra``.

Dropout draws from torch's generator: inside a sharded region each rank draws its own masks
from a state the region seeds from the synchronised one (see region_generators), and Python's
and numpy's generators, or a generator a rank seeded itself, may be the rank's own; a resumed
run repeats the uninterrupted one only if every rank gets its generators back. ``save``
stores, for each rank ``r``, under ``rng/rank-<r>/<name>``:

- ``torch``: ``torch.get_rng_state()`` (uint8);
- ``cuda``: ``torch.cuda.get_rng_state_all()`` stacked (uint8, one row per device), when CUDA
  has been initialised in the process;
- ``python``: ``random.getstate()`` as float64 (every number in it is exact there):
  ``[version, 625 state words, has_gauss, gauss_next]``;
- ``numpy``: ``numpy.random.get_state()`` (the legacy global generator) as float64:
  ``[624 key words, pos, has_gauss, cached_gaussian]``, when numpy has been imported.

``load`` restores them when the checkpoint was saved by as many ranks as load it (rank ``r``
gets rank ``r``'s); on another world size no rank's states fit, so none is restored and a
warning says so.

Per-rank ``extra`` is a JSON-able value each rank saves for itself (its data loader's position,
its own counters) with ``save(..., rank_extra=...)``, returned to the same rank by
``load(..., return_rank_extra=True)``. Rank ``r``'s value is stored as its JSON text (UTF-8
bytes, uint8) under ``rank_extra/rank-<r>``. It belongs to a rank of one world size: loaded by
another number of ranks, no rank's value fits, and asking for it is refused before anything is
changed.
"""

import json
import math
import random
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from ..tensor_io import CheckpointCorruptError, json_input
from .contents import json_value
from .manifest import MAX_VALUE_DEPTH

PREFIX = "rng/"
_PYTHON_WORDS = 625  # the Mersenne Twister's 624 words and its position
_NUMPY_WORDS = 624


def key(rank: int, name: str) -> str:
    return f"{PREFIX}rank-{rank:05d}/{name}"


def _python_state() -> torch.Tensor:
    version, words, gauss = random.getstate()
    return torch.tensor([version, *words, gauss is not None, 0.0 if gauss is None else gauss], dtype=torch.float64)


def _numpy_state() -> Optional[torch.Tensor]:
    numpy = sys.modules.get("numpy")  # not imported: the process draws nothing from it
    if numpy is None:
        return None
    kind, words, pos, has_gauss, gauss = numpy.random.get_state(legacy=True)
    if kind != "MT19937":
        return None
    return torch.tensor([*words.tolist(), pos, has_gauss, gauss], dtype=torch.float64)


def capture() -> Dict[str, torch.Tensor]:
    """This process's generator states (copies), by name; ``save`` takes them before anything
    else, and stores them under ``key(rank, name)``."""
    states = {"torch": torch.get_rng_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    numpy_state = _numpy_state()
    if numpy_state is not None:
        states["numpy"] = numpy_state
    return states


def _words(values: List[float], count: int, where: str) -> List[int]:
    bad = [v for v in values[:count] if not (math.isfinite(v) and v == int(v) and 0 <= v < 2 ** 32)]
    if bad:
        raise CheckpointCorruptError(f"{where}: the generator's state words must be whole numbers in [0, 2**32), "
                                     f"got {bad[0]!r}")
    return [int(v) for v in values[:count]]


def _python_setter(values: List[float], where: str) -> Callable[[], None]:
    if len(values) != _PYTHON_WORDS + 3 or values[0] != 3:
        raise CheckpointCorruptError(f"{where}: expected [3, {_PYTHON_WORDS} words, has_gauss, gauss_next] "
                                     f"({_PYTHON_WORDS + 3} numbers), got {len(values)} numbers starting {values[:1]}")
    words = _words(values[1:], _PYTHON_WORDS, where)
    has_gauss, gauss = values[-2], values[-1]
    if has_gauss not in (0.0, 1.0) or not math.isfinite(gauss) or not 0 <= words[-1] <= 624:
        raise CheckpointCorruptError(f"{where}: has_gauss must be 0 or 1, gauss_next finite and the position "
                                     f"in [0, 624], got {has_gauss!r}, {gauss!r}, {words[-1]!r}")
    state = (3, tuple(words), gauss if has_gauss else None)
    return lambda: random.setstate(state)


def _numpy_setter(values: List[float], where: str) -> Callable[[], None]:
    if len(values) != _NUMPY_WORDS + 3:
        raise CheckpointCorruptError(f"{where}: expected [{_NUMPY_WORDS} words, pos, has_gauss, cached_gaussian] "
                                     f"({_NUMPY_WORDS + 3} numbers), got {len(values)}")
    words = _words(values, _NUMPY_WORDS, where)
    pos, has_gauss, gauss = values[-3:]
    if not (pos == int(pos) and 0 <= pos <= _NUMPY_WORDS) or has_gauss not in (0.0, 1.0) or not math.isfinite(gauss):
        raise CheckpointCorruptError(f"{where}: pos must be a whole number in [0, {_NUMPY_WORDS}], has_gauss 0 or "
                                     f"1 and cached_gaussian finite, got {pos!r}, {has_gauss!r}, {gauss!r}")
    try:
        import numpy  # noqa: PLC0415  (optional: without it nothing in this process draws from numpy)
    except ImportError:
        return lambda: None  # nothing in this process can draw from it
    state = ("MT19937", numpy.array(words, dtype=numpy.uint32), int(pos), int(has_gauss), gauss)
    return lambda: numpy.random.set_state(state)


def restorer(stored: Dict[str, object], rank: int, world_size: int, saved_world_size: int,
             read: Callable[[str], torch.Tensor], where: str) -> Callable[[], None]:
    """Reads and checks this rank's saved states (``read(key)`` returns a stored tensor, its
    blocks verified) and returns what restores them, to be called once nothing can fail any
    more. ``stored`` is the manifest's tensors."""
    names = [k for k in stored if k.startswith(PREFIX)]
    if not names:
        return lambda: None  # saved before checkpoints held them
    if saved_world_size != world_size:
        warnings.warn(f"load: {where!r} was saved by {saved_world_size} ranks and is loaded by {world_size}: the "
                      "ranks' random number generator states saved with it were not restored (no rank's fit "
                      "another world size), so dropout and other random draws will not repeat those of the "
                      "saved run", RuntimeWarning, stacklevel=4)
        return lambda: None
    setters = []
    torch_key = key(rank, "torch")
    if torch_key not in stored:
        raise CheckpointCorruptError(f"load: {where!r} holds random number generator states but none of rank {rank} "
                                     f"({torch_key!r})")
    state = read(torch_key)
    expected = torch.get_rng_state()
    if state.dtype != torch.uint8 or state.shape != expected.shape:
        raise CheckpointCorruptError(f"load: {where!r}: {torch_key!r} must be uint8 of shape {list(expected.shape)}, "
                                     f"got {state.dtype} of shape {list(state.shape)}")
    setters.append(lambda: torch.set_rng_state(state))

    for name, make_setter in (("python", _python_setter), ("numpy", _numpy_setter)):
        state_key = key(rank, name)
        if state_key in stored:
            setters.append(make_setter(read(state_key).tolist(), f"load: {where!r}: {state_key!r}"))
    cuda_key = key(rank, "cuda")
    if cuda_key in stored:
        cuda = read(cuda_key)
        current = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        if current is None or cuda.dim() != 2 or cuda.shape[0] != len(current) or cuda.dtype != torch.uint8:
            present = 0 if current is None else len(current)
            warnings.warn(f"load: {where!r} holds the CUDA generator states of {cuda.shape[0] if cuda.dim() else 0} "
                          f"devices for rank {rank}, this process sees {present}: the CUDA states were not restored",
                          RuntimeWarning, stacklevel=4)
        else:
            if cuda.shape[1] != current[0].numel():
                raise CheckpointCorruptError(f"load: {where!r}: {cuda_key!r} must hold {current[0].numel()} bytes "
                                             f"per device, got {cuda.shape[1]}")
            rows = [row.clone() for row in cuda]
            setters.append(lambda: torch.cuda.set_rng_state_all(rows))

    def restore():
        for setter in setters:
            setter()
    return restore


EXTRA_PREFIX = "rank_extra/"


def extra_key(rank: int) -> str:
    return f"{EXTRA_PREFIX}rank-{rank:05d}"


def encode_extra(value: Any) -> torch.Tensor:
    """``value`` (checked and copied as ``extra`` is) as its JSON text in a uint8 tensor."""
    value = json_value(value, "rank_extra")
    return torch.frombuffer(bytearray(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def read_extra(stored: Dict[str, object], rank: int, world_size: int, saved_world_size: int,
               read_tensor: Callable[[str], torch.Tensor], where: str) -> Optional[Any]:
    """This rank's saved value (None when the checkpoint holds none for it); raises ValueError
    when the checkpoint holds per-rank values of another world size. ``stored`` is the
    manifest's tensors; ``read_tensor(key)`` returns a stored tensor, its blocks verified."""
    if not any(k.startswith(EXTRA_PREFIX) for k in stored):
        return None
    if saved_world_size != world_size:
        raise ValueError(f"load: {where!r} holds per-rank extra saved by {saved_world_size} ranks, and {world_size} "
                         "ranks load it: no rank's value belongs to a rank of this job (load with "
                         "return_rank_extra=False to load the rest)")
    name = extra_key(rank)
    record = stored.get(name)
    if record is None:
        return None  # this rank saved none
    if record.dtype != "uint8" or len(record.shape) != 1 or record.shape[0] > json_input.MAX_JSON_BYTES:
        raise CheckpointCorruptError(f"load: {where!r}: {name!r} must be uint8 JSON text of at most "
                                     f"{json_input.MAX_JSON_BYTES} bytes, got {record.dtype} of shape {record.shape}")
    data = read_tensor(name).numpy().tobytes()
    try:
        return json_input.loads(data, MAX_VALUE_DEPTH, json_input.MAX_JSON_VALUES // 2)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"load: {where!r}: {name!r} is not the JSON text a save writes: {e}") from None
