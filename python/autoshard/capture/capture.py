"""Records a model's dataflow on meta tensors, as the graph the C++ planner reads.

Linear-like layers, embeddings and einsum layers are recorded as single nodes (the planner
decides how to split them and parallelize() swaps them); everything else is recorded at the
ATen level and reduced to the few kinds of op that matter for following a sharded axis.
Nothing is materialised: a model on a real device is shadowed by a meta copy first.
"""

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .folding import BlockFolder
from .index_lists import ConsecutiveIndexLists
from ..inputs.hf_inputs import media_beside_text, missing_decoder_inputs
from .model_grad_mode import ModelGradMode
from ..constructs.layer_info import LayerInfo
from .layers import describe_layer, in_projection_layer
from ..inputs.meta_autocast import meta_autocast
from ..inputs.meta_inputs import clone_or_none, describe_inputs, input_shapes, inputs_on_meta, replayable
from ..inputs.meta_shadow import meta_shadow
from .function_caches import fresh_caches
from ..inputs.meta_values import KnownValues
from ..constructs.split_norm import layer_norm_form
from ..nn.batch_norm import is_batch_norm
from .module_calls import attention_calls, norm_calls, record_attention_weights
from .expert_calls import ExpertReads
from .recorder import Recorder


aten = torch.ops.aten


@dataclass
class CapturedGraph:
    document: Dict[str, Any]  # the planner's input, a versioned graph document (see csrc/plan/graph.h)
    layers: Dict[int, LayerInfo]  # planner node index -> the layer module it stands for
    param_names: List[str]  # parameter index -> a qualified name
    output_shapes: List[Tuple[int, ...]]
    shadow: nn.Module = None  # the meta model that ran
    module_inputs: Dict[str, Tuple[tuple, dict]] = field(default_factory=dict)  # first call of each module
    # Of each module's first call, the flat positions of its inputs that a layer's call gave: a
    # norm taking one is one node, in a trace of the module alone too (shape_trace).
    module_layer_inputs: Dict[str, List[int]] = field(default_factory=dict)
    description: str = ""
    example_inputs: Optional[Dict[str, Any]] = None  # shapes and dtypes, to make them again
    shapes: List[Tuple[int, ...]] = field(default_factory=list)  # tensor id -> global shape
    nodes: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = field(default_factory=list)  # (op label, input ids, output ids)
    module_nodes: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # first call: [first, end) nodes
    # The values of the tensors computed from the inputs (module_inputs' among them), for replays.
    values: Optional[KnownValues] = None
    # The example inputs (args, kwargs) with their values on the CPU (None where too large to keep).
    input_values: Optional[Tuple[tuple, dict]] = None
    folded: Dict[str, str] = field(default_factory=dict)  # block recorded without running -> the block it copies
    inner_nodes: set = field(default_factory=set)  # nodes inside a layer, which no trace sees
    layer_calls: set = field(default_factory=set)  # nodes a trace sees as a layer's call
    # Gatherable parameters whose module is never called: the module whose call reads them.
    gather_calls: Dict[int, str] = field(default_factory=dict)


def capture(model: nn.Module, example_inputs=None, fold_blocks: bool = True) -> CapturedGraph:
    try:
        return _capture(model, example_inputs, fold_blocks)
    except RuntimeError as error:
        if example_inputs is not None or not media_beside_text(model):
            raise
        # The images (audio) made from the config do not fit the model: its text alone is planned.
        warnings.warn(f"plan: {type(model).__name__} failed with the images or audio autoshard made from its config "
                      f"({error}); it is planned on its text alone, so its vision or audio tower is not traced and "
                      "stays whole on every rank: pass example_inputs with the model's image or audio inputs to plan "
                      "the tower too")
        return _capture(model, None, fold_blocks, media=False)


def _capture(model: nn.Module, example_inputs, fold_blocks: bool, media: bool = True) -> CapturedGraph:
    shadow = meta_shadow(model)
    values = KnownValues()
    args, kwargs = inputs_on_meta(shadow, example_inputs, values, media=media)
    input_values = tree_map(lambda t: clone_or_none(values.twin(t)) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    if any(v is None for v, t in zip(tree_flatten(input_values)[0], tree_flatten((args, kwargs))[0])
           if isinstance(t, torch.Tensor)):
        input_values = None  # too large to keep: the dry run makes zeros of their shapes

    param_names: List[str] = []
    param_index: Dict[int, int] = {}
    for name, p in shadow.named_parameters(remove_duplicate=True):
        param_index[id(p)] = len(param_names)
        param_names.append(name)

    recorder = Recorder(param_index)
    layers: Dict[int, LayerInfo] = recorder.layers
    layer_by_module: Dict[int, LayerInfo] = {}
    handles = []
    module_inputs: Dict[str, Tuple[tuple, dict]] = {}
    module_layer_inputs: Dict[str, List[int]] = {}
    module_nodes: Dict[str, Tuple[int, int]] = {}
    module_entries: Dict[str, List[Tuple[int, int]]] = {}
    module_exits: Dict[str, List[Tuple[int, int]]] = {}
    called_again = set()
    folder = BlockFolder(shadow, recorder, module_inputs, module_nodes, module_entries,
                         lambda a, kw: (replayable(a), replayable(dict(kw))), enabled=fold_blocks)
    # Where each recorded tensor enters or leaves a call, for the planner's "entry" and "exit" records.
    recorded = lambda leaves: [(i, recorder.ids[id(t)]) for i, t in enumerate(leaves)
                               if isinstance(t, torch.Tensor) and id(t) in recorder.ids]
    for name, module in shadow.named_modules():
        def remember(mod, a, kw, name=name):
            if name not in module_nodes:
                # A block to be folded takes its first block's inputs (see BlockFolder), unless it runs.
                if name not in folder.folds:
                    module_inputs[name] = (replayable(a), replayable(dict(kw)))
                module_nodes[name] = (recorder.node_count, -1)
                leaves = tree_flatten((tuple(a), dict(kw)))[0]
                module_entries[name] = recorded(leaves)
                module_layer_inputs[name] = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                                             and recorder.ids.get(id(t), -1) in recorder.layer_outputs]
            else:
                # A hook on the output of a module called again would act on every call.
                called_again.add(name)

        def finished(mod, a, out, name=name):
            if name in module_nodes and module_nodes[name][1] < 0:
                module_nodes[name] = (module_nodes[name][0], recorder.node_count)
                module_exits[name] = recorded(tree_flatten(out)[0])

        handles.append(module.register_forward_pre_hook(remember, with_kwargs=True))
        handles.append(module.register_forward_hook(finished))
    for name, module in shadow.named_modules(remove_duplicate=False):
        info = describe_layer(name, module, param_index)
        if info is None or id(module) in layer_by_module:  # a module reachable under two names is one layer
            continue
        layer_by_module[id(module)] = info
        if info.construct.records_weight_products(info):
            recorder.linear_weights[id(module.weight)] = info

        def pre(mod, inputs, info=info):
            if recorder.layer_depth == 0:
                info.input = inputs[0] if inputs else None
                info.inputs = tuple(inputs)
                if info.construct.recorded_at_lookup(info):
                    recorder.lookup_weight, recorder.lookup_indices = id(mod.weight), None
                if info.construct.records_inner_nodes:
                    recorder.experts_reads = ExpertReads(**info.construct.weight_reads(mod, info))
            recorder.layer_depth += 1

        def post(mod, inputs, output, info=info):
            recorder.layer_depth -= 1
            if recorder.layer_depth == 0 and recorder.lookup_weight is not None:
                # Its node reads the indices its forward made and looked up (see Recorder).
                info.input = recorder.lookup_indices
                recorder.lookup_weight, recorder.lookup_indices = None, None
            if info.construct.records_inner_nodes and recorder.layer_depth == 0:
                refusals = recorder.experts_reads.refusals
                recorder.experts_reads = None
                if (not refusals and isinstance(info.input, torch.Tensor) and isinstance(output, torch.Tensor)
                        and output.shape == info.input.shape):
                    recorder.experts_nodes(info, output, layers)
                else:
                    # Its weights used otherwise than multiplied by its inputs (a norm over the
                    # FFN axis), or a call of another form: one opaque call, its weights whole.
                    received = [t for t in tree_flatten(info.inputs)[0] if isinstance(t, torch.Tensor)]
                    made = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)]
                    recorder.node("opaque", info.name or "<model>", [recorder.tensor_id(t) for t in received],
                                  [recorder.tensor_id(o) for o in made], {"routing_floating": []}, "call")
            elif recorder.layer_depth == 0 and isinstance(info.input, torch.Tensor) and isinstance(output, torch.Tensor):
                recorder.layer_node(info, info.input, output, info.construct.last_axis_features)
            info.input = None
            info.inputs = ()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    def record_in_projection(name, module, x, out):
        recorder.layer_node(in_projection_layer(name, module, param_index), x, out)

    def record_norm(name, module, x, out):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        fields = {"weight_param": param_index.get(id(weight), -1) if weight is not None else -1}
        inputs = [recorder.tensor_id(x)] + ([recorder.tensor_id(weight)] if weight is not None else [])
        # A BatchNorm is per channel over the batch and positions; a LayerNorm's mean and variance
        # both need every rank's features. Either's bias is an input like its weight, so that its
        # gradient is followed as the weight's is (where it stays whole).
        form = {"per_channel": True, "running_stats": module.track_running_stats and module.running_mean is not None} \
            if is_batch_norm(module) else {"centered": True} if layer_norm_form(module) else None
        if form is not None:
            fields.update(form, bias_param=param_index.get(id(bias), -1) if bias is not None else -1)
            if bias is not None:
                inputs.append(recorder.tensor_id(bias))
        recorder.node("norm", name, inputs, [recorder.tensor_id(out)], fields, "call")

    handles += norm_calls(shadow, recorder, record_norm, lambda m: describe_layer("", m, {}) is not None)
    example = describe_inputs(args, kwargs)
    recorder.grad_mode = ModelGradMode()
    try:  # a cache filled before would skip ops the dry run then runs, one kept after would skip the next trace's
        with fresh_caches(shadow), torch.no_grad(), recorder.grad_mode, meta_autocast(), values, recorder, folder, ConsecutiveIndexLists(), \
                attention_calls(shadow, recorder, record_in_projection,
                                functools.partial(record_attention_weights, recorder)):
            outputs = shadow(*args, **kwargs)
    except Exception as error:
        hint = ""
        if example_inputs is not None and missing_decoder_inputs(shadow, kwargs):
            hint = (f"; {type(shadow).__name__} is an encoder-decoder model and example_inputs has no "
                    "decoder_input_ids (nor decoder_inputs_embeds or labels): add decoder_input_ids to the dict, "
                    "or leave example_inputs=None to have every input made from the config")
        raise RuntimeError(
            f"plan: the model's forward failed on the meta device ({type(error).__name__}: {error}){hint}; autoshard "
            "plans by running the forward on meta tensors, so the model must support them and example_inputs must "
            "fit it"
        ) from error
    finally:
        for h in handles:
            h.remove()

    if hasattr(outputs, "to_tuple"):
        outputs = outputs.to_tuple()
    flat = [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor)]
    # A tensor a module's first call received, where sequence parallelism may cut it to this
    # rank's tokens: {"tensor", "first", "end" (the call's nodes), "leaf" (its place among the
    # call's flattened inputs), "module"}.
    entries = [{"tensor": tensor, "first": module_nodes[name][0], "end": module_nodes[name][1], "leaf": leaf,
                "module": name}
               for name, received in module_entries.items() if name and module_nodes[name][1] >= module_nodes[name][0]
               for leaf, tensor in received]
    # A tensor a module returned, where sequence parallelism may gather it (csrc/plan/token_indexing.cpp),
    # in the order the calls returned: the same fields, "leaf" its place among the flattened outputs.
    # Only modules called once: a hook on the output of a module called again would act on every call.
    exits = [{"tensor": tensor, "first": module_nodes[name][0], "end": module_nodes[name][1], "leaf": leaf,
              "module": name}
             for name, returned in module_exits.items() if name and name not in called_again
             for leaf, tensor in returned]
    document = recorder.document([recorder.tensor_id(o) for o in flat])
    gather_calls: Dict[int, str] = {}
    document["gatherable_params"] = _read_in_one_call(recorder, param_names, module_nodes, called_again, shadow,
                                                      gather_calls)
    _record_gradient_facts(document, layers, shadow, [t is None or t.is_floating_point() or t.is_complex()
                                                       for t in recorder.keep])
    _record_adapters(document, layers, shadow)
    return CapturedGraph(
        document={**document, "entries": entries, "exits": exits},
        layers=layers,
        param_names=param_names,
        output_shapes=[tuple(o.shape) for o in flat],
        shadow=shadow,
        module_inputs=module_inputs,
        module_layer_inputs=module_layer_inputs,
        description=input_shapes(args, kwargs),
        example_inputs=example if all(a is not None for a in example["args"]) else None,
        shapes=recorder.shapes,
        nodes=recorder.nodes,
        module_nodes=module_nodes,
        values=values,
        input_values=input_values,
        folded={name: folder.folds[name] for name in folder.folded},
        inner_nodes=recorder.inner_nodes,
        layer_calls=recorder.layer_calls,
        gather_calls=gather_calls,
    )


def _read_in_one_call(recorder, param_names: List[str], module_nodes: Dict[str, Tuple[int, int]],
                       called_again, shadow: nn.Module, gather_calls: Dict[int, str]) -> List[int]:
    """The parameters (by index) whose every recorded read lies inside the one call of the module
    holding them: a parameter stored split can be gathered whole where that call begins. Where
    that module is never called (a position table whose weight its parent's forward slices and
    interpolates itself), the call is the innermost called ancestor's, recorded in
    `gather_calls`. Not an nn.MultiheadAttention's: its forward takes another path (the fused
    one) for weights that are not parameters requiring a gradient, which a dry run without
    gradients would see."""
    reads: Dict[int, List[int]] = {}
    for node, (_, inputs, _) in enumerate(recorder.nodes):
        for tensor in inputs:
            param = recorder.tensors[tensor].get("param", -1)
            if param >= 0:
                reads.setdefault(param, []).append(node)
    found = []
    for param, nodes in sorted(reads.items()):
        owner = param_names[param].rpartition(".")[0]
        if isinstance(shadow.get_submodule(owner), nn.MultiheadAttention):
            continue
        caller = owner
        while caller not in module_nodes and caller:
            caller = caller.rpartition(".")[0]
        first, end = module_nodes.get(caller, (0, -1))
        if caller not in called_again and all(first <= node < end for node in nodes):
            found.append(param)
            if caller != owner:
                gather_calls[param] = caller
    return found


def _record_gradient_facts(document: dict, layers: dict, shadow: nn.Module, floating: List[bool]) -> None:
    """Writes into the graph document what the planner needs to know which tensors a backward
    pass reaches (csrc/plan/gradient_flow.h): the tensors that are not floating-point, the
    parameters that require no gradient, and the layers none of whose module's parameters do
    (a layer's output needs a gradient when any parameter of its module requires one: a LoRA
    layer's factors beside a frozen base weight). Only the exceptions are written."""
    trainable = [p.requires_grad for _, p in shadow.named_parameters(remove_duplicate=True)]
    for index, record in enumerate(document["tensors"]):
        if not floating[index]:
            record["floating"] = False
        if "param" in record and not trainable[record["param"]]:
            record["trainable"] = False
    modules = dict(shadow.named_modules())
    for index, node in enumerate(document["nodes"]):
        if node["kind"] not in ("linear", "embedding", "einsum"):
            continue
        info = layers.get(index)
        # The q/k/v projection of an nn.MultiheadAttention is no module of its own: taken as trainable.
        if info is None or (info.name in modules and not any(p.requires_grad for p in modules[info.name].parameters())):
            node["trainable"] = False


def _record_adapters(document: dict, layers: dict, shadow: nn.Module) -> None:
    """Writes each LoRA layer's factors into its node of the graph document (parameter indices,
    shapes, whether trained): the planner splits them with the layer (csrc/plan/constructs/adapters.cpp)."""
    params = [p for _, p in shadow.named_parameters(remove_duplicate=True)]
    for node, info in layers.items():
        if info.adapters:
            document["nodes"][node]["adapters"] = [
                {"a": a, "b": b, "a_shape": list(params[a].shape), "b_shape": list(params[b].shape),
                 "a_trainable": params[a].requires_grad, "b_trainable": params[b].requires_grad}
                for a, b in info.adapters]
