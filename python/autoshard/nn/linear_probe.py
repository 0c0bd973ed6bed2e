"""Whether an nn.Linear subclass computes F.linear, probed on small layers of its own."""

from typing import Dict, Optional

import torch
from torch import nn


_COMPUTES_LINEAR: Dict[tuple, bool] = {}
# nn.Linear's own attributes: the probe has its own sizes, and training does not change F.linear.
_LINEAR_ATTRIBUTES = ("in_features", "out_features", "training")
_PLAIN = (int, float, str, bool, type(None))


def _instance_state(module: Optional[nn.Module]):
    """The plain attributes a subclass's forward may read from `module` beyond nn.Linear's, as
    a sorted tuple; None where the module holds more than nn.Linear's weight and bias and such
    attributes (a buffer, a submodule, a tensor or object attribute), which a probe of the
    class cannot stand for."""
    if module is None:
        return ()
    if set(module._parameters) - {"weight", "bias"} or module._buffers or module._modules:
        return None
    found = []
    for key, value in vars(module).items():
        if key.startswith("_") or key in _LINEAR_ATTRIBUTES:
            continue
        if not isinstance(value, _PLAIN):
            return None
        found.append((key, value))
    return tuple(sorted(found))


def computes_linear(cls: type, module: Optional[nn.Module] = None) -> bool:
    """Whether the nn.Linear subclass `cls` (for `module`, an instance of it, with the plain
    attributes that instance holds) computes F.linear: its own forward, if it has one, checked
    once per class and attributes on small float64 layers of its own (with and without bias,
    inputs of 1 to 3 dimensions) against F.linear. A class whose __init__ is not nn.Linear's,
    an instance holding more than plain attributes, or one that does anything else, is not
    taken for a Linear: its ops are followed one by one."""
    if cls.forward is nn.Linear.forward:
        return True
    state = _instance_state(module)
    if state is None or cls.__init__ is not nn.Linear.__init__:
        return False
    key = (cls, state)
    known = _COMPUTES_LINEAR.get(key)
    if known is not None:
        return known
    same = False
    generator = torch.Generator().manual_seed(0)
    # Outside any mode a capture or a dry run has on: this is a check, not the model's call.
    with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        try:
            same = True
            for bias in (True, False):
                layer = cls(5, 3, bias=bias, device="cpu", dtype=torch.float64)
                for attr, value in state:  # a scale set on the instance after its class's __init__
                    setattr(layer, attr, value)
                with torch.no_grad():
                    for p in layer.parameters():
                        p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
                for shape in ((5,), (4, 5), (2, 4, 5)):
                    x = torch.randn(shape, generator=generator, dtype=torch.float64)
                    got = cls.forward(layer, x)
                    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                    same = same and isinstance(got, torch.Tensor) and got.shape == want.shape and \
                        bool(torch.allclose(got, want, rtol=1e-12, atol=1e-12))
        except Exception:
            same = False
    _COMPUTES_LINEAR[key] = same
    return same
