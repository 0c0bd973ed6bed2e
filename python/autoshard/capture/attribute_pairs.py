"""Attributes that must be made local together.

A module may spell a size from two attributes at once: the query heads written as
`num_kv_heads * (num_heads // num_kv_heads)`. Made local one at a time, neither changes that
size (3 * (4 // 3) is still 3), so the one-at-a-time search of local_attributes._choose finds no
progress and keeps both global. Here, when that search leaves the trace short of the
prediction, pairs of the remaining candidates are tried together.
"""

from itertools import combinations
from typing import Callable, Dict, List, Tuple

# Pairs are tried among at most this many candidates (a module's integer attributes equal to
# one of the region's sizes: a handful).
MAX_CANDIDATES = 12


def widen_by_pairs(candidates, chosen: Dict[str, int], current: List[float],
                   progress: Callable[[Dict[str, int]], List[float]]) -> Tuple[Dict[str, int], List[float]]:
    """`chosen` grown by the first pair of candidates that, made local together, lets the
    trace match further on some rank and no less far on any (repeated while one does)."""
    improved = True
    while improved and any(p != float("inf") for p in current):
        improved = False
        left = [attr for attr in candidates if attr not in chosen][:MAX_CANDIDATES]
        for a, b in combinations(left, 2):
            trial = progress({**chosen, a: 0, b: 0})
            if all(t >= c for t, c in zip(trial, current)) and any(t > c for t, c in zip(trial, current)):
                chosen = {**chosen, a: 0, b: 0}
                current, improved = trial, True
                break
    return chosen, current
