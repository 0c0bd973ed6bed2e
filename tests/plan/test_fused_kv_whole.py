"""Multi-query attention with its one KV head fused beside the query heads (GPT-BigCode's
c_attn): the query heads are split, the KV parts held whole on every rank with their
gradient summed. Against numpy, the unsharded model and torch.optim.AdamW: the layout, 10
AdamW steps with clipping, and a checkpoint saved on 3 ranks reloaded on 2 and on 1."""

import numpy as np
import pytest
import torch

import autoshard
from autoshard import checkpoint
from autoshard.core.spec import ShardSpec
from hf_models import CONFIGS, build
from multirank import run_on_ranks
from adamw_steps import adamw_with_clipping, save_after_one_step

HEADS, HEAD_DIM = CONFIGS["gpt_bigcode"]["n_head"], CONFIGS["gpt_bigcode"]["n_embd"] // CONFIGS["gpt_bigcode"]["n_head"]
PARTS = (HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM)
MAX_NORM = 0.5


@pytest.mark.parametrize("world", [2, 3, 4])
def test_layout_is_the_query_heads_split_and_the_kv_parts_whole(world):
    full = np.arange(sum(PARTS))
    query_heads = np.array_split(np.arange(HEADS), world)
    owned = []
    for rank in range(world):
        spec = ShardSpec(0, sum(PARTS), rank, world, units=HEADS, parts=PARTS, whole_parts=(1, 2))
        heads = query_heads[rank]
        want = np.concatenate([full[heads[0] * HEAD_DIM:(heads[-1] + 1) * HEAD_DIM], full[PARTS[0]:]])
        assert spec.take(torch.from_numpy(full)).tolist() == want.tolist()
        assert spec.overlaps and spec.local_size() == len(want)
        owned += [x for start, length in spec.owned_ranges() for x in range(start, start + length)]
    assert sorted(owned) == full.tolist()  # every feature saved once, the KV parts by rank 0


def test_plan_splits_query_heads_and_holds_the_kv_parts_whole():
    p = autoshard.plan(build("gpt_bigcode", device="meta"), world_size=3)
    c_attn = p.layer("transformer.h.0.attn.c_attn")
    assert (c_attn.style, c_attn.units, tuple(c_attn.parts), c_attn.whole_parts, c_attn.summed_parts) == (
        "column", HEADS, PARTS, [1, 2], True)
    assert "whole on every rank" in str(p)


def _train(steps=10):
    model = build("gpt_bigcode")
    norms, worst = adamw_with_clipping(model, build("gpt_bigcode"), steps, MAX_NORM)
    # Every rank holds the same KV rows after the steps: their gradients were summed alike.
    c_attn = model.transformer.h[0].attn.c_attn
    dim = c_attn.shard_specs["weight"].dim
    weight = autoshard.local(c_attn.weight)  # this rank's piece: its last rows are the KV rows it holds whole
    kv = weight.narrow(dim, weight.shape[dim] - 2 * HEAD_DIM, 2 * HEAD_DIM)
    return norms, worst, kv.detach().clone()


@pytest.mark.parametrize("world", [2, 3])
def test_adamw_with_clipping_matches_unsharded(world):
    results = run_on_ranks(_train, world, timeout=600)
    norms, worst, _ = results[0]
    assert worst < 1e-4
    assert any(ref > MAX_NORM for _, ref in norms), "clipping never acted"
    for got, ref in norms:
        assert abs(got - ref) <= 1e-5 * ref, (got, ref)
    for _, _, kv in results[1:]:
        assert torch.equal(kv, results[0][2])


def _save_trained(path):
    model = build("gpt_bigcode")
    save_after_one_step(model, path)
    return {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def _reload(path):
    model = build("gpt_bigcode", seed=5)
    autoshard.parallelize(model)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3)
    extra = checkpoint.load(path, model, opt)
    return extra, {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def test_checkpoint_saved_on_3_ranks_reloads_on_2_and_on_1(tmp_path):
    path = str(tmp_path / "step-1")
    full = run_on_ranks(_save_trained, 3, path, timeout=300)[0]
    for extra, state in run_on_ranks(_reload, 2, path, timeout=300):
        assert extra == {"step": 1} and state.keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(state[name], value), name
    model = build("gpt_bigcode", seed=5)
    assert checkpoint.load(path, model, torch.optim.AdamW(model.parameters(), lr=2e-3)) == {"step": 1}
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[name]), name
