"""torch.nn.MultiheadAttention split by heads.

nn.MultiheadAttention applies its parameters with functional calls (its fused q/k/v weight
``in_proj_weight`` and ``out_proj.weight`` through ``F.linear`` inside
``F.multi_head_attention_forward``), so no Linear module is ever called and the function
checks the global embedding size against its input. ``multihead_attention`` computes the same
attention written for whatever heads its projections give: the q/k/v projection as one call
(a layer), the heads counted from its output's width, the masks broadcast over the heads, the
output projection as a second call. The planner's capture runs it in place of torch's
function (it records the two calls as layers), and ``ParallelMultiheadAttention`` runs it
with this rank's heads: ``in_proj_weight`` split by heads in each of its q, k and v parts (a
column layer), ``out_proj`` a row layer. Both keep nn.MultiheadAttention's parameter names.
The weights a call with need_weights returns are a third call (``ReturnedWeights``): their
average over every head, all-reduced, where the plan found the model reading them, else None.
"""

import inspect
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core import ops, region_generators
from ..core.distributed import ProcessGroup, resolve
from ..core.parallel_state import attach_layer_state
from ..core.spec import ShardSpec

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
IN_PROJECTION = "in_proj"  # the name of the q/k/v projection as a layer of the module


def unsupported(arguments) -> Optional[str]:
    """Why a call of F.multi_head_attention_forward (its bound arguments) is not one that
    multihead_attention computes, or None."""
    a = arguments
    if not (a["query"] is a["key"] and a["key"] is a["value"]):
        return "query, key and value are not one tensor (only self-attention is split)"
    if a["query"].dim() != 3:
        return "the input is not batched"
    if a["use_separate_proj_weight"] or a["in_proj_weight"] is None:
        return "q, k and v have separate weights (kdim or vdim differ from embed_dim)"
    if a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]:
        return "it adds a bias or zeros to the keys and values (add_bias_kv, add_zero_attn)"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "it is given static keys or values"
    return None


def average_over_heads(weights: torch.Tensor, average: bool) -> torch.Tensor:
    """The attention weights nn.MultiheadAttention returns, from every head's (N, heads, L, S)."""
    return weights.mean(dim=1) if average else weights


def multihead_attention(arguments, in_projection: Callable, out_projection: Callable,
                        returned_weights: Callable = average_over_heads):
    """F.multi_head_attention_forward's result for a supported call (see `unsupported`),
    from inputs shaped (L, N, E), with `in_projection(x)` giving the q/k/v features (the
    fused [q | k | v] layout, any number of heads), `out_projection(o)` the output and
    `returned_weights(weights, average)` the weights returned from the heads' (N, heads, L, S)
    with need_weights (averaged over the heads with average_attn_weights)."""
    a = arguments
    query = a["query"]
    tgt_len, bsz, _ = query.shape
    head_dim = a["embed_dim_to_check"] // a["num_heads"]
    attn_mask, key_padding_mask, is_causal, need_weights = a["attn_mask"], a["key_padding_mask"], a["is_causal"], a["need_weights"]
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # torch's function then relies on the hint alone
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    q, k, v = in_projection(query).chunk(3, dim=-1)

    def heads(t):  # (L, N, heads * head_dim) -> (N, heads, L, head_dim)
        return t.view(t.shape[0], bsz, -1, head_dim).permute(1, 2, 0, 3)

    q, k, v = heads(q), heads(k), heads(v)
    src_len = k.shape[2]
    # The masks broadcast over the heads, never laid out per head, so that each rank's heads
    # read them whole.
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(bsz, -1, tgt_len, src_len)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(bsz, 1, 1, src_len)
        mask = padding if mask is None else mask + padding
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.matmul(weights, v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
    out = out_projection(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, -1))
    if weights is not None:
        weights = returned_weights(weights, a["average_attn_weights"])
    return out, weights


class AttentionCalls(TorchFunctionMode):
    """Routes calls of F.multi_head_attention_forward to `handle(arguments)`, which returns
    the result or None to leave the call to torch."""

    def __init__(self, handle: Callable):
        super().__init__()
        self.handle = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            bound = _SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            result = self.handle(bound.arguments)
            if result is not None:
                return result
        return func(*args, **kwargs)


class FusedInProjection(nn.Module):
    """The q/k/v projection of a ParallelMultiheadAttention as a layer call: it owns no
    parameter (they stay the attention's `in_proj_weight` and `in_proj_bias`) and copies its
    input into the tensor-parallel region (identity forward, all-reduce of the gradient)."""

    autoshard_layer = True  # traced as one layer, as the planner's capture records it

    def __init__(self, group_name: Optional[str]):
        super().__init__()
        self.group_name = group_name
        self.input_copy = None  # shared with other column layers, as parallelize decides

    def forward(self, x, weight, bias):
        if self.group_name is not None:
            x = self.input_copy(x) if self.input_copy is not None else ops.copy_to_parallel(x, self.group_name)
            x = region_generators.enter(x, self.group_name, self.training)
        return F.linear(x, weight, bias)


RETURNED_WEIGHTS = ("all_reduce", "none")


class ReturnedWeights(nn.Module):
    """The attention weights a ParallelMultiheadAttention returns, from this rank's heads, as a
    layer call (the planner records it as one node, csrc/plan/constructs/attention_weights.cpp).

    With `returned` "all_reduce", the weights averaged over every head: this rank's sum over its
    heads divided by the global head count, summed over the ranks (all-reduce in forward; the
    gradient of the replicated average reaches this rank's heads unchanged). With "none", for a
    model that never reads them (``out, _ = attn(x, x, x)``), None in their place and no
    collective. Weights per head (average_attn_weights=False) would need every head; they are
    refused on a split group (the plan keeps an attention whose model reads them whole)."""

    autoshard_layer = True

    def __init__(self, group_name: Optional[str], num_heads: int, returned: str):
        super().__init__()
        if returned not in RETURNED_WEIGHTS:
            raise ValueError(f"ReturnedWeights: returned must be one of {RETURNED_WEIGHTS}, got {returned!r}")
        self.group_name = group_name
        self.num_heads = num_heads
        self.returned = returned

    def forward(self, weights: torch.Tensor, average: bool) -> Optional[torch.Tensor]:
        if self.returned == "none":
            return None
        if not average:
            if self.group_name is not None:
                raise ValueError("ParallelMultiheadAttention: the attention weights per head (average_attn_weights="
                                 "False) need every head, and this rank holds some; the plan was made for a call "
                                 "that returns none or averages them")
            return weights
        summed = weights.sum(dim=1) / self.num_heads
        return summed if self.group_name is None else ops.reduce_from_parallel(summed, self.group_name)

    def extra_repr(self) -> str:
        return f"returned={self.returned!r}, num_heads={self.num_heads}"


class ParallelMultiheadAttention(nn.MultiheadAttention):
    """An nn.MultiheadAttention holding this rank's heads: ``in_proj_weight`` and
    ``in_proj_bias`` are this rank's heads of each of the q, k and v parts (``shard_specs``),
    ``out_proj`` a RowParallelLinear over the same heads. It runs nn.MultiheadAttention's own
    forward, with the attention itself computed by ``multihead_attention``; self-attention
    only (query, key and value one tensor), as the plan that split it was made for. The
    weights it returns with need_weights are ``returned_weights``'s (ReturnedWeights)."""

    autoshard_layer = False  # traced op by op; its projections are the layers

    def forward(self, *args, **kwargs):
        with AttentionCalls(self._attend):
            return super().forward(*args, **kwargs)

    def _attend(self, arguments):
        why = unsupported(arguments)
        if why is not None:
            raise ValueError(f"ParallelMultiheadAttention: this call cannot be computed with the rank's heads: {why}")
        return multihead_attention(
            arguments, lambda x: self.in_proj(x, self.in_proj_weight, self.in_proj_bias), self.out_proj,
            self.returned_weights)


_FORWARD = inspect.signature(nn.MultiheadAttention.forward)


def _self_attention_only(module, args, kwargs):
    call = _FORWARD.bind(module, *args, **kwargs).arguments
    if not (call["query"] is call["key"] and call["key"] is call["value"]):
        raise ValueError("ParallelMultiheadAttention: this call cannot be computed with the rank's heads: query, key "
                         "and value are not one tensor (only self-attention is split)")


def shard_multihead_attention(module: nn.MultiheadAttention, spec: ShardSpec, out_proj: nn.Module,
                              group: Optional[ProcessGroup], returned_weights: str = "all_reduce") -> nn.MultiheadAttention:
    """Makes `module` (in place) a ParallelMultiheadAttention holding the rows of
    in_proj_weight (and in_proj_bias) that `spec` gives this rank, with `out_proj` in place of
    its output projection. `group` None builds a meta stand-in with no collective (the
    planner traces it to check its shapes). `returned_weights` ("all_reduce" or "none") is what
    a call with need_weights returns (see ReturnedWeights)."""
    if returned_weights not in RETURNED_WEIGHTS:
        raise ValueError(f"shard_multihead_attention: returned_weights must be one of {RETURNED_WEIGHTS}, "
                         f"got {returned_weights!r}")
    group_name = None
    if group is not None:
        group = resolve(group, "ParallelMultiheadAttention")
        group_name = group.group_name if group.size() > 1 else None
    weight, bias = module.in_proj_weight, module.in_proj_bias

    def local(full):
        if full.device.type == "meta":
            return torch.empty(spec.local_shape(full.shape), dtype=full.dtype, device="meta")
        return spec.take_owned(full)

    module.in_proj_weight = nn.Parameter(local(weight), requires_grad=weight.requires_grad)
    module.shard_specs = {"in_proj_weight": spec}
    if bias is not None:
        module.in_proj_bias = nn.Parameter(local(bias), requires_grad=bias.requires_grad)
        module.shard_specs["in_proj_bias"] = spec
    module.out_proj = out_proj
    module.in_proj = FusedInProjection(group_name)
    module.returned_weights = ReturnedWeights(group_name, module.num_heads, returned_weights)
    module.group = group
    cls = type(module)
    if not issubclass(cls, ParallelMultiheadAttention):
        # A hook of its own also keeps torch's fused encoder-layer kernel from running it
        # (nn.TransformerEncoderLayer in inference takes it only for modules without hooks):
        # that kernel reads in_proj_weight as holding every head.
        module.register_forward_pre_hook(_self_attention_only, with_kwargs=True)
        module.__class__ = ParallelMultiheadAttention if cls is nn.MultiheadAttention else type(
            f"Parallel{cls.__name__}", (ParallelMultiheadAttention, cls), {})
    if group is not None:
        attach_layer_state(module)
    return module

