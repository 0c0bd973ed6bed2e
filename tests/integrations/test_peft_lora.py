"""PEFT LoRA split with its base layers, against the unsharded PEFT model with the same weights.

A tiny Llama (hidden 64, 4 query / 2 KV heads, 2 layers, MLP 128, vocabulary 256) with LoRA
(r=4) on every projection, its B factors drawn non-zero so that no gradient is trivially zero.
On 2 and 3 gloo ranks: the plan splits every base layer and each adapter with it, a rank holds
at most 1/N + 0.1 of the parameters, the collectives counted equal the plan's, and the logits,
the loss, every LoRA gradient, the LoRA weights after AdamW steps (torch's and autoshard's) and
the merged model of merge_and_unload equal the unsharded model's.
"""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import autoshard  # noqa: E402
from autoshard.model_state import state_of  # noqa: E402
from autoshard.state import gather_full  # noqa: E402
from multirank import run_on_ranks  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
VOCAB = 256
STEPS = 3
# float64: what differs from the unsharded model is only the order of sums.
TOL = dict(rtol=1e-9, atol=1e-11)


def build(seed: int = 0, **lora):
    """The PEFT model, the same weights for the same seed: base Llama, then LoRA factors with
    B drawn at random (PEFT starts it at zero, which would leave A's gradient zero)."""
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                  attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(config).double()
    model = get_peft_model(base, LoraConfig(target_modules=TARGETS, r=4, lora_alpha=8, lora_dropout=0.0, **lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.1)
    return model


def _gathered_grads(model, names):
    """The full gradients of the parameters `names` (the trained ones), each rank's shard at its place."""
    shards, params = state_of(model).shards(), dict(model.named_parameters())
    found = {}
    for name in names:
        p = params[name]
        found[name] = gather_full(p.grad, *shards[id(p)]) if id(p) in shards else p.grad
    return found


def _counts(counter):
    return {k: v for k, v in counter.counts.items() if v}


def _lora_names(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _check_plan(plan, world: int) -> None:
    for rank in range(world):
        assert plan.held_fraction(rank) <= 1 / world + 0.1, (rank, str(plan))
    for layer in plan.layers:
        kind = layer.module.rpartition(".")[2]
        if kind in TARGETS:
            assert layer.style == ("column" if kind in COLUMN else "row"), str(plan)
    records = {r["module"]: r for r in plan.adapters}
    assert len(records) == 2 * len(TARGETS)
    for module, record in records.items():
        split, whole = ("lora_B", "lora_A") if module.rpartition(".")[2] in COLUMN else ("lora_A", "lora_B")
        assert record["split"] == [f"{module}.{split}.default.weight"], record
        assert record["whole"] == [f"{module}.{whole}.default.weight"], record
    summed = {name for bucket in plan.partial_gradients for name in bucket["params"]}
    assert {name for r in records.values() for name in r["whole"]} <= summed


def _check_counts(counted: dict, planned: dict, exact: bool) -> None:
    """The collectives counted against the plan's. The plan counts backward as if every
    parameter were trained: with the base model frozen, the first layers' input gradients (and
    the frozen norms' partial gradients) are never computed, so fewer may happen."""
    if exact:
        assert counted == planned, (counted, planned)
    else:
        assert all(n <= planned.get(kind, 0) for kind, n in counted.items()), (counted, planned)


def _train(optimizer: str, sequence_parallel: bool, trained: str) -> dict:
    world = dist.get_world_size()
    reference, model = build(), build()
    if trained == "all":  # LoRA beside a trained base model (as with modules_to_save)
        for m in (reference, model):
            m.requires_grad_(True)
    plan = autoshard.plan(model, sequence_parallel=sequence_parallel)
    _check_plan(plan, world)
    autoshard.parallelize(model, plan)
    names = _lora_names(reference)
    assert _lora_names(model) == names

    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # without labels: whole logits
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)

    make = {"torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "autoshard": lambda ps: autoshard.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[optimizer]
    opt = make([p for p in model.parameters() if p.requires_grad])
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + step))
        with autoshard.CommCounter() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        want = reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, want, **TOL)
        with autoshard.CommCounter() as backward:
            loss.backward()
        want.backward()
        assert _counts(forward) == plan.collectives("forward", labels=True), (_counts(forward), str(plan))
        _check_counts(_counts(backward), plan.collectives("backward"), exact=trained == "all")
        # The adapters' whole factors are summed in backward: at least that all-reduce happens.
        assert _counts(backward).get("all_reduce", 0) >= 1, _counts(backward)
        grads = _gathered_grads(model, names)
        ref_params = dict(reference.named_parameters())
        for name in names:
            assert grads[name].abs().max() > 0, name
            torch.testing.assert_close(grads[name], ref_params[name].grad, **TOL,
                                       msg=lambda m: f"step {step}, gradient of {name}: {m}")
        for name, p in model.named_parameters():
            assert p.requires_grad or p.grad is None, name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    got, want = autoshard.full_state_dict(model), reference.state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name} after steps: {m}")

    # Merging: each rank adds B @ A of its local factors to its local slice of the base weight.
    merged, ref_merged = model.merge_and_unload(), reference.merge_and_unload()
    got, want = autoshard.full_state_dict(merged), ref_merged.state_dict()
    assert set(got) == set(want) and not any("lora" in k for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"merged {name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits, **TOL)
    return {"held": [plan.held_fraction(r) for r in range(world)]}


def _train_all():
    return {run: _train(*run) for run in (("torch", True, "lora"), ("autoshard", True, "lora"), ("torch", False, "lora"),
                                          ("autoshard", True, "all"))}


@pytest.mark.parametrize("world_size", [2, 3])
def test_lora_split_with_base_layers_trains_exactly(world_size):
    results = run_on_ranks(_train_all, world_size, timeout=900)[0]
    for result in results.values():
        assert max(result["held"]) <= 1 / world_size + 0.1, result
