"""Layers whose forward is not their class's (an embedding subclass calling F.embedding itself,
Linear subclasses computing their own product, a forward set on the instance, hooks), and
state_dict hooks that rename: on 2 and 3 gloo ranks, each either equals the unsharded model
(outputs, every gradient, the state after a torch.optim.AdamW step, the plan's collectives)
or is refused with an error naming the layer and what to do, the model left unchanged."""

import copy
import json
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from gathered import gathered_grads
from multirank import run_on_ranks

VOCAB, HIDDEN, FFN = 13, 8, 12


# ---- embedding subclasses


class DirectEmbedding(nn.Embedding):
    """Looks its rows up with F.embedding, never reaching nn.Embedding.forward."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, self.padding_idx) * 1.5


class TorchEmbedding(nn.Embedding):
    def forward(self, ids):
        return torch.embedding(self.weight, ids) + 0.25


class ScaledEmbedding(nn.Embedding):
    """Gemma's way: nn.Embedding's lookup, scaled."""

    def forward(self, ids):
        return super().forward(ids) * self.weight.dtype.itemsize


class IndexingEmbedding(nn.Embedding):
    """Indexes its weight by ids: a lookup, made vocab-parallel as F.embedding is."""

    def forward(self, ids):
        return self.weight[ids]


class SlicedEmbedding(nn.Embedding):
    """Whisper's positions: rows of the table for the positions, `weight[start:start + length]`."""

    def forward(self, ids):
        return self.weight[1:1 + ids.shape[1]].expand(ids.shape[0], -1, -1)


class ColumnReadingEmbedding(nn.Embedding):
    """Reads a column of its weight: each rank would read its own rows of it."""

    def forward(self, ids):
        return F.embedding(ids, self.weight) * self.weight[:, :1].sum()


# ---- Linear subclasses and instances


class MatmulLinear(nn.Linear):
    def forward(self, x):
        out = x @ self.weight.t()
        return out if self.bias is None else out + self.bias


class OwnScaleLinear(nn.Linear):
    def __init__(self, features_in, features_out):
        super().__init__(features_in, features_out)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features_out)[:, None])

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


class AttributeScaledLinear(nn.Linear):
    scale = 1.0  # F.linear for the class as built; not for an instance given another scale

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


def attribute_scaled(features_in, features_out):
    layer = AttributeScaledLinear(features_in, features_out)
    layer.scale = 0.25
    return layer


def instance_forward(features_in, features_out):
    layer = nn.Linear(features_in, features_out)
    layer.forward = types.MethodType(lambda self, x: F.linear(x, self.weight, self.bias) * 3.0, layer)
    return layer


def hooked(features_in, features_out):
    layer = nn.Linear(features_in, features_out)
    layer.register_forward_hook(lambda module, args, out: out * 3.0)
    return layer


class LanguageModel(nn.Module):
    def __init__(self, embedding=nn.Embedding, linear=nn.Linear):
        super().__init__()
        self.emb = embedding(VOCAB, HIDDEN, padding_idx=2)
        self.up, self.down = linear(HIDDEN, FFN), linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


EXACT = {
    "F.embedding": dict(embedding=DirectEmbedding),
    "torch.embedding": dict(embedding=TorchEmbedding),
    "super().forward": dict(embedding=ScaledEmbedding),
    "weight[ids]": dict(embedding=IndexingEmbedding),
    "weight[start:end]": dict(embedding=SlicedEmbedding),
    "matmul": dict(linear=MatmulLinear),
    "own scale": dict(linear=OwnScaleLinear),
    "instance scale": dict(linear=attribute_scaled),
    "instance forward": dict(linear=instance_forward),
}
IDS = torch.tensor([[0, 3, 7, 12, 2], [1, 2, 9, 4, 11]])  # every rank's rows, and the padding row


def _seeded(make, seed=0):
    torch.manual_seed(seed)
    return make()


def _check_exact(make, example, own_plan: bool = False) -> dict:
    """With `own_plan`, parallelize makes the plan itself (and plans again around what its dry
    run refuses) and the layers' notes come back too."""
    model, reference = _seeded(make), _seeded(make)
    if own_plan:
        autoshard.parallelize(model, example_inputs=(example,))
        plan = model.autoshard_state.plan
    else:
        plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(example,))
        autoshard.parallelize(model, plan, example_inputs=(example,))
    with autoshard.CommCounter() as forward:
        out = model(example)
    want = reference(example)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    counted = {k: v for k, v in forward.counts.items() if v}
    assert counted == plan.collectives("forward"), (counted, plan.collectives("forward"))
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    shards = autoshard.core.parallel_state.state_of(model).shards()
    params = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        grad = params[name].grad
        if id(params[name]) in shards:
            spec, _ = shards[id(params[name])]
            ref_grad = torch.cat([ref.grad.narrow(spec.dim, s, n) for s, n in spec.local_ranges()], spec.dim)
        else:
            ref_grad = ref.grad
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
    for m in (model, reference):
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1).step()
    got, expected = autoshard.full_state_dict(model), reference.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if own_plan:
        return {layer.module: (layer.style, layer.note) for layer in plan.layers}
    return {layer.module: layer.style for layer in plan.layers}


def _exact_cases():
    styles = {case: _check_exact(lambda: LanguageModel(**kwargs), IDS) for case, kwargs in EXACT.items()}
    return styles


@pytest.mark.parametrize("world_size", [2, 3])
def test_bypassing_layers_equal_unsharded(world_size):
    styles = run_on_ranks(_exact_cases, world_size, timeout=600)[0]
    for case in ("F.embedding", "torch.embedding", "super().forward", "weight[ids]", "weight[start:end]"):
        assert styles[case]["emb"] == "vocab", (case, styles[case])  # split, and exact
    assert styles["matmul"]["up"] == "column" and styles["matmul"]["down"] == "row", styles["matmul"]
    for case in ("own scale", "instance scale", "instance forward"):
        # Not F.linear: followed op by op and kept whole, never swapped for a sharded Linear.
        assert "up" not in styles[case] and "down" not in styles[case], (case, styles[case])


def _column_read_planned_by_parallelize():
    return _check_exact(lambda: LanguageModel(embedding=ColumnReadingEmbedding), IDS, own_plan=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_embedding_reading_its_table_is_kept_whole_where_parallelize_plans_itself(world_size):
    # The plan given by hand is refused (below); the plan parallelize makes itself holds it whole.
    styles = run_on_ranks(_column_read_planned_by_parallelize, world_size)[0]
    style, note = styles["emb"]
    assert style == "replicate" and "other than by a lookup" in note, styles["emb"]
    assert styles["up"][0] == "column" and styles["down"][0] == "row", styles


# ---- refusals


def _refused(make, plan_kwargs=None, tamper=None, plan_from=None):
    """parallelize's error text, and whether the model came out unchanged; with `plan_from`, the
    plan is that model's (a plan brought from another model: autoshard.plan of this one would
    hold whole what it sees cannot be split)."""
    model = _seeded(make)
    before = copy.deepcopy(model.state_dict())
    classes = [type(m) for m in model.modules()]
    plan = autoshard.plan(_seeded(plan_from or make), world_size=dist.get_world_size(), example_inputs=(IDS,),
                          **(plan_kwargs or {}))
    if tamper is not None:  # a plan document edited by hand
        document = json.loads(plan.to_json())
        tamper(document)
        plan = autoshard.ShardingPlan.from_json(json.dumps(document))
    try:
        autoshard.parallelize(model, plan, example_inputs=(IDS,))
    except ValueError as error:
        text = str(error)
    else:
        text = None
    after = model.state_dict()
    unchanged = (classes == [type(m) for m in model.modules()] and before.keys() == after.keys()
                 and all(torch.equal(before[k], after[k]) for k in before)
                 and autoshard.core.parallel_state.state_of(model) is None)
    return text, unchanged


def _one_more_all_reduce(document):
    for c in document["comm"]:
        if c["phase"] == "forward" and c["kind"] == "all_reduce":
            c["count"] += 1


def _cut_after_lookup(document):
    for layer in document["layers"]:
        if layer["module"] == "emb":
            layer["sequence"] = "reduce_scatter"


def _without_whole_table_lookups():
    """The embedding subclass as parallelize once left it: F.embedding on this rank's rows, no sum."""
    from autoshard.nn import embedding_subclass

    kept = embedding_subclass.WholeTableLookups.__torch_function__
    embedding_subclass.WholeTableLookups.__torch_function__ = lambda self, func, types, args=(), kwargs=None: \
        func(*args, **(kwargs or {}))
    try:
        return _refused(lambda: LanguageModel(embedding=DirectEmbedding), plan_from=LanguageModel)
    finally:
        embedding_subclass.WholeTableLookups.__torch_function__ = kept


def _refusals():
    return {
        "column read": _refused(lambda: LanguageModel(embedding=ColumnReadingEmbedding), plan_from=LanguageModel),
        "column read, planned": _planned_whole(lambda: LanguageModel(embedding=ColumnReadingEmbedding)),
        "hooked": _refused(lambda: LanguageModel(linear=hooked)),
        "miscounted": _refused(LanguageModel, tamper=_one_more_all_reduce),
        "silent layer": _without_whole_table_lookups(),
        # Ops after the lookup, inside the same call, are unseen by the plan: never on a token piece.
        "cut lookup": _refused(lambda: LanguageModel(embedding=DirectEmbedding),
                               tamper=_cut_after_lookup),
    }


def _planned_whole(make):
    """autoshard.plan's styles and reasons for the model's layers: the plan that runs."""
    plan = autoshard.plan(_seeded(make), world_size=dist.get_world_size(), example_inputs=(IDS,))
    return {layer.module: (layer.style.value, layer.reason, layer.note) for layer in plan.layers}


@pytest.mark.parametrize("world_size", [2, 3])
def test_what_cannot_be_exact_is_refused_before_any_change(world_size):
    found = run_on_ranks(_refusals, world_size)[0]
    # Planned by autoshard.plan, the embedding read other than by a lookup is held whole, saying why.
    planned = found.pop("column read, planned")
    assert planned["emb"][:2] == ("replicate", "dry_run_mismatch") and "lookup" in planned["emb"][2], planned
    assert planned["up"][0] != "replicate", planned
    for case, (text, unchanged) in found.items():
        assert text is not None, f"{case}: not refused"
        assert unchanged, f"{case}: the model changed"
        assert "left unchanged" in text, (case, text)
    text = found["column read"][0]
    assert "'emb' (ColumnReadingEmbedding)" in text and "other than by a lookup" in text, text
    assert "overrides={'emb': 'replicate'}" in text, text
    text = found["hooked"][0]
    assert "'up' (Linear: forward_hook)" in text and "'down'" in text, text
    assert "remove the hooks before parallelize" in text and "overrides=" in text, text
    text = found["miscounted"][0]
    assert "the plan predicts {'all_reduce': 3" in text and "issues the collectives {'all_reduce': 2" in text, text
    # The missing all-reduce of a lookup on this rank's rows alone: no shape shows it, the count does.
    text = found["silent layer"][0]
    assert "issues the collectives {'all_reduce': 1" in text and "the plan predicts {'all_reduce': 2" in text, text
    assert "layer(s) 'emb' (DirectEmbedding) issued none" in text and "overrides={'emb': 'replicate'}" in text, text
    text = found["cut lookup"][0]
    assert "lookup of 'emb' (DirectEmbedding" in text and "sequence_parallel=False" in text, text


def _override_hooked():
    model, reference = _seeded(lambda: LanguageModel(linear=hooked)), _seeded(lambda: LanguageModel(linear=hooked))
    plan = autoshard.plan(model, world_size=dist.get_world_size(), example_inputs=(IDS,),
                          overrides={"up": "replicate", "down": "replicate"})
    autoshard.parallelize(model, plan, example_inputs=(IDS,))
    torch.testing.assert_close(model(IDS), reference(IDS), rtol=1e-5, atol=1e-6)
    return {layer.module: layer.style for layer in plan.layers}


def test_hooked_layers_kept_whole_are_exact():
    styles = run_on_ranks(_override_hooked, 2)[0]
    assert styles["up"] == styles["down"] == "replicate" and styles["emb"] == "vocab", styles


# ---- state_dict hooks that rename


def _save_split(module, state, prefix, local_metadata):
    """A fused q/k/v Linear saved as q, k and v (split by the module's own width)."""
    for kind in ("weight", "bias"):
        fused = state.pop(prefix + "qkv." + kind)
        for name, part in zip("qkv", fused.split(module.width, 0)):
            state[prefix + name + "." + kind] = part


class FusedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.width = HIDDEN
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.register_state_dict_post_hook(_save_split)

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.width, -1)
        return self.out(torch.sigmoid(q) * k + v)


class FusedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.attn = FusedAttention()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.attn(h))


def _renamed_state():
    styles = _check_exact(FusedModel, IDS)  # full_state_dict against state_dict(), hooks and all
    keys = sorted(autoshard.full_state_dict(_parallelized(FusedModel)))
    return styles, keys


def _parallelized(make):
    model = _seeded(make)
    autoshard.parallelize(model, example_inputs=(IDS,))
    return model


def _hook_on_replaced():
    def make():
        model = FusedModel()
        model.attn.qkv.register_state_dict_post_hook(lambda module, state, prefix, local: None)
        return model
    return _refused(make)


@pytest.mark.parametrize("world_size", [2, 3])
def test_renaming_state_dict_hooks_give_the_unsharded_state(world_size):
    styles, keys = run_on_ranks(_renamed_state, world_size)[0]
    assert styles["attn.qkv"] == "column" and styles["attn.out"] == "row", styles
    assert "attn.q.weight" in keys and "attn.v.bias" in keys and "attn.qkv.weight" not in keys, keys
    text, unchanged = run_on_ranks(_hook_on_replaced, world_size)[0]
    assert unchanged and "'attn.qkv' (Linear: state_dict_hook)" in text and "remove the hooks" in text, text


def _planned_again_without_the_silent_layer():
    """The embedding subclass computing on this rank's rows alone, as in the refusal above, but
    with the plan left to parallelize: planned again with that layer whole, and exact."""
    from autoshard.nn import embedding_subclass

    kept = embedding_subclass.WholeTableLookups.__torch_function__
    embedding_subclass.WholeTableLookups.__torch_function__ = lambda self, func, types, args=(), kwargs=None: \
        func(*args, **(kwargs or {}))
    try:
        model = _seeded(lambda: LanguageModel(embedding=DirectEmbedding))
        reference = _seeded(lambda: LanguageModel(embedding=DirectEmbedding))
        autoshard.parallelize(model, example_inputs=(IDS,))
        layer = autoshard.core.parallel_state.state_of(model).plan.layer("emb")
        out, want = model(IDS), reference(IDS)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        out.square().sum().backward()
        want.square().sum().backward()
        grads = gathered_grads(model)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return layer.style, layer.reason, layer.note
    finally:
        embedding_subclass.WholeTableLookups.__torch_function__ = kept


def test_a_plan_parallelize_makes_is_made_again_with_the_differing_layer_whole():
    for style, reason, note in run_on_ranks(_planned_again_without_the_silent_layer, 2):
        assert (style, reason) == ("replicate", "dry_run_mismatch"), (style, reason, note)
        assert "issued none" in note and "'emb'" in note, note
