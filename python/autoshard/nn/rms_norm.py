"""An RMS norm over features split by heads across the ranks (OLMo 2's q_norm and k_norm,
which normalise every head's features of q_proj's output together).

Each rank holds its heads' features and the matching part of the weight. The mean of squares
needs every rank's features: each rank's sum of squares is all-reduced in forward
(reduce_from_parallel), and the scale rsqrt(mean + eps) it gives is the same on every rank.
The scale is read by this rank's features only, so its gradient is partial on each rank:
copy_to_parallel sums it in backward. What reaches each rank's features and weight is then
exactly the unsharded norm's gradient for them.
"""

import torch
from torch import nn

from ..core import comm
from ..core.distributed import resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec
from .layer_norm import check_eps, take_parameters

FORMS = ("input_dtype", "scale_then_cast", "cast_then_scale")


class ShardedRMSNorm(nn.Module):
    """This rank's part of an RMS norm over ``spec.full_size`` features, computing
    ``x * rsqrt(mean(x ** 2, -1) + eps) * weight`` with every rank's features in the mean.
    ``form`` says in which dtype, as the norm it stands for: "input_dtype" (x's own), or float32
    cast back to x's dtype after the weight scales it ("scale_then_cast", OLMo 2) or before
    ("cast_then_scale", Llama). Build one with ``from_norm``."""

    autoshard_layer = True

    def __init__(self, weight: torch.Tensor, spec: ShardSpec, eps: float, form: str, group=None):
        super().__init__()
        if not isinstance(spec, ShardSpec) or spec.dim != 0 or spec.parts is not None or spec.repeat is not None:
            raise ValueError(f"ShardedRMSNorm: spec must be a ShardSpec over dim 0 without parts or repeat, got {spec!r}")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != spec.full_size:
            got = None if not isinstance(weight, torch.Tensor) else tuple(weight.shape)
            raise ValueError(f"ShardedRMSNorm: weight must be 1-D of {spec.full_size} features, got shape {got}")
        if form not in FORMS:
            raise ValueError(f"ShardedRMSNorm: form must be one of {FORMS}, got {form!r}")
        self.eps = check_eps("ShardedRMSNorm", eps)
        self.group = resolve(group, "ShardedRMSNorm")
        self.features = spec.full_size
        self.form = form
        take_parameters(self, spec, weight=weight)
        attach_layer_state(self)

    @classmethod
    def from_norm(cls, norm: nn.Module, spec: ShardSpec, eps: float, form: str, group=None) -> "ShardedRMSNorm":
        """This rank's part of ``norm`` (its ``weight`` split by ``spec``)."""
        return cls(norm.weight, spec, eps, form, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.weight.shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != local:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"ShardedRMSNorm: x must end in this rank's {local} features, got {got}")
        dtype = x.dtype
        wide = x if self.form == "input_dtype" else x.to(torch.float32)
        squares = comm.reduce_from_parallel(wide.pow(2).sum(-1, keepdim=True), self.group)
        scale = comm.copy_to_parallel(torch.rsqrt(squares / self.features + self.eps), self.group)
        normalized = wide * scale
        if self.form == "input_dtype":
            return normalized * self.weight
        if self.form == "scale_then_cast":
            return (self.weight * normalized).to(dtype)
        return self.weight * normalized.to(dtype)

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return (f"{self.weight.shape[0]} of {self.features} features on rank {spec.rank} of {spec.world_size}, "
                f"eps={self.eps}, {self.form}")
