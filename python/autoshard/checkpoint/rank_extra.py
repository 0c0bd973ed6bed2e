"""Per-rank ``extra``: a JSON-able value each rank saves for itself (its data loader's position,
its own counters) with ``save(..., rank_extra=...)``, returned to the same rank by
``load(..., return_rank_extra=True)``.

Rank ``r``'s value is stored as its JSON text (UTF-8 bytes, uint8) under
``rank_extra/rank-<r>`` in that rank's own file, so it is checksummed like every tensor and
each rank reads only its own. It belongs to a rank of one world size: loaded by another number
of ranks, no rank's value fits, and asking for it is refused before anything is changed.
"""

import json
from typing import Any, Callable, Dict, Optional

import torch

from ..tensor_io import CheckpointCorruptError, json_input
from .contents import json_value
from .manifest import MAX_VALUE_DEPTH

PREFIX = "rank_extra/"


def key(rank: int) -> str:
    return f"{PREFIX}rank-{rank:05d}"


def encode(value: Any) -> torch.Tensor:
    """``value`` (checked and copied as ``extra`` is) as its JSON text in a uint8 tensor."""
    value = json_value(value, "rank_extra")
    return torch.frombuffer(bytearray(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def read(stored: Dict[str, object], rank: int, world_size: int, saved_world_size: int,
         read_tensor: Callable[[str], torch.Tensor], where: str) -> Optional[Any]:
    """This rank's saved value (None when the checkpoint holds none for it); raises ValueError
    when the checkpoint holds per-rank values of another world size. ``stored`` is the
    manifest's tensors; ``read_tensor(key)`` returns a stored tensor, its blocks verified."""
    if not any(k.startswith(PREFIX) for k in stored):
        return None
    if saved_world_size != world_size:
        raise ValueError(f"load: {where!r} holds per-rank extra saved by {saved_world_size} ranks, and {world_size} "
                         "ranks load it: no rank's value belongs to a rank of this job (load with "
                         "return_rank_extra=False to load the rest)")
    name = key(rank)
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
