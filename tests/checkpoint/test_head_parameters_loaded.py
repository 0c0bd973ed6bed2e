"""Parameters split with their heads (DeBERTa's q_bias and v_bias, of all_head_size) through
everything that reads shard_specs: load_pretrained against transformers' from_pretrained,
AdamW steps and gradient clipping against torch's on the unsharded model, and a checkpoint
saved on 2 ranks reloaded on 3 ranks and on one unsharded model; and a plan naming a head
parameter that the model lacks, refused before anything changes."""

import copy
import os
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM
from transformers.utils import logging

import autoshard
from autoshard import checkpoint
from multirank import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"))
from conformance_models import TinyDecoder  # noqa: E402

logging.set_verbosity_error()

CONFIG = dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=70,
              max_position_embeddings=32)
HEAD_PARAMETERS = ("q_bias", "v_bias")
LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 0.5


def _ids(step: int) -> torch.Tensor:
    # No padding token (0): DeBERTa's forward checks input ids for it.
    return torch.randint(1, 101, (2, 9), generator=torch.Generator().manual_seed(40 + step))


def _deberta(device="cpu", seed: int = 0, dtype=torch.float32):
    config = AutoConfig.for_model("deberta", **CONFIG)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForMaskedLM.from_config(config)
    if device != "meta":
        # They start as zeros: random values make a slice of the wrong heads show.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(HEAD_PARAMETERS):
                    param.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def _attention(model):
    return model.deberta.encoder.layer[0].attention.self


def _check_split(model) -> None:
    """q_bias and v_bias hold this rank's heads, under their own names, recorded in shard_specs."""
    attention = _attention(model)
    names = dict(model.named_parameters())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    heads = autoshard.split_sizes(6, world)[rank]
    for attr in HEAD_PARAMETERS:
        spec = attention.shard_specs[attr]
        assert spec.full_size == 48 and spec.units == 6, spec
        assert tuple(getattr(attention, attr).shape) == (heads * 8,)
        assert names[f"deberta.encoder.layer.0.attention.self.{attr}"] is getattr(attention, attr)
    plan = model.autoshard_state.plan
    assert {r.name.rpartition(".")[2] for r in plan.head_parameters} == set(HEAD_PARAMETERS)
    # A local parameter: no gradient of it is summed over the ranks.
    assert not any(name.endswith(HEAD_PARAMETERS) for bucket in plan.partial_gradients for name in bucket.params)


def _load_pretrained(path: str) -> None:
    model = _deberta("meta")
    autoshard.parallelize(model)
    _check_split(model)
    autoshard.load_pretrained(model, path, progress=False)
    reference = AutoModelForMaskedLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids(0)).logits, reference(input_ids=_ids(0)).logits,
                                   rtol=1e-5, atol=1e-5)
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    spec = _attention(model).shard_specs["q_bias"]
    assert torch.equal(_attention(model).q_bias, spec.take(_attention(reference).q_bias.detach()))


# At 4 ranks the heads split 2, 2, 1, 1: not as 48 features would split element by element.
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_load_pretrained_reads_each_ranks_heads(tmp_path, world_size):
    _deberta(seed=7).save_pretrained(tmp_path / "deberta", max_shard_size="20KB")
    run_on_ranks(_load_pretrained, world_size, str(tmp_path / "deberta"), timeout=600)


def _step(model, optimizer, step: int, sharded: bool) -> None:
    optimizer.zero_grad()
    ids = _ids(step)
    model(input_ids=ids, labels=ids).loss.backward()
    if sharded:
        autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()


def _state(model, sharded: bool = True):
    state = autoshard.full_state_dict(model) if sharded else model.state_dict()
    return {name: value.clone() for name, value in state.items()}


def _train_and_save(path: str):
    """Two steps on the sharded model and on an unsharded copy (torch's AdamW and clipping) must
    agree (in float64: AdamW's first steps amplify rounding where a gradient is near zero); the
    sharded one is saved, then steps once more."""
    model = _deberta(seed=0, dtype=torch.float64)
    reference = copy.deepcopy(model)
    autoshard.parallelize(model)
    _check_split(model)
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    before = _state(model)
    for step in range(2):
        _step(model, optimizer, step, sharded=True)
        _step(reference, reference_optimizer, step, sharded=False)
    saved, want = _state(model), reference.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name in saved:
        if name.endswith(HEAD_PARAMETERS):
            assert not torch.equal(saved[name], before[name]), name  # the steps moved them
    checkpoint.save(path, model, optimizer, extra={"step": 2})
    _step(model, optimizer, 2, sharded=True)
    return saved, _state(model)


def _load_and_step(path: str, sharded: bool = True):
    model = _deberta(seed=1, dtype=torch.float64)
    if sharded:
        autoshard.parallelize(model)
        optimizer = autoshard.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    assert checkpoint.load(path, model, optimizer) == {"step": 2}
    loaded = _state(model, sharded)
    _step(model, optimizer, 2, sharded)
    return loaded, _state(model, sharded)


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deberta-2ranks") / "ckpt")
    saved, stepped = run_on_ranks(_train_and_save, 2, path, timeout=600)[0]
    return path, saved, stepped


def _assert_round_trip(saved, stepped, result) -> None:
    loaded, got_stepped = result
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name  # loading copies bytes: exact
    for name, value in stepped.items():
        torch.testing.assert_close(got_stepped[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_checkpoint_reloads_on_three_ranks(saved_on_two_ranks):
    path, saved, stepped = saved_on_two_ranks
    _assert_round_trip(saved, stepped, run_on_ranks(_load_and_step, 3, path, timeout=600)[0])


def test_checkpoint_reloads_unsharded_with_torch_adamw(saved_on_two_ranks):
    path, saved, stepped = saved_on_two_ranks
    _assert_round_trip(saved, stepped, _load_and_step(path, sharded=False))


def _plan_for_another_model() -> str:
    ids = (torch.ones(2, 5, dtype=torch.long),)
    torch.manual_seed(0)
    plan = autoshard.plan(TinyDecoder(head_scale=True), example_inputs=ids)
    torch.manual_seed(0)
    other = TinyDecoder()  # the same layers, without the per-head scale
    before = {name: p.clone() for name, p in other.named_parameters()}
    with pytest.raises(ValueError) as error:
        autoshard.parallelize(other, plan, example_inputs=ids)
    assert not any(hasattr(m, "shard_specs") for m in other.modules())
    assert all(torch.equal(p, before[name]) for name, p in other.named_parameters())
    return str(error.value)


def test_plan_naming_a_parameter_the_model_lacks_is_refused_before_any_change():
    message = run_on_ranks(_plan_for_another_model, 2, timeout=300)[0]
    assert "parameter 'blocks.0.attn.head_scale' with its heads" in message and "None" in message, message
