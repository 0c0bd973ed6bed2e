"""Split norms: an RMS norm or a LayerNorm over a layer's output features that are split by
heads (OLMo 2's q_norm and k_norm over q_proj's and k_proj's outputs, ESM-C's LayerNorms over
them). The capture records a call of one on a layer's output as one "norm" node
(capture/module_calls.py), the planner splits it with the layer's features (csrc/plan/constructs/norms.cpp),
and each becomes nn.rms_norm.ShardedRMSNorm (one all-reduce of the squares' sums in forward, one
in backward) or nn.layer_norm.ShardedLayerNorm (two each: the mean, then the variance).

A module is such a norm by what it computes, not by its name: norm_form probes its class.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from ..nn.batch_norm import ShardedBatchNorm, is_batch_norm
from ..nn.layer_norm import ShardedLayerNorm
from ..nn.rms_norm import ShardedRMSNorm
from ..core.spec import ShardSpec
from .base import RecordConstruct, planned_module, register_records, set_submodule
from ..core.sealed import Sealed


@dataclass
class SplitNorm(Sealed):
    """An RMS norm over a layer's output features split by heads (OLMo 2's q_norm), a LayerNorm
    (`centered`: ESM-C's q_norm), or a BatchNorm over a convolution's output channels
    (`per_channel`; `running_stats` where it updates them): its weight `weight` (and bias
    `bias`; either None where it has none) of `features` global elements, split in the region's
    `units`."""

    module: str
    weight: Optional[str]
    features: int
    units: int
    region: int
    bias: Optional[str] = None
    centered: bool = False
    per_channel: bool = False
    running_stats: bool = False


# How an RMS norm meets its input's dtype: "input_dtype" (it computes in that dtype), or it
# computes in float32 and casts back, "scale_then_cast" (the weight scales the float32 result,
# then cast back, as OLMo 2) or "cast_then_scale" (cast back, then scaled, as Llama).
RMS_NORM_FORMS = ("input_dtype", "scale_then_cast", "cast_then_scale")
LAYER_NORM = "layer_norm"
# (probe, class, plain attributes) -> the form the probe found, or None.
_FORMS: Dict[tuple, Optional[str]] = {}


def rms_norm_eps(module: nn.Module) -> Optional[float]:
    """The epsilon of an RMS norm module (`variance_epsilon` or `eps`), or None."""
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            return float(value)
    return None


def _probe_forward(module: nn.Module, x: torch.Tensor, **params) -> torch.Tensor:
    """`module`'s class forward on `x`, with `params` (CPU tensors, or None) in place of its own
    parameters and without its hooks."""
    probe = copy.copy(module)
    probe._parameters = {k: None if v is None else nn.Parameter(v, requires_grad=False) for k, v in params.items()}
    probe._forward_hooks, probe._forward_pre_hooks = OrderedDict(), OrderedDict()
    if isinstance(getattr(module, "normalized_shape", None), tuple):  # nn.RMSNorm passes it to F.rms_norm
        probe.normalized_shape = (x.shape[-1],)
    return type(module).forward(probe, x)


def _probed(kind: str, module: nn.Module, probe) -> Optional[str]:
    """`probe(generator)`'s answer, once per class and plain attributes of `module` (eps, and any
    flag a class reads in its forward); None where the forward fails on the probe."""
    key = (kind, type(module), tuple(sorted((k, v) for k, v in vars(module).items()
                                            if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None))))))
    if key not in _FORMS:
        # Outside any mode a capture or a dry run has on: this is a check, not the model's call.
        with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            try:
                _FORMS[key] = probe(torch.Generator().manual_seed(0))
            except Exception:  # noqa: BLE001 - a forward that fails on the probe is no such norm
                _FORMS[key] = None
    return _FORMS[key]


def rms_norm_form(module: nn.Module) -> Optional[str]:
    """Whether `module` computes x * rsqrt(mean(x ** 2, -1) + eps) * weight over its input's last
    axis, with a 1-D weight as its only parameter and no submodules: checked once per class (and
    plain attributes) on a small float64 input with its own eps: exactly ("input_dtype"), or to
    float32's precision, then on a bfloat16 input for where it casts back, which must match one
    of the float32 RMS_NORM_FORMS bit for bit. None for any other module."""
    weight = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    eps = rms_norm_eps(module) if weight is not None else None
    if (eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or len(module._parameters) != 1
            or len(module._modules) or len(module._buffers)):
        return None

    def probe(generator):
        w = torch.randn(5, generator=generator, dtype=torch.float64)
        x = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
        got = _probe_forward(module, x, weight=w)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        same = isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
        if same and bool(torch.allclose(got, want, rtol=1e-12, atol=1e-14)):
            return "input_dtype"
        # Else to fp32's precision: most norms compute in fp32 whatever their input.
        if not (same and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))):
            return None
        w16 = torch.randn(5, generator=generator).to(torch.bfloat16)
        x16 = torch.randn(2, 3, 5, generator=generator).to(torch.bfloat16)
        got = _probe_forward(module, x16, weight=w16)
        x32 = x16.to(torch.float32)
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        casts = ((w16 * normalized).to(torch.bfloat16), w16 * normalized.to(torch.bfloat16))
        return next((name for name, value in zip(RMS_NORM_FORMS[1:], casts)
                     if got.dtype == value.dtype and torch.equal(got, value)), None)

    return _probed("rms", module, probe)


def layer_norm_form(module: nn.Module) -> Optional[str]:
    """LAYER_NORM where `module` computes F.layer_norm over its input's last axis with its 1-D
    weight and bias (which may be None) as its only parameters and no submodules, checked once
    per class (and plain attributes) on a small float64 input against F.layer_norm, exactly;
    None for any other module."""
    if not isinstance(module, nn.Module) or len(module._modules) or len(module._buffers):
        return None
    params = dict(module._parameters)
    eps = rms_norm_eps(module)
    if eps is None or set(params) - {"weight", "bias"} or params.get("weight") is None \
            or any(v is not None and v.dim() != 1 for v in params.values()):
        return None

    def probe(generator):
        given = {k: None if v is None else torch.randn(5, generator=generator, dtype=torch.float64)
                 for k, v in params.items()}
        x = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
        got = _probe_forward(module, x, **given)
        want = torch.nn.functional.layer_norm(x, (5,), given.get("weight"), given.get("bias"), eps)
        ok = (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
              and bool(torch.allclose(got, want, rtol=1e-12, atol=1e-14)))
        return LAYER_NORM if ok else None

    return _probed("layer", module, probe)


BATCH_NORM = "batch_norm"


def norm_form(module: nn.Module) -> Optional[str]:
    """The module's RMS norm form (rms_norm_form), LAYER_NORM, BATCH_NORM (a torch BatchNorm:
    nn.batch_norm.is_batch_norm), or None where it is none of them."""
    if is_batch_norm(module):
        return BATCH_NORM
    return rms_norm_form(module) or layer_norm_form(module)


@register_records
class SplitNormConstruct(RecordConstruct):
    kind = "split_norm"
    fields = {"norms": SplitNorm}
    order = 10
    printout_order = 30

    def read(self, answer, reading):
        norms = []
        for record in answer.get("norms", []):
            node = reading.graph.document["nodes"][record["node"]]
            weight, bias = node.get("weight_param", -1), node.get("bias_param", -1)
            norms.append(SplitNorm(node["label"], reading.names[weight] if weight >= 0 else None, record["features"],
                                   reading.regions[record["region"]].units, record["region"],
                                   bias=reading.names[bias] if bias >= 0 else None,
                                   centered=bool(node.get("centered")), per_channel=bool(node.get("per_channel")),
                                   running_stats=bool(node.get("running_stats"))))
        return {"norms": norms}

    def printout(self, plan, printing):
        lines = []
        feature_norms = [n.module for n in plan.norms if not n.per_channel]
        if feature_norms:
            lines.append(f"  norms split with their layer's features (one all-reduce in forward and one in "
                         f"backward each, two for a LayerNorm): {printing.listed(feature_norms)}")
        channel_norms = [n.module for n in plan.norms if n.per_channel]
        if channel_norms:
            lines.append(f"  BatchNorms split with their channels (no collective; a training forward all-gathers "
                         f"each one's running statistics): {printing.listed(channel_norms)}")
        return lines

    @staticmethod
    def spec(plan, norm, rank: int) -> ShardSpec:
        """The ShardSpec of a split norm's weight on `rank` (split like its layer's features)."""
        return ShardSpec(0, norm.features, rank, plan.world_size, units=norm.units or None)

    def specs(self, plan, rank: int) -> Dict[str, ShardSpec]:
        specs = {}
        for norm in plan.norms:
            for name in (norm.weight, norm.bias):
                if name:
                    specs[name] = self.spec(plan, norm, rank)
        return specs

    def replaced(self, plan) -> List[str]:
        return [norm.module for norm in plan.norms]

    def check(self, model, plan, params) -> None:
        for norm in plan.norms:
            module = planned_module(model, norm.module, "names norm")
            held = [getattr(module, name.rpartition(".")[2], None) for name in (norm.weight, norm.bias) if name]
            form = norm_form(module)
            if norm.per_channel:
                wrong = form != BATCH_NORM or module.num_features != norm.features
            else:
                wrong = not held or form in (None, BATCH_NORM) or (form == LAYER_NORM) != norm.centered
            if wrong or any(not isinstance(p, torch.Tensor) or list(p.shape) != [norm.features] for p in held):
                what = "a BatchNorm" if norm.per_channel else "a LayerNorm" if norm.centered else "an RMS norm"
                raise ValueError(f"parallelize: norm {norm.module!r} is not {what} over {norm.features} features, "
                                 "as the plan expects")

    def stand_in(self, copy_: nn.Module, prefix: str, plan, rank: int) -> None:
        for norm in plan.norms:
            if norm.module.startswith(prefix):
                owner = copy_.get_submodule(norm.module[len(prefix):])
                local = self.spec(plan, norm, rank).local_size()
                for name in (norm.weight, norm.bias):
                    if name:
                        attr = name.rpartition(".")[2]
                        dtype = getattr(owner, attr).dtype
                        setattr(owner, attr, nn.Parameter(torch.empty(local, device="meta", dtype=dtype)))
                if isinstance(getattr(owner, "normalized_shape", None), tuple):  # nn.LayerNorm's, nn.RMSNorm's
                    owner.normalized_shape = (local,)
                if norm.per_channel:  # a BatchNorm reads its running statistics at this rank's channels
                    for attr in ("running_mean", "running_var"):
                        if getattr(owner, attr, None) is not None:
                            buffer = getattr(owner, attr)
                            owner.register_buffer(attr, torch.empty(local, device="meta", dtype=buffer.dtype))
                    owner.num_features = local

    def apply(self, model, plan, surgery) -> None:
        for norm in plan.norms:
            module = model.get_submodule(norm.module)
            spec = self.spec(plan, norm, surgery.rank)
            if norm.per_channel:
                sharded = ShardedBatchNorm.from_norm(module, spec, surgery.group)
            elif norm.centered:
                sharded = ShardedLayerNorm.from_norm(module, spec, rms_norm_eps(module), surgery.group)
            else:
                sharded = ShardedRMSNorm.from_norm(module, spec, rms_norm_eps(module), rms_norm_form(module),
                                                   surgery.group)
            set_submodule(model, norm.module, sharded)
