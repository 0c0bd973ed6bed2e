"""Module names folded into index ranges for the plan's printout.

A model of 32 identical blocks lists every layer 32 times; folded, `model.layers.0.mlp.up_proj`
to `model.layers.31.mlp.up_proj` print once as `model.layers.0-31.mlp.up_proj`. Only entries that
say the same thing fold: each entry carries the rest of its row, and names fold only where that
rest is equal, so a block planned differently keeps a line of its own.
"""

import re
from typing import Hashable, List, Sequence, Tuple

def _ranges(indices: List[int]) -> str:
    runs, start = [], indices[0]
    for previous, index in zip(indices, indices[1:] + [None]):
        if index != previous + 1:
            runs.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = index
    return ",".join(runs)


def _fold_at(entries: List[Tuple[str, int, Hashable]], position: int) -> List[Tuple[str, int, Hashable]]:
    """Entries folded where the path component at `position` is a plain index."""
    groups = {}  # (components before, components after, payload) -> [(index, count, name)]
    for serial, (name, count, payload) in enumerate(entries):
        parts = name.split(".")
        if position < len(parts) and parts[position].isdigit():
            key = (tuple(parts[:position]), tuple(parts[position + 1:]), payload)
            index = int(parts[position])
        else:
            key, index = (serial,), -1
        groups.setdefault(key, []).append((index, count, name, payload))
    folded = []
    for key, members in groups.items():  # dicts keep the order of each group's first member
        if len(members) == 1:
            folded += [(name, count, payload) for _, count, name, payload in members]
            continue
        indices = sorted({index for index, _, _, _ in members})
        name = ".".join(key[0] + (_ranges(indices),) + key[1])
        folded.append((name, sum(count for _, count, _, _ in members), key[2]))
    return folded


def fold(entries: Sequence[Tuple[str, Hashable]]) -> List[Tuple[str, int, Hashable]]:
    """(name, payload) pairs, in order, folded: (name with index ranges, how many it stands
    for, payload), in the order of each fold's first member. Nested indices (experts inside a
    block) fold first, then the blocks around them."""
    current = [(name, 1, payload) for name, payload in entries]
    depth = max((name.count(".") + 1 for name, _ in entries), default=0)
    for position in reversed(range(depth)):
        current = _fold_at(current, position)
    return current


def fold_names(names: Sequence[str]) -> List[str]:
    """Names alone folded (`a.0.w`, `a.1.w` -> `a.0-1.w`)."""
    return [name for name, _, _ in fold([(name, None) for name in names])]


def blocks(names: Sequence[str]) -> List[str]:
    """The runs of identical blocks a folded name list shows once, e.g. ["model.layers.0-31 (32)"]."""
    found = {}
    for name in names:
        for match in re.finditer(r"(?:^|(?<=\.))(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)+|\d+-\d+)(?=\.|$)", name):
            prefix = name[:match.start()] + match.group(1)
            count = sum(int(b) - int(a) + 1 if "-" in run else 1
                        for run in match.group(1).split(",") for a, _, b in [run.partition("-")])
            found.setdefault(prefix, count)
    return [f"{prefix} ({count})" for prefix, count in found.items()]
