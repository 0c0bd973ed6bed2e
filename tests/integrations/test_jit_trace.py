"""torch.jit.trace of a parallelized Llama with the defaults (sequence and loss parallelism on), at
2 gloo ranks, with and without check_inputs.

The trace records autoshard's collectives as the ops they are (autoshard::...), with their group
names, so the traced module computes what the model does. It records no per-forward check: those
compare the ranks' inputs through collectives of their own, which are no part of the model and
which the tracer cannot record ('Tried to trace <ProcessGroup>'). Nor does it record a Python
autograd Function that holds an object of the forward it was traced in, which every later call
would share: the gradients' overlap with their collectives is left out, as under torch.compile.
The traced module is run on other inputs than it was traced with, forward and backward, against
the unsharded model.
"""

from collections import Counter

import pytest
import torch

import autoshard
from gathered import gathered_grads, nonzero_counts
from hf_models import build
from multirank import run_on_ranks

LLAMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128,
             num_hidden_layers=2, use_cache=False)


def _batch(seed: int, rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _traced(check_inputs: bool):
    # In float64: the sharded sums run in another order than the unsharded ones, which float32
    # rounds differently (1.4e-5 seen on a v_proj gradient); a wrong trace differs by far more.
    model, reference = build("llama", seed=0, **LLAMA).double(), build("llama", seed=0, **LLAMA).double()
    autoshard.parallelize(model, check_inputs=check_inputs)
    plan = model.autoshard_state.plan
    # torch.jit.trace's default check_trace traces a second time and compares the two graphs.
    traced = torch.jit.trace(model, (_batch(1),), strict=False)
    nodes = list(traced.inlined_graph.nodes())
    kinds = Counter(node.kind() for node in nodes)
    # A Python autograd Function is traced as a PythonOp holding its non-tensor arguments; one that
    # holds an object of the traced forward shares it with every later call.
    held = [type(a).__name__ for node in nodes if node.kind() == "prim::PythonOp" for a in node.scalar_args()
            if not isinstance(a, (bool, int, float, str, type(None)))]
    ids = _batch(2)
    with autoshard.CommCounter() as forward:
        got = traced(ids)["logits"]
    want = reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with autoshard.CommCounter() as backward:
        (got * weights).sum().backward()
    (want * weights).sum().backward()
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return dict(collectives={k: v for k, v in kinds.items() if k.startswith("autoshard::")},
                held=held, sequence_parallel=bool(plan.sequence_exits),
                forward=nonzero_counts(forward), backward=nonzero_counts(backward),
                planned=(plan.collectives("forward"), plan.collectives("backward")))


@pytest.mark.parametrize("check_inputs", [True, False])
def test_traced_model_equals_the_unsharded_model(check_inputs):
    for r in run_on_ranks(_traced, 2, check_inputs, timeout=600):
        assert r["sequence_parallel"], r
        assert r["collectives"]["autoshard::reduce_scatter_to_sequence"] > 0, r
        assert r["held"] == [], r
        # The traced graph's collectives run: as many as the plan predicts, in forward and backward.
        assert (r["forward"], r["backward"]) == r["planned"], r
