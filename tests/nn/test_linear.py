"""ColumnParallelLinear and RowParallelLinear against the unsharded layers on 1 to 4 gloo
ranks, with sizes that no world size divides (in 10, hidden 11, out 7, batch 2 x seq 3).

Every rank builds the same unsharded reference from the same seed, shards it with
from_linear, and compares outputs and gradients: a local parameter's gradient against
its slice (ShardSpec.take) of the reference gradient.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import autoshard
from autoshard.nn import ColumnParallelLinear, RowParallelLinear
from multirank import run_on_ranks
from checks import expect_errors

IN, HIDDEN, OUT = 10, 11, 7
BATCH = (2, 3)
TOL = dict(rtol=1e-5, atol=1e-5)


def reference(seed, kind="linear", sizes=(IN, HIDDEN, OUT)):
    """Two unsharded layers, an input and an upstream gradient, the same on every rank."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        if kind == "linear":
            layers.append(nn.Linear(fan_in, fan_out))
        else:
            layer = Conv1D(fan_out, fan_in)
            nn.init.normal_(layer.bias)  # Conv1D starts with zero bias, which would test nothing
            layers.append(layer)
    x = torch.randn(*BATCH, sizes[0])
    upstream = torch.randn(*BATCH, sizes[-1])
    return layers, x, upstream


def run(f, x, upstream):
    """f(x) and the gradient of <f(x), upstream> with respect to x."""
    x = x.detach().clone().requires_grad_()
    y = f(x)
    y.backward(upstream)
    return y.detach(), x.grad


def assert_grads_match(sharded, full):
    names = [name for name, _ in sharded.named_parameters()]
    assert names == [name for name, _ in full.named_parameters()]
    for name, param in sharded.named_parameters():
        full_grad = dict(full.named_parameters())[name].grad
        spec = sharded.shard_specs.get(name)
        want = spec.take(full_grad) if spec is not None else full_grad
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m: f"{type(sharded).__name__}.{name}: {m}")


def check_mlp(kind, seed):
    """column -> GELU -> row: equal to the unsharded pair, one all-reduce each way."""
    world = dist.get_world_size()
    (fc1, fc2), x, upstream = reference(seed, kind)
    column = ColumnParallelLinear.from_linear(fc1)
    row = RowParallelLinear.from_linear(fc2)
    want_y, want_dx = run(lambda t: fc2(F.gelu(fc1(t))), x, upstream)

    xs = x.clone().requires_grad_()
    with autoshard.CommCounter() as forward:
        y = row(F.gelu(column(xs)))
    with autoshard.CommCounter() as backward:
        y.backward(upstream)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(xs.grad, want_dx, **TOL)
    assert_grads_match(column, fc1)
    assert_grads_match(row, fc2)
    if world == 1:
        assert forward.counts == {} and backward.counts == {}
    else:
        assert forward.counts == {"all_reduce": 1} and backward.counts == {"all_reduce": 1}
        assert forward.bytes == {"all_reduce": 2 * 3 * OUT * 4}  # the output's partial sums
        assert backward.bytes == {"all_reduce": 2 * 3 * IN * 4}  # the input's gradient


def check_column_alone(kind, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    (fc1,), x, upstream = reference(seed, kind, sizes=(IN, HIDDEN))
    for gather_output in (False, True):
        fc1.zero_grad()
        want_y, want_dx = run(fc1, x, upstream)
        column = ColumnParallelLinear.from_linear(fc1, gather_output=gather_output)
        local_upstream = upstream if gather_output else autoshard.shard(upstream, rank, world, -1)
        with autoshard.CommCounter() as counter:
            y, dx = run(column, x, local_upstream)
        torch.testing.assert_close(y, want_y if gather_output else autoshard.shard(want_y, rank, world, -1), **TOL)
        torch.testing.assert_close(dx, want_dx, **TOL)
        assert_grads_match(column, fc1)
        if world > 1:
            want_counts = {"all_reduce": 1, "all_gather": 1} if gather_output else {"all_reduce": 1}
            assert counter.counts == want_counts


def check_row_alone(kind, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    (fc2,), x, upstream = reference(seed, kind, sizes=(HIDDEN, OUT))
    for input_is_parallel in (True, False):
        fc2.zero_grad()
        want_y, want_dx = run(fc2, x, upstream)
        row = RowParallelLinear.from_linear(fc2, input_is_parallel=input_is_parallel)
        local_x = autoshard.shard(x, rank, world, -1) if input_is_parallel else x
        y, dx = run(row, local_x, upstream)
        torch.testing.assert_close(y, want_y, **TOL)
        torch.testing.assert_close(dx, autoshard.shard(want_dx, rank, world, -1) if input_is_parallel else want_dx,
                                   **TOL)
        assert_grads_match(row, fc2)


def check_fused_heads(seed):
    """A fused QKV column layer split on whole heads, part by part, feeding a row layer split
    on the same heads: what a planner builds for attention."""
    heads, head_dim = 3, 2
    width = heads * head_dim
    torch.manual_seed(seed)
    qkv, out = nn.Linear(IN, 3 * width), nn.Linear(width, OUT)
    x, upstream = torch.randn(*BATCH, IN), torch.randn(*BATCH, OUT)

    def attention_like(t, qkv_layer, out_layer):
        q, k, v = qkv_layer(t).chunk(3, dim=-1)  # locally: this rank's heads of each part
        return out_layer(q * torch.sigmoid(k) + v)

    want_y, want_dx = run(lambda t: attention_like(t, qkv, out), x, upstream)
    column = ColumnParallelLinear.from_linear(qkv, units=heads, parts=(width, width, width))
    row = RowParallelLinear.from_linear(out, units=heads)
    y, dx = run(lambda t: attention_like(t, column, row), x, upstream)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(dx, want_dx, **TOL)
    assert_grads_match(column, qkv)
    assert_grads_match(row, out)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert column.local_out_features == 3 * head_dim * autoshard.split_sizes(heads, world)[rank]


def check_construction(seed):
    """Direct construction draws nn.Linear's initialisation and keeps this rank's slice; on
    meta it allocates nothing. Attributes and specs describe the layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for cls, split_dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        torch.manual_seed(seed)
        layer = cls(IN, HIDDEN)
        torch.manual_seed(seed)
        full = nn.Linear(IN, HIDDEN)
        torch.testing.assert_close(layer.weight, autoshard.shard(full.weight.detach(), rank, world, split_dim),
                                   rtol=0, atol=0)
        want_bias = autoshard.shard(full.bias.detach(), rank, world, 0) if split_dim == 0 else full.bias.detach()
        torch.testing.assert_close(layer.bias, want_bias, rtol=0, atol=0)
        spec = layer.shard_specs["weight"]
        assert (spec.dim, spec.full_size, spec.rank, spec.world_size) == (split_dim, (HIDDEN, IN)[split_dim], rank,
                                                                         world)
        assert ("bias" in layer.shard_specs) == (split_dim == 0)
        assert layer.in_features == IN and layer.out_features == HIDDEN
        assert layer.group is dist.group.WORLD

    column = ColumnParallelLinear(IN, HIDDEN, bias=False, gather_output=True)
    assert column.bias is None and column.gather_output and "bias" not in column.shard_specs
    assert column.local_out_features == autoshard.split_sizes(HIDDEN, world)[rank]
    assert f"local_out_features={column.local_out_features} (rank {rank} of {world})" in repr(column)
    row = RowParallelLinear(HIDDEN, OUT, input_is_parallel=False, dtype=torch.float64)
    assert row.local_in_features == autoshard.split_sizes(HIDDEN, world)[rank] and row.weight.dtype == torch.float64
    assert "input_is_parallel=False" in repr(row) and f"local_in_features={row.local_in_features}" in repr(row)

    with torch.device("meta"):
        big = nn.Linear(4096, 1 << 20)  # 16 GiB in fp32, were it real
    column = ColumnParallelLinear.from_linear(big)
    row = RowParallelLinear.from_linear(big)
    assert column.weight.device.type == "meta" and row.bias.device.type == "meta"
    assert tuple(column.weight.shape) == (autoshard.split_sizes(1 << 20, world)[rank], 4096)
    assert tuple(row.weight.shape) == (1 << 20, autoshard.split_sizes(4096, world)[rank])
    y = column(torch.empty(2, 4096, device="meta"))
    assert y.device.type == "meta" and tuple(y.shape) == (2, column.local_out_features)
    meta_row = RowParallelLinear(HIDDEN, OUT, device="meta")
    assert meta_row.weight.device.type == "meta"

    conv = Conv1D(HIDDEN, IN)
    from_conv = ColumnParallelLinear.from_linear(conv)
    assert from_conv.transposed_weight and from_conv.shard_specs["weight"].dim == 1
    assert tuple(from_conv.weight.shape) == (IN, from_conv.local_out_features)
    assert "transposed_weight=True" in repr(from_conv)
    # The sharded parameters own their memory.
    fc = nn.Linear(IN, HIDDEN)
    assert ColumnParallelLinear.from_linear(fc).weight.data_ptr() != fc.weight.data_ptr()


def _layers_match_unsharded():
    checks = []
    world = dist.get_world_size()
    for seed, kind in enumerate(("linear", "conv1d")):
        check_mlp(kind, seed)
        check_column_alone(kind, 10 + seed)
        check_row_alone(kind, 20 + seed)
        checks += [f"mlp-{kind}", f"column-{kind}", f"row-{kind}"]
    if world <= 3:  # three heads to split
        check_fused_heads(30)
        checks.append("fused-heads")
    check_construction(40)
    checks.append("construction")
    return checks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layers_match_unsharded(world_size):
    results = run_on_ranks(_layers_match_unsharded, world_size, timeout=300)
    want = ["mlp-linear", "column-linear", "row-linear", "mlp-conv1d", "column-conv1d", "row-conv1d"]
    want += ["fused-heads"] if world_size <= 3 else []
    assert results == [want + ["construction"]] * world_size


def _layer_errors():
    group = dist.group.WORLD
    cases = [
        (lambda: ColumnParallelLinear(IN, 2), ValueError, ["out_features=2", "3 ranks"]),
        (lambda: RowParallelLinear(2, OUT), ValueError, ["in_features=2", "3 ranks"]),
        (lambda: ColumnParallelLinear.from_linear(nn.Linear(IN, 4), units=2, parts=(2, 2)), ValueError,
         ["out_features=2 (2 whole units)", "3 ranks"]),
        (lambda: ColumnParallelLinear(IN, HIDDEN)(torch.ones(2, 9)), ValueError, ["in_features=10", "got 9"]),
        (lambda: RowParallelLinear(HIDDEN, OUT)(torch.ones(2, HIDDEN)), ValueError,
         ["local_in_features=", f"got {HIDDEN}"]),
        (lambda: RowParallelLinear(HIDDEN, OUT, input_is_parallel=False)(torch.ones(2, 4)), ValueError,
         ["in_features=11", "got 4"]),
        (lambda: ColumnParallelLinear(IN, HIDDEN)(torch.tensor(1.0)), ValueError, ["in_features=10", "0-d"]),
        (lambda: ColumnParallelLinear.from_linear(nn.Conv2d(1, 1, 1)), TypeError,
         ["from_linear", "nn.Linear", "Conv1D", "Conv2d"]),
        (lambda: ColumnParallelLinear.from_linear(nn.Linear(IN, 6), gather_output=True, units=3), ValueError,
         ["gather_output=True", "units=None"]),
        (lambda: RowParallelLinear.from_linear(nn.Linear(6, OUT), input_is_parallel=False, units=3), ValueError,
         ["input_is_parallel=False", "units=None"]),
        (lambda: ColumnParallelLinear(IN, HIDDEN, group=group.group_name), TypeError, ["group", "ProcessGroup", "str"]),
        (lambda: ColumnParallelLinear(IN, 12.0), TypeError, ["out_features", "float"]),
        (lambda: RowParallelLinear(-1, OUT), ValueError, ["in_features", ">= 0", "-1"]),
    ]
    return expect_errors(cases)


def test_bad_input_names_the_argument():
    results = run_on_ranks(_layer_errors, 3)
    assert results[0] == results[1] == results[2] and len(results[0]) == 13


def test_layers_need_initialised_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ColumnParallelLinear(IN, HIDDEN)


# ---- CUDA (skipped without a GPU)


def _mlp_on_cuda_matches_cpu():
    (fc1, fc2), x, upstream = reference(50)
    column, row = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
    want_y, want_dx = run(lambda t: row(F.gelu(column(t))), x, upstream)
    column_cuda = ColumnParallelLinear.from_linear(fc1.cuda())
    row_cuda = RowParallelLinear.from_linear(fc2.cuda())
    assert column_cuda.weight.is_cuda and row_cuda.bias.is_cuda
    y, dx = run(lambda t: row_cuda(F.gelu(column_cuda(t))), x.cuda(), upstream.cuda())
    torch.testing.assert_close(y.cpu(), want_y, **TOL)
    torch.testing.assert_close(dx.cpu(), want_dx, **TOL)
    torch.testing.assert_close(column_cuda.weight.grad.cpu(), column.weight.grad, **TOL)
    torch.testing.assert_close(row_cuda.weight.grad.cpu(), row.weight.grad, **TOL)
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_mlp_on_cuda_matches_cpu(world_size):
    assert run_on_ranks(_mlp_on_cuda_matches_cpu, world_size) == [True] * world_size
