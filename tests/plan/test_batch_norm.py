"""BatchNorms over a convolution's split output channels: one planner node per call, split with
the channels (statistics per channel need no communication), their running statistics kept
whole on every rank and all-gathered after a training forward updates them. Against the
unsharded model in float64 (outputs, every gradient and the running statistics over training
steps, then in eval mode), numpy's array_split, and a checkpoint saved on 3 ranks reloaded on 2
and unsharded, and through torch's DCP into the unsharded model."""

import numpy as np
import pytest
import torch
from torch import nn

import autoshard
from autoshard import checkpoint
from autoshard.nn.batch_norm import ShardedBatchNorm, is_batch_norm
from multirank import run_on_ranks
from test_planner_graphs import G, comm, styles


# ---- the planner on hand-written graphs


def test_the_planner_splits_a_batch_norm_with_its_channels():
    g = G()
    x = g.tensor(2, 5, 3)
    _, h = g.linear(x, 3, 6, 0, out_shape=(2, 5, 6))
    channels_first = g.tensor(2, 6, 5)
    g.node("permute", [h], [channels_first], permutation=[0, 2, 1])
    w, b = g.tensor(6, param=2), g.tensor(6, param=3)
    normed = g.tensor(2, 6, 5)
    g.node("norm", [channels_first, w, b], [normed], label="bn", weight_param=2, bias_param=3, per_channel=True,
           running_stats=True)
    back = g.tensor(2, 5, 6)
    g.node("permute", [normed], [back], permutation=[0, 2, 1])
    _, y = g.linear(back, 6, 3, 1, out_shape=(2, 5, 3))
    g.output(y)
    doc = g.plan(3)
    assert styles(doc) == ["column", "row"]
    assert doc["norms"] == [{"node": 2, "region": doc["layers"][0]["region"], "features": 6}]
    assert doc["partial_gradients"] == []
    # The row layer's all-reduce, and the running statistics' all-gather; nothing in backward
    # but the column layer's copy of an input that needs no gradient (none).
    assert comm(doc, "forward") == {"all_reduce": 1, "all_gather": 1}


def test_a_batch_norm_over_features_on_the_last_axis_keeps_the_layer_whole():
    g = G()
    x = g.tensor(2, 5, 3)
    _, h = g.linear(x, 3, 6, 0, out_shape=(2, 5, 6))
    w = g.tensor(6, param=2)
    normed = g.tensor(2, 5, 6)
    g.node("norm", [h, w], [normed], label="bn", weight_param=2, per_channel=True)
    _, y = g.linear(normed, 6, 3, 1, out_shape=(2, 5, 3))
    g.output(y)
    doc = g.plan(2)
    assert styles(doc)[0] == "replicate" and doc["norms"] == []
    assert any("normalises each channel over an axis split otherwise than by its channels" in r["note"]
               for r in doc["layers"])


# ---- which modules are such norms


def test_only_torch_batch_norms_with_their_own_forward_are_recognised():
    class OwnForward(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    assert is_batch_norm(nn.BatchNorm1d(4)) and is_batch_norm(nn.BatchNorm2d(4, affine=False))
    assert is_batch_norm(nn.BatchNorm3d(4, track_running_stats=False))
    assert not is_batch_norm(OwnForward(4)) and not is_batch_norm(nn.SyncBatchNorm(4))
    assert not is_batch_norm(nn.LazyBatchNorm2d()) and not is_batch_norm(nn.GroupNorm(2, 4))


# ---- a convolutional network against the unsharded one


class ConvNet(nn.Module):
    """Column/row pairs of convolutions with BatchNorms between, of each kind torch has (its
    default momentum, another, no affine parameters, no running statistics), and one after a
    row convolution, on whole channels. (A momentum of None, a cumulative average, reads
    num_batches_tracked's value in torch's own forward, which no trace on meta can.)"""

    def __init__(self):
        super().__init__()
        # No bias before a BatchNorm, as in ResNet: the norm takes the mean away, so its gradient
        # is rounding noise, which AdamW would blow up to whole steps differing run to run.
        self.c1, self.n1 = nn.Conv2d(3, 10, 3, padding=1, bias=False), nn.BatchNorm2d(10)
        self.c2, self.n2 = nn.Conv2d(10, 7, 3, padding=1, bias=False), nn.BatchNorm2d(7, momentum=0.3)
        self.c3, self.n3 = nn.Conv2d(7, 11, 1, bias=False), nn.BatchNorm2d(11, affine=False)
        self.c4 = nn.Conv2d(11, 7, 1)
        self.c5, self.n5 = nn.Conv1d(7, 9, 1, bias=False), nn.BatchNorm1d(9, track_running_stats=False)
        self.c6 = nn.Conv1d(9, 5, 1)

    def forward(self, x):
        h = torch.relu(self.n1(self.c1(x)))
        h = torch.relu(self.n2(self.c2(h)))
        h = h + self.c4(torch.relu(self.n3(self.c3(h))))
        h = h.flatten(2)
        # h read beside n5 too: c4's bias then has a gradient that is not rounding noise.
        return self.c6(torch.relu(self.n5(self.c5(h)))).mean(-1) + h.mean((1, 2)).unsqueeze(-1)


def _build(seed=0):
    torch.manual_seed(seed)
    model = ConvNet().double()
    with torch.no_grad():  # affine parameters and running statistics that are not 1 and 0
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                if module.affine:
                    module.weight.copy_(torch.rand(module.num_features, dtype=torch.float64) + 0.5)
                    module.bias.copy_(torch.rand(module.num_features, dtype=torch.float64) - 0.5)
                if module.running_mean is not None:
                    module.running_mean.copy_(torch.randn(module.num_features, dtype=torch.float64))
                    module.running_var.copy_(torch.rand(module.num_features, dtype=torch.float64) + 0.5)
    return model


def _inputs(step):
    return 1 + torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _against_unsharded():
    model, reference = _build(), _build()
    autoshard.parallelize(model, example_inputs=(_inputs(0),))
    n1_weight = model.n1.weight.detach().clone()
    plan = model.autoshard_state.plan
    specs = plan.param_specs(torch.distributed.get_rank())
    opt = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    errors, counted = {}, []
    for step in range(3):
        with autoshard.CommCounter() as forward:
            got = model(_inputs(step))
        counted.append(({k: v for k, v in forward.counts.items() if v}, plan.collectives("forward")))
        want = reference(_inputs(step))
        errors[f"output {step}"] = float((got - want).abs().max())
        got.square().sum().backward()
        want.square().sum().backward()
        for name, p in reference.named_parameters():
            local = dict(model.named_parameters())[name].grad
            full = p.grad if name not in specs else specs[name].take(p.grad)
            errors[f"grad {name} {step}"] = float((local - full).abs().max())
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    # The running statistics: whole on every rank, equal to the unsharded model's.
    for name, buffer in reference.named_buffers():
        errors[f"buffer {name}"] = float((dict(model.named_buffers())[name].double() - buffer.double()).abs().max())
    model.eval(), reference.eval()
    with autoshard.CommCounter() as forward:
        got = model(_inputs(7))
    counted.append(({k: v for k, v in forward.counts.items() if v}, plan.collectives("forward", training=False)))
    errors["eval output"] = float((got - reference(_inputs(7))).abs().max())
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if name.startswith("n")}
    return errors, counted, kinds, str(plan), n1_weight


@pytest.mark.parametrize("world", [2, 3])
def test_conv_net_matches_unsharded_over_training_steps_and_in_eval(world):
    full = _build().n1.weight.detach()
    results = run_on_ranks(_against_unsharded, world, timeout=300)
    for rank, (errors, counted, kinds, printed, n1_weight) in enumerate(results):
        # This rank's channels, as numpy splits 10 over the ranks.
        assert torch.equal(n1_weight, full[torch.from_numpy(np.array_split(np.arange(10), world)[rank])])
        assert max(errors.values()) < 1e-10, {k: v for k, v in errors.items() if v >= 1e-10}
        assert {k for k in errors if k.startswith("grad")} >= {f"grad n1.weight {s}" for s in range(3)}
        for got, predicted in counted:
            assert got == predicted
        # A training forward gathers the running statistics of n1 and n3 (n2, after the row
        # convolution c2, is whole; n5 keeps none).
        assert counted[0][0]["all_gather"] - counted[-1][0].get("all_gather", 0) == 2
        assert kinds == {"n1": "ShardedBatchNorm", "n2": "BatchNorm2d", "n3": "ShardedBatchNorm",
                         "n5": "ShardedBatchNorm"}
        assert "BatchNorms split with their channels" in printed


# ---- checkpoints: the running statistics whole, the weights split


def _save(path):
    model = _build()
    autoshard.parallelize(model, example_inputs=(_inputs(0),))
    opt = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    model(_inputs(1)).square().sum().backward()
    opt.step()
    checkpoint.save(path, model, opt, extra={"step": 1})
    return {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def _reload(path):
    model = _build(seed=5)
    autoshard.parallelize(model, example_inputs=(_inputs(0),))
    opt = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    extra = checkpoint.load(path, model, opt)
    model.eval()
    return extra, {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}, model(_inputs(4)).detach()


def test_checkpoint_saved_on_3_ranks_reloads_on_2_and_unsharded(tmp_path):
    path = str(tmp_path / "step-1")
    full = run_on_ranks(_save, 3, path, timeout=300)[0]
    # What was saved is the unsharded model trained alike: its running statistics too, which a
    # checkpoint keeping one rank's channels of them would not match.
    trained = _build()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    trained(_inputs(1)).square().sum().backward()
    opt.step()
    assert full.keys() == trained.state_dict().keys()
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-10, msg=name)
    assert not torch.equal(full["n1.running_mean"], _build().n1.running_mean)
    reference = _build(seed=5)
    reference.load_state_dict(full)
    want = reference.eval()(_inputs(4)).detach()
    for extra, state, out in run_on_ranks(_reload, 2, path, timeout=300):
        assert extra == {"step": 1} and state.keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(state[name], value), name
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    model = _build(seed=5)
    assert checkpoint.load(path, model, torch.optim.AdamW(model.parameters(), lr=1e-2)) == {"step": 1}
    for name, value in model.state_dict().items():
        assert torch.equal(value, full[name]), name


# ---- Hugging Face's MobileNetV2 in training


def _mobilenet(seed=0):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("mobilenet_v2", depth_multiplier=0.25, image_size=64)
    torch.manual_seed(seed)
    return AutoModel.from_config(config).double().train()


def _mobilenet_steps():
    model, reference = _mobilenet(), _mobilenet()
    # 64 x 64: 2 x 2 positions at the last stage, so no norm takes its statistics over a handful
    # of values, whose variance would magnify every rounding difference step after step.
    pixels = [torch.randn(4, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
              for s in range(3)]
    autoshard.parallelize(model, example_inputs=(pixels[0],))
    # SGD: a parameter whose gradient a later BatchNorm takes away (a bias before a linear
    # bottleneck's norm) has rounding noise for a gradient, which AdamW would scale up by 1/eps.
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3, momentum=0.9)
    errors = {}
    for step, x in enumerate(pixels):
        got, want = model(x).pooler_output, reference(x).pooler_output
        errors[f"output {step}"] = float((got - want).abs().max())
        got.square().sum().backward(), want.square().sum().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    full = autoshard.full_state_dict(model)
    for name, value in reference.state_dict().items():  # relative to the tensor's largest value
        errors[name] = float((full[name].double() - value.double()).abs().max() / value.double().abs().max().clamp(min=1))
    split = sum(isinstance(m, ShardedBatchNorm) for m in model.modules())
    # Every split parameter is in the plan's specs (the folded blocks' norm biases too).
    specs = model.autoshard_state.plan.param_specs(torch.distributed.get_rank())
    shards = model.autoshard_state.shards()
    unlisted = [n for n, p in model.named_parameters() if id(p) in shards and n not in specs]
    return errors, split, unlisted


def test_hf_mobilenet_v2_trains_as_unsharded_with_its_running_statistics():
    for errors, split, unlisted in run_on_ranks(_mobilenet_steps, 2, timeout=300):
        assert unlisted == []
        assert split >= 17  # each inverted residual's expansion norm, at least
        # Three steps through 37 BatchNorms magnify rounding: the unsharded model itself, given
        # inputs changed by one part in 1e15, ends 4e-9 away in outputs and 3e-9 in parameters.
        # A wrong gradient or a rank's stale running statistics would be off by far more.
        assert max(errors.values()) < 1e-7, {k: v for k, v in errors.items() if v >= 1e-7}
        assert any(k.endswith("running_mean") for k in errors) and any(k.endswith("weight") for k in errors)


# ---- torch's DCP: the split weights described by their global shapes, the statistics whole


def _dcp_save(path):
    import torch.distributed.checkpoint as dcp

    model = _build()
    autoshard.parallelize(model, example_inputs=(_inputs(0),))
    opt = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    model(_inputs(1)).square().sum().backward()
    opt.step()
    dcp.save(model.state_dict(), checkpoint_id=path)
    return {k: v.clone() for k, v in autoshard.full_state_dict(model).items()}


def test_dcp_saves_the_global_tensors_and_reloads_into_the_unsharded_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    full = run_on_ranks(_dcp_save, 2, path, timeout=300)[0]
    plain = _build(seed=7)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    assert plain.state_dict().keys() == full.keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert not torch.equal(full["n1.running_mean"], _build().n1.running_mean)  # the step moved them
