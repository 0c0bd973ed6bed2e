"""PEFT LoRA split with its base layers, against the unsharded PEFT model with the same weights.

Tiny Llamas with LoRA (r=4) on every projection, their B factors drawn non-zero so that no
gradient is trivially zero: hidden 64, 4 query / 2 KV heads, MLP 128, vocabulary 256 ("llama"),
and hidden 48, 6 query / 2 KV heads, MLP 70 ("kv_shared": on 3 ranks KV heads are held by two
ranks each and the MLP splits 24/23/23). On 2 and 3 gloo ranks: the plan splits every base layer
as it splits the model without LoRA and each adapter with it, a rank holds at most 1/N + 0.1 of
the parameters wherever the model without LoRA does, the collectives counted are the plan's, and
the logits, the loss, every LoRA gradient, the weights after AdamW steps (torch's and
autoshard's) and the merged model of merge_and_unload equal the unsharded model's (float64).
"""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import autoshard  # noqa: E402
from autoshard.core.parallel_state import state_of  # noqa: E402
from autoshard.state.unsharded import gather_full  # noqa: E402
from gathered import nonzero_counts  # noqa: E402
from multirank import run_on_ranks  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
VOCAB = 256
CONFIGS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "kv_shared": dict(hidden_size=48, intermediate_size=70, num_attention_heads=6, num_key_value_heads=2),
}
PREFIX = "base_model.model."  # where get_peft_model puts the model's own names
STEPS = 3
# float64: what differs from the unsharded model is only the order of sums.
TOL = dict(rtol=1e-9, atol=1e-11)


def build_base(kind: str, seed: int = 0):
    config = AutoConfig.for_model("llama", num_hidden_layers=2, vocab_size=VOCAB, attention_dropout=0.0,
                                  **CONFIGS[kind])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).double()


def build(kind: str = "llama", seed: int = 0, **lora):
    """The PEFT model, the same weights for the same seed: base Llama, then LoRA factors with
    B drawn at random (PEFT starts it at zero, which would leave A's gradient zero)."""
    model = get_peft_model(build_base(kind, seed),
                           LoraConfig(target_modules=TARGETS, r=4, lora_alpha=8, lora_dropout=0.0, **lora))
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


def _lora_names(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _check_plan(plan, kind: str, world: int) -> None:
    """Every base layer split as in the model without LoRA, each adapter with it."""
    plain = autoshard.plan(build_base(kind), world_size=world)
    styles = {layer.module: layer.style for layer in plain.layers}
    assert {layer.module.removeprefix(PREFIX): layer.style for layer in plan.layers} == styles, str(plan)
    for rank in range(world):
        if plain.held_fraction(rank) <= 1 / world + 0.1:
            assert plan.held_fraction(rank) <= 1 / world + 0.1, (rank, str(plan))
    records = {r.module: r for r in plan.adapters}
    assert len(records) == 2 * len(TARGETS)
    summed = {name for bucket in plan.partial_gradients for name in bucket.params}
    for module, record in records.items():
        factors = [f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"]
        style = styles[module.removeprefix(PREFIX)]
        if style == "replicate":
            assert record.split == [] and record.whole == factors, record
            continue
        split, whole = factors[::-1] if style == "column" else factors
        assert record.split == [split] and record.whole == [whole], record
        assert whole in summed, (whole, plan.partial_gradients)


def _check_counts(counted: dict, planned: dict, exact: bool) -> None:
    """The collectives counted against the plan's. The plan counts backward as if every
    parameter were trained: with the base model frozen, the first layers' input gradients (and
    the frozen norms' partial gradients) are never computed, so fewer may happen."""
    if exact:
        assert counted == planned, (counted, planned)
    else:
        assert all(n <= planned.get(kind, 0) for kind, n in counted.items()), (counted, planned)


def _check_saved_adapter(model, reference, kind: str, directory: str) -> None:
    """The adapter saved from the split model with its full state dict loads into the unsharded
    base model as the reference's adapter."""
    from peft import PeftModel

    model.save_pretrained(directory, state_dict=autoshard.full_state_dict(model), is_main_process=dist.get_rank() == 0)
    dist.barrier()
    loaded = PeftModel.from_pretrained(build_base(kind), directory)
    want = reference.state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want[name], **TOL, msg=lambda m: f"loaded {name}: {m}")


def _train(kind: str, optimizer: str, sequence_parallel: bool, trained: str, directory: str = "") -> dict:
    world = dist.get_world_size()
    reference, model = build(kind), build(kind)
    if trained == "all":  # LoRA beside a trained base model (as with modules_to_save)
        for m in (reference, model):
            m.requires_grad_(True)
    plan = autoshard.plan(model, sequence_parallel=sequence_parallel)
    _check_plan(plan, kind, world)
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
        assert nonzero_counts(forward) == model.autoshard_state.collectives("forward", labels=True), \
            (nonzero_counts(forward), str(model.autoshard_state))
        _check_counts(nonzero_counts(backward), plan.collectives("backward"), exact=trained == "all")
        # The adapters' whole factors are summed in backward: at least that all-reduce happens.
        assert nonzero_counts(backward).get("all_reduce", 0) >= 1, nonzero_counts(backward)
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

    if directory:
        _check_saved_adapter(model, reference, kind, directory)

    # Merging: each rank adds B @ A of its local factors to its local slice of the base weight.
    merged, ref_merged = model.merge_and_unload(), reference.merge_and_unload()
    got, want = autoshard.full_state_dict(merged), ref_merged.state_dict()
    assert set(got) == set(want) and not any("lora" in k for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"merged {name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits, **TOL)
    return {"held": [plan.held_fraction(r) for r in range(world)]}


def _train_all(runs, directory):
    return {run: _train(*run, directory=directory if i == 0 else "") for i, run in enumerate(runs)}


def _adapter_calls() -> dict:
    """A batch mixing adapters computes what the unsharded model does; an adapter added after
    parallelize is refused where it is used, naming the way out."""
    from peft import LoraConfig

    reference, model = build(), build()
    autoshard.parallelize(model)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    model.add_adapter("late", LoraConfig(target_modules=TARGETS, r=2))
    model.set_adapter("late")
    with pytest.raises(ValueError) as late:
        model(input_ids=ids)
    model.set_adapter("default")
    model.eval()
    reference.eval()
    mixed = ["default", "__base__", "default"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, adapter_names=mixed).logits,
                                   reference(input_ids=ids, adapter_names=mixed).logits, **TOL)
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)
    return {"late": str(late.value)}


RUNS = {
    2: [("llama", "torch", True, "lora"), ("llama", "autoshard", True, "lora"), ("llama", "torch", False, "lora"),
        ("llama", "autoshard", True, "all")],
    # The 4 / 2-head model keeps its attention whole on 3 ranks, with or without LoRA (the ranks
    # would use their KV heads in groups of different sizes); the 6 / 2-head one splits it.
    3: [("llama", "torch", True, "lora"), ("kv_shared", "torch", True, "lora"), ("kv_shared", "autoshard", True, "lora"),
        ("kv_shared", "torch", False, "lora"), ("kv_shared", "autoshard", True, "all")],
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_lora_split_with_base_layers_trains_exactly(world_size, tmp_path):
    results = run_on_ranks(_train_all, world_size, RUNS[world_size], str(tmp_path), timeout=900)[0]
    for run, result in results.items():
        if run[0] == "kv_shared" or world_size == 2:
            assert max(result["held"]) <= 1 / world_size + 0.1, (run, result)


def test_split_lora_mixed_batches_and_late_adapters():
    found = run_on_ranks(_adapter_calls, 2, timeout=300)[0]
    assert "ParallelLoraLinear" in found["late"] and "['late']" in found["late"], found["late"]
    assert "before autoshard.parallelize" in found["late"], found["late"]


def _dora() -> dict:
    reference, model = build(use_dora=True), build(use_dora=True)
    plan = autoshard.plan(model)
    autoshard.parallelize(model, plan)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    loss, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    names = _lora_names(reference)
    grads, ref_params = _gathered_grads(model, names), dict(reference.named_parameters())
    for name in names:
        torch.testing.assert_close(grads[name], ref_params[name].grad, **TOL, msg=lambda m: f"gradient of {name}: {m}")
    return {"adapters": plan.adapters, "base": {l.module: l.style for l in plan.layers if l.module.endswith("base_layer")}}


def test_lora_variants_are_followed_op_by_op():
    """DoRA normalises the whole adapted weight: its layers are no LoRA construct, and their
    ops are planned one by one, their base layers whole; exact all the same."""
    found = run_on_ranks(_dora, 2, timeout=300)[0]
    assert found["adapters"] == []
    assert len(found["base"]) == 2 * len(TARGETS) and set(found["base"].values()) == {"replicate"}, found["base"]


def test_plan_of_split_adapters_round_trips_through_json():
    plan = autoshard.plan(build("kv_shared"), world_size=3)
    again = autoshard.ShardingPlan.from_json(plan.to_json())
    assert again.adapters == plan.adapters and len(plan.adapters) == 2 * len(TARGETS)
    assert again.partial_gradients == plan.partial_gradients
    for rank in range(3):
        assert again.held_parameters(rank) == plan.held_parameters(rank)
        specs = plan.param_specs(rank)
        # B of a column layer is split as its base weight's rows, A of a row layer as its columns.
        for record in plan.adapters:
            base = plan.layer(record.module).weight
            assert [specs[name] for name in record.split] == [specs[base]], record
