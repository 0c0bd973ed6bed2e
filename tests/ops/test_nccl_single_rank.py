"""NCCL on the GPU, in a group of one: every collective op and mapping against its definition
and under opcheck, and every kind of sharded layer (column and row Linear, HF Conv1D,
convolutions, vocabulary-parallel Embedding, the vocabulary-parallel loss) in models parallelized
over that group, against the unsharded model. The default group of the worker is gloo; the NCCL
group is installed as autoshard's default for the call, so the same functions the gloo tests
run go through NCCL here."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

import autoshard
import test_collectives
import test_comm
import test_sequence_ops
from autoshard.core import distributed
from checks import opcheck_all
from gathered import assert_equals_unsharded, gathered_grads
from multirank import run_on_ranks

# The convolution models of tests/nn/test_conv.py, imported by the worker.
_NN_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nn")
if _NN_TESTS not in sys.path:
    sys.path.append(_NN_TESTS)

GPU = pytest.mark.gpu
# The layer tests also run on CPU over the gloo group, so that CI runs what the GPU runs.
DEVICES = [pytest.param("cpu", id="gloo-cpu"), pytest.param("cuda", id="nccl-cuda", marks=GPU)]


def _over_nccl(fn, *args):
    """fn(*args) with a one-rank NCCL group as autoshard's default group; the NCCL group's
    backend is checked so that a silent fallback to gloo cannot pass."""
    if args and args[-1] == "cpu":
        return fn(*args)
    group = dist.new_group([0], backend="nccl")
    assert dist.get_backend(group) == "nccl"
    distributed.set_default_group(group)
    try:
        return fn(*args)
    finally:
        distributed.set_default_group(None)
        dist.destroy_process_group(group)


@GPU
def test_collectives_over_nccl():
    assert run_on_ranks(_over_nccl, 1, test_collectives._collectives_match_definitions, "cuda") == [4 + 25 + 2 + 1]


@GPU
def test_mappings_over_nccl():
    assert run_on_ranks(_over_nccl, 1, test_comm._mappings_match_definitions, "cuda") == [37]


@GPU
def test_sequence_collectives_over_nccl():
    assert run_on_ranks(_over_nccl, 1, test_sequence_ops._definitions, "cuda") == [2 * len(test_sequence_ops.CASES)]


@GPU
@pytest.mark.parametrize("module, count", [(test_collectives, 7), (test_comm, 8), (test_sequence_ops, 4)],
                         ids=["collectives", "mappings", "sequence"])
def test_opcheck_over_nccl(module, count):
    assert run_on_ranks(_over_nccl, 1, opcheck_all, module._opcheck_cases, "cuda") == [count]


def _hf_model_equals_unsharded(kind: str, device: str) -> dict:
    """A tiny HF model on the GPU, parallelized over the default group (NCCL here): loss and every
    gradient against the unsharded copy, then one AdamW step each. Returns the styles planned."""
    from hf_models import build

    reference = build(kind, device=device).train()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    plan = autoshard.plan(model, example_inputs={"input_ids": ids, "labels": ids})
    autoshard.parallelize(model, plan)
    assert all(p.device.type == device for p in model.parameters())
    loss, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")
    autoshard.optim.AdamW(model.parameters(), lr=1e-2).step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    got, expected = autoshard.full_state_dict(model), reference.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name].to(value.device), value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{kind} {name} after a step: {m}")
    return {layer.style.value for layer in plan.layers}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma"])
def test_hf_layers_over_nccl(kind, device):
    styles = run_on_ranks(_over_nccl, 1, _hf_model_equals_unsharded, kind, device)[0]
    # Column and row layers (and, in Llama, the vocabulary-parallel embedding) ran.
    assert ({"column", "row"} | ({"vocab"} if kind == "llama" else set())) <= styles, styles


def _convolutions_equal_unsharded(device: str) -> int:
    import test_conv

    checked = 0
    for name in ("conv1d", "conv2d", "conv_transpose", "conv3d", "audio_encoder"):
        reference = test_conv._build(name).to(device)
        model = copy.deepcopy(reference)
        x = test_conv._inputs(name).to(device)
        autoshard.parallelize(model, autoshard.plan(model, example_inputs=(x,)))
        assert_equals_unsharded(model, reference, (x,), rtol=1e-4, atol=1e-5)
        checked += 1
    return checked


@pytest.mark.parametrize("device", DEVICES)
def test_convolutions_over_nccl(device):
    assert run_on_ranks(_over_nccl, 1, _convolutions_equal_unsharded, device) == [5]
