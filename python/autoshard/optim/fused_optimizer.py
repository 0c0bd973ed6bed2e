"""The torch.optim.Optimizer that AdamW and SGD both are. Everything but the arithmetic of a step
is the same for the two: checking settings as a group joins, refusing parameters on several
devices, agreeing across tensor-parallel ranks on non-finite gradients, loading a state dict
without losing master weights, and a step that checks every fused call before making any. It
is written once here, and each optimizer supplies its checks, its state rule and its fused op."""

from typing import Dict, Hashable, List

import torch

from ..runtime.nonfinite import agreements_for
from ..runtime.optimizer_partition import all_gather_pieces
from .fused_calls import FusedCall, check_one_device, gather_fused_calls
from .optimizer_state import (
    check_masterable,
    conform_master_state,
    keep_owned_pieces,
    load_state_dict_keeping_masters,
)


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer AdamW and SGD share (see the module docstring). A subclass sets `_name` (for
    messages), `_check_hyperparameters(values, group_index, defaults)` (the settings present in
    `values`; `defaults` fill in what a group does not set) and `_state_rule` (see StateRule, as
    staticmethods), and steps one group's fused calls in `_step_fused_calls(group, calls)`.
    `_loaded_settings` are the settings a loaded group always takes (see conform_loaded_groups)."""

    _name: str
    _loaded_settings: Dict = {}

    def __init__(self, params, defaults: Dict) -> None:
        self._check_hyperparameters(defaults, None)
        super().__init__(params, defaults)
        # Hooks that agree, at the end of each backward, on which replicated gradients are not
        # finite on which tensor-parallel rank (runtime/nonfinite.py), installed before the first backward.
        agreements_for(self._all_params())

    def _all_params(self) -> List[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for agreement in agreements_for(self._all_params()):
            agreement.forget()

    def add_param_group(self, param_group: Dict) -> None:
        if isinstance(param_group, dict):
            self._check_hyperparameters(param_group, len(self.param_groups), self.defaults)
            check_one_device(self._name, self.param_groups, param_group)
            check_masterable(self._name, {**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)

    def state_dict(self) -> Dict:
        """torch's state_dict, without ``master_weights`` where it is None (the default): a
        group then holds exactly torch.optim's keys, so that DCP, which loads the keys of the
        loading optimizer's own state dict, finds all of them in a checkpoint of torch.optim's.
        A loading autoshard optimizer keeps its own master_weights where none was saved."""
        state = super().state_dict()
        groups = [{k: v for k, v in group.items() if not (k == "master_weights" and v is None)}
                  for group in state["param_groups"]]
        return {**state, "param_groups": groups}

    def __setstate__(self, state: Dict) -> None:
        # torch's load_state_dict ends here with the saved groups, as do unpickling and deepcopy.
        super().__setstate__(state)
        self.conform_loaded_groups()

    def conform_loaded_groups(self) -> None:
        """Groups that came from a state dict: torch's switches missing from it (amsgrad,
        nesterov, foreach ...: one saved before they were kept) get their defaults, and
        `_loaded_settings` their only value here. capturable and differentiable say how torch's
        optimizer ran, not what its state is: refusing them at the next step would refuse a
        state that continues correctly here. decoupled_weight_decay becomes True as
        torch.optim.AdamW makes it on load."""
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key != "master_weights" and (value is None or isinstance(value, bool)):
                    group.setdefault(key, value)
            group.update(self._loaded_settings)

    def load_state_dict(self, state_dict: Dict) -> None:
        """torch's load_state_dict, keeping fp32 master weights and states fp32 (a state saved
        without master weights gets them); a partitioned parameter keeps only its own piece of
        state tensors saved whole (see the class docstring)."""
        load_state_dict_keeping_masters(self, state_dict, super().load_state_dict)
        keep_owned_pieces(self)

    def conform_loaded_state(self) -> None:
        """After a state was put in place from elsewhere (autoshard.checkpoint.load): master
        weights and fp32 states where master_weights asks for them, none where it does not; the
        groups' settings as conform_loaded_groups makes them."""
        self.conform_loaded_groups()
        conform_master_state(self)

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan, partitioned = gather_fused_calls(self._name, self.param_groups, self.state,
                                               self._check_hyperparameters, self._state_rule)
        # A replicated gradient that is not finite on some tensor-parallel ranks only: every rank
        # raises alike, before anything is stepped (the ranks agreed on it in backward).
        stepped = [p for _, calls in plan for call in calls.values() for p in call.keys]
        for agreement in agreements_for(self._all_params()):
            agreement.check(stepped)
        for group, calls in plan:
            self._step_fused_calls(group, calls)
        if partitioned:  # the owned pieces were stepped: every replica gets the whole parameters back
            all_gather_pieces(partitioned)
        return loss

    def _step_fused_calls(self, group: Dict, calls: Dict[Hashable, FusedCall]) -> None:
        """One parameter group's step, one fused op per call: what each optimizer (AdamW, SGD)
        defines for itself; the base class has no step of its own."""
        raise NotImplementedError(f"{type(self).__name__} defines no _step_fused_calls")
