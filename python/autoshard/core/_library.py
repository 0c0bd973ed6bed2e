"""Loads the compiled library so that ``torch.ops.autoshard.*`` exist."""

import torch

_REBUILD = "rebuild it with `pip install --no-build-isolation -e .` (or `make build`) in the autoshard checkout"


def load() -> None:
    # Imported here, not at the top, so that a missing or stale build is named with its remedy.
    try:
        from .. import _build_info  # noqa: PLC0415  (written by setup.py; absent before a build)
    except ImportError:
        raise ImportError(f"autoshard's compiled library is missing: {_REBUILD}") from None
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"autoshard's compiled library was built for torch {_build_info.TORCH_VERSION}, "
            f"but torch {torch.__version__} is installed: {_REBUILD}"
        )
    try:
        from .. import _C  # noqa: F401, PLC0415  (loading it registers the ops)
    except ImportError as error:
        raise ImportError(f"autoshard's compiled library failed to load ({error}): {_REBUILD}") from error
