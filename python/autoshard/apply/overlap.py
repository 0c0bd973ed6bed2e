"""Overlap in backward turned on for a sharded model: each column-parallel Linear whose input is
copied or whose tokens are gathered is listed as a reader of that copy (nn/backward_overlap.py
defers its weight gradient until the input gradient's reduction has started)."""

import torch

from ..nn.input_copies import SharedInputCopy
from ..nn.linear import ColumnParallelLinear
from ..nn.sequence import GatherTokens, already_gathered


def enable(model: torch.nn.Module, tokens=None) -> int:
    """Turns overlap on for every column-parallel Linear of `model` whose input is copied or
    whose tokens are gathered, by itself, with the layers sharing its copy, or by a module of
    the plan's (`tokens`, the PlanSteps of sequence parallelism); returns how many."""
    module_gathers = [] if tokens is None else tokens.module_gathers
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear) or module._world == 1 or not module.plain_product:
            continue
        entry = module.input_copy
        if isinstance(entry, SharedInputCopy) and entry.enter is not None:
            entry = entry.enter  # the tokens' gather, shared by the layers reading one tensor
        if entry is None:
            module.overlap_readers = [module]
        elif isinstance(entry, (SharedInputCopy, GatherTokens)):
            entry.overlap_readers.append(module)
        elif entry is already_gathered:
            # Tokens a module gathered as it received them (the attention whose length the
            # layers read), or as another module returned them. Listing a layer that reads
            # something else is harmless: only a layer reading the gathered tensor itself defers.
            gathers = [g for at, g, exit in module_gathers if not exit and name.startswith(at + ".")]
            gathers = gathers or [g for _, g, exit in module_gathers if exit]
            if not gathers:
                continue
            for gather in gathers:
                gather.overlap_readers.append(module)
        else:
            continue  # a layer whose calls read different tensors
        count += 1
    return count
