"""EinsumDense against torch.einsum and nn.Linear; the equation ops; ShardedEinsumDense on
1-4 gloo ranks against the unsharded layers (an attention-style pair sharded on heads)."""

import math

import pytest
import torch
from torch import nn
from torch.library import opcheck

import autoshard
import autoshard.nn
from autoshard.core import ops
from autoshard.nn import EinsumDense, ShardedEinsumDense
from autoshard.nn.einsum import classify
from multirank import run_on_ranks

D, N, H = 11, 5, 3  # model dim, heads, head dim: sizes that divide nothing


# ---- the equation ops


@pytest.mark.parametrize(
    "equation, roles",
    [
        ("ab,bc->ac", {"b": "contracted", "c": "output"}),
        ("btd,dnh->btnh", {"d": "contracted", "n": "output", "h": "output"}),
        ("btnh,nhd->btd", {"n": "contracted", "h": "contracted", "d": "output"}),
        ("btnd,nde->btne", {"n": "batch", "d": "contracted", "e": "output"}),
        ("...b,bc->...c", {"b": "contracted", "c": "output"}),
        ("ab...,bc->ac...", {"b": "contracted", "c": "output"}),
        (" a b , b c -> a c ", {"b": "contracted", "c": "output"}),
    ],
)
def test_classify(equation, roles):
    got = classify(equation)
    assert got == roles and list(got) == list(roles)  # weight order


def test_weight_axes_report_tensor_dims():
    assert ops.einsum_weight_axes("btd,dnh->btnh") == (["d", "n", "h"], ["contracted", "output", "output"],
                                                      [2, None, None], [None, 2, 3])
    # After a leading "..." dims count from the end.
    assert ops.einsum_weight_axes("...td,dh->...th") == (["d", "h"], ["contracted", "output"], [-1, None], [None, -1])
    assert ops.einsum_weight_axes("btnd,nde->btne")[2:] == ([2, 3, None], [2, None, 3])


@pytest.mark.parametrize(
    "equation, words",
    [
        ("ab,bc", ["'ab,bc'", "'->'"]),
        ("ab,bc->ac->ac", ["exactly one '->'"]),
        ("ab->ab", ["two operands"]),
        ("ab,bc,cd->ad", ["two operands"]),
        ("ab,b...->a...", ["weight", "'...'"]),
        ("...b,bc->ac", ["'...'", "both the input and the output"]),
        ("...b,bc->c...", ["same end"]),
        ("a1,1c->ac", ["only letters", "'1'"]),
        ("abb,bc->ac", ["'b'", "more than once", "input"]),
        ("ab,bc->acz", ["output letter 'z'", "neither"]),
        ("ab,bcz->ac", ["weight letter 'z'", "neither"]),
    ],
)
def test_invalid_equations_are_refused(equation, words):
    for call in (lambda: classify(equation), lambda: EinsumDense(equation, 4, input_shape=(3,))):
        with pytest.raises(ValueError) as info:
            call()
        for word in words:
            assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "equation, input_shape, output_shape, bias_axes, weight, bias, output",
    [
        ("ab,bc->ac", (32,), 64, "c", [32, 64], [64], [None, 64]),
        ("abc,cd->abd", (None, 32), (None, 64), "d", [32, 64], [64], [None, None, 64]),
        ("btd,dnh->btnh", (7, D), (None, N, H), "nh", [D, N, H], [N, H], [None, 7, N, H]),
        ("btd,dnh->btnh", (7, D), (7, N, H), "n", [D, N, H], [N, 1], [None, 7, N, H]),
        ("btnh,nhd->btd", (None, N, H), (None, D), None, [N, H, D], [], [None, None, D]),
        ("btnd,nde->btne", (4, N, D), (4, N, 6), "ne", [N, D, 6], [N, 6], [None, 4, N, 6]),
        ("...b,bc->...c", (7, 32), 64, "c", [32, 64], [64], [None, 7, 64]),
        ("...tb,bc->...tc", (2, 9, 32), (9, 64), "t", [32, 64], [9, 1], [None, 2, 9, 64]),
        ("ab...,bc->ac...", (32, 7, 9), 64, "c", [32, 64], [64, 1, 1], [None, 64, 7, 9]),
    ],
)
def test_dense_shapes(equation, input_shape, output_shape, bias_axes, weight, bias, output):
    got = ops.einsum_dense_shapes(equation, input_shape, [output_shape] if isinstance(output_shape, int)
                                  else output_shape, bias_axes)
    assert got == (weight, bias, output)
    layer = EinsumDense(equation, output_shape, input_shape=input_shape, bias_axes=bias_axes)
    assert list(layer.weight.shape) == weight
    assert (layer.bias is None) == (bias_axes is None)
    if bias_axes is not None:
        assert list(layer.bias.shape) == bias
    assert list(layer.output_shape) == output[1:]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(equation="ab,bc->ac", output_shape=(4, 4), input_shape=(3,)), ["output_shape (4, 4)", "1 dims"]),
        (dict(equation="ab,bc->ac", output_shape=4, input_shape=(3, 2)), ["input_shape (3, 2)", "1 dims"]),
        (dict(equation="...b,bc->...c", output_shape=4, input_shape=()), ["input_shape ()", "at least 1"]),
        (dict(equation="abc,cd->abd", output_shape=(5, 4), input_shape=(6, 3)),
         ["letter 'b'", "6 in input_shape", "5 in output_shape"]),
        (dict(equation="ab,bc->ac", output_shape=(None,), input_shape=(3,)), ["weight letter 'c'", "unknown"]),
        (dict(equation="abc,cd->abd", output_shape=(None, 4), input_shape=(None, None)), ["weight letter 'c'"]),
        (dict(equation="ab,bc->ac", output_shape=4, input_shape=(3,), bias_axes="b"),
         ["bias_axes 'b'", "output 'ac'"]),
        (dict(equation="ab,bc->ac", output_shape=4, input_shape=(3,), bias_axes="cc"), ["more than once"]),
        (dict(equation="ab,bc->ca", output_shape=4, input_shape=(3,)), ["first letter", "batch"]),
        (dict(equation="ab,bc->ac", output_shape=-4, input_shape=(3,)), ["output_shape", ">= 0"]),
    ],
)
def test_bad_shapes_are_refused(kwargs, words):
    with pytest.raises(ValueError) as info:
        EinsumDense(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: EinsumDense(3, 4, input_shape=(3,)), ["equation", "str", "int"]),
        (lambda: EinsumDense("ab,bc->ac", "4", input_shape=(3,)), ["output_shape"]),
        (lambda: EinsumDense("ab,bc->ac", 4, input_shape=(3.0,)), ["input_shape", "3.0"]),
        (lambda: EinsumDense("ab,bc->ac", 4, input_shape=(3,), bias_axes=["c"]), ["bias_axes"]),
        (lambda: classify(None), ["equation", "NoneType"]),
    ],
)
def test_bad_argument_types(call, words):
    with pytest.raises(TypeError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_opcheck_equation_ops():
    opcheck(torch.ops.autoshard.einsum_dense_shapes.default, ("btd,dnh->btnh", [None, D], [None, N, H], "nh"))
    opcheck(torch.ops.autoshard.einsum_dense_shapes.default, ("...b,bc->...c", [7, 32], [64], None))
    # opcheck's output comparison cannot compare str outputs, which the aot-dispatch test needs;
    # the op takes and returns no tensors, so that test has nothing else to check.
    opcheck(torch.ops.autoshard.einsum_weight_axes.default, ("btd,dnh->btnh",),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ---- EinsumDense, one process


def random_layer(equation, output_shape, input_shape, bias_axes, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = EinsumDense(equation, output_shape, input_shape=input_shape, bias_axes=bias_axes, dtype=dtype)
    if layer.bias is not None:
        nn.init.normal_(layer.bias)  # zeros would hide a misplaced bias
    return layer


@pytest.mark.parametrize(
    "equation, input_shape, output_shape, bias_axes, x_shape, bias_shape",
    [
        ("ab,bc->ac", (D,), 7, "c", (4, D), (7,)),
        ("abc,cd->abd", (None, D), (None, 7), "d", (4, 6, D), (7,)),
        ("btd,dnh->btnh", (None, D), (None, N, H), "nh", (2, 6, D), (N, H)),
        ("btd,dnh->btnh", (None, D), (None, N, H), "n", (2, 6, D), (N, 1)),
        ("btnh,nhd->btd", (None, N, H), (None, D), "d", (2, 6, N, H), (D,)),
        ("btnd,nde->btne", (None, N, D), (None, N, 4), "e", (2, 3, N, D), (4,)),
        ("...b,bc->...c", (6, D), 7, "c", (2, 6, D), (7,)),
        ("...tb,bc->...tc", (2, 6, D), (6, 7), "t", (3, 2, 6, D), (6, 1)),
        ("ab...,bc->ac...", (D, 2, 3), 7, "c", (4, D, 2, 3), (7, 1, 1)),
        ("abc,cd->abd", (None, D), (None, 7), None, (4, 6, D), None),
    ],
)
def test_matches_direct_einsum(equation, input_shape, output_shape, bias_axes, x_shape, bias_shape):
    layer = random_layer(equation, output_shape, input_shape, bias_axes)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    weight = layer.weight.detach().clone().requires_grad_()
    want = torch.einsum(equation, x, weight)
    if bias_shape is not None:
        # The bias lines up with the output's trailing dims.
        assert tuple(layer.bias.shape) == bias_shape
        bias = layer.bias.detach().clone().requires_grad_()
        want = want + bias
    got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(layer.weight.grad, weight.grad, rtol=1e-12, atol=1e-12)
    if bias_shape is not None:
        torch.testing.assert_close(layer.bias.grad, bias.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(layer, (x,))


def test_matches_linear():
    torch.manual_seed(0)
    linear = nn.Linear(D, 7)
    layer = EinsumDense("ab,bc->ac", 7, input_shape=(D,), bias_axes="c")
    with torch.no_grad():
        layer.weight.copy_(linear.weight.t())
        layer.bias.copy_(linear.bias)
    x = torch.randn(9, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn(9, 7)
    got, want = layer(x), linear(x2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, linear.weight.grad.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-6, atol=1e-6)


def test_glorot_init_and_zero_bias():
    torch.manual_seed(0)
    layer = EinsumDense("btd,dnh->btnh", (None, 40, 30), input_shape=(None, 500), bias_axes="nh")
    assert layer.fans() == (500, 1200)
    bound = math.sqrt(6 / 1700)
    assert layer.weight.abs().max() <= bound
    assert layer.weight.abs().max() > 0.9 * bound  # spread over the whole range
    assert abs(layer.weight.std().item() - bound / math.sqrt(3)) < 0.01 * bound
    assert torch.count_nonzero(layer.bias) == 0
    # Batch letters index independent matrices and count in neither fan.
    assert EinsumDense("btnd,nde->btne", (None, 4, 6), input_shape=(None, 4, 8)).fans() == (8, 6)


def test_meta_device_and_dtype():
    layer = EinsumDense("btd,dnh->btnh", (None, N, H), input_shape=(None, D), bias_axes="nh", device="meta",
                        dtype=torch.bfloat16)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert layer(torch.empty(2, 3, D, device="meta", dtype=torch.bfloat16)).shape == (2, 3, N, H)


@pytest.mark.parametrize("x_shape", [(4, D + 1), (4,), (4, 2, D)])
def test_wrong_input_shape_is_refused(x_shape):
    layer = EinsumDense("ab,bc->ac", 7, input_shape=(D,))
    with pytest.raises(ValueError, match=rf"input must have shape \(\*, {D}\).*got \({x_shape[0]},"):
        layer(torch.randn(x_shape))


def test_sharding_needs_initialised_distributed():
    assert not torch.distributed.is_initialized()
    layer = EinsumDense("btd,dnh->btnh", (None, N, H), input_shape=(None, D))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ShardedEinsumDense.from_einsum_dense(layer, "n")


def test_shard_axis_errors_before_any_communication():
    layer = EinsumDense("btnd,nde->btne", (None, N, 4), input_shape=(None, N, D))
    with pytest.raises(ValueError, match=r"shard_axis 'z'.*weight 'nde'.*'btnd,nde->btne'"):
        ShardedEinsumDense.from_einsum_dense(layer, "z")
    with pytest.raises(ValueError, match=r"shard_axis 't'.*weight 'nde'"):
        ShardedEinsumDense.from_einsum_dense(layer, "t")  # in the equation, not in the weight
    with pytest.raises(ValueError, match=r"shard_axis 'n' is a batch letter of equation 'btnd,nde->btne'"):
        ShardedEinsumDense.from_einsum_dense(layer, "n")
    with pytest.raises(ValueError, match="gather_output=True needs an output letter"):
        ShardedEinsumDense.from_einsum_dense(layer, "d", gather_output=True)
    with pytest.raises(ValueError, match="input_is_parallel=False needs a contracted letter"):
        ShardedEinsumDense.from_einsum_dense(layer, "e", input_is_parallel=False)
    with pytest.raises(TypeError, match="shard_axis"):
        ShardedEinsumDense.from_einsum_dense(layer, 1)
    with pytest.raises(TypeError, match="EinsumDense"):
        ShardedEinsumDense.from_einsum_dense(nn.Linear(2, 2), "n")


# ---- ShardedEinsumDense on 1-4 gloo ranks


def _attention_pair(bias_axes_in, bias_axes_out, seed=0):
    torch.manual_seed(seed)
    qkv = random_layer("btd,dnh->btnh", (None, N, H), (None, D), bias_axes_in, seed=seed, dtype=torch.float32)
    out = random_layer("btnh,nhd->btd", (None, D), (None, N, H), bias_axes_out, seed=seed + 1, dtype=torch.float32)
    return qkv, out


def _grads_of(*modules):
    return {f"{i}.{name}": p.grad.clone() for i, m in enumerate(modules) for name, p in m.named_parameters()}


def _sharded_pair_matches_unsharded(bias_axes_in, bias_axes_out):
    from autoshard.core import comm

    qkv, out = _attention_pair(bias_axes_in, bias_axes_out)
    s_qkv = ShardedEinsumDense.from_einsum_dense(qkv, "n")
    s_out = ShardedEinsumDense.from_einsum_dense(out, "n")  # its input arrives sharded on n
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, D, generator=g)
    grad = torch.randn(2, 6, D, generator=g)

    x_full = x.clone().requires_grad_()
    want = out(torch.tanh(qkv(x_full)))
    want.backward(grad)
    x_sharded = x.clone().requires_grad_()
    with autoshard.CommCounter() as forward:
        hidden = s_qkv(x_sharded)
        got = s_out(torch.tanh(hidden))
    with autoshard.CommCounter() as backward:
        got.backward(grad)

    errors = {"out": (got - want).abs().max().item(), "x.grad": (x_sharded.grad - x_full.grad).abs().max().item()}
    full_grads = _grads_of(qkv, out)
    for key, local_grad in _grads_of(s_qkv, s_out).items():
        module = (s_qkv, s_out)[int(key[0])]
        spec = module.shard_specs.get(key.split(".")[1])
        expected = full_grads[key] if spec is None else spec.take(full_grads[key])
        assert local_grad.shape == expected.shape, key
        errors[key] = (local_grad - expected).abs().max().item()
    heads = autoshard.split_sizes(N, comm.world_size())[comm.rank()]
    return {
        "comm": (forward.counts, backward.counts),
        "errors": errors,
        "hidden_shape": tuple(hidden.shape),
        "heads": heads,
        "styles": (s_qkv.style, s_out.style),
        "specs": {f"{i}.{k}": (v.dim, v.full_size) for i, m in enumerate((s_qkv, s_out))
                  for k, v in m.shard_specs.items()},
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_attention_pair_sharded_on_heads(world_size):
    results = run_on_ranks(_sharded_pair_matches_unsharded, world_size, "nh", "d")
    for rank, r in enumerate(results):
        for name, error in r["errors"].items():
            assert error <= 1e-5, (rank, name, error)
        assert set(r["errors"]) == {"out", "x.grad", "0.weight", "0.bias", "1.weight", "1.bias"}
        assert r["hidden_shape"] == (2, 6, r["heads"], H)
        assert r["styles"] == ("column", "row")
        assert r["specs"] == {"0.weight": (1, N), "0.bias": (0, N), "1.weight": (0, N)}
        # Megatron's minimum: one all-reduce in forward (row output), one in backward (column input).
        one = {"all_reduce": 1} if world_size > 1 else {}
        assert r["comm"] == (one, one)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bias_replicated_over_the_sharded_letter_gets_every_shards_gradient(world_size):
    # The first layer's bias ("h") is broadcast over the sharded heads: its gradient is the sum
    # over all heads, so the shards' contributions must be summed.
    results = run_on_ranks(_sharded_pair_matches_unsharded, world_size, "h", "d")
    for rank, r in enumerate(results):
        for name, error in r["errors"].items():
            assert error <= 1e-5, (rank, name, error)
        assert r["specs"] == {"0.weight": (1, N), "1.weight": (0, N)}
        assert r["comm"] == ({"all_reduce": 1}, {"all_reduce": 2})  # the input's and the bias's gradients


def _error(got, want):
    return (got - want).abs().max().item()


def _compare(name, layer, reference, inputs, grad, results, counts):
    """Runs the sharded `layer` and its unsharded `reference` on copies of `inputs`, backward
    from `grad`: the collectives each counts in forward and backward, and the largest errors of
    the output, the input's gradient and the weight's and bias's (a shard's against its piece)."""
    a, b = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    with autoshard.CommCounter() as forward:
        got = layer(a)
    with autoshard.CommCounter() as backward:
        got.backward(grad)
    counts[name] = (forward.counts, backward.counts)
    want = reference(b)
    want.backward(grad)
    results[f"{name}.out"] = _error(got, want)
    results[f"{name}.input.grad"] = _error(a.grad, b.grad)
    for param in ("weight", "bias"):
        spec, whole = layer.shard_specs.get(param), getattr(reference, param).grad
        results[f"{name}.{param}.grad"] = _error(getattr(layer, param).grad, whole if spec is None else spec.take(whole))


def _gathered_and_scattered():
    qkv, out = _attention_pair("nh", "d", seed=3)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 4, D, generator=g)
    results, counts = {}, {}
    # Column-style with its output gathered back: the full output on every rank.
    layer = ShardedEinsumDense.from_einsum_dense(qkv, "h", gather_output=True)
    _compare("gather", layer, qkv, x, torch.randn(2, 4, N, H, generator=g), results, counts)
    # Row-style cutting its full input itself.
    layer = ShardedEinsumDense.from_einsum_dense(out, "h", input_is_parallel=False)
    h = torch.randn(2, 4, N, H, generator=g)
    _compare("scatter", layer, out, h, torch.randn(2, 4, D, generator=g), results, counts)
    return results, counts


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_output_and_scattered_input(world_size):
    for rank, (r, counts) in enumerate(run_on_ranks(_gathered_and_scattered, world_size)):
        assert len(r) == 8
        for name, error in r.items():
            assert error <= 1e-5, (rank, name, error)
        assert counts["gather"] == ({"all_gather": 1}, {"all_reduce": 1})
        assert counts["scatter"] == ({"all_reduce": 1}, {"all_gather": 1})


def _leading_ellipsis_column_and_row():
    torch.manual_seed(4)
    up = EinsumDense("...d,df->...f", 13, input_shape=(5, D), bias_axes="f")
    down = EinsumDense("...f,fd->...d", D, input_shape=(5, 13), bias_axes="d")
    s_up, s_down = ShardedEinsumDense.from_einsum_dense(up, "f"), ShardedEinsumDense.from_einsum_dense(down, "f")
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(9))
    got, want = s_down(torch.relu(s_up(x))), down(torch.relu(up(x)))
    return (got - want).abs().max().item(), s_up.shard_specs["bias"].dim, s_down.shard_specs["weight"].dim


def test_leading_ellipsis_mlp_pair():
    for error, bias_dim, weight_dim in run_on_ranks(_leading_ellipsis_column_and_row, 3):
        assert error <= 1e-5 and bias_dim == 0 and weight_dim == 0


def _shard_errors():
    errors = {}
    layer = EinsumDense("btd,dnh->btnh", (None, 2, H), input_shape=(None, D))
    try:
        ShardedEinsumDense.from_einsum_dense(layer, "n")
    except ValueError as e:
        errors["too_many_ranks"] = str(e)
    row = ShardedEinsumDense.from_einsum_dense(EinsumDense("btnh,nhd->btd", (None, D), input_shape=(None, N, H)), "n")
    try:
        row(torch.randn(2, 3, N, H))  # the full input where this rank's heads were expected
    except ValueError as e:
        errors["full_input_to_row"] = str(e)
    column_layer = EinsumDense("btd,dnh->btnh", (None, N, H), input_shape=(None, D))
    column = ShardedEinsumDense.from_einsum_dense(column_layer, "n")
    try:
        column(torch.randn(2, 3, D + 1))
    except ValueError as e:
        errors["bad_column_input"] = str(e)
    return errors


def test_shard_errors_on_ranks():
    for rank, errors in enumerate(run_on_ranks(_shard_errors, 3)):
        assert "letter 'n' of size 2" in errors["too_many_ranks"] and "3 ranks" in errors["too_many_ranks"]
        assert "'btd,dnh->btnh'" in errors["too_many_ranks"] and "at most 2" in errors["too_many_ranks"]
        heads = autoshard.split_sizes(N, 3)[rank]
        assert f"input must have shape (*, *, {heads}, {H})" in errors["full_input_to_row"]
        assert f"(*, *, {D})" in errors["bad_column_input"] and f"got (2, 3, {D + 1})" in errors["bad_column_input"]


def _meta_sharding():
    with torch.device("meta"):
        layer = EinsumDense("btd,dnh->btnh", (None, 32, 128), input_shape=(None, 4096), bias_axes="nh")
    sharded = ShardedEinsumDense.from_einsum_dense(layer, "n")
    return sharded.weight.device.type, tuple(sharded.weight.shape), tuple(sharded.bias.shape)


def test_meta_layer_shards_on_meta():
    sizes = autoshard.split_sizes(32, 3)
    assert run_on_ranks(_meta_sharding, 3) == [("meta", (4096, s, 128), (s, 128)) for s in sizes]
