"""Shared assertions for bad-input tests."""


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
