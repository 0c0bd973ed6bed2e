"""Mixed precision: the fused master-weight steps against fp32/float64 references and
torch.library.opcheck, autoshard.optim's master_weights, fp32 clipping norms of bf16
gradients, and (on 2 ranks) bf16 training of a tiny Llama against torch AdamW stepping an
fp32 copy of the weights."""

import pytest
import torch
from torch.library import opcheck

import autoshard
from autoshard.core import ops

SHAPES = [(37,), (64, 129), (0,), (300, 129), (3, 5, 7), (), (1, 1)]  # 300x129 > one 32K work item
ADAMW_ARGS = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, step=3, maximize=False)


def _random(shapes, dtype, seed, positive=False):
    generator = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=generator) for s in shapes]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def _adamw_inputs(dtype, shapes=SHAPES):
    masters = _random(shapes, torch.float32, 0)
    params = [m.to(dtype) for m in masters]
    grads = _random(shapes, dtype, 1)
    exp_avgs = _random(shapes, torch.float32, 2)
    exp_avg_sqs = _random(shapes, torch.float32, 3, positive=True)
    return params, grads, masters, exp_avgs, exp_avg_sqs


def _adamw_float64(master, grad, m, v, lr, beta1, beta2, weight_decay, eps, step, maximize):
    """torch.optim.AdamW's update written out in float64."""
    master, grad, m, v = (t.double() for t in (master, grad, m, v))
    grad = -grad if maximize else grad
    master = master * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (grad - m)
    v = v * beta2 + (1 - beta2) * grad * grad
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return master - lr / (1 - beta1**step) * m / denom, m, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("maximize", [False, True])
def test_fused_adamw_master_is_the_fp32_step_rounded_once(dtype, maximize):
    params, grads, masters, exp_avgs, exp_avg_sqs = _adamw_inputs(dtype)
    wide = [[t.float().clone() for t in ts] for ts in (masters, grads, exp_avgs, exp_avg_sqs)]
    exact = [_adamw_float64(*ts, **{**ADAMW_ARGS, "maximize": maximize})
             for ts in zip(masters, grads, exp_avgs, exp_avg_sqs)]
    args = list({**ADAMW_ARGS, "maximize": maximize}.values())
    ops.fused_adamw_master_(params, grads, masters, exp_avgs, exp_avg_sqs, *args)
    ops.fused_adamw_(*wide, *args)  # the fp32 step of the fp32 master on the widened gradient
    for i in range(len(SHAPES)):
        # Bit for bit the fp32 kernel (itself torch.optim.AdamW's fp32 arithmetic) ...
        assert torch.equal(masters[i], wide[0][i])
        assert torch.equal(exp_avgs[i], wide[2][i]) and torch.equal(exp_avg_sqs[i], wide[3][i])
        # ... the 16-bit parameter is the master rounded to nearest even ...
        assert params[i].dtype == dtype and torch.equal(params[i], masters[i].to(dtype))
        # ... and all of it within fp32 rounding of the float64 update.
        for got, want in zip((masters[i], exp_avgs[i], exp_avg_sqs[i]), exact[i]):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum, first_step, nesterov", [(0.0, False, False), (0.9, True, False),
                                                            (0.9, False, False), (0.8, False, True)])
def test_fused_sgd_master_is_the_fp32_step_rounded_once(dtype, momentum, first_step, nesterov):
    masters = _random(SHAPES, torch.float32, 0)
    params = [m.to(dtype) for m in masters]
    grads = _random(SHAPES, dtype, 1)
    buffers = _random(SHAPES, torch.float32, 2) if momentum else []
    dampening = 0.0 if nesterov else 0.1
    wide = ([m.clone() for m in masters], [g.float() for g in grads], [b.clone() for b in buffers])
    args = (0.05, momentum, dampening, 0.01, nesterov, False, first_step)
    ops.fused_sgd_master_(params, grads, masters, buffers, *args)
    ops.fused_sgd_(*wide, *args)
    for i in range(len(SHAPES)):
        assert torch.equal(masters[i], wide[0][i])
        assert torch.equal(params[i], masters[i].to(dtype))
        if momentum:
            assert torch.equal(buffers[i], wide[2][i])


def test_master_keeps_updates_that_bf16_rounds_away():
    # 1.0 in bf16 has an ulp of 2^-7: steps of 1e-4 vanish from a bf16 weight, not from its master.
    param = torch.ones(1000, dtype=torch.bfloat16)
    master, m, v = torch.ones(1000), torch.zeros(1000), torch.zeros(1000)
    plain, pm, pv = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    grad = torch.ones(1000, dtype=torch.bfloat16)
    for step in range(1, 101):
        ops.fused_adamw_master_([param], [grad], [master], [m], [v], 1e-4, 0.9, 0.999, 0.0, 1e-8, step, False)
        ops.fused_adamw_([plain], [grad], [pm], [pv], 1e-4, 0.9, 0.999, 0.0, 1e-8, step, False)
    assert torch.equal(plain, torch.ones_like(plain))  # every update rounded away
    torch.testing.assert_close(master, torch.full((1000,), 1 - 100e-4), rtol=0, atol=1e-5)
    assert torch.equal(param, master.to(torch.bfloat16)) and bool((param < 1).all())


def _opcheck_cases(device):
    def lists(dtype, seed, shapes=((5, 3), (0,), (17,))):
        return [t.to(device) for t in _random(shapes, dtype, seed, positive=seed == 3)]

    cases = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        cases[f"adamw_master_{name}"] = (ops._ops.fused_adamw_master_.default, (
            lists(dtype, 0), lists(dtype, 1), lists(torch.float32, 0), lists(torch.float32, 2),
            lists(torch.float32, 3), 1e-3, 0.9, 0.999, 0.01, 1e-8, 2, False))
        cases[f"sgd_master_momentum_{name}"] = (ops._ops.fused_sgd_master_.default, (
            lists(dtype, 0), lists(dtype, 1), lists(torch.float32, 0), lists(torch.float32, 2),
            0.1, 0.9, 0.0, 0.01, True, False, False))
        cases[f"sgd_master_plain_{name}"] = (ops._ops.fused_sgd_master_.default, (
            lists(dtype, 0), lists(dtype, 1), lists(torch.float32, 0), [], 0.1, 0.0, 0.0, 0.0, False, True, True))
    return cases


@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck_cpu(case):
    op, args = _opcheck_cases("cpu")[case]
    opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck_cuda(case):
    op, args = _opcheck_cases("cuda")[case]
    opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_master_step_matches_cpu(dtype):
    cpu = _adamw_inputs(dtype, shapes=[(37,), (300, 129), (0,), (70_000,)])
    gpu = [[t.cuda() for t in ts] for ts in cpu]
    args = list(ADAMW_ARGS.values())
    ops.fused_adamw_master_(*cpu, *args)
    ops.fused_adamw_master_(*gpu, *args)
    for a, b in zip(cpu, gpu):
        for x, y in zip(a, b):
            torch.testing.assert_close(y.cpu(), x, rtol=1e-6, atol=1e-6)
    for param, master in zip(gpu[0], gpu[2]):
        assert torch.equal(param, master.to(dtype))


def _master_call(**changes):
    params, grads, masters, exp_avgs, exp_avg_sqs = _adamw_inputs(torch.bfloat16, shapes=[(4,), (3,)])
    lists = dict(params=params, grads=grads, masters=masters, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    lists.update(changes)
    return lambda: ops.fused_adamw_master_(*lists.values(), 1e-3, 0.9, 0.999, 0.0, 1e-8, 1, False)


@pytest.mark.parametrize("call, error, pattern", [
    (_master_call(masters=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(3)]), TypeError,
     r"master_params\[0\] has dtype BFloat16 but must be float32"),
    (_master_call(exp_avg_sqs=[torch.zeros(4), torch.zeros(3, dtype=torch.float64)]), TypeError,
     r"exp_avg_sqs\[1\] has dtype Double but must be float32"),
    (_master_call(grads=[torch.zeros(4), torch.zeros(3)]), TypeError, r"grads\[0\] has dtype Float but params\[0\]"),
    (_master_call(params=[torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)],
                  grads=[torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]), TypeError,
     r"params\[0\] must be bfloat16, float16 or float32"),
    (_master_call(masters=[torch.zeros(4), torch.zeros(4)]), ValueError, r"master_params\[1\] has shape \[4\]"),
    (_master_call(masters=[torch.zeros(4)]), ValueError, r"master_params must hold one tensor per entry"),
])
def test_master_op_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_master_op_errors_leave_inputs_untouched():
    params, grads, masters, exp_avgs, exp_avg_sqs = _adamw_inputs(torch.bfloat16, shapes=[(4,), (3,)])
    before = [t.clone() for t in params + masters + exp_avgs + exp_avg_sqs]
    bad_last = exp_avg_sqs[:1] + [torch.zeros(3, dtype=torch.bfloat16)]
    with pytest.raises(TypeError):
        ops.fused_adamw_master_(params, grads, masters, exp_avgs, bad_last, 1e-3, 0.9, 0.999, 0.0, 1e-8, 1, False)
    for b, a in zip(before, params + masters + exp_avgs + exp_avg_sqs):
        assert torch.equal(a, b)


# ---- autoshard.optim with master weights


def _bf16_params(seed=0, shapes=((37,), (64, 129), (3, 5, 7), ())):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).to(torch.bfloat16).requires_grad_() for s in shapes]


def _step_against_fp32_copy(make_ours, make_torch, steps=20):
    """Ours on bf16 parameters against torch stepping an fp32 copy, cast to bf16 after each step."""
    params = _bf16_params()
    wide = [p.detach().float().requires_grad_() for p in params]
    ours, reference = make_ours(params), make_torch(wide)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, w in zip(params, wide):
            p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
            w.grad = p.grad.float()
        ours.step()
        reference.step()
    return params, wide, ours


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_bf16_parameters_step_through_fp32_masters_by_default(name):
    if name == "AdamW":
        options = dict(lr=1e-2, weight_decay=0.1)
        make_ours, make_torch = autoshard.optim.AdamW, torch.optim.AdamW
        states = ("exp_avg", "exp_avg_sq", "master")
    else:
        options = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
        make_ours, make_torch = autoshard.optim.SGD, torch.optim.SGD
        states = ("momentum_buffer", "master")
    params, wide, ours = _step_against_fp32_copy(lambda p: make_ours(p, **options),
                                                 lambda p: make_torch(p, **options))
    for p, w in zip(params, wide):
        state = ours.state[p]
        assert all(state[key].dtype == torch.float32 for key in states)
        torch.testing.assert_close(state["master"], w.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), state["master"].to(torch.bfloat16))
        assert p.dtype == torch.bfloat16


def test_master_weights_false_and_true_force_it():
    params = _bf16_params()
    plain = autoshard.optim.AdamW(params, lr=1e-2, master_weights=False)
    reference = [p.detach().clone().requires_grad_() for p in params]
    torch_plain = torch.optim.AdamW(reference, lr=1e-2)
    for p, r in zip(params, reference):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
    plain.step()
    torch_plain.step()
    for p, r in zip(params, reference):
        assert "master" not in plain.state[p] and plain.state[p]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-2, atol=1e-2)
    fp32 = [torch.randn(5, requires_grad=True)]
    forced = autoshard.optim.SGD(fp32, lr=0.1, master_weights=True)
    fp32[0].grad = torch.ones(5)
    forced.step()
    assert forced.state[fp32[0]]["master"].dtype == torch.float32
    assert torch.equal(forced.state[fp32[0]]["master"], fp32[0].detach())
    default_fp32 = autoshard.optim.AdamW([torch.randn(3, requires_grad=True)], lr=0.1)
    default_fp32.param_groups[0]["params"][0].grad = torch.ones(3)
    default_fp32.step()
    assert "master" not in default_fp32.state[default_fp32.param_groups[0]["params"][0]]


@pytest.mark.parametrize("make, error, pattern", [
    (lambda: autoshard.optim.AdamW([torch.zeros(2, requires_grad=True)], master_weights="yes"), TypeError,
     "AdamW: master_weights must be None"),
    (lambda: autoshard.optim.SGD([torch.zeros(2, dtype=torch.float64, requires_grad=True)], master_weights=True),
     TypeError, r"SGD: master_weights=True needs bfloat16, float16 or float32 parameters, but "
                r"param_groups\[0\]\['params'\]\[0\] has dtype torch.float64"),
])
def test_master_weights_setting_is_checked(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_state_dict_keeps_fp32_masters_and_loads_torch_state():
    params, _, ours = _step_against_fp32_copy(lambda p: autoshard.optim.AdamW(p, lr=1e-2), torch.optim.AdamW, 3)
    saved = ours.state_dict()
    fresh_params = [p.detach().clone().requires_grad_() for p in params]
    fresh = autoshard.optim.AdamW(fresh_params, lr=1e-2)
    fresh.load_state_dict(saved)
    for p, q in zip(params, fresh_params):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh.state[q][key].dtype == torch.float32
            assert torch.equal(fresh.state[q][key], ours.state[p][key])
    # A state saved by torch's plain bf16 AdamW gets masters (from the weights) and fp32 moments.
    plain = torch.optim.AdamW(fresh_params, lr=1e-2)
    for q in fresh_params:
        q.grad = torch.ones_like(q)
    plain.step()
    again = autoshard.optim.AdamW(fresh_params, lr=1e-2)
    again.load_state_dict(plain.state_dict())
    for q in fresh_params:
        assert torch.equal(again.state[q]["master"], q.detach().float())
        assert again.state[q]["exp_avg"].dtype == torch.float32
    again.step()  # and it steps


# ---- clipping


def test_clip_grad_norm_of_bf16_gradients_is_computed_in_fp32():
    generator = torch.Generator().manual_seed(7)
    params = [torch.zeros(n, dtype=torch.bfloat16, requires_grad=True) for n in (3, 1000, 77, 5000)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
    exact = torch.cat([p.grad.double().reshape(-1) for p in params]).norm().item()
    norm = autoshard.clip_grad_norm_(params, max_norm=1e9)
    assert norm.dtype == torch.float32
    assert abs(norm.item() - exact) <= 1e-6 * exact, (norm.item(), exact)


# ---- loading bf16 weights


class _Float32Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every fp32 tensor of 100 elements or more that an op creates."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= 100:
                self.created.append((str(func), tuple(t.shape)))
        return out


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from hf_models import build
    path = str(tmp_path_factory.mktemp("bf16") / "llama")
    build("llama", seed=11).to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.mark.parametrize("where", ["meta", "materialised"])
def test_load_pretrained_bf16_files_into_a_bf16_model_stays_bf16(bf16_checkpoint, where):
    from hf_models import build
    from safetensors.torch import load_file
    import glob
    import os
    model = build("llama", device="meta") if where == "meta" else build("llama", seed=3)
    model = model.to(torch.bfloat16) if where == "materialised" else model
    with _Float32Allocations() as spy:
        autoshard.load_pretrained(model, bf16_checkpoint, dtype=torch.bfloat16 if where == "meta" else None,
                                  progress=False)
    assert spy.created == []
    saved = {}
    for f in glob.glob(os.path.join(bf16_checkpoint, "*.safetensors")):
        saved.update(load_file(f))
    state = model.state_dict()
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value), name


def test_load_pretrained_dtype_on_a_materialised_model_is_refused(bf16_checkpoint):
    from hf_models import build
    model = build("llama", seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 applies to tensors on the meta device, but "
                                         r"'.*' is already materialised as torch.float32"):
        autoshard.load_pretrained(model, bf16_checkpoint, dtype=torch.bfloat16, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The model's own dtype is fine: bf16 weights widened into fp32 tensors.
    autoshard.load_pretrained(model, bf16_checkpoint, dtype=torch.float32, progress=False)
    assert model.model.embed_tokens.weight.dtype == torch.float32
