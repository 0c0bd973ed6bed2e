"""The one test for Hugging Face's Conv1D (GPT-2's Linear, its weight stored as [in, out]),
shared by the layers that shard it and the planner that plans it, so that both accept the
same modules."""

import sys

from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a transformers Conv1D. A Conv1D instance implies transformers is
    imported, so this never imports it."""
    for module_name in ("transformers.pytorch_utils", "transformers.modeling_utils"):
        conv1d = getattr(sys.modules.get(module_name), "Conv1D", None)
        if isinstance(conv1d, type) and isinstance(module, conv1d):
            return True
    return False
