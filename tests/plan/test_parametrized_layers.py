"""A layer whose weight is computed on access (torch's weight_norm parametrization, as wav2vec2's
positional convolution has): the dry run's trace decides which modules are layers before the
call, so reading such a weight to decide is not traced as the model's own ops, and parallelize
accepts the plan and computes the unsharded model's outputs."""

import torch
from torch import nn

import autoshard
from checks import seeded_twins, worst_gradient_difference
from multirank import run_on_ranks


class WeightNormedConvThenMLP(nn.Module):
    """A weight-normed convolution, then an MLP: the parametrization (`old_style`: torch.nn.utils.
    weight_norm, the forward pre-hook that computes `weight` from weight_g and weight_v before
    each call)."""

    def __init__(self, old_style: bool = False):
        super().__init__()
        if old_style:
            self.conv = nn.utils.weight_norm(nn.Conv1d(16, 16, 3, padding=1))
        else:
            self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(16, 16, 3, padding=1, groups=4), dim=2)
        self.up, self.down = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x):
        h = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return h + self.down(torch.relu(self.up(h)))


def _parallelized_against_unsharded():
    model, reference = seeded_twins(WeightNormedConvThenMLP)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, example_inputs=(x,))  # its dry run used to refuse the plan
    styles = {layer.module: layer.style for layer in autoshard.core.parallel_state.state_of(model).plan.layers}
    return model(x).detach(), reference(x).detach(), styles


def test_a_weight_normed_layer_does_not_break_the_dry_run():
    for got, want, styles in run_on_ranks(_parallelized_against_unsharded, 2):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert (styles["up"], styles["down"]) == ("column", "row")


def _old_style_against_unsharded():
    model, reference = seeded_twins(lambda: WeightNormedConvThenMLP(old_style=True))
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, example_inputs=(x,))
    plan = autoshard.core.parallel_state.state_of(model).plan
    model(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    whole = {layer.module: layer.note for layer in plan.layers if not layer.style.is_split}
    return whole, worst_gradient_difference(model, reference), (model(x) - reference(x)).abs().max().item()


def test_a_convolution_whose_weight_a_pre_hook_computes_is_held_whole_alone():
    # Sharded, the convolution would lose the hook (its weight trained in place of weight_g and
    # weight_v): parallelize(model) holds only it whole, saying why, where it refuses a user's hooks.
    for whole, worst_gradient, worst_output in run_on_ranks(_old_style_against_unsharded, 2):
        assert list(whole) == ["conv"] and "weight_norm's" in whole["conv"], whole
        assert worst_gradient < 1e-12 and worst_output < 1e-12, (worst_gradient, worst_output)
