"""Each rank's random number generator states, saved with a checkpoint and restored by ``load``.

Dropout draws from torch's generator: inside a sharded region each rank draws its own masks
from a state the region seeds from the synchronised one (see region_generators), and Python's
and numpy's generators, or a generator a rank seeded itself, may be the rank's own; a resumed
run repeats the uninterrupted one only if every rank gets its generators back. ``save``
stores, for each rank ``r``, under ``rng/rank-<r>/<name>`` in that rank's own file (so
checksummed like every tensor, and each rank reads only its own):

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
"""

import math
import random
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch

from ..tensor_io import CheckpointCorruptError, full_selection

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


def _numpy_setter(values: List[float], where: str) -> Optional[Callable[[], None]]:
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
        return None  # nothing in this process can draw from it
    state = ("MT19937", numpy.array(words, dtype=numpy.uint32), int(pos), int(has_gauss), gauss)
    return lambda: numpy.random.set_state(state)


def _current_cuda_states() -> Optional[List[torch.Tensor]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_rng_state_all()


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

    python_key = key(rank, "python")
    if python_key in stored:
        setters.append(_python_setter(read(python_key).tolist(), f"load: {where!r}: {python_key!r}"))
    numpy_key = key(rank, "numpy")
    if numpy_key in stored:
        setter = _numpy_setter(read(numpy_key).tolist(), f"load: {where!r}: {numpy_key!r}")
        if setter is not None:
            setters.append(setter)
    cuda_key = key(rank, "cuda")
    if cuda_key in stored:
        cuda = read(cuda_key)
        current = _current_cuda_states()
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


def stored_tensor(files, stored: Dict[str, object], dtype_of) -> Callable[[str], torch.Tensor]:
    """``read(key)`` for ``restorer``: the whole stored tensor, its blocks verified."""
    def read(name: str) -> torch.Tensor:
        record = stored[name]
        selection = full_selection(record.shape)
        files.verify(name, selection)
        tensor = torch.empty(record.shape, dtype=dtype_of(record.dtype))
        files.fill(name, tensor, selection)
        return tensor
    return read
