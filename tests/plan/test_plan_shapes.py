"""Module attributes become local only when the plan's predicted shapes need it: a rotary
dimension count that happens to equal the number of KV heads is left alone (it used to be
halved, and the logits differed by about 1e-3), and every intermediate shape of the sharded
model is checked against the plan before any weight is touched."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from gathered import assert_equals_unsharded
from multirank import run_on_ranks
from soundness_models import build_partial_rotary, build_shared_kv_rotary


def test_coincident_attribute_is_not_localized():
    model = build_partial_rotary()
    ids = torch.zeros(2, 7, dtype=torch.long)
    p = autoshard.plan(model, world_size=2, example_inputs=(ids,))
    assert p.layer("attn.q").style == "column"
    attributes = p.regions[p.layer("attn.q").region].attributes
    assert attributes == {"num_heads": 4, "num_kv_heads": 2}, attributes


def _check_partial_rotary():
    world = dist.get_world_size()
    reference, model = build_partial_rotary(), build_partial_rotary()
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    plan = autoshard.plan(model, world_size=world, example_inputs=(ids,))
    autoshard.parallelize(model, plan)
    torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    return model.attn.rotary_dims


@pytest.mark.parametrize("world_size", [2])
def test_coincident_attribute_logits_equal_unsharded(world_size):
    assert run_on_ranks(_check_partial_rotary, world_size) == [2] * world_size


def test_coincident_attribute_with_shared_kv_heads_is_not_localized():
    # On 4 ranks the KV heads are shared: the shapes along repeat_kv's repeated axis are
    # predicted too, so rotary_dims (equal to the query heads per KV head) stays whole.
    p = autoshard.plan(build_shared_kv_rotary(), world_size=4, example_inputs=(torch.zeros(2, 7, dtype=torch.long),))
    region = p.regions[p.layer("attn.q").region]
    assert region.repeat == 2
    assert region.attributes == {"num_heads": 6, "num_kv_heads": 3}, region.attributes


def _check_shared_kv_rotary():
    reference, model = build_shared_kv_rotary(), build_shared_kv_rotary()
    reference.double(), model.double()
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    autoshard.parallelize(model, autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(ids,)))
    grads = assert_equals_unsharded(model, reference, (ids,), rtol=1e-9, atol=1e-11)
    return model.attn.rotary_dims, sorted(grads) == sorted(dict(reference.named_parameters()))


def test_shared_kv_rotary_logits_and_gradients_equal_unsharded():
    assert run_on_ranks(_check_shared_kv_rotary, 4) == [(2, True)] * 4


def _refused_before_any_weight(drop_prediction: bool = False):
    model = build_partial_rotary()
    ids = torch.zeros(2, 7, dtype=torch.long)
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(ids,))
    region = plan.layer("attn.q").region
    try:
        plan.regions[region].attributes["rotary_dims"] = 2
        frozen = False
    except AttributeError:
        frozen = True
    # A plan whose attributes no longer give the predicted shapes (rotary_dims made local),
    # edited the one way a plan can be: in its JSON document.
    document = json.loads(plan.to_json())
    document["regions"][str(region)]["attributes"]["rotary_dims"] = 2
    if drop_prediction:
        document["prediction"] = None
    plan = autoshard.ShardingPlan.from_json(json.dumps(document))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        autoshard.parallelize(model, plan)
    except ValueError as error:
        message = str(error)
    else:
        return None, False, frozen  # parallelized: its state_dict() holds shards
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return message, unchanged, frozen


def test_shape_mismatch_refuses_the_plan_naming_module_op_and_shapes():
    """A plan cannot be changed in place; edited in its JSON document (which carries the shape
    prediction), it is checked op by op on a meta copy and refused before any weight changes."""
    message, unchanged, frozen = run_on_ranks(_refused_before_any_weight, 2)[0]
    assert frozen and unchanged
    assert message is not None and "'attn'" in message and "slice" in message and "predicts" in message, message


def test_a_plan_read_from_json_without_its_prediction_is_checked_less():
    # Without the prediction, the dry run has no shapes to compare with, and this plan goes through.
    assert run_on_ranks(_refused_before_any_weight, 2, True)[0] == (None, False, True)


def test_a_config_size_is_localised_on_a_copy_of_the_modules_own():
    from types import SimpleNamespace

    from autoshard.core.module_attributes import set_attribute

    shared = SimpleNamespace(num_attention_heads=6, hidden_size=48)
    a, b = nn.Module(), nn.Module()
    a.config = b.config = shared
    set_attribute(a, "config.num_attention_heads", 3)
    set_attribute(a, "config.hidden_size", 24)
    assert (a.config.num_attention_heads, a.config.hidden_size) == (3, 24)
    assert a.config is not shared and b.config is shared
    assert (shared.num_attention_heads, shared.hidden_size) == (6, 48)
