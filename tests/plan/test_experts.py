"""Mixture-of-experts weights held as 3-D parameters (Mixtral, Qwen2-MoE): planned from the
dataflow under the models' default expert implementation, split on each expert's FFN axis
(a column side in gate/up parts, a row side), the router replicated; what the plan says each
rank holds against what parallelize leaves on 2 gloo ranks; the meta answers the capture
gives (the grouped matmul's shapes against its CPU kernel, every token routed to every expert)."""

import itertools
import json
import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging

import autoshard
from autoshard.inputs.meta_values import KnownValues
from checkpoint_round_trip import load, train_and_save
from multirank import run_on_ranks

logging.set_verbosity_error()

TINY = dict(vocab_size=101, hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3)
MODELS = {
    "mixtral": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2)),
    "mixtral_eager": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2, experts_implementation="eager")),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30,
                                    shared_expert_intermediate_size=40)),
}


# gpt-oss: gate and up interleaved on the FFN axis, and a bias per expert on each side.
OSS = ("gpt_oss", dict(num_local_experts=3, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                       experts_implementation="eager"))


def _build(name: str, device="cpu"):
    kind, overrides = OSS if name == "gpt_oss" else MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **TINY, **overrides))


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@pytest.mark.parametrize("name", sorted(MODELS))
def test_experts_split_on_the_ffn_axis(name):
    model = _build(name, device="meta")
    plan = autoshard.plan(model, world_size=2)
    experts = [layer for layer in plan.layers if layer.kind == "experts"]
    assert len(experts) == 2 * TINY["num_hidden_layers"]
    ffn = MODELS[name][1].get("moe_intermediate_size", TINY["intermediate_size"])
    for column, row in zip(experts[::2], experts[1::2]):
        assert column.module == row.module and column.module.endswith("mlp.experts")
        assert (column.style, row.style) == ("column", "row")
        assert column.weight.endswith("gate_up_proj") and row.weight.endswith("down_proj")
        # gate and up each split on the FFN axis (dim 1 of [E, 2F, H]); down on dim 2 of [E, H, F].
        spec, row_spec = column.weight_spec(1, 2), row.weight_spec(1, 2)
        assert (spec.dim, spec.parts, row_spec.dim) == (1, (ffn, ffn), 2)
        first, second = autoshard.split_sizes(ffn, 2)
        assert spec.local_ranges() == [(first, second), (ffn + first, second)]
        assert row_spec.local_ranges() == [(first, second)]
    specs = plan.param_specs(0)
    assert not any(n.endswith("mlp.gate.weight") for n in specs)  # the router stays whole
    assert plan.held_fraction(0) <= 1 / 2 + 0.1 and plan.held_fraction(1) <= 1 / 2 + 0.1
    experts_class = type(model.model.layers[0].mlp.experts).__name__
    assert plan.held_fraction(0, experts_class) == pytest.approx(autoshard.split_sizes(ffn, 2)[0] / ffn)


@pytest.mark.parametrize("dtype, world_size, sizes", [
    (torch.float32, 3, [24, 20, 20]), (torch.float32, 5, [16, 12, 12, 12, 12]),
    (torch.bfloat16, 3, [24, 24, 16]), (torch.bfloat16, 5, [16, 16, 16, 8, 8])])
def test_expert_slices_keep_the_grouped_matmul_rows_on_16_bytes(dtype, world_size, sizes):
    """An FFN of 64 features is split in groups of 16 bytes (4 features in float32, 8 in
    bfloat16), numpy's rule over the groups, so that each rank's rows stay a multiple of 16 bytes,
    as the grouped matmul's kernels require."""
    kind, overrides = MODELS["mixtral"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**TINY, "intermediate_size": 64},
                                                                      **overrides)).to(dtype)
    plan = autoshard.plan(model, world_size=world_size)
    column, row = [layer for layer in plan.layers if layer.kind == "experts"][:2]
    assert [row.weight_spec(r, world_size).local_size() for r in range(world_size)] == sizes
    assert [column.weight_spec(r, world_size).local_size() for r in range(world_size)] == [2 * s for s in sizes]


def test_mixtral_8x7b_plans_on_meta_under_default_settings():
    config = AutoConfig.for_model("mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                  num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._experts_implementation == "grouped_mm"  # the default, left as it is
    plan = autoshard.plan(model, world_size=8)
    total = sum(_numel(r.shape) for r in plan.parameters.values())
    sharded = sum(_numel(plan.parameters[n].shape) for n in plan.param_specs(0))
    assert total > 46e9
    assert sharded / total >= 0.95, sharded / total
    assert plan.held_fraction(0) <= 1 / 8 + 0.01


def _held_on_rank(name: str) -> dict:
    model = _build(name)
    plan = autoshard.plan(model, world_size=dist.get_world_size())
    said = plan.held_parameters(dist.get_rank())
    autoshard.parallelize(model, plan)
    return {"said": said, "real": {n: p.numel() for n, p in model.named_parameters()},
            "fraction": plan.held_fraction(dist.get_rank())}


def _check_all():
    return {name: _held_on_rank(name) for name in MODELS}


def test_held_parameters_equal_what_parallelize_leaves():
    results = run_on_ranks(_check_all, 2, timeout=600)
    for name in MODELS:
        full = {n: p.numel() for n, p in _build(name).named_parameters()}
        for by_model in results:
            report = by_model[name]
            assert report["said"] == report["real"], name
            assert report["fraction"] == pytest.approx(sum(report["real"].values()) / sum(full.values()))
            assert report["fraction"] <= 0.6, (name, report["fraction"])


def test_grouped_matmul_shapes_on_meta_equal_its_cpu_kernel():
    """torch's grouped matmul has a meta kernel for bf16 only; the capture answers its shapes."""
    x, w = torch.randn(5, 8), torch.randn(3, 12, 8).transpose(-2, -1)
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)
    want = torch.nn.functional.grouped_mm(x, w, offs=offsets)
    with pytest.raises(RuntimeError, match="BF16"):
        torch.nn.functional.grouped_mm(x.to("meta"), w.to("meta"), offs=offsets.to("meta"))
    with KnownValues():
        got = torch.nn.functional.grouped_mm(x.to("meta"), w.to("meta"), offs=offsets.to("meta"))
    assert got.device.type == "meta" and (got.shape, got.dtype) == (want.shape, want.dtype)


def test_routing_of_unknown_values_reaches_every_expert():
    """nonzero of a value that depends on weights (which expert a token goes to) answers as if
    every element were nonzero; known values keep their own answer."""
    values = KnownValues()
    weight = torch.empty(3, 4, device="meta")
    with values:
        hit = (weight > 0).nonzero()
        assert hit.shape == (12, 2)
        assert hit.tolist() == torch.ones(3, 4).nonzero().tolist()
        (positions,) = torch.where(weight[1] > 0)  # the eager expert loop's tokens of one expert
        assert positions.tolist() == [0, 1, 2, 3]
        known = values.to_meta(torch.tensor([0, 2, 0, 1])).nonzero()
        assert known.tolist() == [[1], [3]]


def _ids(step: int) -> torch.Tensor:
    return torch.randint(1, 101, (2, 8), generator=torch.Generator().manual_seed(step))


def test_expert_slices_checkpoint_on_two_ranks_reload_on_three_and_unsharded(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(train_and_save, 2, path, _build, "mixtral_eager", timeout=600)[0]
    before = {n: p.detach() for n, p in _build("mixtral_eager").state_dict().items()}
    assert not torch.equal(saved["model.layers.0.mlp.experts.gate_up_proj"],
                           before["model.layers.0.mlp.experts.gate_up_proj"])  # the step changed them
    for loaded in (run_on_ranks(load, 3, path, _build, "mixtral_eager", timeout=600)[0],
                   load(path, _build, "mixtral_eager", sharded=False)):
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


def test_interleaved_experts_with_biases_split_in_gate_up_pairs():
    """gpt-oss's in weight [E, H, 2F] holds gate and up interleaved: each rank's slice is a run of
    whole (gate, up) pairs, its in bias [E, 2F] the same run; down [E, F, H] by its F rows, and
    the out bias [E, H] whole on every rank."""
    model = _build("gpt_oss", device="meta")
    ffn = TINY["intermediate_size"]
    for world in (2, 3):
        plan = autoshard.plan(model, world_size=world)
        experts = [layer for layer in plan.layers if layer.kind == "experts"]
        assert len(experts) == 2 * TINY["num_hidden_layers"]
        for column, row in zip(experts[::2], experts[1::2]):
            assert (column.style, row.style) == ("column", "row")
            assert column.bias.endswith("gate_up_proj_bias") and row.bias.endswith("down_proj_bias")
            starts = [0, *itertools.accumulate(autoshard.split_sizes(ffn, world))]
            for rank in range(world):
                pairs = (2 * starts[rank], 2 * (starts[rank + 1] - starts[rank]))
                spec, bias = column.weight_spec(rank, world), column.bias_spec(rank, world)
                assert (spec.dim, bias.dim) == (2, 1)  # stored transposed: [E, H, 2F]
                assert spec.local_ranges() == bias.local_ranges() == [pairs]
                assert row.weight_spec(rank, world).local_ranges() == [(starts[rank], pairs[1] // 2)]
                assert row.bias_spec(rank, world) is None
        specs = plan.param_specs(0)
        assert not any(n.endswith("down_proj_bias") for n in specs)


def test_interleaved_expert_slices_checkpoint_on_two_ranks_reload_on_three_and_unsharded(tmp_path):
    """The full tensors reassembled from interleaved slices are the model's own: saved on 2 ranks
    after a step, reloaded on 3 and unsharded, every value equal."""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(train_and_save, 2, path, _build, "gpt_oss", timeout=600)[0]
    before = _build("gpt_oss").state_dict()
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj_bias"):
        key = f"model.layers.0.mlp.experts.{name}"
        assert not torch.equal(saved[key], before[key])  # the step changed them
    for loaded in (run_on_ranks(load, 3, path, _build, "gpt_oss", timeout=600)[0],
                   load(path, _build, "gpt_oss", sharded=False)):
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


def test_experts_of_other_forms_are_not_read_as_interleaved_or_biased():
    """A module with 3-D weights and biases but no has_bias flag, or biases of other shapes, is
    not an experts module the split understands."""
    from autoshard.constructs.experts import experts_weights

    class Biased(torch.nn.Module):
        def __init__(self, flag: bool, out_bias_shape=(3, 8)):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(3, 8, 10))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(3, 10))
            self.down_proj = torch.nn.Parameter(torch.zeros(3, 5, 8))
            self.down_proj_bias = torch.nn.Parameter(torch.zeros(*out_bias_shape))
            self.is_transposed, self.is_concatenated = True, False
            if flag:
                self.has_bias = True

    found = experts_weights(Biased(True))
    assert found is not None and found.interleaved and found.transposed
    assert (found.in_bias, found.out_bias) == ("gate_up_proj_bias", "down_proj_bias")
    assert experts_weights(Biased(False)) is None
    assert experts_weights(Biased(True, out_bias_shape=(3, 5))) is None


class _Experts(torch.nn.Module):
    """Experts of our own (no transformers): each token through every expert, weighted."""

    def __init__(self, normalized: bool = False, transposed: bool = False, zero_experts: int = 0):
        super().__init__()
        # Routed slots past the weights' experts return their input (LongCat-Flash's
        # zero-computation experts): a term every rank would add to the partial sums.
        self.zero_experts = zero_experts
        # Stored transposed for x @ w (Llama 4's and Aria's layout): [E, H, 2F] and [E, F, H].
        self.transposed = transposed
        self.gate_up = torch.nn.Parameter(torch.randn((3, 8, 2 * 10) if transposed else (3, 2 * 10, 8)))
        self.down = torch.nn.Parameter(torch.randn((3, 10, 8) if transposed else (3, 8, 10)))
        self.normalized = normalized

    def forward(self, x, weights):
        gate_up = self.gate_up
        if self.normalized:  # a norm over each expert's FFN axis: not a split-able expert MLP
            gate_up = gate_up / gate_up.norm(dim=2 if self.transposed else 1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(gate_up.shape[0]):
            w_in, w_out = (gate_up[e], self.down[e]) if self.transposed else (gate_up[e].t(), self.down[e].t())
            gate, up = (x @ w_in).chunk(2, dim=-1)
            out = out + weights[:, e:e + 1] * ((torch.nn.functional.silu(gate) * up) @ w_out)
        for e in range(gate_up.shape[0], gate_up.shape[0] + self.zero_experts):
            out = out + weights[:, e:e + 1] * x
        return out


class _MoE(torch.nn.Module):
    def __init__(self, normalized: bool = False, transposed: bool = False, zero_experts: int = 0):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))  # the experts' input needs a gradient
        self.router = torch.nn.Linear(8, 3 + zero_experts)
        self.experts = _Experts(normalized, transposed, zero_experts)

    def forward(self, x):
        x = x * self.scale
        return x + self.experts(x, self.router(x).softmax(-1))


def test_experts_of_our_own_are_split_and_other_uses_of_their_weights_kept_whole():
    x = torch.randn(5, 8)
    plan = autoshard.plan(_MoE(), world_size=2, example_inputs=(x,))
    assert [(l.module, l.kind, l.style) for l in plan.layers] == [
        ("router", "linear", "replicate"), ("experts", "experts", "column"), ("experts", "experts", "row")]
    assert plan.layers[1].parts == [10, 10]
    # A norm over each expert's FFN axis: splitting it would compute something else.
    plan = autoshard.plan(_MoE(normalized=True), world_size=2, example_inputs=(x,))
    assert [(l.module, l.style) for l in plan.layers] == [("router", "replicate")]
    assert plan.held_fraction(0) == 1.0
    # Experts that return their input beside those computed by the weights: the input would be
    # summed over the ranks with the split experts' partial outputs.
    plan = autoshard.plan(_MoE(zero_experts=2), world_size=2, example_inputs=(x,))
    assert [(l.module, l.style) for l in plan.layers] == [("router", "replicate")]


class _ExpertsMixingWhole(_Experts):
    """Experts whose output takes the input itself where a token is masked, or fills it with a
    constant: either way a whole tensor every rank would add to the sum of the partial outputs."""

    def __init__(self, fill: bool):
        super().__init__()
        self.fill = fill

    def forward(self, x, weights):
        out = super().forward(x, weights)
        masked = x[:, :1] > 0
        return out.masked_fill(masked, 1.0) if self.fill else torch.where(masked, x, out)


@pytest.mark.parametrize("fill", [False, True], ids=["where", "masked_fill"])
def test_experts_taking_a_whole_tensor_into_their_output_stay_whole(fill):
    x = torch.randn(5, 8)
    moe = _MoE()
    moe.experts = _ExpertsMixingWhole(fill)
    plan = autoshard.plan(moe, world_size=2, example_inputs=(x,))
    assert [(l.module, l.style) for l in plan.layers] == [("router", "replicate")]


def test_experts_stored_transposed_split_on_the_ffn_axis():
    x = torch.randn(5, 8)
    plan = autoshard.plan(_MoE(transposed=True), world_size=2, example_inputs=(x,))
    column, row = plan.layers[1:]
    assert (column.kind, column.style, row.kind, row.style) == ("experts", "column", "experts", "row")
    # gate and up each split on the FFN axis: dim 2 of [E, H, 2F]; down on dim 1 of [E, F, H].
    spec, row_spec = column.weight_spec(0, 2), row.weight_spec(0, 2)
    assert (spec.dim, spec.parts, spec.full_size, row_spec.dim, row_spec.full_size) == (2, (10, 10), 20, 1, 10)
    assert spec.local_ranges() == [(0, 5), (10, 5)] and row_spec.local_ranges() == [(0, 5)]
    plan = autoshard.plan(_MoE(normalized=True, transposed=True), world_size=2, example_inputs=(x,))
    assert [(l.module, l.style) for l in plan.layers] == [("router", "replicate")]


def _own_experts_on_ranks(normalized: bool = False, transposed: bool = False, zero_experts: int = 0):
    torch.manual_seed(0)
    model = _MoE(normalized, transposed, zero_experts).double()
    reference = _MoE(normalized, transposed, zero_experts).double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    autoshard.parallelize(model, example_inputs=(x,))
    with autoshard.CommCounter() as forward:
        out = model(x)
    with autoshard.CommCounter() as backward:
        out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    shards = autoshard.core.parallel_state.state_of(model).shards()
    grads = {}
    for name, p in model.named_parameters():
        want = reference.get_parameter(name).grad
        if id(p) in shards:
            spec = shards[id(p)][0]
            want = torch.cat([want.narrow(spec.dim, s, n) for s, n in spec.local_ranges()], spec.dim)
        grads[name] = (p.grad, want)
    plan = autoshard.core.parallel_state.state_of(model).plan
    return {"out": (out.detach(), reference(x).detach()), "grads": grads,
            "comm": ({k: v for k, v in forward.counts.items() if v}, plan.collectives("forward"),
                     {k: v for k, v in backward.counts.items() if v}, plan.collectives("backward"))}


def _own_experts_refused(normalized: bool, transposed: bool, zero_experts: int = 0) -> str:
    model = _MoE(normalized, transposed, zero_experts).double()
    with pytest.raises(ValueError) as refusal:
        autoshard.parallelize(model, example_inputs=(torch.randn(5, 8, dtype=torch.float64),))
    return str(refusal.value)


@pytest.mark.parametrize("transposed", [False, True], ids=["stored_for_w_x", "stored_for_x_w"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_experts_of_our_own_compute_the_unsharded_result(world_size, transposed):
    # A norm of the weights; zero experts: the experts stay whole, and with the router's softmax
    # whole too nothing is left to split, which parallelize refuses, saying why.
    for whole in ((True, transposed), (False, transposed, 2)):
        for refusal in run_on_ranks(_own_experts_refused, world_size, *whole, timeout=300):
            assert "the plan splits nothing" in refusal and "experts (_Experts" in refusal, refusal
    for result in run_on_ranks(_own_experts_on_ranks, world_size, False, transposed, timeout=300):
        torch.testing.assert_close(*result["out"], rtol=1e-12, atol=1e-12)
        for name, (got, want) in result["grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)
        counted_forward, planned_forward, counted_backward, planned_backward = result["comm"]
        assert counted_forward == planned_forward == {"all_reduce": 1}
        # The hidden states' gradient and the routing weights': one all-reduce each.
        assert counted_backward == planned_backward == {"all_reduce": 2}


# FFN sizes whose slices on 2 and 3 ranks keep torch's CPU grouped matmul's 16-byte strides.
ALIGNED = {"mixtral": dict(num_local_experts=3, num_experts_per_tok=2, intermediate_size=96),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                             shared_expert_intermediate_size=40)}


def _aligned_config(kind: str):
    return AutoConfig.for_model(kind, **{**TINY, **ALIGNED[kind]})


def _load_pretrained_on_ranks(kind: str, path: str) -> dict:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_aligned_config(kind))
    autoshard.parallelize(model)
    autoshard.load_pretrained(model, path, progress=False)
    ids = _ids(7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"logits": logits, "state": autoshard.full_state_dict(model)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_pretrained_stacks_each_ranks_slices_of_per_expert_tensors(world_size, tmp_path):
    """save_pretrained writes one tensor per expert and projection (Mixtral's w1/w2/w3, Qwen2-MoE's
    gate/up/down_proj); each rank reads its FFN slices of them into its 3-D expert weights."""
    for kind in ALIGNED:
        path = str(tmp_path / kind)
        torch.manual_seed(4)
        AutoModelForCausalLM.from_config(_aligned_config(kind)).save_pretrained(path, max_shard_size="20KB")
        with open(os.path.join(path, "model.safetensors.index.json")) as index:
            keys = json.load(index)["weight_map"]
        assert any(".experts.2." in k for k in keys) and not any(k.endswith("gate_up_proj") for k in keys)
        reference = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            want = reference(input_ids=_ids(7)).logits
        for result in run_on_ranks(_load_pretrained_on_ranks, world_size, kind, path, timeout=600):
            torch.testing.assert_close(result["logits"], want, rtol=1e-5, atol=1e-5)
            state = reference.state_dict()
            assert result["state"].keys() == state.keys()
            for name, value in state.items():
                assert torch.equal(result["state"][name], value), (kind, name)
