"""Which of the model's ops run under its own torch.no_grad().

The planner traces the forward under torch.no_grad() (no autograd graph on meta), so
torch.is_grad_enabled() cannot tell the model's own no_grad blocks from the rest (the PE Audio
encoder runs its DAC encoder in one). While the trace runs, ModelGradMode follows the model's
entries into and exits from torch.no_grad(), torch.inference_mode() and torch.enable_grad()
(blocks and decorators alike, which enter the same classes) and says whether the model computes
with gradients at each op. The recorder marks the nodes recorded without them ("no_grad"), and
the planner predicts no gradient, and no backward collective, through them
(csrc/plan/gradient_flow.cpp)."""

from torch.autograd import grad_mode

# The context managers that set the mode, and the mode each sets.
_MODES = ((grad_mode.no_grad, False), (grad_mode.inference_mode, False), (grad_mode.enable_grad, True))


class ModelGradMode:
    def __init__(self) -> None:
        self.modes = [True]  # the model is traced as training calls it: with gradients
        self._saved = []

    @property
    def enabled(self) -> bool:
        return self.modes[-1]

    def __enter__(self) -> "ModelGradMode":
        for cls, mode in _MODES:
            enter, leave = vars(cls).get("__enter__"), vars(cls).get("__exit__")
            self._saved.append((cls, enter, leave))
            inherited_enter, inherited_leave = cls.__enter__, cls.__exit__

            def entering(context, enter=inherited_enter, mode=mode):
                self.modes.append(mode)
                return enter(context)

            def leaving(context, *exc, leave=inherited_leave):
                self.modes.pop()
                return leave(context, *exc)

            cls.__enter__, cls.__exit__ = entering, leaving
        return self

    def __exit__(self, *exc) -> None:
        for cls, enter, leave in reversed(self._saved):
            for name, original in (("__enter__", enter), ("__exit__", leave)):
                if original is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)
        self._saved.clear()
