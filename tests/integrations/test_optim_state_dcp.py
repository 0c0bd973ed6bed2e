"""Optimizer state moving between autoshard.optim and torch.optim through DCP's state-dict API.

On 2 gloo ranks, a parallelized Llama trained 2 steps by one library's AdamW (or SGD with
Nesterov momentum) hands its state to a fresh optimizer of the other library: in memory on the
same model (get_state_dict -> set_state_dict), and through dcp.save / dcp.load into a model of
other weights. The receiving optimizer is built with other settings, so its learning rate,
betas or momentum come from the state dict too. Its next step must land where the unsharded
model trained 3 steps by torch.optim lands, and where the source optimizer's own third step
lands on the parallelized model. In one process: the param groups and states hold
torch's keys exactly, and what autoshard's optimizers do not implement is refused by name.
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import autoshard
from hf_models import build
from multirank import run_on_ranks

EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)
SETTINGS = {
    "AdamW": dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}
# What the receiving optimizer is built with: settings the state dict's must replace. SGD needs
# momentum here, or the state DCP builds from it would hold no momentum_buffer to load into.
RECEIVING = {"AdamW": dict(lr=1e-3), "SGD": dict(lr=0.1, momentum=0.5)}
LIBRARY = {"autoshard": autoshard.optim, "torch": torch.optim}
# float64, but Hugging Face computes the loss in float32: the parallelized model's weights follow
# the unsharded model's to a few 1e-6 after three AdamW steps, and those of a parallelized model
# trained the same way by either library to the last bits. A step whose moments, momentum or
# step count did not travel lands about lr away (checked).
AGAINST_UNSHARDED = dict(rtol=1e-5, atol=1e-5)
AGAINST_UNINTERRUPTED = dict(rtol=1e-10, atol=1e-12)


def _model(seed: int = 0):
    return build("llama", seed=seed, **EVEN).double()


def _parallel(seed: int):
    model = _model(seed)
    autoshard.parallelize(model)
    return model


def _step(model, opt, step: int) -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(100 + step))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _hand_over(kind: str, source: str, target: str, path: str):
    uninterrupted = _parallel(seed=0)
    opt = getattr(LIBRARY[source], kind)(uninterrupted.parameters(), **SETTINGS[kind])
    for step in range(3):
        _step(uninterrupted, opt, step)

    model = _parallel(seed=0)
    opt = getattr(LIBRARY[source], kind)(model.parameters(), **SETTINGS[kind])
    for step in range(2):
        _step(model, opt, step)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    # In memory, on the same model, which holds its own weights already.
    other = getattr(LIBRARY[target], kind)(model.parameters(), **RECEIVING[kind])
    set_state_dict(model, other, model_state_dict={}, optim_state_dict=optim_state)
    _step(model, other, 2)
    in_memory = autoshard.full_state_dict(model)

    # Through the files, into a model of other weights: DCP loads the keys of the receiving
    # optimizer's own state dict, each of which the checkpoint must hold.
    fresh = _parallel(seed=1)
    fresh_opt = getattr(LIBRARY[target], kind)(fresh.parameters(), **RECEIVING[kind])
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(fresh, fresh_opt, 2)
    return autoshard.full_state_dict(uninterrupted), in_memory, autoshard.full_state_dict(fresh)


def _unsharded(kind: str, steps: int, handed_over_after=None):
    """The ground truth: the unsharded model trained by torch.optim; with `handed_over_after`,
    by a fresh optimizer from that step on (what a lost optimizer state would give)."""
    model = _model()
    opt = getattr(torch.optim, kind)(model.parameters(), **SETTINGS[kind])
    for step in range(steps):
        if step == handed_over_after:
            opt = getattr(torch.optim, kind)(model.parameters(), **SETTINGS[kind])
        _step(model, opt, step)
    return model.state_dict()


def _worst(got, want):
    return max(float((got[name] - value).abs().max()) for name, value in want.items())


def _assert_close(got, want, tolerance, what):
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m, name=name: f"{what}, {name}: {m}")


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
@pytest.mark.parametrize("source,target", [("autoshard", "torch"), ("torch", "autoshard")])
def test_state_moves_between_autoshard_and_torch_optimizers(tmp_path, kind, source, target):
    want = _unsharded(kind, steps=3)
    # Without the state two steps built, the third step lands far outside both tolerances.
    assert _worst(_unsharded(kind, steps=3, handed_over_after=2), want) > 1e-3
    path = str(tmp_path / "dcp")
    for uninterrupted, in_memory, through_files in run_on_ranks(_hand_over, 2, kind, source, target, path,
                                                                timeout=600):
        _assert_close(uninterrupted, want, AGAINST_UNSHARDED, f"{source} uninterrupted")
        for got, how in ((in_memory, "in memory"), (through_files, "through dcp.save / dcp.load")):
            _assert_close(got, want, AGAINST_UNSHARDED, f"{source} -> {target} {how}")
            _assert_close(got, uninterrupted, AGAINST_UNINTERRUPTED, f"{source} -> {target} {how}")


# ---- one process: the keys, and what is refused

def _params():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=generator)), torch.nn.Parameter(torch.randn(4, generator=generator))]


def _train(params, opt, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_param_groups_and_state_hold_torchs_keys(kind, default_dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        ours_params, theirs_params = _params(), _params()
        ours = getattr(autoshard.optim, kind)(ours_params, **SETTINGS[kind])
        theirs = getattr(torch.optim, kind)(theirs_params, **SETTINGS[kind])
        _train(ours_params, ours, 2)
        _train(theirs_params, theirs, 2)
        ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    finally:
        torch.set_default_dtype(before)
    assert ours_state["param_groups"] == theirs_state["param_groups"]
    assert set(ours.param_groups[0]) == set(theirs.param_groups[0]) | {"master_weights"}
    for index in (0, 1):
        mine, torchs = ours_state["state"][index], theirs_state["state"][index]
        assert set(mine) == set(torchs)
        for key, value in torchs.items():
            assert (mine[key].shape, mine[key].dtype, mine[key].device) == (value.shape, value.dtype, value.device), key
            torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("saved_with", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_a_state_dict_of_torchs_fused_or_foreach_adamw_continues_alike(saved_with):
    theirs_params = _params()
    theirs = torch.optim.AdamW(theirs_params, **SETTINGS["AdamW"], **saved_with)
    _train(theirs_params, theirs, 2)
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in theirs_params]
    ours = autoshard.optim.AdamW(ours_params)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for key, value in saved_with.items():
        assert ours.param_groups[0][key] is value  # kept, as torch keeps it; the step is fused anyway
    _train(ours_params, ours, 1, seed=2)
    _train(theirs_params, theirs, 1, seed=2)
    for a, b in zip(ours_params, theirs_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_loaded_settings_that_change_no_result_become_autoshards_own():
    """capturable and differentiable say how torch's optimizer ran; a saved Adam's coupled
    decay becomes decoupled, as torch.optim.AdamW makes it on load too."""
    theirs_params = _params()
    theirs = torch.optim.AdamW(theirs_params, **SETTINGS["AdamW"])
    _train(theirs_params, theirs, 1)
    saved = copy.deepcopy(theirs.state_dict())
    saved["param_groups"][0].update(capturable=True, differentiable=True, decoupled_weight_decay=False)
    del saved["param_groups"][0]["amsgrad"]  # as a state dict saved before autoshard kept torch's keys
    loaded = {}
    for library in (torch.optim, autoshard.optim):
        opt = library.AdamW([torch.nn.Parameter(p.detach().clone()) for p in theirs_params])
        opt.load_state_dict(copy.deepcopy(saved))
        loaded[library.__name__] = opt.param_groups[0]
    assert loaded["torch.optim"]["decoupled_weight_decay"] is True
    group = loaded["autoshard.optim"]
    assert (group["capturable"], group["differentiable"], group["decoupled_weight_decay"], group["amsgrad"]) == \
        (False, False, True, False)


def _one():
    return [torch.nn.Parameter(torch.ones(3))]


def _adding_a_group(**settings):
    opt = autoshard.optim.AdamW(_one())
    opt.add_param_group({"params": _one(), **settings})


@pytest.mark.parametrize("make, error, pattern", [
    (lambda: autoshard.optim.AdamW(_one(), amsgrad=True), ValueError,
     r"AdamW: amsgrad=True is not supported: .*max_exp_avg_sq.*; only amsgrad=False is"),
    (lambda: autoshard.optim.AdamW(_one(), 1e-3, (0.9, 0.999), 1e-8, 0.0, True), ValueError,
     r"AdamW: amsgrad=True is not supported"),  # torch's positional order
    (lambda: autoshard.optim.AdamW(_one(), capturable=True), ValueError,
     r"AdamW: capturable=True is not supported: .*CUDA graph; only capturable=False is"),
    (lambda: autoshard.optim.AdamW(_one(), differentiable=True), ValueError,
     r"AdamW: differentiable=True is not supported: .*autograd; only differentiable=False is"),
    (lambda: autoshard.optim.AdamW([{"params": _one(), "amsgrad": True}]), ValueError,
     r"AdamW: param_groups\[0\]\['amsgrad'\]=True is not supported"),
    (lambda: _adding_a_group(decoupled_weight_decay=False), ValueError,
     r"AdamW: param_groups\[1\]\['decoupled_weight_decay'\]=False is not supported: .*only "
     r"param_groups\[1\]\['decoupled_weight_decay'\]=True is"),
    (lambda: autoshard.optim.AdamW(_one(), amsgrad=1), TypeError, r"AdamW: amsgrad must be a bool, got int"),
    (lambda: autoshard.optim.AdamW(_one(), fused="yes"), TypeError, r"AdamW: fused must be None, True or False"),
    (lambda: autoshard.optim.SGD(_one(), differentiable=True), ValueError,
     r"SGD: differentiable=True is not supported: .*only differentiable=False is"),
    (lambda: autoshard.optim.SGD(_one(), foreach=0), TypeError, r"SGD: foreach must be None, True or False, got 0"),
], ids=["amsgrad", "amsgrad-positional", "capturable", "differentiable", "group-amsgrad", "added-group-coupled-decay",
        "amsgrad-not-bool", "fused-not-bool", "sgd-differentiable", "sgd-foreach-not-bool"])
def test_unsupported_settings_are_refused_by_name(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_a_loaded_amsgrad_state_is_refused_at_the_step_before_anything_changes():
    theirs_params = _params()
    theirs = torch.optim.AdamW(theirs_params, amsgrad=True)
    _train(theirs_params, theirs, 1)
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in theirs_params]
    ours = autoshard.optim.AdamW(ours_params)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for p in ours_params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in ours_params] + [ours.state[p]["exp_avg"].clone() for p in ours_params]
    with pytest.raises(ValueError, match=r"AdamW: param_groups\[0\]\['amsgrad'\]=True is not supported"):
        ours.step()
    after = [p.detach().clone() for p in ours_params] + [ours.state[p]["exp_avg"].clone() for p in ours_params]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
