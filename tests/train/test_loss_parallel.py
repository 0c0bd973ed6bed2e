"""Loss parallelism on Hugging Face models (GPT-2 with tied embeddings, Llama, Gemma with tied
embeddings and a scaled lookup, BERT masked-LM) at 2 and 3 gloo ranks, against the unsharded
model in float64: the loss and every parameter's gradient, no tensor of batch x sequence x
vocabulary elements kept by autograd on any rank, whole logits without labels, 20 AdamW steps
against torch.optim.AdamW, and loss_parallel=False (or a model it cannot vouch for) keeping
whole logits."""

import pytest
import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

import autoshard
from hf_models import build
from multirank import run_on_ranks

VOCAB = 101  # hf_models' vocabulary: no other dimension of these models has this size
BATCH, SEQ = 2, 8


def _inputs(kind, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if kind == "bert":
        labels = torch.full_like(ids, -100)
        mask = torch.rand(ids.shape, generator=generator) < 0.4
        labels[mask] = ids[mask]
    else:
        labels = ids.clone()
        labels[0, 3] = -100
    return ids, labels


def _model_pair(kind, **options):
    reference = build(kind, seed=0).double()
    model = build(kind, seed=0).double()
    autoshard.parallelize(model, **options)
    return model, reference


def _shard_specs(model):
    """id(parameter) -> its ShardSpec, whichever of its names (a tied head's bias) it goes by."""
    specs = {}
    for module in model.modules():
        for attr, spec in getattr(module, "shard_specs", {}).items():
            specs[id(getattr(module, attr))] = spec
    return specs


def _compare_gradients(model, reference, rtol, atol):
    """Every parameter's gradient on this rank against its piece of the unsharded gradient."""
    want = dict(reference.named_parameters())
    specs = _shard_specs(model)
    compared = 0
    for name, param in model.named_parameters():
        full = want[name].grad
        spec = specs.get(id(param))
        expected = spec.take(full) if spec is not None else full
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared == len(want)
    return compared


class _LargestSaved:
    """The saved tensors autograd keeps that have a vocabulary dimension and whole logits'
    elements (batch x sequence x vocabulary, or one position fewer per sequence once shifted)."""

    def __init__(self):
        self.whole = []

    def pack(self, tensor):
        if VOCAB in tensor.shape and tensor.numel() >= BATCH * (SEQ - 1) * VOCAB:
            self.whole.append(tuple(tensor.shape))
        return tensor


def _forward_with_labels(model, ids, labels):
    saved = _LargestSaved()
    with autoshard.CommCounter() as forward, saved_tensors_hooks(saved.pack, lambda t: t):
        out = model(input_ids=ids, labels=labels)
    return out, saved.whole, forward.counts


def _check_model(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference = _model_pair(kind)
    decision = model.autoshard_state.loss_parallel
    assert decision.enabled, str(decision)
    head = model.get_submodule(decision.head)
    local = autoshard.split_sizes(VOCAB, world)[rank]
    ids, labels = _inputs(kind)
    plan = model.autoshard_state.plan

    out, whole, forward = _forward_with_labels(model, ids, labels)
    want = reference(input_ids=ids, labels=labels)
    assert whole == [], whole
    assert out.logits.shape == (BATCH, SEQ, local)
    expected_forward = dict(plan.collectives("forward"))
    # The head's gather of its logits, which loss parallelism drops (the tokens' gathers of
    # sequence parallelism stay).
    assert expected_forward.get("all_gather", 0) >= 1, expected_forward
    expected_forward["all_gather"] -= 1
    if not expected_forward["all_gather"]:
        del expected_forward["all_gather"]
    expected_forward["all_reduce"] = expected_forward.get("all_reduce", 0) + 3
    assert forward == expected_forward, (forward, expected_forward)
    state = model.autoshard_state
    assert state.collectives("forward", labels=True) == forward, (state.collectives("forward", labels=True), forward)
    assert f"called with labels (loss parallelism): {decision.head}'s all_gather" in str(state)
    # Hugging Face's causal-LM loss is computed in float32, whatever the model's dtype.
    tolerance = dict(rtol=1e-10, atol=1e-12) if kind == "bert" else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss, want.loss, **tolerance)
    torch.testing.assert_close(autoshard.local(out.logits), autoshard.shard(want.logits, rank, world, dim=-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(autoshard.gather_logits(model, out.logits), want.logits, rtol=1e-10, atol=1e-10)

    with autoshard.CommCounter() as backward:
        out.loss.backward()
    want.loss.backward()
    assert backward.counts == plan.collectives("backward"), (backward.counts, plan.collectives("backward"))
    compared = _compare_gradients(model, reference, **tolerance)

    # return_dict=False: the loss first, as Hugging Face orders it.
    loss, logits = model(input_ids=ids, labels=labels, return_dict=False)[:2]
    torch.testing.assert_close(loss, want.loss, **tolerance)
    assert logits.shape[-1] == local

    # Without labels: whole logits, the head gathers again.
    with torch.no_grad():
        plain = model(input_ids=ids)
        assert plain.loss is None and head.gather_output
    torch.testing.assert_close(plain.logits, want.logits, rtol=1e-10, atol=1e-10)
    return decision.mode, compared


@pytest.mark.parametrize("world_size", [2, 3])
def test_loss_and_every_gradient_equal_unsharded(world_size):
    results = run_on_ranks(_check_models, world_size, timeout=600)
    modes = {kind: mode for kind, (mode, _) in zip(KINDS, results[0])}
    assert modes == {"gpt2": "loss_function", "llama": "loss_function", "gemma": "loss_function", "bert": "labels"}


KINDS = ("gpt2", "llama", "gemma", "bert")


def _check_models():
    return [_check_model(kind) for kind in KINDS]


def _train(kind, steps=20):
    model, reference = _model_pair(kind)
    assert model.autoshard_state.loss_parallel.enabled
    options = dict(lr=3e-3, weight_decay=0.1)
    opt = autoshard.optim.AdamW(model.parameters(), **options)
    ref_opt = torch.optim.AdamW(reference.parameters(), **options)
    losses = []
    for step in range(steps):
        ids, labels = _inputs(kind, seed=100 + step)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            o.step()
            losses.append(float(loss))
    # Hugging Face computes causal-LM losses in float32 even for a float64 model, and AdamW
    # turns the round-off of small gradients into steps of about lr: the project's float32
    # tolerance there; BERT's loss stays in float64.
    tolerance = dict(rtol=1e-9, atol=1e-10) if kind == "bert" else dict(rtol=1e-4, atol=1e-4)
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance, msg=lambda m: f"{name}: {m}")
    # The pairs of losses (sharded, unsharded) of every step.
    for a, b in zip(losses[0::2], losses[1::2]):
        assert abs(a - b) <= tolerance["rtol"] * abs(b), (a, b)
    return losses[-2:]


def _train_all():
    return [_train(kind) for kind in ("gpt2", "llama", "bert")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_twenty_adamw_steps_equal_torch(world_size):
    results = run_on_ranks(_train_all, world_size, timeout=600)
    assert all(r == results[0] for r in results)  # the loss is the same on every rank


def _whole_logits_without_loss_parallel():
    world = dist.get_world_size()
    summary = {}
    for name, options, prepare in (
        ("off", dict(loss_parallel=False), None),
        # A model with a loss_function of its own: autoshard cannot vouch for it.
        ("own_loss", {}, lambda m: setattr(m, "loss_function", _own_loss)),
    ):
        reference = build("gpt2", seed=0).double()
        model = build("gpt2", seed=0).double()
        if prepare is not None:
            prepare(model)
            prepare(reference)
        autoshard.parallelize(model, **options)
        decision = model.autoshard_state.loss_parallel
        ids, labels = _inputs("gpt2")
        out, whole, forward = _forward_with_labels(model, ids, labels)
        want = reference(input_ids=ids, labels=labels)
        assert out.logits.shape == (BATCH, SEQ, VOCAB)  # whole logits, as before
        assert forward.get("all_gather") == 1
        if world > 1:
            assert whole, "the check of saved tensors sees the whole logits torch's loss keeps"
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-7)
        out.loss.backward()
        want.loss.backward()
        _compare_gradients(model, reference, rtol=1e-5, atol=1e-7)
        summary[name] = (decision.enabled, decision.reason)
    return summary


def _own_loss(logits, labels, vocab_size, **kwargs):
    shifted = labels[..., 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, vocab_size).float(), shifted)


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_loss_parallelism_logits_stay_whole(world_size):
    for summary in run_on_ranks(_whole_logits_without_loss_parallel, world_size):
        assert summary["off"] == (False, "parallelize(loss_parallel=False)")
        enabled, reason = summary["own_loss"]
        assert not enabled and "loss_function of its own" in reason, reason


def _bad_argument():
    model = build("gpt2")
    try:
        autoshard.parallelize(model, loss_parallel="yes")
    except TypeError as error:
        return "loss_parallel must be a bool" in str(error) and not hasattr(model, "autoshard_state")
    return False


def test_bad_loss_parallel_argument():
    assert run_on_ranks(_bad_argument, 2) == [True, True]
