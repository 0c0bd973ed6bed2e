"""A LayerNorm over features split by heads across the ranks (ESM-C's q_norm and k_norm, which
normalise every head's features of q_proj's output together).

Each rank holds its heads' features and the matching parts of the weight and bias. The mean
and the variance need every rank's features: each rank's sum is all-reduced in forward
(reduce_from_parallel) for the mean, then its sum of squared deviations from that mean for the
variance, two passes as torch's own LayerNorm makes (no E[x^2] - E[x]^2 cancellation). The mean
and the scale rsqrt(var + eps) are then the same on every rank, and read by this rank's
features only, so their gradients are partial on each rank: copy_to_parallel sums each in
backward. What reaches each rank's features, weight and bias is then exactly the unsharded
norm's gradient for them.
"""

from typing import Optional

import torch
from torch import nn

from ..core import comm
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec


def check_eps(owner: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{owner}: eps must be a non-negative float, got {eps!r}")
    return float(eps)


def take_parameters(module: nn.Module, spec: ShardSpec, **full: Optional[torch.Tensor]) -> None:
    """Gives `module` this rank's part (`spec`) of each tensor of `full` (None: no such
    parameter) as its parameter of that name, recorded in its shard_specs."""
    module.shard_specs = {}
    for name, value in full.items():
        if value is None:
            module.register_parameter(name, None)
        else:
            module.shard_specs[name] = spec
            setattr(module, name, nn.Parameter(spec.take(value.detach()), requires_grad=value.requires_grad))


class ShardedLayerNorm(nn.Module):
    """This rank's part of a LayerNorm over ``spec.full_size`` features, computing
    ``(x - mean) * rsqrt(var + eps) * weight + bias`` with every rank's features in the mean and
    the variance. A float16 or bfloat16 input is normalised in float32 and cast back, as torch's
    LayerNorm accumulates. Build one with ``from_norm``."""

    autoshard_layer = True

    def __init__(self, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], spec: ShardSpec, eps: float,
                 group=None):
        super().__init__()
        if not isinstance(spec, ShardSpec) or spec.dim != 0 or spec.parts is not None or spec.repeat is not None:
            raise ValueError(f"ShardedLayerNorm: spec must be a ShardSpec over dim 0 without parts or repeat, "
                             f"got {spec!r}")
        for name, value in (("weight", weight), ("bias", bias)):
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 1
                                      or value.shape[0] != spec.full_size):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"ShardedLayerNorm: {name} must be None or 1-D of {spec.full_size} features, "
                                 f"got {got}")
        self.eps = check_eps("ShardedLayerNorm", eps)
        self.group = resolve(group, "ShardedLayerNorm")
        self.features = spec.full_size
        self.local_features = spec.local_size()
        take_parameters(self, spec, weight=weight, bias=bias)
        attach_layer_state(self)

    @classmethod
    def from_norm(cls, norm: nn.Module, spec: ShardSpec, eps: float, group=None) -> "ShardedLayerNorm":
        """This rank's part of ``norm`` (its ``weight`` and ``bias`` split by ``spec``)."""
        return cls(getattr(norm, "weight", None), getattr(norm, "bias", None), spec, eps, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.local_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"ShardedLayerNorm: x must end in this rank's {self.local_features} features, got {got}")
        dtype = x.dtype
        wide = x.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else x
        total = comm.reduce_from_parallel(wide.sum(-1, keepdim=True), self.group)
        centered = wide - comm.copy_to_parallel(total / self.features, self.group)
        squares = comm.reduce_from_parallel(centered.pow(2).sum(-1, keepdim=True), self.group)
        scale = comm.copy_to_parallel(torch.rsqrt(squares / self.features + self.eps), self.group)
        out = centered * scale
        if self.weight is not None:
            out = out * self.weight
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype)

    def extra_repr(self) -> str:
        spec = next(iter(self.shard_specs.values()), None)
        where = f" on rank {spec.rank} of {spec.world_size}" if spec is not None else ""
        return f"{self.local_features} of {self.features} features{where}, eps={self.eps}"
