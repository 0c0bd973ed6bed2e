"""torchao's int8 weight-only quantization of a parallelized model, equal to the same quantization of
the unsharded model.

torchao's ``quantize_`` computes each weight row's scale from the weight it is given; on a rank's
shard that is the whole row only where the rows are split (a column-parallel layer). Where the
columns are split (a row-parallel layer), each rank holds part of every row, so the shard guard
refuses torchao's own ``quantize_`` there. ``quantize_`` here quantizes each sharded Linear layer
with the scales of its whole rows: a column layer's rows as torchao does, a row layer's from the
rows' minimum and maximum over the ranks (one all-reduce of two values per row, then torchao's own
``choose_qparams_affine`` on them, which gives the scale the whole row gives), and every Linear held
whole by torchao's ``quantize_`` itself. The layers then multiply with torchao's int8 weights: a
column layer's output features are the unsharded layer's, a row layer's partial sums add up to it.

Only ``Int8WeightOnlyConfig`` with per-row scales is taken; any other config is refused by name
before anything changes (its scales or its activations' quantization would need the same care).
"""

import torch
from torch import nn

from ..core import ops
from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..core.parallel_state import state_of
from ..runtime.shard_guard import local

__all__ = ["quantize_"]


def _row_scales(weight: torch.Tensor, group_name: str):
    """The scale and zero point torchao gives each whole row of a weight whose columns are split."""
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS, MappingType, choose_qparams_affine  # noqa: PLC0415  (torchao is optional)

    extremes = torch.stack([weight.amin(dim=1), weight.amax(dim=1)], dim=1).float()
    low, high = -extremes[:, :1].contiguous(), extremes[:, 1:].contiguous()
    ops.all_reduce_(low, "max", group_name)  # the minimum over the ranks, as a maximum of negatives
    ops.all_reduce_(high, "max", group_name)
    row = torch.cat([-low, high], dim=1).to(weight.dtype)
    quant_min, quant_max = _DTYPE_TO_QVALUE_BOUNDS[torch.int8]
    # As Int8Tensor.from_hp calls it: symmetric int8 per row, float32 scales and eps.
    return choose_qparams_affine(input=row, mapping_type=MappingType.SYMMETRIC, block_size=[1, 2],
                                 target_dtype=torch.int8, quant_min=quant_min, quant_max=quant_max, scale_dtype=torch.float32,
                                 zero_point_dtype=torch.int8, keepdim=True, eps=torch.finfo(torch.float32).eps)


def _quantize_layer(layer: nn.Module) -> None:
    from torchao.quantization import PerRow  # noqa: PLC0415  (torchao is optional)
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor  # noqa: PLC0415  (torchao is optional)

    weight = local(layer.weight).detach()
    if isinstance(layer, RowParallelLinear):
        scale, zero_point = _row_scales(weight, layer._group_name)
        quantized = Int8Tensor.from_hp(weight, PerRow(), scale=scale, zero_point=zero_point)
    else:
        quantized = Int8Tensor.from_hp(weight, PerRow())
    layer.weight = nn.Parameter(quantized, requires_grad=False)


def quantize_(model: nn.Module, config) -> nn.Module:
    """Quantizes every Linear layer of the parallelized `model` in place with torchao's `config`
    (``Int8WeightOnlyConfig()``), sharded layers with their whole rows' scales; returns the model.
    For inference: the quantized weights are frozen."""
    from torchao.quantization import Int8WeightOnlyConfig, PerRow  # noqa: PLC0415  (torchao is optional)
    from torchao.quantization import quantize_ as torchao_quantize  # noqa: PLC0415  (torchao is optional)

    if state_of(model) is None:
        raise ValueError("autoshard.integrations.torchao_quantize.quantize_: model is not parallelized; quantize an "
                         "unsharded model with torchao's quantize_ itself")
    if type(config) is not Int8WeightOnlyConfig or not isinstance(config.granularity, PerRow):
        raise ValueError(
            f"autoshard.integrations.torchao_quantize.quantize_: config must be torchao's "
            f"Int8WeightOnlyConfig(granularity=PerRow()), got {config!r}; other configs compute scales (or "
            "quantize activations) that autoshard does not yet take over the shards, so they are refused")
    sharded = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in sharded:  # every refusal before the first change
        if layer.transposed_weight or (isinstance(layer, ColumnParallelLinear) and not layer.plain_product):
            raise ValueError(f"autoshard.integrations.torchao_quantize.quantize_: {type(layer).__name__} with a "
                             "transposed (Conv1D) or shared-head weight cannot be quantized yet")
    with torch.no_grad():
        for layer in sharded:
            _quantize_layer(layer)
    whole = {id(m) for m in sharded}
    torchao_quantize(model, config, filter_fn=lambda module, name: isinstance(module, nn.Linear)
                     and id(module) not in whole and hasattr(module, "weight"))
    return model
