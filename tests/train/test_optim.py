"""autoshard.optim.AdamW / SGD and their fused ops against torch.optim's own AdamW and SGD,
opcheck, and the argument checks."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import autoshard
from autoshard.core import ops

# Empty, odd and larger-than-one-work-item (32K elements) shapes, and a 0-d parameter.
SHAPES = [(37,), (64, 129), (0,), (300, 129), (3, 5, 7), (), (1, 1)]
STEPS = 20
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def make_params(dtype, seed=0, shapes=SHAPES):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=dtype, generator=generator).requires_grad_() for s in shapes]


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def assert_relatively_close(got, want, dtype):
    """Equal to `rtol` relative to each tensor's largest value: elements that an update has
    carried close to zero keep the absolute rounding error of their larger past values."""
    tolerance = TOLERANCE[dtype]
    for g, w in zip(got, want):
        scale = w.abs().max().item() if w.numel() else 0.0
        torch.testing.assert_close(g.detach(), w.detach(), rtol=tolerance, atol=tolerance * max(scale, 1e-30))


def run_side_by_side(make_ours, make_reference, params, steps=STEPS, groups=None, scheduler=None, grad_mask=None):
    """Steps autoshard's optimizer and torch's from equal parameters on equal gradients."""
    ours_params, reference_params = clone_params(params), clone_params(params)

    def grouped(ps):
        return [{"params": [ps[i] for i in indices], **options} for indices, options in groups] if groups else ps

    ours, reference = make_ours(grouped(ours_params)), make_reference(grouped(reference_params))
    schedulers = [scheduler(ours), scheduler(reference)] if scheduler else []
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(ours_params, reference_params)):
            if grad_mask is not None and not grad_mask(step, i):
                a.grad = b.grad = None
                continue
            grad = torch.randn(a.shape, dtype=a.dtype, generator=generator).to(a.device)
            a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        reference.step()
        for s in schedulers:
            s.step()
    return ours_params, reference_params, ours, reference


ADAMW_CASES = {
    "defaults": dict(lr=1e-2),
    "weight_decay": dict(lr=3e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6),
    "maximize": dict(lr=1e-2, weight_decay=0.05, maximize=True),
    "no_decay_big_beta1": dict(lr=1e-2, weight_decay=0.0, betas=(0.6, 0.9)),  # lerp weight >= 0.5
}

SGD_CASES = {
    "plain": dict(lr=0.1),
    "weight_decay": dict(lr=0.05, weight_decay=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "nesterov": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
    "maximize": dict(lr=0.05, momentum=0.5, maximize=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ADAMW_CASES)
def test_adamw_matches_torch(case, dtype):
    kwargs = ADAMW_CASES[case]
    ours, reference, ours_opt, reference_opt = run_side_by_side(
        lambda p: autoshard.optim.AdamW(p, **kwargs), lambda p: torch.optim.AdamW(p, **kwargs), make_params(dtype)
    )
    assert_relatively_close(ours, reference, dtype)
    for a, b in zip(ours, reference):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_relatively_close([ours_opt.state[a][key]], [reference_opt.state[b][key]], dtype)
        assert ours_opt.state[a]["step"].item() == reference_opt.state[b]["step"].item() == STEPS


@pytest.mark.parametrize(
    "case, dtype",
    [(case, torch.float32) for case in SGD_CASES] + [("dampening", torch.float64), ("nesterov", torch.float64)],
)
def test_sgd_matches_torch(case, dtype):
    kwargs = SGD_CASES[case]
    ours, reference, ours_opt, reference_opt = run_side_by_side(
        lambda p: autoshard.optim.SGD(p, **kwargs), lambda p: torch.optim.SGD(p, **kwargs), make_params(dtype)
    )
    assert_relatively_close(ours, reference, dtype)
    if kwargs.get("momentum", 0):
        for a, b in zip(ours, reference):
            assert_relatively_close([ours_opt.state[a]["momentum_buffer"]], [reference_opt.state[b]["momentum_buffer"]], dtype)
    else:
        assert len(ours_opt.state) == 0


GROUPS = [([0, 1, 2], {}), ([3, 4, 5, 6], {"lr": 3e-3, "weight_decay": 0.0})]


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_param_groups_and_lr_scheduler(name):
    kwargs = dict(lr=2e-2, weight_decay=0.1) if name == "AdamW" else dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    ours, reference, ours_opt, _ = run_side_by_side(
        lambda p: getattr(autoshard.optim, name)(p, **kwargs),
        lambda p: getattr(torch.optim, name)(p, **kwargs),
        make_params(torch.float32),
        groups=GROUPS,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
    )
    assert_relatively_close(ours, reference, torch.float32)
    assert ours_opt.param_groups[0]["lr"] == pytest.approx(kwargs["lr"] * 0.5 ** (STEPS // 4))


def test_adamw_parameters_without_gradients_keep_their_own_step_counts():
    # The first parameter gets a gradient only on even steps, so the two step counts differ.
    ours, reference, ours_opt, reference_opt = run_side_by_side(
        lambda p: autoshard.optim.AdamW(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        make_params(torch.float64, shapes=[(9,), (4, 4)]),
        grad_mask=lambda step, i: i == 1 or step % 2 == 0,
    )
    assert_relatively_close(ours, reference, torch.float64)
    assert [ours_opt.state[p]["step"].item() for p in ours] == [STEPS / 2, STEPS]


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_non_dense_parameters_and_gradients(name):
    kwargs = dict(lr=1e-2, weight_decay=0.1) if name == "AdamW" else dict(lr=0.1, momentum=0.9)
    # A strided view (not dense) and a transposed parameter (dense, not contiguous).
    params = [torch.randn(12, 5, dtype=torch.float64), torch.randn(7, 9, dtype=torch.float64)]
    reference_params = clone_params(params)
    ours_params = [
        torch.empty(12, 10, dtype=torch.float64)[:, ::2].copy_(params[0].detach()).requires_grad_(),
        torch.empty(9, 7, dtype=torch.float64).t().copy_(params[1].detach()).requires_grad_(),
    ]
    ours = getattr(autoshard.optim, name)(ours_params, **kwargs)
    reference = getattr(torch.optim, name)(reference_params, **kwargs)
    for _ in range(5):
        for a, b in zip(ours_params, reference_params):
            grad = torch.randn(a.shape[::-1], dtype=a.dtype).t()  # transposed layout
            a.grad, b.grad = grad, grad.contiguous()
        ours.step()
        reference.step()
    assert not ours_params[0].is_contiguous() and not ours_params[1].is_contiguous()
    assert_relatively_close(ours_params, reference_params, torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_steps_in_fp32_and_rounds_once(dtype):
    generator = torch.Generator().manual_seed(3)
    shapes = [(100,), (33, 3), (5,)]
    tensors = [[torch.randn(s, generator=generator).to(dtype) for s in shapes] for _ in range(4)]
    params, grads, exp_avgs, exp_avg_sqs = tensors
    exp_avg_sqs = [v.abs() for v in exp_avg_sqs]
    wide = [[t.float() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    args = (1e-2, 0.9, 0.999, 0.1, 1e-8, 3, False)
    ops.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, *args)
    ops.fused_adamw_(*wide, *args)
    for narrow_list, wide_list in zip((params, exp_avgs, exp_avg_sqs), (wide[0], wide[2], wide[3])):
        for n, w in zip(narrow_list, wide_list):
            assert torch.equal(n, w.to(dtype))
    buffers = [b.float() for b in exp_avgs]
    params_wide = [p.float() for p in params]
    ops.fused_sgd_(params, grads, exp_avgs, 0.1, 0.9, 0.1, 0.01, False, False, False)
    ops.fused_sgd_(params_wide, wide[1], buffers, 0.1, 0.9, 0.1, 0.01, False, False, False)
    for n, w in zip(params + exp_avgs, params_wide + buffers):
        assert torch.equal(n, w.to(dtype))


def test_complex_parameters_step_as_real_pairs():
    params = [torch.randn(6, 3, dtype=torch.complex128).requires_grad_()]
    ours, reference, _, _ = run_side_by_side(
        lambda p: autoshard.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        params,
        steps=5,
    )
    torch.testing.assert_close(ours[0].detach(), reference[0].detach(), rtol=1e-12, atol=1e-12)


def test_many_small_tensors_in_one_call():
    generator = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 300, (250,), generator=generator).tolist() + [70_000, 1, 0]
    params = make_params(torch.float32, shapes=[(n,) for n in sizes])
    ours, reference, _, _ = run_side_by_side(
        lambda p: autoshard.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        params,
        steps=3,
    )
    assert_relatively_close(ours, reference, torch.float32)


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = autoshard.optim.SGD([weight], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (weight**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 5.0
    torch.testing.assert_close(weight.detach(), torch.tensor([0.0, 0.0]))  # w - 0.5 * 2w


def test_baseline_kernels_match_torch_too():
    # The CPU kernels exist once per instruction set; ATEN_CPU_CAPABILITY=default makes this
    # library pick its portable build, as it makes ATen pick its own.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import torch, test_optim as t\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'\n"
        "t.test_adamw_matches_torch('weight_decay', torch.float32)\n"
        "t.test_sgd_matches_torch('nesterov', torch.float64)\n"
        "t.test_reduced_precision_steps_in_fp32_and_rounds_once(torch.bfloat16)\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    env["PYTHONPATH"] = os.pathsep.join([tests_dir] + sys.path)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


# ---- state dicts


@pytest.mark.parametrize(
    "make",
    [
        lambda p: autoshard.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: autoshard.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ],
    ids=["AdamW", "SGD"],
)
def test_state_dict_round_trip_continues_identically(make):
    start = make_params(torch.float32)
    generator = torch.Generator().manual_seed(5)
    gradients = [[torch.randn(p.shape, generator=generator) for p in start] for _ in range(STEPS)]

    def train(params, opt, steps):
        for grads in steps:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()

    uninterrupted = clone_params(start)
    train(uninterrupted, make(uninterrupted), gradients)

    first = clone_params(start)
    first_opt = make(first)
    train(first, first_opt, gradients[:5])
    saved = copy.deepcopy(first_opt.state_dict())
    resumed = clone_params(first)
    resumed_opt = make(resumed)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, gradients[5:])
    for a, b in zip(resumed, uninterrupted):
        assert torch.equal(a, b)


def test_state_dicts_carry_torch_keys_and_load_from_torch():
    params = make_params(torch.float32)
    reference_params, ours_params = clone_params(params), clone_params(params)
    reference = torch.optim.AdamW(reference_params, lr=1e-2)
    generator = torch.Generator().manual_seed(6)
    for step in range(10):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(reference_params, grads):
            p.grad = g.clone()
        if step == 5:
            # Hand torch's state (after 5 steps) over to autoshard's optimizer.
            ours = autoshard.optim.AdamW(ours_params, lr=1e-2)
            ours.load_state_dict(copy.deepcopy(reference.state_dict()))
            with torch.no_grad():
                for a, b in zip(ours_params, reference_params):
                    a.copy_(b)
        if step >= 5:
            for p, g in zip(ours_params, grads):
                p.grad = g.clone()
            ours.step()
        reference.step()
    assert_relatively_close(ours_params, reference_params, torch.float32)
    state = ours.state_dict()["state"]
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state[0]["step"].dtype == torch.float32 and state[0]["step"].item() == 10
    sgd = autoshard.optim.SGD(ours_params, lr=0.1, momentum=0.9)
    sgd.step()
    assert set(sgd.state_dict()["state"][0]) == {"momentum_buffer"}


# ---- opcheck


def opcheck_cases(device):
    generator = torch.Generator().manual_seed(7)

    def lists(dtype, shapes=((5, 3), (0,), (17,))):
        return [torch.randn(s, generator=generator).to(device=device, dtype=dtype) for s in shapes]

    def adamw(dtype, **options):
        params, grads, exp_avgs, exp_avg_sqs = (lists(dtype) for _ in range(4))
        exp_avg_sqs = [v.abs() for v in exp_avg_sqs]
        settings = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, step=3, maximize=False)
        settings.update(options)
        return (torch.ops.autoshard.fused_adamw_.default, (params, grads, exp_avgs, exp_avg_sqs, *settings.values()))

    def sgd(dtype, momentum, first_step=False, **options):
        params, grads, buffers = (lists(dtype) for _ in range(3))
        settings = dict(lr=0.1, momentum=momentum, dampening=0.0, weight_decay=0.01, nesterov=False, maximize=False)
        settings.update(options)
        return (torch.ops.autoshard.fused_sgd_.default,
                (params, grads, buffers if momentum else [], *settings.values(), first_step))

    return [
        adamw(torch.float32),
        adamw(torch.float64, maximize=True, weight_decay=0.0, step=1),
        adamw(torch.bfloat16),
        sgd(torch.float32, 0.9),
        sgd(torch.float64, 0.9, first_step=True, nesterov=True),
        sgd(torch.float32, 0.0, maximize=True),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck_cpu(case):
    op, args = opcheck_cases("cpu")[case]
    opcheck(op, args)


def test_ops_step_meta_tensors_without_memory():
    shapes = [(4096, 4096), (10,)]
    params = [torch.empty(s, device="meta") for s in shapes]
    ops.fused_adamw_(params, params, params, params, 1e-3, 0.9, 0.999, 0.0, 1e-8, 1, False)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] has shape \[11\] but params\[1\] has shape \[10\]"):
        ops.fused_adamw_(params, params, [params[0], torch.empty(11, device="meta")], params,
                         1e-3, 0.9, 0.999, 0.0, 1e-8, 1, False)


# ---- bad input: errors name the argument, and nothing has changed when they are raised


def pair(dtype=torch.float32, device="cpu"):
    return [torch.ones(4, dtype=dtype, device=device), torch.ones(2, 3, dtype=dtype, device=device)]


ADAMW_OK = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, step=1, maximize=False)


def adamw_call(params=None, grads=None, exp_avgs=None, exp_avg_sqs=None, **changes):
    settings = {**ADAMW_OK, **changes}
    return lambda: ops.fused_adamw_(params or pair(), grads or pair(), exp_avgs or pair(), exp_avg_sqs or pair(),
                                    *settings.values())


def sgd_call(params=None, grads=None, buffers=None, momentum=0.9, dampening=0.0, nesterov=False):
    return lambda: ops.fused_sgd_(params or pair(), grads or pair(), pair() if buffers is None else buffers,
                                  0.1, momentum, dampening, 0.0, nesterov, False, False)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (adamw_call(grads=pair()[:1]), ValueError, r"grads must hold one tensor per entry of params \(2\), got 1"),
        (adamw_call(exp_avgs=[torch.ones(4), torch.ones(4, device="meta")]), ValueError,
         r"exp_avgs\[1\] is on meta but params\[0\] is on cpu"),
        (adamw_call(grads=pair(torch.float64)), TypeError, r"grads\[0\] has dtype Double but params\[0\] has dtype Float"),
        (adamw_call(params=[torch.ones(4, dtype=torch.int64)] * 2, grads=[torch.ones(4, dtype=torch.int64)] * 2),
         TypeError, r"params\[0\] must be float32, float64, float16 or bfloat16, got Long"),
        (adamw_call(exp_avg_sqs=[torch.ones(4), torch.ones(3, 2)]), ValueError,
         r"exp_avg_sqs\[1\] has shape \[3, 2\] but params\[1\] has shape \[2, 3\]"),
        (adamw_call(step=0), ValueError, r"step must be >= 1"),
        (adamw_call(beta1=1.0), ValueError, r"beta1 must be in \[0, 1\), got 1"),
        (adamw_call(beta2=-0.5), ValueError, r"beta2 must be in \[0, 1\), got -0.5"),
        (adamw_call(lr=-1.0), ValueError, r"lr must be >= 0, got -1"),
        (adamw_call(eps=-1e-8), ValueError, r"eps must be >= 0"),
        (adamw_call(weight_decay=float("nan")), ValueError, r"weight_decay must be finite"),
        (sgd_call(buffers=pair()[:1]), ValueError, r"momentum_buffers must hold one tensor per entry of params"),
        (sgd_call(momentum=0.0), ValueError, r"momentum_buffers must be empty when momentum is 0, got 2"),
        (sgd_call(nesterov=True, dampening=0.1), ValueError, r"nesterov needs momentum > 0 and dampening == 0"),
        (sgd_call(grads=[torch.ones(4), torch.ones(2, 3, device="meta")]), ValueError,
         r"grads\[1\] is on meta but params\[0\] is on cpu"),
    ],
)
def test_op_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_op_errors_leave_inputs_untouched():
    params, grads, exp_avgs, exp_avg_sqs = pair(), pair(), pair(), pair()
    exp_avg_sqs[1] = torch.ones(3, 2)
    with pytest.raises(ValueError):
        ops.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, *ADAMW_OK.values())
    for ts in (params, exp_avgs):
        assert all(torch.equal(t, torch.ones_like(t)) for t in ts)


def one_param():
    return [torch.nn.Parameter(torch.ones(3))]


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda: autoshard.optim.AdamW(one_param(), lr=-1e-3), ValueError, r"AdamW: lr must be >= 0, got -0.001"),
        (lambda: autoshard.optim.AdamW(one_param(), eps=-1.0), ValueError, r"AdamW: eps must be >= 0"),
        (lambda: autoshard.optim.AdamW(one_param(), betas=(1.0, 0.9)), ValueError,
         r"AdamW: betas\[0\] must be in \[0, 1\), got 1.0"),
        (lambda: autoshard.optim.AdamW(one_param(), betas=(0.9, -0.1)), ValueError, r"AdamW: betas\[1\] must be >= 0"),
        (lambda: autoshard.optim.AdamW(one_param(), betas=0.9), ValueError, r"AdamW: betas must be a pair"),
        (lambda: autoshard.optim.AdamW(one_param(), weight_decay=-0.1), ValueError, r"AdamW: weight_decay must be >= 0"),
        (lambda: autoshard.optim.AdamW(one_param(), lr="0.1"), TypeError, r"AdamW: lr must be a real number, got str"),
        (lambda: autoshard.optim.AdamW([{"params": one_param()}, {"params": one_param(), "lr": -1.0}]), ValueError,
         r"AdamW: param_groups\[1\]\['lr'\] must be >= 0, got -1.0"),
        (lambda: autoshard.optim.SGD(one_param(), lr=-0.1), ValueError, r"SGD: lr must be >= 0"),
        (lambda: autoshard.optim.SGD(one_param(), momentum=-0.9), ValueError, r"SGD: momentum must be >= 0"),
        (lambda: autoshard.optim.SGD(one_param(), weight_decay=-1), ValueError, r"SGD: weight_decay must be >= 0"),
        (lambda: autoshard.optim.SGD(one_param(), nesterov=True), ValueError,
         r"SGD: nesterov needs momentum > 0 and dampening == 0, got momentum=0, dampening=0"),
        (lambda: autoshard.optim.SGD(one_param(), momentum=0.9, dampening=0.1, nesterov=True), ValueError,
         r"SGD: nesterov needs momentum > 0 and dampening == 0"),
        (lambda: autoshard.optim.SGD([{"params": one_param(), "nesterov": True}], momentum=0.9, dampening=0.5),
         ValueError, r"SGD: param_groups\[0\]\['nesterov'\] needs momentum > 0 and dampening == 0"),
    ],
)
def test_optimizer_settings_are_checked(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_parameters_on_mixed_devices_are_refused(name):
    on_cpu, on_meta = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=rf"{name}: all parameters must be on one device, but "
                                         r"param_groups\[0\]\['params'\]\[0\] is on cpu and "
                                         r"param_groups\[0\]\['params'\]\[1\] is on meta"):
        getattr(autoshard.optim, name)([on_cpu, on_meta], lr=0.1)
    opt = getattr(autoshard.optim, name)((p for p in [on_cpu]), lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is on cpu and "
                                         r"param_groups\[1\]\['params'\]\[0\] is on meta"):
        opt.add_param_group({"params": (p for p in [on_meta])})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] is on meta"):
        getattr(autoshard.optim, name)([("a", on_cpu), ("b", on_meta)], lr=0.1)


def stepped_twice(name):
    """Two groups of two parameters, each stepped once, with fresh gradients for the next step."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(4)]
    kwargs = dict(lr=0.1, momentum=0.9) if name == "SGD" else dict(lr=0.1)
    opt = getattr(autoshard.optim, name)([{"params": params[:2]}, {"params": params[2:]}], **kwargs)
    for p in params:
        p.grad = torch.randn(4)
    opt.step()
    return params, opt


def on_meta_with_grad():
    p = torch.nn.Parameter(torch.ones(4, device="meta"))
    p.grad = torch.ones(4, device="meta")
    return p


def snapshot(params, opt):
    tensors = [p.detach().clone() for p in params]
    for p in params:
        tensors += [v.clone() for v in opt.state[p].values()]
    return tensors


@pytest.mark.parametrize(
    "name, spoil, error, pattern",
    [
        ("AdamW", lambda params, opt: opt.state[params[3]].update(exp_avg=torch.zeros(4, device="meta")), ValueError,
         r"AdamW: state 'exp_avg' of param_groups\[1\]\['params'\]\[1\] is on meta but the parameter is on cpu"),
        ("AdamW", lambda params, opt: opt.state[params[2]].update(exp_avg_sq=torch.zeros(4, dtype=torch.float64)),
         TypeError, r"state 'exp_avg_sq' of param_groups\[1\]\['params'\]\[0\] has dtype torch.float64"),
        ("AdamW", lambda params, opt: opt.param_groups[1].update(lr=-1.0), ValueError,
         r"AdamW: param_groups\[1\]\['lr'\] must be >= 0"),
        ("AdamW", lambda params, opt: setattr(params[3], "grad", torch.zeros(4).to_sparse()), TypeError,
         r"AdamW: param_groups\[1\]\['params'\]\[1\].grad is sparse"),
        ("SGD", lambda params, opt: opt.state[params[2]].update(momentum_buffer=torch.zeros(5)), ValueError,
         r"SGD: state 'momentum_buffer' of param_groups\[1\]\['params'\]\[0\] has shape \(5,\)"),
        ("SGD", lambda params, opt: opt.param_groups[1].update(nesterov=True, dampening=0.5), ValueError,
         r"SGD: param_groups\[1\]\['nesterov'\] needs momentum > 0 and dampening == 0"),
        # A parameter on another device, slipped into a group past add_param_group's check.
        ("AdamW", lambda params, opt: opt.param_groups[1]["params"].append(on_meta_with_grad()), ValueError,
         r"AdamW: all parameters must be on one device, but param_groups\[0\]\['params'\]\[0\] is on cpu "
         r"and param_groups\[1\]\['params'\]\[2\] is on meta"),
        ("SGD", lambda params, opt: opt.param_groups[1]["params"].append(on_meta_with_grad()), ValueError,
         r"SGD: all parameters must be on one device"),
    ],
)
def test_step_checks_every_group_before_changing_any(name, spoil, error, pattern):
    params, opt = stepped_twice(name)
    spoil(params, opt)
    before = snapshot(params[:2], opt)
    with pytest.raises(error, match=pattern):
        opt.step()
    after = snapshot(params[:2], opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# ---- CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(6))
def test_opcheck_cuda(case):
    op, args = opcheck_cases("cuda")[case]
    opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    # 120 tensors (more than one launch's table holds) and one tensor of more chunks than one
    # launch has blocks, so every way a table fills up is taken.
    generator = torch.Generator().manual_seed(8)
    sizes = torch.randint(0, 5000, (120,), generator=generator).tolist() + [330 * 65536 + 17]

    def lists():
        return [torch.randn(n, generator=generator).to(dtype) for n in sizes]

    cpu = [lists(), lists(), lists(), [v.abs() for v in lists()]]
    cuda = [[t.cuda() for t in ts] for ts in cpu]
    for step in (1, 2, 3):
        for tensors in (cpu, cuda):
            ops.fused_adamw_(*tensors, 1e-2, 0.9, 0.999, 0.1, 1e-8, step, step == 2)
            ops.fused_sgd_(tensors[0], tensors[1], tensors[2], 0.05, 0.9, 0.1, 0.01, False, False, step == 1)
            ops.fused_sgd_(tensors[0], tensors[1], [], 0.05, 0.0, 0.0, 0.0, False, True, False)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12 if dtype == torch.float64 else 1e-2
    for c, g in zip(cpu, cuda):
        for a, b in zip(c, g):
            torch.testing.assert_close(b.cpu(), a, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
def test_cuda_optimizer_matches_torch():
    params = [p.detach().cuda().requires_grad_() for p in make_params(torch.float32)]
    ours, reference, _, _ = run_side_by_side(
        lambda p: autoshard.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        params,
    )
    assert all(p.is_cuda for p in ours)
    assert_relatively_close(ours, reference, torch.float32)
