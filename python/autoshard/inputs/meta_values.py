"""Values on the meta device, where the forward needs them: a padding check on the input ids
(`pad_token_id in input_ids`, `.item()`, `.tolist()`, `nonzero`).

Meta tensors have shapes but no values, so such a read fails on meta. KnownValues follows the
tensors computed from the example inputs and constants alone (masks, ids, positions) with a
small CPU twin holding their values, and answers an op that meta cannot compute from those
twins, exactly as the real forward would on the same inputs. Nothing else changes: every op
that meta computes runs on meta as before, and a twin is only consulted when meta fails, so a
model that ran on meta without it traces the same ops. A value computed from weights or
buffers (which meta does not hold) stays unknown, and reading it fails with an error that says
so, with two exceptions: `nonzero` of such a value (mixture-of-experts routing, which tokens
reach an expert) answers as if every element were nonzero, so that every expert is followed; and
such a value indexed by known indices (`inputs_embeds[mask]`, the mask of a model's image or
audio tokens in the ids) answers with the shape those indices select, its values unknown.
"""

from typing import Dict, Optional, Tuple

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# Twins are for ids and masks, not activations: a tensor larger than this has none.
TWIN_ELEMENT_LIMIT = 1 << 22


class UnknownValueError(RuntimeError):
    """An op needs the values of a meta tensor that depends on more than the example inputs."""


# Their values are whatever memory held: never a value to answer with.
_UNINITIALIZED = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                  torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.empty_permuted}


def _shallow_tensors(value, keep_none: bool = False) -> list:
    """The tensors of an op's arguments or results: a tensor, or a sequence holding tensors (one
    level deep, as ATen's schemas allow); with keep_none, every position of the sequence."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple, type({}.values()))):
        found = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found += [t if isinstance(t, torch.Tensor) else None for t in item
                          if keep_none or isinstance(t, torch.Tensor)]
            elif keep_none:
                found.append(None)
        return found
    return []


def _is_meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


class KnownValues(TorchDispatchMode):
    """A dispatch mode keeping CPU twins of meta tensors computed from the inputs alone."""

    def __init__(self):
        super().__init__()
        # id(meta tensor) -> (a weak reference to the meta tensor, its twin). The meta tensor is
        # not kept alive (a memory prediction counts what the forward holds); its entry goes
        # with it, and a lookup checks identity, so an id used again never finds another's twin.
        self._twins: Dict[int, Tuple[weakref.ref, torch.Tensor]] = {}
        self._stale = set()  # storages of twins whose tensor was written with unknown values
        self._written: Dict[object, list] = {}  # op -> the arguments it writes to

    # ---- twins

    def know(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        if value.numel() <= TWIN_ELEMENT_LIMIT:
            key, twins = id(meta), self._twins

            def gone(ref, key=key, twins=twins):
                if twins.get(key, (None,))[0] is ref:
                    del twins[key]

            twins[key] = (weakref.ref(meta, gone), value)

    def twin(self, value) -> Optional[torch.Tensor]:
        """The CPU twin of a meta tensor, a non-meta tensor itself, or None if unknown."""
        if not isinstance(value, torch.Tensor):
            return None
        if not _is_meta(value):
            return value
        entry = self._twins.get(id(value))
        if entry is None or entry[0]() is not value or entry[1].untyped_storage().data_ptr() in self._stale:
            return None
        return entry[1]

    def to_meta(self, value):
        """`value` (tensors anywhere in it) on meta, each tensor's values kept as its twin."""
        def convert(t):
            if not isinstance(t, torch.Tensor) or _is_meta(t):
                return t
            twin = t.detach().to("cpu").clone()
            meta = t.to("meta")
            self.know(meta, twin)
            return meta
        return tree_map(convert, value)

    # ---- dispatch

    def __enter__(self):
        result = super().__enter__()
        self._indexing = _IndexingValues(self)
        self._indexing.__enter__()
        return result

    def __exit__(self, *exc):
        self._indexing.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:  # what meta cannot compute
            fake = _fake_result(func, args, kwargs)
            if fake is not None:
                return fake
            return self._answer(func, args, kwargs, error)
        self._follow(func, args, kwargs, out)
        return out

    def _mutated(self, func, args, kwargs):
        written = self._written.get(func)
        if written is None:
            written = self._written[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                                              if a.alias_info is not None and a.alias_info.is_write]
        for index, name in written:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                yield value

    def _forget(self, meta: torch.Tensor) -> None:
        """`meta` was written with unknown values: its twin, and every view sharing its storage,
        no longer holds its values."""
        entry = self._twins.pop(id(meta), None)
        if entry is not None and entry[0]() is meta:
            self._stale.add(entry[1].untyped_storage().data_ptr())

    def _follow(self, func, args, kwargs, out) -> None:
        outputs = _shallow_tensors(out)
        if not any(o.device.type == "meta" for o in outputs):
            return
        tensors = _shallow_tensors(args) + _shallow_tensors(kwargs.values())
        # Most ops read a weight or an activation: no twin, nothing to compute.
        known = (all(self.twin(t) is not None for t in tensors) and func.overloadpacket not in _UNINITIALIZED
                 and torch.Tag.nondeterministic_seeded not in func.tags
                 and all(o.numel() <= TWIN_ELEMENT_LIMIT for o in outputs))
        twin_out = self._run_on_twins(func, args, kwargs) if known else None
        if twin_out is None:
            if self._twins:
                for written in self._mutated(func, args, kwargs):
                    self._forget(written)
            return
        for meta, twin in zip(_shallow_tensors(out, keep_none=True), _shallow_tensors(twin_out, keep_none=True)):
            if _is_meta(meta) and isinstance(twin, torch.Tensor) and tuple(twin.shape) == tuple(meta.shape):
                self.know(meta, twin)

    def _run_on_twins(self, func, args, kwargs):
        replaced = _twins(self, (args, kwargs))
        if replaced is None:
            return None
        try:
            return func(*replaced[0], **replaced[1])
        except Exception:  # noqa: BLE001 - a twin that cannot be computed is merely unknown
            return None

    def _answer(self, func, args, kwargs, error: Exception):
        replaced = _twins(self, (args, kwargs))
        if replaced is None and func.overloadpacket is torch.ops.aten.nonzero and _is_meta(args[0]):
            # Routing: which tokens an expert receives depends on the router's weights. Every
            # token is assumed to reach every expert, so that the capture follows each expert.
            replaced = (torch.ones(args[0].shape, dtype=torch.bool),), {}
        if replaced is None:
            selected = self._selected_shape(func, args, kwargs)
            if selected is not None:
                return selected
            unknown = [tuple(a.shape) for a in tree_flatten((args, kwargs))[0]
                       if _is_meta(a) and self.twin(a) is None]
            if not unknown or not _reads_values(error):
                raise error
            raise UnknownValueError(
                f"{func} reads the values of a tensor of shape {list(unknown[0])} on the meta device, and they "
                "depend on more than the example inputs (on weights or buffers, which meta does not hold); "
                f"planning can only follow value-dependent code on the inputs themselves ({error})") from error
        try:
            result = func(*replaced[0], **replaced[1])
        except Exception:  # noqa: BLE001 - the twins cannot compute it either: meta's own error
            raise error from None
        if _wants_host_copy(func, args, kwargs):
            return result  # an explicit copy off meta (.tolist(), .cpu()): the values themselves

        def back_to_meta(value):  # the twins' result as meta tensors whose values are known
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return value
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            self.know(meta, value)
            return meta
        return tree_map(back_to_meta, result)

    def _selected_shape(self, func, args, kwargs) -> Optional[torch.Tensor]:
        """Indexing an unknown tensor by known indices (`inputs_embeds[mask]`, the mask made from the
        ids' image or audio tokens): the result's shape follows from the indices alone, so it is
        answered with a meta tensor of that shape whose values stay unknown. None otherwise."""
        if func.overloadpacket is not torch.ops.aten.index or kwargs or len(args) != 2 or not _is_meta(args[0]):
            return None
        indices = [None if i is None else self.twin(i) for i in args[1]]
        if any(t is None for t, i in zip(indices, args[1]) if i is not None):
            return None
        # Every element alike (a zero-stride view): only which are selected matters, not their values.
        stand_in = torch.zeros((), dtype=args[0].dtype).expand(args[0].shape)
        try:
            result = func(stand_in, indices)
        except Exception:  # noqa: BLE001 - indices that do not fit: meta's own error follows
            return None
        return torch.empty(result.shape, dtype=result.dtype, device="meta")


class _IndexingValues(TorchFunctionMode):
    """Indexing with a Python sequence (`input_ids[:, [-1, 0]]`) makes its index tensor on meta
    out of the dispatcher's sight, so its values never reach KnownValues: the twin of such an
    index is taken here, from the indexed tensor's twin and the index as written. A device move
    (Tensor.to) is told apart from a read of values here too, where the call is still seen."""

    def __init__(self, values: KnownValues):
        super().__init__()
        self.values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        moved = self._device_move(func, args, kwargs or {})
        if moved is not None:
            return moved
        out = func(*args, **(kwargs or {}))
        if not _is_meta(out) or self.values.twin(out) is not None:
            return out
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            source, index = self.values.twin(args[0]), _twins(self.values, args[1])
            if source is not None and index is not None:
                self._know(out, lambda: source[index])
        elif func in (torch.tensor, torch.as_tensor):
            # A tensor written out in Python (torch.tensor([2], device=...)) is made on meta out
            # of the dispatcher's sight: its twin is made from the same data on the CPU.
            data = _twins(self.values, (args, kwargs))
            if data is not None:
                self._know(out, lambda: func(*data[0], **{**data[1], "device": "cpu"}))
        return out

    def _know(self, out: torch.Tensor, compute) -> None:
        """`out`'s twin computed from twins by `compute`, where it computes one of out's shape."""
        with _disable_current_modes():
            try:
                value = compute()
            except Exception:  # noqa: BLE001 - what the twins cannot take stays unknown
                return
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(out.shape):
            self.values.know(out, value)

    def _device_move(self, func, args, kwargs) -> Optional[torch.Tensor]:
        """`x.to(device)` of a meta tensor whose values are unknown (TransformerLens's
        `residual.to(cfg.device)`): a device move reads no value, so on meta it stays on meta, with
        the dtype asked for. Only Tensor.to is read so: .cpu(), .tolist() and .numpy() ask for the
        values themselves, and the dispatcher sees one copy off meta for all of them."""
        if func is not torch.Tensor.to or not args or not _is_meta(args[0]):
            return None
        if self.values.twin(args[0]) is not None:
            return None  # known values: copied off meta as they are, for what reads them
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        if device is None or device.type == "meta":
            return None
        options = {} if memory_format is None else {"memory_format": memory_format}
        return args[0].to(device="meta", dtype=dtype or args[0].dtype, non_blocking=non_blocking, **options)


def _twins(values: KnownValues, tree):
    """`tree` with every meta tensor replaced by its twin (and device "meta" by the CPU), or
    None if some meta tensor has no known values."""
    flat, spec = tree_flatten(tree)
    replaced = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            value = values.twin(value)
            if value is None:
                return None
        elif isinstance(value, torch.device) and value.type == "meta" or isinstance(value, str) and value == "meta":
            value = torch.device("cpu")
        replaced.append(value)
    return tree_unflatten(replaced, spec)


def _fake_result(func, args, kwargs) -> Optional[torch.Tensor]:
    """The meta result of an op whose meta kernel refuses the arguments' dtype or strides
    (torch's grouped matmul takes only bf16 with 16-byte strides there, while its CPU kernel
    takes fp32): a tensor of the shape the op gives, or None for any other op."""
    if func.overloadpacket is not torch.ops.aten._grouped_mm:
        return None
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if not (_is_meta(a) and _is_meta(b)):
        return None
    dtype = kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[0] if offs is None else offs.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:
        return None
    return torch.empty(shape, dtype=dtype, device="meta")


def _reads_values(error: Exception) -> bool:
    text = str(error)
    return any(s in text for s in ("meta tensor", "data-dependent", "data-independent", "no data", "Meta"))


def _wants_host_copy(func, args, kwargs) -> bool:
    """A copy from meta to another device (what .tolist(), .cpu() and .numpy() ask for)."""
    if func.overloadpacket not in (torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.aten.copy_):
        return False
    device = kwargs.get("device")
    if func.overloadpacket is torch.ops.aten.copy_:
        return isinstance(args[0], torch.Tensor) and not _is_meta(args[0])
    return device is not None and torch.device(device).type != "meta"
