"""Parts of a model its own forward runs under torch.no_grad() (a frozen feature extractor, as the
PE Audio encoder runs its DAC encoder): no gradient flows through them, and the plan predicts no
backward collective for them, equal to what a step counts."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from gathered import nonzero_counts
from multirank import run_on_ranks


class FrozenFeatures(nn.Module):
    """An MLP whose first block runs without gradients, by a block or by a decorator."""

    def __init__(self, decorated: bool):
        super().__init__()
        self.decorated = decorated
        self.up1, self.down1 = nn.Linear(12, 40), nn.Linear(40, 12)
        self.up2, self.down2 = nn.Linear(12, 40), nn.Linear(40, 12)
        self.head = nn.Linear(12, 12)

    @torch.no_grad()
    def _frozen(self, x):
        return x + self.down1(torch.relu(self.up1(x)))

    def forward(self, x):
        if self.decorated:
            h = self._frozen(self.head(x))
        else:
            with torch.no_grad():
                h = self.head(x)
                h = h + self.down1(torch.relu(self.up1(h)))
            with torch.enable_grad():  # a block inside, with gradients again, outside any no_grad here
                h = h * 1.0
        return h + self.down2(torch.relu(self.up2(h)))


def _predicted_and_counted(decorated: bool):
    torch.manual_seed(0)
    model = FrozenFeatures(decorated)
    reference = FrozenFeatures(decorated)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    out = model(x)
    torch.testing.assert_close(out, reference(x))
    with autoshard.CommCounter() as backward:
        out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    grads = {name: p.grad is not None for name, p in reference.named_parameters()}
    return nonzero_counts(backward), plan.collectives("backward"), grads


@pytest.mark.parametrize("decorated", [False, True])
def test_no_backward_collectives_predicted_through_the_models_no_grad(decorated):
    counted, predicted, grads = run_on_ranks(_predicted_and_counted, 2, decorated)[0]
    # The frozen block and the head before it get no gradient; the MLP after it does, and its
    # input (the frozen block's output) needs none: no all-reduce of it in backward.
    assert grads == {"up1.weight": False, "up1.bias": False, "down1.weight": False, "down1.bias": False,
                     "up2.weight": True, "up2.bias": True, "down2.weight": True, "down2.bias": True,
                     "head.weight": False, "head.bias": False}
    assert counted == predicted == {}, (counted, predicted)


class ModeSetters(nn.Module):
    """A head, then a block whose gradients a context sets by its own mode, then an MLP."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.head = nn.Linear(12, 12)
        self.up1, self.down1 = nn.Linear(12, 40), nn.Linear(40, 12)
        self.up2, self.down2 = nn.Linear(12, 40), nn.Linear(40, 12)

    def _block(self, h):
        return h + self.down1(torch.relu(self.up1(h)))

    @torch.set_grad_enabled(False)
    def _decorated_block(self, h):
        return self._block(h)

    def forward(self, x):
        h = self.head(x)
        if self.style == "after a no_grad block":
            with torch.no_grad():  # a statistic taken without gradients, as a router's: what follows has them
                scale = h.abs().mean()
            h = self._block(h) + 0.0 * scale
        elif self.style == "inference_mode(False)":
            with torch.inference_mode(False):  # not inference mode: gradients stay on
                h = self._block(h)
        elif self.style == "set_grad_enabled block":
            with torch.set_grad_enabled(False):
                h = self._block(h)
        else:
            h = self._decorated_block(h)
        return h + self.down2(torch.relu(self.up2(h)))


def _mode_setters_counted(style: str):
    torch.manual_seed(0)
    model, reference = ModeSetters(style), ModeSetters(style)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(x,))
    autoshard.parallelize(model, plan)
    out = model(x)
    with autoshard.CommCounter() as backward:
        out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    grads = {name: p.grad is not None for name, p in reference.named_parameters()}
    local = {name: p.grad is not None for name, p in model.named_parameters()}
    return nonzero_counts(backward), plan.collectives("backward"), grads, local


@pytest.mark.parametrize("style", ["after a no_grad block", "inference_mode(False)", "set_grad_enabled block",
                                   "set_grad_enabled decorator"])
def test_each_context_read_by_its_own_mode(style):
    counted, predicted, grads, local = run_on_ranks(_mode_setters_counted, 2, style)[0]
    assert local == grads
    frozen = style.startswith("set_grad_enabled")
    assert grads == {name: not (frozen and name.startswith(("head", "up1", "down1")))
                     for name in ("head.weight", "head.bias", "up1.weight", "up1.bias", "down1.weight", "down1.bias",
                                  "up2.weight", "up2.bias", "down2.weight", "down2.bias")}
    # With gradients through the block, each column layer's input gradient is summed over the
    # ranks (the first block's and the MLP's); without them no input gradient is needed at all.
    assert counted == predicted, (counted, predicted)
    assert counted == ({} if frozen else {"all_reduce": 2}), counted
