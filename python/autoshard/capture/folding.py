"""Identical blocks are traced once: the capture records the first block of each kind as it
runs, and records every later identical block again from that recording instead of running it.

Running a model's forward on meta costs most of the time of a plan, and nearly all of it is
spent in the repeated blocks of a ModuleList (every decoder layer of a 70B model). Blocks are
identical when they have the same classes, parameters, buffers and plain attributes (an
attribute that holds the block's own index in the list, such as `layer_idx`, excepted), and
are called with inputs of the same structure and shapes. A folded block's recorded nodes are
the first block's with its own tensors, parameters and layers in place of the first block's;
its outputs are fresh meta tensors of the first block's output shapes. A block that was not
called like its first block is run as usual. parallelize's dry run traces the whole model
unfolded and checks it against the plan's prediction.
"""

from typing import Dict, List

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .layers import layer_at

_PLAIN = (int, float, str, bool, type(None))


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _named_tensors(block: nn.Module) -> Dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes of a block, by relative name."""
    tensors = {}
    for prefix, module in block.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                tensors[dot + attr] = value
        for attr, value in list(module._parameters.items()) + list(module._buffers.items()):
            if value is not None:
                tensors[dot + attr] = value
    return tensors


def _description(block: nn.Module) -> Dict[tuple, object]:
    """What makes two blocks compute alike: per submodule, its class, parameters, buffers and
    plain attributes."""
    entries: Dict[tuple, object] = {}
    for prefix, module in block.named_modules(remove_duplicate=False):
        entries[(prefix, "<class>")] = (type(module), "forward" in vars(module))
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                for k, v in value.items():
                    entries[(prefix, attr, k)] = None if v is None else (tuple(v.shape), v.dtype, v.requires_grad)
            elif attr.startswith("_"):
                continue
            elif isinstance(value, torch.Tensor):
                entries[(prefix, attr)] = (tuple(value.shape), value.dtype)
            elif _plain(value):
                entries[(prefix, attr)] = (type(value), value)
            elif not isinstance(value, (nn.Module, dict)):
                entries[(prefix, attr)] = type(value)
    return entries


def foldable_blocks(model: nn.Module) -> Dict[str, str]:
    """Block name -> the name of the first identical block before it in the same ModuleList."""
    folds = {}
    for list_name, container in model.named_modules():
        if not isinstance(container, nn.ModuleList) or len(container) < 2:
            continue
        # A ModuleList may hold None (a layer a config leaves out): there is nothing to fold.
        blocks = [(int(key), block) for key, block in container._modules.items() if block is not None]
        if len(blocks) < 2:
            continue
        described = [_description(block) for _, block in blocks]
        # An int attribute that holds each block's own index (layer_idx) differs by design.
        own_index = {key for key in described[0]
                     if all(d.get(key) == (int, i) for (i, _), d in zip(blocks, described))}
        first: Dict[tuple, str] = {}
        for (index, _), entries in zip(blocks, described):
            name = f"{list_name}.{index}" if list_name else str(index)
            key = tuple(sorted(((k, v) for k, v in entries.items() if k not in own_index), key=repr))
            try:
                hash(key)
            except TypeError:  # an attribute that cannot be compared: run the block
                continue
            if key in first:
                folds[name] = first[key]
            else:
                first[key] = name
    return folds


def _same_call(recorded, flat) -> bool:
    if len(recorded) != len(flat):
        return False
    for a, b in zip(recorded, flat):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                    or a.dtype != b.dtype or a.device != b.device:
                return False
        elif _plain(a) or _plain(b):
            if a != b:
                return False
        elif type(a) is not type(b):
            return False
    return True


class _Recording:
    """One call of a first block: its inputs, what the recorder logged, its outputs."""

    def __init__(self, name: str, block: nn.Module, flat_inputs: list, spec, log_start: int, node_start: int):
        self.name = name
        self.block = block
        self.flat_inputs = flat_inputs
        self.spec = spec
        self.log_start = log_start
        self.node_start = node_start
        self.log_end = self.node_end = -1
        self.output = None


class BlockFolder:
    """Installed around one capture: records first blocks and replays them for the others."""

    def __init__(self, model: nn.Module, recorder, module_inputs: dict, module_nodes: dict, module_entries: dict,
                 replayable, enabled: bool = True):
        self.model = model
        self.module_entries = module_entries  # name -> [(leaf, tensor id)]
        self.replayable = replayable  # (args, kwargs) -> what module_inputs keeps of a call
        self.recorder = recorder
        self.param_index = recorder.param_index
        self.layers = recorder.layers
        self.module_inputs = module_inputs
        self.module_nodes = module_nodes
        self.folds = foldable_blocks(model) if enabled else {}
        self.recordings: Dict[str, _Recording] = {}
        self.folded: List[str] = []
        self._handles = []
        self._patched: List[nn.Module] = []

    def __enter__(self):
        firsts = set(self.folds.values())
        for name in firsts:
            block = self.model.get_submodule(name)
            self._handles.append(block.register_forward_pre_hook(
                lambda mod, a, kw, name=name: self._start(name, mod, a, kw), with_kwargs=True))
            self._handles.append(block.register_forward_hook(
                lambda mod, a, out, name=name: self._finish(name, out)))
        for name, first in self.folds.items():
            block = self.model.get_submodule(name)
            block.forward = self._folded_forward(name, first, block, type(block).forward.__get__(block))
            self._patched.append(block)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for block in self._patched:
            del block.forward
        return False

    def _start(self, name, block, args, kwargs):
        if name not in self.recordings and self.recorder.layer_depth == 0:
            flat, spec = tree_flatten((args, kwargs))
            self.recordings[name] = _Recording(name, block, flat, spec, len(self.recorder.log), self.recorder.node_count)

    def _finish(self, name, output):
        recording = self.recordings.get(name)
        if recording is not None and recording.log_end < 0:
            recording.log_end, recording.node_end = len(self.recorder.log), self.recorder.node_count
            recording.output = output

    def _folded_forward(self, name: str, first: str, block: nn.Module, forward):
        def folded(*args, **kwargs):
            recording = self.recordings.get(first)
            flat, spec = tree_flatten((args, kwargs))
            if (recording is None or recording.log_end < 0 or self.recorder.layer_depth != 0
                    or spec != recording.spec or not _same_call(recording.flat_inputs, flat)):
                self.module_inputs.setdefault(name, self.replayable(args, kwargs))
                return forward(*args, **kwargs)
            if first in self.module_inputs:
                self.module_inputs.setdefault(name, self.module_inputs[first])
            return self._replay(recording, name, block, flat)

        # A block folded inside a block folded in turn (a ModuleList of MLPs, each a ModuleList
        # of Linears) is looked up again when the outer block is replayed: it is still its layer.
        folded.autoshard_folded_block = True
        return folded

    def _replay(self, recording: _Recording, name: str, block: nn.Module, flat: list):
        recorder = self.recorder
        ids: Dict[int, int] = {}
        # The first block's inputs, parameters and buffers are this block's.
        for before, now in zip(recording.flat_inputs, flat):
            if isinstance(before, torch.Tensor) and id(before) in recorder.ids:
                ids[recorder.ids[id(before)]] = recorder.tensor_id(now)
        mine = _named_tensors(block)
        for rel, tensor in _named_tensors(recording.block).items():
            if id(tensor) in recorder.ids and rel in mine:
                ids.setdefault(recorder.ids[id(tensor)], recorder.tensor_id(mine[rel]))
        params = {self.param_index[id(t)]: self.param_index.get(id(mine[rel]), -1)
                  for rel, t in _named_tensors(recording.block).items() if id(t) in self.param_index and rel in mine}
        node_offset = recorder.node_count - recording.node_start
        prefix_before, prefix_now = recording.name + ".", name + "."
        for entry in recorder.log[recording.log_start:recording.log_end]:
            if entry[0] == "tensor":
                if entry[1] not in ids:  # made inside the block
                    ids[entry[1]] = recorder.declare(recorder.shapes[entry[1]])
                continue
            _, kind, label, inputs, outputs, fields, traced = entry
            index = recorder.node_count - node_offset
            info = self.layers.get(index)
            if info is not None:
                rel = info.name[len(prefix_before):]
                now = layer_at(block, rel, prefix_now + rel, self.param_index)
                if info.side:
                    now = now.experts_side(info.side)
                now.input_shape, now.output_shape = info.input_shape, info.output_shape
                label = now.name
            elif traced:
                label = prefix_now + label[len(prefix_before):] if label.startswith(prefix_before) else label
            if info is not None or kind == "norm":  # a layer, or a norm recorded as one node: this block's parameters
                fields = {k: params.get(v, v) if k in ("weight_param", "bias_param") else v for k, v in fields.items()}
            node = recorder.node(kind, label, [ids.get(t, t) for t in inputs], [ids.get(t, t) for t in outputs], fields,
                                 traced)
            if info is not None:
                self.layers[node] = now
        for module_name, (first, end) in list(self.module_nodes.items()):
            if module_name.startswith(prefix_before) and end >= 0 and first >= recording.node_start:
                rel = module_name[len(prefix_before):]
                self.module_nodes.setdefault(prefix_now + rel, (first + node_offset, end + node_offset))
                if module_name in self.module_inputs:
                    self.module_inputs.setdefault(prefix_now + rel, self.module_inputs[module_name])
                if module_name in self.module_entries:
                    self.module_entries.setdefault(prefix_now + rel, [(leaf, ids.get(t, t))
                                                                      for leaf, t in self.module_entries[module_name]])
        self.folded.append(name)
        inputs_by_id = {id(b): n for b, n in zip(recording.flat_inputs, flat) if isinstance(b, torch.Tensor)}

        def output(value):
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in inputs_by_id:
                return inputs_by_id[id(value)]
            recorder.layer_depth += 1  # made here, not by the model: not recorded
            try:
                fresh = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            finally:
                recorder.layer_depth -= 1
            recorded = recorder.ids.get(id(value))
            if recorded is not None and recorded in ids:
                recorder.ids[id(fresh)] = ids[recorded]
                recorder.keep[ids[recorded]] = fresh
            return fresh

        return tree_map(output, recording.output)

