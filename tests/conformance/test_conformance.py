"""The conformance matrix: every architecture of conformance_table at 2, 3 and 4 gloo ranks
against the unsharded model (logits, every gradient, collectives against the plan, clipping's
norm, the state after one step). `make test` runs the entries marked small (at 2 and 3 ranks, or the sizes they name);
`make conformance` runs everything (the `conformance_full` marker)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conformance_harness import judge, norm_agrees  # noqa: E402
from conformance_table import DEFECT_MODELS, IDIOM_MODELS, TABLE, check_named  # noqa: E402
from multirank import run_on_ranks  # noqa: E402

# Building, planning and checking a tiny model takes a few seconds per rank; 4 ranks share 2 cores.
TIMEOUT = 300


def _params():
    for arch in TABLE:
        for world_size in arch.world_sizes:
            marks = [pytest.mark.conformance]
            if not arch.small_at(world_size):
                marks.append(pytest.mark.conformance_full)
            xfail = arch.xfail_at(world_size)
            if xfail is not None:
                marks.append(pytest.mark.xfail(strict=True, raises=xfail.symptom, reason=xfail.reason))
            yield pytest.param(arch.name, world_size, marks=marks, id=f"{arch.name}-{world_size}")


@pytest.mark.parametrize("name,world_size", list(_params()))
def test_conforms(name, world_size):
    reports = run_on_ranks(check_named, world_size, name, timeout=TIMEOUT)
    judge(next(a for a in TABLE if a.name == name), world_size, reports)


def test_table_is_wide_enough():
    """At least 25 Hugging Face architectures, and every defect-class and idiom model of our own
    in the small matrix that each make test runs."""
    hf = [a for a in TABLE if not a.name.startswith("own_")]
    assert len(hf) >= 25, len(hf)
    small = {a.name for a in TABLE if a.small}
    assert DEFECT_MODELS <= small, DEFECT_MODELS - small
    assert IDIOM_MODELS <= small, IDIOM_MODELS - small


def test_norm_judged_against_torch_and_the_fp64_sum():
    # A large fp32 norm (Inkling 2's gradients, 2.6e4): torch's own sum is 1.4e-4 off the fp64 sum,
    # autoshard's 5.3e-5; both round from the same gradients, equal to 1.3e-6.
    assert norm_agrees(26400.783203125, 26398.349609375, 26402.18580217512)
    # A norm further from the truth than torch's rounding explains is wrong, as is one off by 1e-3.
    assert not norm_agrees(26390.0, 26398.349609375, 26402.18580217512)
    assert not norm_agrees(1.001, 1.0, 1.0)
    assert norm_agrees(1.000001, 1.0, 1.0)
