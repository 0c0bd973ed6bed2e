"""Shared assertions: bad input raises the named error, opcheck over a list of cases, and a
parallelized model's gradients against the unsharded model's."""

import torch
from torch.library import opcheck

from autoshard.core.parallel_state import state_of


def expect_errors(cases):
    """Runs each (call, error type, words) case: the call must raise that error with every
    word in its message. Returns the error type names, in order."""
    raised = []
    for call, error, words in cases:
        try:
            call()
        except error as e:
            missing = [w for w in words if w not in str(e)]
            assert not missing, (missing, str(e))
            raised.append(type(e).__name__)
        else:
            raise AssertionError(f"no {error.__name__} for case {len(raised)}")
    return raised


def error_text(call, error=ValueError) -> str:
    """The message `call` raises as `error`, or "no error"."""
    try:
        call()
    except error as e:
        return str(e)
    return "no error"


def opcheck_all(make_cases, *args) -> int:
    """Runs torch.library.opcheck on every (op, args) case of `make_cases(*args)` (built where
    it runs: on each rank, under run_on_ranks); returns how many cases there were."""
    cases = make_cases(*args)
    for op, op_args in cases:
        opcheck(op, op_args)
    return len(cases)


def worst_gradient_difference(model, reference) -> float:
    """The largest difference between a parallelized model's gradients and this rank's piece of
    the unsharded `reference`'s (by each sharded parameter's ShardSpec), over every parameter."""
    shards = state_of(model).shards()
    params = dict(model.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, ref in reference.named_parameters():
        spec = shards[id(params[name])][0] if id(params[name]) in shards else None
        piece = ref.grad if spec is None else torch.cat(
            [ref.grad.narrow(spec.dim, start, length) for start, length in spec.local_ranges()], spec.dim)
        worst = max(worst, (params[name].grad - piece).abs().max().item())
    return worst


def seeded_twins(make):
    """Two float64 copies of the model `make()` builds, with the same weights: one to parallelize,
    one to compare it with."""
    torch.manual_seed(0)
    model, reference = make().double(), make().double()
    reference.load_state_dict(model.state_dict())
    return model, reference
