"""A plan that splits nothing is refused by parallelize with why and what to pass, never a
warning: a forward whose inputs are all optional traced with none of them (open_clip's
CLIP.forward(image=None, text=None)) calls no layer, and a model of norms alone has nothing to
split. Given inputs that reach its towers, the same model is split and equals the unsharded one."""

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.planner.holdings import nothing_split_error
from checks import worst_gradient_difference
from multirank import run_on_ranks


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.text = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, image=None, text=None):
        features = []
        if image is not None:
            features.append(self.image(image))
        if text is not None:
            features.append(self.text(text))
        return features


def _refusals():
    found = {}
    for name, model in (("towers", TwoTowers().double()),):
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(ValueError) as refusal:
            autoshard.parallelize(model)
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        found[name] = (str(refusal.value), unchanged, type(model.image[0]).__name__ if name == "towers" else "")
    return found


def _split_with_inputs():
    torch.manual_seed(0)
    model = TwoTowers().double()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    inputs = {"image": torch.randn(3, 8, dtype=torch.float64, generator=generator),
              "text": torch.randn(3, 8, dtype=torch.float64, generator=generator)}
    autoshard.parallelize(model, example_inputs=inputs)
    styles = [layer.style.value for layer in model.autoshard_state.plan.layers]
    got, want = model(**inputs), reference(**inputs)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    worst = max(max((g - w).abs().max().item() for g, w in zip(got, want)),
                worst_gradient_difference(model, reference))
    return styles, worst


def test_a_plan_splitting_nothing_is_refused_with_what_to_pass():
    for found in run_on_ranks(_refusals, 2):
        towers, unchanged, layer_class = found["towers"]
        assert "splits nothing over its 2 ranks" in towers and "pass example_inputs" in towers, towers
        assert "image.0" in towers and "never calls" in towers, towers
        assert unchanged and layer_class == "Linear", "the refused model was changed"


def test_a_model_with_nothing_to_split_is_told_so():
    # Experts normalised over their FFN axis stay whole, and the router's softmax needs its
    # whole output: at 2 ranks nothing is split (tests/plan/test_experts.py).
    from test_experts import _MoE
    plan = autoshard.plan(_MoE(normalized=True), world_size=2, example_inputs=(torch.randn(5, 8),))
    message = nothing_split_error(plan)
    assert "splits nothing over its 2 ranks" in message and "without tensor parallelism" in message, message
    assert "experts (_Experts" in message and "router (Linear" in message, message
    assert nothing_split_error(autoshard.plan(_MoE(), world_size=2, example_inputs=(torch.randn(5, 8),))) == ""


def test_given_inputs_that_reach_both_towers_the_model_is_split_and_exact():
    for styles, worst in run_on_ranks(_split_with_inputs, 2):
        assert styles == ["column", "row", "column", "row"], styles
        assert worst < 1e-12, worst
