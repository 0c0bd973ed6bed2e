import os
import sys

import pytest

# The helpers every test folder shares (multirank, hf_models, checks, ...) live in support/.
_SUPPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT_DIR not in sys.path:
    sys.path.insert(0, _SUPPORT_DIR)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    import torch

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
