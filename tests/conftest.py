import os
import sys

import pytest

# The helpers every test folder shares (multirank, hf_models, checks, ...) live in support/.
_SUPPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT_DIR not in sys.path:
    sys.path.insert(0, _SUPPORT_DIR)


def pytest_addoption(parser):
    parser.addoption("--conformance-full", action="store_true", default=False,
                     help="run the full conformance matrix (tests marked conformance_full), as make conformance does")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "conformance: an architecture of the conformance matrix (tests/conformance)")
    config.addinivalue_line("markers", "conformance_full: only in the full conformance matrix; deselected unless "
                                       "--conformance-full is given (make conformance)")


def pytest_collection_modifyitems(config, items):
    import torch

    if not config.getoption("--conformance-full"):
        # The full matrix takes minutes; every make test runs its small part only.
        kept = [item for item in items if "conformance_full" not in item.keywords]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if "conformance_full" in item.keywords])
            items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    # Only stop pools if some test actually started them.
    for name in ("multirank", "tests.multirank"):
        module = sys.modules.get(name)
        if module is not None:
            module.shutdown_pools()
