"""torch.compile and torch.export of a parallelized Llama with the defaults (sequence and loss
parallelism on), at 2 gloo ranks, against the unsharded model.

The per-forward checks (forward_checks) are a forward pre-hook on the model. torch.compile(model)
calls a module's hooks outside the frame of its forward, so a hook Dynamo traced would be a graph
of its own, one op long, before the model's: explain would count two graphs and a break with no
reason. Dynamo is disabled for that hook, which runs eagerly, and the model is one graph. Where
Dynamo traces the model's call itself (a compiled function calling the model, strict
torch.export), or torch.export's non-strict tracing runs the hook, the checks are one op of the
graph. Either way they still refuse ranks given different inputs.
"""

import pytest
import torch
import torch.distributed as dist

import autoshard
from gathered import gathered_grads, nonzero_counts
from hf_models import build
from checks import error_text
from multirank import run_on_ranks

# Even shards at 2 ranks: hidden 64, 4 query heads over 2 KV heads, vocabulary 256.
LLAMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128,
             num_hidden_layers=2)
CHECK_OP = "autoshard.check_forward"


def _batch(seed: int, rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _models():
    model, reference = build("llama", seed=0, **LLAMA), build("llama", seed=0, **LLAMA)
    autoshard.parallelize(model)  # the defaults: sequence_parallel=True, loss_parallel=True
    return model, reference


def _ops(graphs) -> set:
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


def _holds_check(ops: set) -> bool:
    return any(op.startswith(CHECK_OP) for op in ops)  # the op's packet, or its .default overload


def _gradient_gaps(model, reference) -> dict:
    """The largest difference of each parameter's full gradient from the unsharded model's."""
    grads = gathered_grads(model)
    return {name: float((grads[name] - p.grad).abs().max()) for name, p in reference.named_parameters()}


def _compiled(call: str, backward: bool):
    """`call` "model": torch.compile(model), whose hooks torch calls outside its forward's frame;
    "function": a compiled function calling the model, in whose frame Dynamo traces the hooks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, reference = _models()
    ids, labels = _batch(1), _batch(2)

    def loss_of(m):
        return lambda input_ids, labels: m(input_ids=input_ids, labels=labels).loss

    target = model if call == "model" else loss_of(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(target)(input_ids=ids, labels=labels)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(target, backend="inductor", fullgraph=True)
    run = loss_of(compiled) if call == "model" else compiled
    loss = run(ids, labels)
    want = reference(input_ids=ids, labels=labels).loss
    result = dict(graphs=explained.graph_count, breaks=explained.graph_break_count,
                  reasons=[str(b.reason) for b in explained.break_reasons], ops=_ops(explained.graphs),
                  sequence_parallel=bool(model.autoshard_state.plan.sequence_exits),
                  loss_gap=abs(float(loss.detach()) - float(want.detach())))
    if backward:
        loss.backward()
        want.backward()
        result["gradient_gaps"] = _gradient_gaps(model, reference)
    result.update(compiled_graphs=counters["stats"]["unique_graphs"], counted_breaks=dict(counters["graph_break"]),
                  refused=error_text(lambda: run(_batch(3 + dist.get_rank()), labels)))
    return result


@pytest.mark.parametrize("call", ["model", "function"])
def test_compiled_forward_is_one_graph_that_checks_the_inputs(call):
    for r in run_on_ranks(_compiled, 2, call, False, timeout=900):
        assert r["sequence_parallel"], r
        assert (r["graphs"], r["breaks"], r["reasons"]) == (1, 0, []), r
        assert r["compiled_graphs"] == 1 and r["counted_breaks"] == {}, r
        # torch.compile(model): the checks ran eagerly, outside the graph; a compiled function
        # calling the model: they are an op of its graph. Either way they still refuse.
        assert _holds_check(r["ops"]) == (call == "function"), r["ops"]
        assert "holds different values" in r["refused"], r["refused"]
        assert r["loss_gap"] < 1e-5, r


@pytest.mark.parametrize("call", ["model", "function"])
def test_compiled_forward_and_backward_equal_the_unsharded_model(call):
    for r in run_on_ranks(_compiled, 2, call, True, timeout=900):
        assert (r["graphs"], r["breaks"]) == (1, 0), r
        # One graph compiled: AOT autograd's backward is that graph's, with no break of its own.
        assert r["compiled_graphs"] == 1 and r["counted_breaks"] == {}, r
        assert r["loss_gap"] < 1e-5, r
        assert max(r["gradient_gaps"].values()) < 1e-5, r["gradient_gaps"]
        assert "holds different values" in r["refused"], r["refused"]


def _exported(strict: bool):
    model, reference = _models()
    plan = model.autoshard_state.plan
    program = torch.export.export(model, (_batch(1),), {"use_cache": False}, strict=strict)
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    exported = program.module()
    ids = _batch(4)  # not the inputs it was exported with
    with torch.no_grad(), autoshard.CommCounter() as counter:
        got = exported(ids, use_cache=False).logits
    want = reference(ids, use_cache=False).logits.detach()
    refused = error_text(lambda: exported(_batch(5 + dist.get_rank()), use_cache=False))
    return dict(ops=ops, gap=float((got - want).abs().max()), scale=float(want.abs().max()),
                counts=nonzero_counts(counter), planned=plan.collectives("forward"), refused=refused)


@pytest.mark.parametrize("strict", [False, True])
def test_export_equals_the_unsharded_model_and_keeps_the_checks(strict):
    for r in run_on_ranks(_exported, 2, strict, timeout=600):
        assert _holds_check(r["ops"]), r["ops"]
        assert r["gap"] < 1e-5 * max(1.0, r["scale"]), r
        assert r["counts"] == r["planned"], r
        assert "holds different values" in r["refused"], r["refused"]
