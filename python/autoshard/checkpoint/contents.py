"""What a rank holds that a checkpoint stores: the model's parameters and persistent buffers
(tied tensors once, its targets, which a load fills too), and the optimizer's state, each with
the part of the global tensor it holds (its selection).

Optimizer state is stored under ``optimizer/<parameter name>/<state key>``, in one of three
layouts: "param", a tensor shaped like its parameter (AdamW's moments, SGD's momentum),
sharded with it and sharing its selection; "flat", the piece a data-parallel replica keeps
of a parameter whose state is partitioned (optimizer_partition), stored as part of the
flattened global tensor; "whole", any other tensor (AdamW's ``step``), the same on every rank.
Non-tensor values go into the manifest as JSON.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core.spec import ShardSpec, module_shards
from ..runtime.optimizer_partition import piece_of
from ..tensor_io import Selection, full_selection, json_input, selection_of
from .manifest import MAX_VALUE_DEPTH

OPTIMIZER_PREFIX = "optimizer/"


@dataclass
class Target:
    name: str  # the first name the module tree gives it
    tensor: torch.Tensor  # the local tensor (a Parameter or a buffer; may be on meta)
    selection: Selection  # which part of the full tensor it holds
    is_parameter: bool
    aliases: List[str] = field(default_factory=list)  # every name of a tied tensor, `name` first
    spec: Optional[ShardSpec] = None

    def owned(self, local: torch.Tensor) -> Optional[Tuple[torch.Tensor, Selection]]:
        """The part of `local` (shaped like this target's tensor) that this rank saves, and its
        selection: all of it, except where several ranks hold the same KV heads, which the
        lowest-ranked holder saves; None when another rank saves all of it."""
        if self.spec is None or not self.spec.overlaps:
            return local, self.selection
        part = self.spec.owned_part(local)
        if part is None:
            return None
        runs = list(self.selection.runs)
        runs[self.spec.dim] = tuple(self.spec.owned_ranges())
        return part, Selection(self.selection.shape, tuple(runs))


def _refuse_fully_sharded(model: torch.nn.Module) -> None:
    # FSDP's DTensor of a tensor-parallel shard holds a piece the selections here do not describe.
    name = next((n for n, p in model.named_parameters() if hasattr(p, "device_mesh")), None)
    if name is not None:
        raise ValueError(f"autoshard.checkpoint and load_pretrained do not read or write a model under fully_shard "
                         f"({name!r} is FSDP's piece of a parameter). Save autoshard.full_state_dict(model) instead, "
                         "load weights before fully_shard, or use the mesh path without fully_shard, "
                         "parallelize(model, mesh=mesh)")


def model_targets(model: torch.nn.Module, persistent_only: bool = True) -> Dict[str, Target]:
    """Name -> Target for every parameter and (persistent) buffer, tied tensors once."""
    _refuse_fully_sharded(model)
    specs = module_shards(model.modules())
    targets: Dict[str, Target] = {}
    by_id: Dict[int, Target] = {}

    def add(name: str, tensor: torch.Tensor, is_parameter: bool) -> None:
        if id(tensor) in by_id:
            by_id[id(tensor)].aliases.append(name)
            return
        spec = specs.get(id(tensor), (None, None))[0] if is_parameter else None
        full_shape = spec.full_shape(tensor.shape) if spec is not None else tuple(tensor.shape)
        target = Target(name, tensor, selection_of(spec, full_shape), is_parameter, [name], spec)
        targets[name] = by_id[id(tensor)] = target

    for name, param in model.named_parameters(remove_duplicate=False):
        add(name, param, True)
    for module_name, module in model.named_modules(remove_duplicate=False):
        skipped = getattr(module, "_non_persistent_buffers_set", set()) if persistent_only else set()
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in skipped:
                add(f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer, False)
    return targets


@dataclass
class Held:
    key: str  # the name it is stored under
    tensor: torch.Tensor  # this rank's local tensor
    selection: Selection


def json_value(value: Any, where: str) -> Any:
    """``value`` as JSON (tuples become lists, one-element tensors numbers), or an error naming ``where``.
    Lists and dicts come back as copies, as the manifest will hold them: a caller may change
    theirs while an asynchronous save is still being written."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, tuple):
        value = list(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(f"save: {where} holds a {type(value).__name__}, which cannot be stored as JSON") from None
    except RecursionError:
        text = None
    if text is None or json_input.too_deep(text.encode(), MAX_VALUE_DEPTH):
        raise ValueError(f"save: {where} nests lists and dicts more than {MAX_VALUE_DEPTH} levels deep, "
                         "more than a checkpoint's manifest may hold")
    count = json_input.value_count(text.encode())
    if count > json_input.MAX_JSON_VALUES // 2:
        raise ValueError(f"save: {where} holds {count} lists, dicts and elements, more than the "
                         f"{json_input.MAX_JSON_VALUES // 2} a checkpoint's manifest may hold in it (half of "
                         f"autoshard.tensor_io.json_input.MAX_JSON_VALUES, {json_input.MAX_JSON_VALUES})")
    return json.loads(text) if isinstance(value, (list, dict)) else value


def model_holdings(model: torch.nn.Module) -> Tuple[Dict[str, Target], List[Held], Dict[str, str]]:
    """The model's targets, what this rank holds of them, and alias -> stored name for tied tensors."""
    targets = model_targets(model)
    held, aliases = [], {}
    for name, target in targets.items():
        if target.tensor.device.type == "meta":
            raise ValueError(f"save: {name!r} is on the meta device; only a materialised model can be saved")
        owned = target.owned(target.tensor.detach())
        if owned is not None:
            held.append(Held(name, *owned))
        for alias in target.aliases[1:]:
            aliases[alias] = name
    return targets, held, aliases


def optimizer_holdings(optimizer: torch.optim.Optimizer, targets: Dict[str, Target]) -> Tuple[List[Held], Dict]:
    """What this rank holds of the optimizer's state, and its description for the manifest:
    ``{"type", "param_groups": [{hyperparameters..., "params": [names]}], "state": {name: {key:
    {"tensor": stored key} or {"value": json}}}}``."""
    names = {id(t.tensor): name for name, t in targets.items()}
    groups, state, held = [], {}, []
    for g, group in enumerate(optimizer.param_groups):
        described = {}
        for key, value in group.items():
            if key != "params":
                described[key] = json_value(value, f"optimizer.param_groups[{g}][{key!r}]")
        params = []
        for i, p in enumerate(group["params"]):
            name = names.get(id(p))
            if name is None:
                raise ValueError(f"save: optimizer.param_groups[{g}]['params'][{i}] is not a parameter of the model")
            params.append(name)
            entries = {}
            piece = piece_of(p)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    stored = f"{OPTIMIZER_PREFIX}{name}/{key}"
                    value = value.detach()
                    if piece is not None and value.dim() == 1 and value.numel() == piece.numel:
                        layout = "flat"
                        start = piece.starts[piece.rank]
                        held.append(Held(stored, value, Selection((p.numel(),), (((start, piece.numel),),))))
                    elif value.shape == p.shape:
                        layout = "param"
                        owned = targets[name].owned(value)
                        if owned is not None:
                            held.append(Held(stored, *owned))
                    else:
                        layout = "whole"
                        held.append(Held(stored, value, full_selection(value.shape)))
                    entries[key] = {"tensor": stored, "layout": layout}
                else:
                    entries[key] = {"value": json_value(value, f"the optimizer state {key!r} of {name!r}")}
            if entries:
                state[name] = entries
        described["params"] = params
        groups.append(described)
    return held, {"type": type(optimizer).__name__, "param_groups": groups, "state": state}
