"""The largest world size at which a plan splits every layer it can split at all."""

import warnings


def largest_world_size(make_plan, start: int, limit: int = 4096):
    """(world size, plan) for the largest world size, from `start` up to `limit`, at which the plan
    `make_plan(world_size)` splits every layer it can split at all: no layer held whole for having
    too few whole units (heads) for the ranks. Doubling, then halving the gap."""
    good, good_plan, bad = start, None, None
    n = max(start, 1) * 2
    while n <= limit and bad is None:
        found = _splits_everything(make_plan, n)
        if found is None:
            bad = n
        else:
            good, good_plan, n = n, found, n * 2
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        found = _splits_everything(make_plan, middle)
        if found is None:
            bad = middle
        else:
            good, good_plan = middle, found
    return good, good_plan


def _splits_everything(make_plan, world_size: int):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(world_size)
    except ValueError:
        return None
    return None if any(layer.reason == "too_few_units" for layer in plan.layers) else plan
