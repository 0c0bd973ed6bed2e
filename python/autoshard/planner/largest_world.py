"""The largest world size at which a plan splits every layer it can split at all."""

import warnings


def largest_world_size(make_plan, start: int, limit: int = 4096):
    """(world size, plan) for the largest world size, from `start` up to `limit`, at which the plan
    `make_plan(world_size)` splits every layer it can split at all: no layer held whole for having
    too few whole units (heads) for the ranks. Doubling, then halving the gap."""
    good, good_plan = start, None
    bad = None
    n = max(start, 1) * 2
    while n <= limit:
        found = _splits_everything(make_plan, n)
        if found is None:
            bad = n
            break
        good, good_plan = n, found
        n *= 2
    if bad is None:
        return good, good_plan
    while bad - good > 1:
        middle = (good + bad) // 2
        found = _splits_everything(make_plan, middle)
        if found is None:
            bad = middle
        else:
            good, good_plan = middle, found
    return good, good_plan


def _too_few_units(plan) -> bool:
    """Whether some layer is held whole for having fewer whole units than ranks."""
    return any(layer.reason == "too_few_units" for layer in plan.layers)


def _splits_everything(make_plan, world_size: int):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(world_size)
    except ValueError:
        return None
    return None if _too_few_units(plan) else plan
