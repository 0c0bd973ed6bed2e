"""parallelize(..., overlap_backward=True), the default (nn/backward_overlap.py): the input-gradient
all-reduce of column layers runs while their weight gradients are computed. Against the same model without
overlap: bit-identical losses, gradients and steps, the same collectives; against the unsharded
model: equal within fp32 tolerance. And the edges: frozen weights, gradients of some weights
only, autocast, sequence parallelism, double backward, a bad argument."""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.apply import overlap
from autoshard.nn import backward_overlap
from checks import expect_errors
from gathered import gathered_grads, gathered_params
from hf_models import build
from multirank import run_on_ranks


def _batch(step: int):
    return torch.randint(0, 101, (3, 11), generator=torch.Generator().manual_seed(40 + step))


def _deferred_nodes(loss) -> dict:
    """How many nodes of each overlap kind the backward graph of `loss` holds."""
    seen, stack, kinds = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name in ("GradientsAfterReduceBackward", "ReduceStartsBackward", "ProductWeightLaterBackward"):
            kinds[name] = kinds.get(name, 0) + 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return kinds


def _bit_identical_training(kind: str, steps: int = 3, **options):
    overlapped, plain, reference = build(kind, seed=5).train(), build(kind, seed=5).train(), build(kind, seed=5).train()
    autoshard.parallelize(overlapped, **options)  # overlap_backward=True is the default
    autoshard.parallelize(plain, overlap_backward=False, **options)
    optimizers = [autoshard.optim.AdamW(m.parameters(), lr=1e-2) for m in (overlapped, plain)]
    nodes = None
    for step in range(steps):
        ids = _batch(step)
        counts = []
        for model, opt in zip((overlapped, plain), optimizers):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            if model is overlapped and nodes is None:
                nodes = _deferred_nodes(loss)
            with autoshard.CommCounter() as counter:
                loss.backward()
            counts.append({k: v for k, v in counter.counts.items() if v})
            if model is overlapped:
                got_loss = loss.detach()
            else:
                assert torch.equal(got_loss, loss.detach()), (step, got_loss, loss)
        assert counts[0] == counts[1], counts
        for (name, a), (_, b) in zip(overlapped.named_parameters(), plain.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            assert a.grad is None or torch.equal(a.grad, b.grad), (step, name, (a.grad - b.grad).abs().max())
        # The unsharded model is given the sharded one's parameters before each step rather than
        # stepped beside it: AdamW turns a gradient's rounding noise into steps of lr where the
        # gradient is near zero, so two runs stepped apart part further than the gradients do.
        with torch.no_grad():
            for name, value in gathered_params(overlapped).items():
                reference.get_parameter(name).copy_(value)
        reference.zero_grad()
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        torch.testing.assert_close(got_loss, want.detach(), rtol=1e-5, atol=1e-5)
        grads = gathered_grads(overlapped)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
        for opt in optimizers:
            opt.step()
    for a, b in zip(overlapped.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    return nodes


@pytest.mark.parametrize("kind,world_size", [("llama", 2), ("llama", 3), ("gpt2", 2), ("bert", 3), ("gpt_bigcode", 2)])
def test_bit_identical_to_the_path_without_overlap(kind, world_size):
    nodes = run_on_ranks(_bit_identical_training, world_size, kind, sequence_parallel=False)
    for per_rank in nodes:
        # One reduce node pair per copy group, one deferred product per plain column layer.
        assert per_rank["GradientsAfterReduceBackward"] == per_rank["ReduceStartsBackward"] > 0, per_rank
        assert per_rank["ProductWeightLaterBackward"] >= per_rank["ReduceStartsBackward"], per_rank


def _edges():
    ids = _batch(0)
    model, reference = build("llama", seed=5).train(), build("llama", seed=5).train()
    for m in (model, reference):
        m.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    autoshard.parallelize(model, overlap_backward=True, sequence_parallel=False)
    # A frozen weight gets no gradient; the others are exact.
    model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # torch.autograd.grad of some weights only: the deferred weight gradient arrives through autograd.
    up = model.model.layers[1].mlp.up_proj
    (got,) = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, [up.weight])
    torch.testing.assert_close(got, up.weight.grad, rtol=0, atol=0)
    # Under autocast the layers take the path without overlap: the graph has no deferred node.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    assert not _deferred_nodes(loss)
    # Double backward through a deferred layer is refused where create_graph asks for it, instead
    # of losing the second-order terms; without overlap it works.
    # (The hidden states: a loss over vocabulary shards refuses a second derivative of its own.)
    energy = model.model(input_ids=ids).last_hidden_state.square().sum()
    with pytest.raises(RuntimeError, match="create_graph=True.*overlap_backward=False"):
        torch.autograd.grad(energy, [up.weight], create_graph=True)
    plain = build("llama", seed=5).train()
    autoshard.parallelize(plain, overlap_backward=False, sequence_parallel=False)
    plain_up = plain.model.layers[1].mlp.up_proj
    energy = plain.model(input_ids=ids).last_hidden_state.square().sum()
    (first,) = torch.autograd.grad(energy, [plain_up.weight], create_graph=True)
    first.square().sum().backward()
    assert plain_up.weight.grad is not None
    return dist.get_rank()


def _order_of_backward():
    """The events of one backward, in order: the all-reduce started, the weight gradients
    computed, the all-reduce waited for."""
    events = []
    overlap = backward_overlap._Overlap
    originals = {name: getattr(overlap, name) for name in ("start", "parameter_gradients", "summed_input_gradient")}

    def logged(name):
        def run(self, *args):
            events.append(name)
            return originals[name](self, *args)
        return run

    for name in originals:
        setattr(overlap, name, logged(name))
    try:
        model = build("llama", seed=5).train()
        autoshard.parallelize(model, overlap_backward=True, sequence_parallel=False)
        ids = _batch(0)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for name, original in originals.items():
            setattr(overlap, name, original)
    return events


def test_weight_gradients_are_computed_while_the_all_reduce_is_in_flight():
    for events in run_on_ranks(_order_of_backward, 2):
        # Two blocks, each an attention and an MLP copy group, and the output head's copy.
        assert events == ["start", "parameter_gradients", "summed_input_gradient"] * 5, events


def test_frozen_weights_some_gradients_autocast_and_double_backward():
    assert run_on_ranks(_edges, 2) == [0, 1]


def test_a_bad_argument_is_named_and_nothing_changes():
    model = build("llama")
    before = [p.clone() for p in model.parameters()]
    expect_errors([(lambda: autoshard.parallelize(model, overlap_backward="yes"), TypeError,
                    ["overlap_backward", "bool", "str"])])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not hasattr(model, "autoshard_state")


def test_enable_skips_layers_of_one_rank_and_counts_the_rest():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    assert overlap.enable(layer) == 0


@pytest.mark.parametrize("kind,world_size", [("llama", 2), ("gpt2", 3)])
def test_with_sequence_parallelism_the_reduce_scatter_overlaps_too(kind, world_size):
    nodes = run_on_ranks(_bit_identical_training, world_size, kind, sequence_parallel=True)
    for per_rank in nodes:
        assert per_rank["GradientsAfterReduceBackward"] == per_rank["ReduceStartsBackward"] > 0, per_rank
