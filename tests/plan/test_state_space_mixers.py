"""State-space mixers (Mamba's selective scan): the model multiplies a layer's weight itself
(`self.dt_proj.weight @ x`), a depthwise convolution is called functionally, and the row layer
x_proj's output (dt, B and C) meets this rank's channels only. The plan splits the mixer over
its channels: in_proj column, x_proj row with its output gradient summed in backward, dt_proj a
column layer the model multiplies itself (no input copy), out_proj row; A_log, D and the
convolution's weight with the channels. Checked against the unsharded module on 2 and 3 gloo
ranks (outputs, every gradient, the collectives the plan predicts), and against Hugging Face's
Mamba; a weight product whose input gradient nothing sums, or whose bias is read whole, stays
whole."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from gathered import forward_backward_as_planned, gathered_grads
from multirank import run_on_ranks


class SelectiveScanMixer(nn.Module):
    """Mamba's mixer in plain PyTorch, written as transformers writes it."""

    def __init__(self, hidden=12, inner=10, state=3, rank=2, kernel=3):
        super().__init__()
        self.inner, self.state, self.rank = inner, state, rank
        self.in_proj = nn.Linear(hidden, 2 * inner)
        self.conv1d = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float).repeat(inner, 1)))
        self.D = nn.Parameter(torch.randn(inner))
        self.out_proj = nn.Linear(inner, hidden)

    def forward(self, x):
        seq = x.shape[1]
        projected = self.in_proj(x).transpose(1, 2)
        h, gate = projected.chunk(2, dim=1)
        h = F.silu(F.conv1d(h, self.conv1d.weight, self.conv1d.bias, padding=self.conv1d.padding[0],
                            groups=h.shape[1])[..., :seq])
        dt, B, C = torch.split(self.x_proj(h.transpose(1, 2)), [self.rank, self.state, self.state], dim=-1)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)
        dt = F.softplus(dt + self.dt_proj.bias[..., None])
        A = -torch.exp(self.A_log)
        dA = torch.exp(A[None, :, None, :] * dt[..., None])
        dBu = dt[..., None] * B[:, None, :, :] * h[..., None]
        state = torch.zeros(x.shape[0], h.shape[1], self.state, dtype=x.dtype, device=x.device)
        outs = []
        for t in range(seq):
            state = dA[:, :, t] * state + dBu[:, :, t]
            outs.append((state * C[:, None, t, :]).sum(-1))
        y = torch.stack(outs, dim=-1) + h * self.D[None, :, None]
        return self.out_proj((y * F.silu(gate)).transpose(1, 2))


class Stack(nn.Module):
    def __init__(self, mixer_class=SelectiveScanMixer):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.mixers = nn.ModuleList([mixer_class(), mixer_class()])

    def forward(self, x):
        for mixer in self.mixers:
            x = x + mixer(self.norm(x))
        return x


def _inputs():
    return torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _stack(mixer_class=SelectiveScanMixer):
    torch.manual_seed(0)
    return Stack(mixer_class).double()


def test_the_mixer_is_split_over_its_channels():
    plan = autoshard.plan(_stack(), example_inputs=(_inputs(),), world_size=2)
    styles = {layer.module: layer.style.value for layer in plan.layers}
    for i in range(2):
        assert styles[f"mixers.{i}.in_proj"] == "column"
        assert styles[f"mixers.{i}.x_proj"] == "row"
        assert styles[f"mixers.{i}.dt_proj"] == "column"
        assert styles[f"mixers.{i}.out_proj"] == "row"
    assert [r.module for r in plan.summed_outputs] == ["mixers.0.x_proj", "mixers.1.x_proj"]
    dt_proj = next(layer for layer in plan.layers if layer.module == "mixers.0.dt_proj")
    assert dt_proj.deferred_copy and "multiplies its weight itself" in dt_proj.note
    split = {p.name for p in plan.head_parameters}
    assert {"mixers.0.A_log", "mixers.0.D", "mixers.0.conv1d.weight", "mixers.0.conv1d.bias"} <= split
    # dt_proj's bias is split by its layer, not as a parameter of its own.
    assert "mixers.0.dt_proj.bias" not in split
    # Per mixer: x_proj's and out_proj's all-reduce in forward; in_proj's input copy and x_proj's
    # summed output in backward.
    assert plan.collectives("forward") == {"all_reduce": 4}
    assert plan.collectives("backward") == {"all_reduce": 4}
    assert "output gradients summed where their layer returns them" in str(plan)


def _equal_to_unsharded(model, reference, inputs, run, tolerance=1e-10):
    """`model` parallelized on `inputs` against `reference`: outputs, the collectives the plan
    predicts, every gradient (gathered). Returns each layer's style."""
    autoshard.parallelize(model, example_inputs=inputs)
    plan = autoshard.core.parallel_state.state_of(model).plan
    forward_backward_as_planned(model, reference, plan, run, rtol=tolerance, atol=tolerance)
    grads = gathered_grads(model)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=tolerance, atol=tolerance, msg=lambda m: f"{name}: {m}")
    return {layer.module: layer.style.value for layer in plan.layers}


def _exact_on_ranks(world_size):
    x = _inputs()
    return _equal_to_unsharded(_stack(), _stack(), (x,), lambda m: m(x))


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_split_mixer_equals_the_unsharded_one(world_size):
    for styles in run_on_ranks(_exact_on_ranks, world_size, world_size):
        assert styles["mixers.1.dt_proj"] == "column" and styles["mixers.1.x_proj"] == "row"


def _hf_mamba():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, intermediate_size=24,
                         time_step_rank=3, conv_kernel=3, use_cache=False)
    return MambaForCausalLM(config).double()


def _hf_mamba_exact():
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    return _equal_to_unsharded(_hf_mamba(), _hf_mamba(), {"input_ids": ids}, lambda m: m(input_ids=ids).logits,
                               tolerance=1e-9)


def test_hugging_face_mamba_split_equals_the_unsharded_model():
    for styles in run_on_ranks(_hf_mamba_exact, 2):
        assert styles["backbone.layers.0.mixer.dt_proj"] == "column"
        assert styles["backbone.layers.0.mixer.x_proj"] == "row"


class ProductAfterNorm(nn.Module):
    """F.linear on a layer's weight reading a norm's output: the product's input gradient is this
    rank's part, and it reaches only the norm's weight and bias (the model's input needs none),
    whose partial gradients the plan sums. Split, and exact."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 16)
        self.down = nn.Linear(16, 12)

    def forward(self, x):
        return self.down(F.gelu(F.linear(x, self.up.weight, self.up.bias)))


class ProductBesideResidual(ProductAfterNorm):
    """The same product beside a residual: its input also gets a whole gradient, which a partial
    one would corrupt, and nothing upstream sums it. Kept whole."""

    def forward(self, x):
        return x + super().forward(x)


class BiasReadWhole(SelectiveScanMixer):
    """dt_proj's bias also summed whole into the output: it cannot be split with the channels."""

    def forward(self, x):
        return super().forward(x) + self.dt_proj.bias.sum()


BLOCKS = {"ProductAfterNorm": (ProductAfterNorm, "1.up", "column"),
          "ProductBesideResidual": (ProductBesideResidual, "1.up", "replicate"),
          "BiasReadWhole": (BiasReadWhole, "1.dt_proj", "replicate")}


def _block_model(block_name):
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(12), BLOCKS[block_name][0]()).double()


@pytest.mark.parametrize("block_name", list(BLOCKS))
def test_a_weight_product_is_split_only_where_its_input_gradient_is_summed(block_name):
    plan = autoshard.plan(_block_model(block_name), example_inputs=(_inputs(),), world_size=2)
    _, name, style = BLOCKS[block_name]
    layer = next(layer for layer in plan.layers if layer.module == name)
    assert layer.style.value == style, str(plan)
    if style == "replicate":
        assert layer.reason in ("functional_layer", "conflict"), str(plan)


def _block_exact(block_name):
    x = _inputs()
    return _equal_to_unsharded(_block_model(block_name), _block_model(block_name), (x,), lambda m: m(x))


@pytest.mark.parametrize("block_name", list(BLOCKS))
def test_a_weight_product_split_or_whole_is_exact(block_name):
    run_on_ranks(_block_exact, 2, block_name)
