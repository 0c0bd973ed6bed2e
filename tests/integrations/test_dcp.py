"""torch.distributed.checkpoint (DCP) with a parallelized model: dcp.save / dcp.load of
`model.state_dict()` and `get_model_state_dict` / `set_model_state_dict` store the global tensors
(uneven, whole-head and shared-KV-head shards included), and reload exactly at the same world
size, at another, and into the plain unsharded model in one process."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import autoshard
from autoshard.state.state_views import ShardView
from hf_models import build as build_hf
from hf_models import from_config
from multirank import run_on_ranks

IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
# gpt-oss: experts with gate and up interleaved and a bias per expert on each side (the out bias
# held whole on every rank), under its default grouped matmul.
GPT_OSS = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=3, head_dim=8, vocab_size=101, num_local_experts=3, num_experts_per_tok=2,
               sliding_window=4)


def build(kind, seed, **overrides):
    if kind != "gpt_oss":
        return build_hf(kind, seed=seed, **overrides)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return from_config(AutoModelForCausalLM, kind, **GPT_OSS, **overrides)


def _parallel(kind, seed, **overrides):
    model = build(kind, seed=seed, **overrides)
    autoshard.parallelize(model)
    return model


def _save(kind, path, use_helpers, overrides):
    model = _parallel(kind, seed=1, **overrides)
    state = get_model_state_dict(model) if use_helpers else model.state_dict()
    views = {name: tuple(v.shape) for name, v in state.items() if isinstance(v, ShardView)}
    if use_helpers == "async":
        dcp.async_save(state, checkpoint_id=path).result()  # staged in host memory, written behind
    else:
        dcp.save(state, checkpoint_id=path)
    return views, model(input_ids=IDS).logits.detach()


def _load(kind, path, use_helpers, overrides):
    model = _parallel(kind, seed=2, **overrides)  # other weights: everything must come from the file
    if use_helpers:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
    else:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)
    return model(input_ids=IDS).logits.detach(), autoshard.full_state_dict(model)


# llama: 6 query heads over 3 KV heads (at 4 ranks, KV heads are held by two ranks each);
# gpt_bigcode: one KV head fused with 5 query heads (held whole beside the split query heads);
# gemma: tied input and output embeddings.
@pytest.mark.parametrize("kind,save_world,load_world,use_helpers", [
    ("llama", 2, 3, False), ("llama", 3, 2, True), ("llama", 4, 2, False),
    ("gpt_bigcode", 2, 3, True), ("gemma", 3, 2, False), ("llama", 3, 3, "async"), ("gpt_oss", 2, 3, False),
])
def test_dcp_checkpoint_holds_the_global_tensors(tmp_path, kind, save_world, load_world, use_helpers):
    path = str(tmp_path / "dcp")
    reference = build(kind, seed=1)
    want_logits = reference(input_ids=IDS).logits.detach()
    want = reference.state_dict()
    saved = run_on_ranks(_save, save_world, kind, path, use_helpers, {}, timeout=300)
    views, logits = saved[0]
    assert views, "no sharded entry was described to DCP"
    if kind == "gpt_oss":  # the interleaved experts and their in bias are split, the out bias is not
        experts = "model.layers.0.mlp.experts."
        assert {experts + "gate_up_proj", experts + "gate_up_proj_bias", experts + "down_proj"} <= set(views)
        assert experts + "down_proj_bias" not in views
    for name, shape in views.items():
        assert shape == tuple(want[name].shape), name  # the global shape, not this rank's piece
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)

    # Into the plain unsharded model, in one process: every tensor equal to the saved model's.
    plain = build(kind, seed=7)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    for name, value in want.items():
        assert torch.equal(plain.state_dict()[name], value), name

    # At the same or another world size, parallelized again.
    for loaded_logits, full in run_on_ranks(_load, load_world, kind, path, use_helpers, {}, timeout=300):
        torch.testing.assert_close(loaded_logits, want_logits, rtol=1e-5, atol=1e-5)
        for name, value in want.items():
            assert torch.equal(full[name], value), name


def _misuse():
    model = _parallel("llama", seed=1)
    view = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    errors = []
    for use in (lambda v: v + 1, lambda v: v.sum(), lambda v: v.numpy()):
        try:
            use(view)
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            errors.append(str(error))
    return tuple(view.shape), tuple(view.local.shape), errors


def test_a_shard_view_refuses_to_act_as_the_whole_tensor():
    shape, local_shape, errors = run_on_ranks(_misuse, 2, timeout=300)[0]
    assert shape == (48, 48) and local_shape == (32, 48)  # 4 of 6 query heads: 2 of 3 KV groups
    assert len(errors) == 3
    for error in errors:
        assert "one rank's shard" in error and "autoshard.full_state_dict" in error


def _load_full_tensors(full):
    model = _parallel("llama", seed=4)
    model.load_state_dict(full)
    return model(input_ids=IDS).logits.detach()


def test_load_state_dict_of_full_tensors_keeps_each_ranks_part():
    reference = build("llama", seed=1)
    want = reference(input_ids=IDS).logits.detach()
    for logits in run_on_ranks(_load_full_tensors, 3, reference.state_dict(), timeout=300):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def _optimizer(kind, model):
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return autoshard.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, step):
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(100 + step))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _save_trained(optimizer_kind, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _parallel("llama", seed=1)
    opt = _optimizer(optimizer_kind, model)
    _train_step(model, opt, 0)
    parallel_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": parallel_state, "optim": optim_state}, checkpoint_id=path)
    _train_step(model, opt, 1)  # the step the resumed run must repeat
    return autoshard.full_state_dict(model)


def _resume(optimizer_kind, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _parallel("llama", seed=2)
    opt = _optimizer(optimizer_kind, model)
    parallel_state, optim_state = get_state_dict(model, opt)
    state = {"model": parallel_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train_step(model, opt, 1)
    return autoshard.full_state_dict(model)


@pytest.mark.parametrize("optimizer_kind", ["torch", "autoshard"])
def test_dcp_resumes_model_and_optimizer_at_another_world_size(tmp_path, optimizer_kind):
    """Saved after one step at 2 ranks, resumed at 3: the second step lands where the
    uninterrupted run's does, so the moments were restored whole, not one rank's piece."""
    path = str(tmp_path / "dcp")
    uninterrupted = run_on_ranks(_save_trained, 2, optimizer_kind, path, timeout=300)[0]
    for resumed in run_on_ranks(_resume, 3, optimizer_kind, path, timeout=300):
        for name, value in uninterrupted.items():
            torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _save_pretrained_and_torch_save(directory):
    import os

    import torch.distributed as dist

    model = _parallel("llama", seed=1)
    rank = dist.get_rank()
    try:
        model.save_pretrained(os.path.join(directory, f"hf-{rank}"))  # the state dict of one rank's shards
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    # One rank's own state dict, saved and loaded back at the same world size.
    path = os.path.join(directory, f"rank-{rank}.pt")
    torch.save(model.state_dict(), path)
    again = _parallel("llama", seed=2)
    again.load_state_dict(torch.load(path, weights_only=False))
    return refusal, again(input_ids=IDS).logits.detach()


def test_save_pretrained_of_shards_is_refused_and_a_ranks_own_state_dict_round_trips(tmp_path):
    want = build("llama", seed=1)(input_ids=IDS).logits.detach()
    for refusal, logits in run_on_ranks(_save_pretrained_and_torch_save, 2, str(tmp_path), timeout=300):
        assert refusal is not None and "one rank's shard" in refusal
        assert "save_pretrained(..., state_dict=...)" in refusal and "autoshard.full_state_dict" in refusal
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
