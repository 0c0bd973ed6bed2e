"""What the ranks agree on before ``save`` returns: that the save may start (the same path on
every rank, no rank with an error, ``path`` free), and which rank writes each piece.

Each piece is written once: a tensor held whole by every rank (a replicated parameter) or a
shard held by several data-parallel replicas is written by one of its holders, chosen to
balance the bytes each rank writes. Choosing needs every rank's list of pieces, which does not
change from one save of a training run to the next; so the ranks first exchange a fixed-size
summary (a digest of their pieces and of the path, the agreement each last reached, and their
error and existence flags) in one collective, and exchange the lists themselves only when a
digest changed or something has to be reported. Every rank decides from the same gathered
summaries, so all take the same branch. A rank that has no agreement cached (or one from
other pieces) makes all of them exchange again. The summaries travel while the caller copies
its tensors (by the last agreement, when its own pieces have not changed).
"""

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from . import manifest as mf
from .claim import describe_owner
from .contents import Held
from .pending import WRITER, CheckpointGroup, CheckpointSaveError

_ERROR, _EXISTS, _CLAIMED = 1, 2, 4  # summary flags


@dataclass(frozen=True)
class Agreement:
    writer: Dict[tuple, int]  # (key, repr(runs)) -> the rank that writes that piece
    records: Dict[str, mf.TensorRecord]  # the manifest's tensors (never changed once made)


def assign_writers(described: List[List[tuple]]) -> Dict[tuple, int]:
    """(key, runs as a tuple) -> the rank that writes that piece: the holder that has been given
    the fewest bytes so far (the same answer on every rank)."""
    holders: Dict[tuple, List[int]] = {}
    sizes: Dict[tuple, int] = {}
    for rank, items in enumerate(described):
        for key, dtype, shape, runs in items:
            piece = (key, repr(runs))
            holders.setdefault(piece, []).append(rank)
            volume = math.prod(sum(length for _, length in dim_runs) for dim_runs in runs)
            sizes[piece] = volume * torch.empty((), dtype=mf.dtype_of(dtype)).element_size()
    load = [0] * len(described)
    writer = {}
    for piece, ranks in holders.items():
        chosen = min(ranks, key=lambda r: (load[r], r))
        writer[piece] = chosen
        load[chosen] += sizes[piece]
    return writer


def tensor_records(described: List[List[tuple]], writer: Dict[tuple, int]) -> Dict[str, mf.TensorRecord]:
    records: Dict[str, mf.TensorRecord] = {}
    for rank, items in enumerate(described):
        for key, dtype, shape, runs in items:
            record = records.get(key)
            if record is None:
                record = records[key] = mf.TensorRecord(shape, dtype, [])
            elif record.shape != shape or record.dtype != dtype:
                raise ValueError(f"save: the ranks disagree on {key!r}: global shape {record.shape} and dtype "
                                 f"{record.dtype} on one rank, {shape} and {dtype} on rank {rank}")
            if writer[(key, repr(runs))] == rank:
                record.pieces.append(mf.StoredPiece(mf.rank_file(rank), runs))
    return records


def claimed_message(path: str, detail: str) -> str:
    return (f"save: another save to {path!r} is in progress, or one that died left its work behind: {detail}. "
            f"Nothing was written. If no job is saving there, delete that directory (CheckpointManager removes "
            f"the leftovers of dead saves when it starts)")


def _ints(digest: bytes) -> List[int]:
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, len(digest), 8)]


class PendingAgreement:
    """An agreement whose summaries are being gathered (one collective, started on construction:
    every rank makes one, then calls ``finish()``); ``guess`` is the last agreement when this
    rank's pieces are the same as then (the one ``finish`` returns unless another rank's
    changed), to work with meanwhile."""

    def __init__(self, comm: CheckpointGroup, path: str, held: List[Held], error: Optional[str],
                 exists: bool, claimed: bool):
        self.comm, self.path, self.error = comm, path, error
        # (key, dtype, global shape, runs) of each held tensor: what the ranks exchange to plan writes.
        self.described = [(h.key, mf.dtype_name(h.tensor.dtype), list(h.selection.shape), h.selection.to_json()["runs"])
                          for h in held]
        self.pieces = hashlib.blake2b(repr(self.described).encode(), digest_size=16).digest()
        last = WRITER.last_agreement
        self.guess = last[1] if last is not None and last[2] == self.pieces else None
        flags = (_ERROR if error is not None else 0) | (_EXISTS if exists else 0) | (_CLAIMED if claimed else 0)
        last_id = last[0] if last is not None else bytes(16)
        path_digest = hashlib.blake2b(path.encode(), digest_size=8).digest()
        self._gathered = comm.start_all_gather_ints(_ints(self.pieces) + _ints(path_digest) + _ints(last_id) + [flags])

    def finish(self) -> Agreement:
        """The agreement for this save, on every rank; raises on every rank what stops it
        (``error`` is this rank's; ``exists`` and ``claimed`` count on rank 0 only)."""
        comm, path = self.comm, self.path
        summaries = self._gathered()
        same_path = len({s[2] for s in summaries}) == 1
        if not same_path or any(s[5] & _ERROR for s in summaries):
            _exchange(comm, path, self.described, self.error)  # raises, naming every rank's error
        if summaries[0][5] & _CLAIMED and not summaries[0][5] & _EXISTS:
            partial = path + mf.PARTIAL_SUFFIX
            raise CheckpointSaveError(claimed_message(path, f"{partial!r} exists: {describe_owner(partial)}"))
        if summaries[0][5] & _EXISTS:
            raise FileExistsError(f"save: {path!r} already exists; a checkpoint is never overwritten, "
                                  "choose a new path or delete the old one first")
        agreement_id = hashlib.blake2b(repr([s[:2] for s in summaries]).encode(), digest_size=16).digest()
        last = WRITER.last_agreement
        if last is not None and all(s[3:5] == _ints(agreement_id) for s in summaries):
            return last[1]
        WRITER.last_agreement = None
        everyone = _exchange(comm, path, self.described, self.error)
        writer = assign_writers(everyone)
        agreement = Agreement(writer, tensor_records(everyone, writer))  # on every rank: a mismatch raises on all
        WRITER.last_agreement = (agreement_id, agreement, self.pieces)
        return agreement


def _exchange(comm: CheckpointGroup, path: str, described: List[tuple], error: Optional[str]) -> List[List[tuple]]:
    """Every rank's pieces; raises (on every rank) the errors of any rank, and a path that differs."""
    reports = comm.all_gather((error, described, path))
    errors = [e for e, _, _ in reports if e is not None]
    paths = sorted({p for _, _, p in reports})
    if len(paths) > 1:
        errors.append(f"every rank must pass the same path, got {paths}")
    if errors:
        raise ValueError("; ".join(errors))
    return [d for _, d, _ in reports]
