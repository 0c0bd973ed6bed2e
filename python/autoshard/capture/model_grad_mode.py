"""Which of the model's ops run under its own torch.no_grad().

The planner traces the forward under torch.no_grad() (no autograd graph on meta), so
torch.is_grad_enabled() cannot tell the model's own no_grad blocks from the rest (the PE Audio
encoder runs its DAC encoder in one). While the trace runs, ModelGradMode follows the model's
entries into and exits from torch.no_grad(), torch.inference_mode(mode), torch.enable_grad() and
torch.set_grad_enabled(mode) (blocks and decorators alike) and says
whether the model computes with gradients at each op. The recorder marks the nodes recorded
without them ("no_grad"), and the planner predicts no gradient, and no backward collective,
through them (csrc/plan/gradient_flow.cpp)."""

from torch.autograd import grad_mode


class ModelGradMode:
    def __init__(self) -> None:
        self.modes = [True]  # the model is traced as training calls it: with gradients
        self._saved = []

    @property
    def enabled(self) -> bool:
        return self.modes[-1]

    # What each context sets, read from the context object itself: inference_mode(False) and
    # set_grad_enabled(True) leave gradients on.
    def _mode_of(self, context) -> bool:
        if isinstance(context, grad_mode.no_grad):
            return False
        if isinstance(context, grad_mode.enable_grad):
            return True
        if isinstance(context, grad_mode.inference_mode):
            return self.enabled and not context.mode
        return bool(context.mode)

    def _patch(self, cls, name: str, replacement) -> None:
        self._saved.append((cls, name, vars(cls).get(name)))
        setattr(cls, name, replacement)

    def __enter__(self) -> "ModelGradMode":
        # set_grad_enabled sets the mode when it is made; it is followed where the model uses it
        # as a block or a decorator (entered, then left), not as a plain call: torch's own
        # no_grad makes plain calls on entry and exit, restoring the mode the trace runs under.
        for cls in (grad_mode.no_grad, grad_mode.inference_mode, grad_mode.enable_grad, grad_mode.set_grad_enabled):
            def entering(context, enter=cls.__enter__):
                self.modes.append(self._mode_of(context))
                return enter(context)

            def leaving(context, *exc, leave=cls.__exit__):
                self.modes.pop()
                return leave(context, *exc)

            self._patch(cls, "__enter__", entering)
            self._patch(cls, "__exit__", leaving)
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, original in reversed(self._saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._saved.clear()
