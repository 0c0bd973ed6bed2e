"""Shared assertions: bad input raises the named error, and opcheck over a list of cases."""

from torch.library import opcheck


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
