"""Setting a module's attribute by its dotted name, its configuration's included: how a global
size (a head count, GPT-2's split_size) becomes the local one on the module that reads it."""

import copy

from torch import nn

CONFIG = "config"


def set_attribute(module: nn.Module, dotted: str, value) -> None:
    """Sets `dotted` ("num_heads", "self.all_head_size" on a submodule, or "config.num_attention_heads"
    on a module's configuration) on `module`. A configuration is shared by the model's modules:
    the module gets a copy of its own first, so that only it sees the local size."""
    owner_name, _, attr = dotted.rpartition(".")
    module_name, _, config = owner_name.rpartition(".") if owner_name.endswith(CONFIG) else (owner_name, "", "")
    if owner_name == CONFIG:
        module_name, config = "", CONFIG
    owner = module.get_submodule(module_name) if module_name else module
    if config:
        if not getattr(owner, "_autoshard_own_config", False):
            owner.__dict__[CONFIG] = copy.copy(getattr(owner, CONFIG))
            owner._autoshard_own_config = True
        owner = getattr(owner, CONFIG)
    setattr(owner, attr, value)
