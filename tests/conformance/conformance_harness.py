"""The conformance check of one architecture on the ranks of a gloo pool, against the same
model unsharded on every rank:

1. every floating-point output of the forward (the logits);
2. every parameter's gradient: a sharded parameter's local gradient against its piece of the
   unsharded gradient, a replicated one against the whole;
3. the collectives counted by autoshard.CommCounter in forward and in backward against the
   plan's prediction;
4. the global gradient norm of autoshard.clip_grad_norm_ against torch's (fp32 sums);
5. autoshard.full_state_dict after one SGD step (autoshard.optim.SGD) against the
   unsharded model's state dict after the same step with torch.optim.SGD.

SGD is used for the step because its update is proportional to the gradient: a partial
gradient that AdamW's first step (about lr * sign(grad)) could hide shows up.

The ranks never raise on a mismatch (a rank that raises costs a pool restart); they return
a report and the parent turns it into the first failing check's exception, in the order
above, with every finding in its message.
"""

import copy
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

import autoshard
from autoshard.core.parallel_state import state_of
from autoshard.planner.holdings import held_fraction, replicated
from gathered import nonzero_counts

SGD_LR = 0.1
# Larger than any norm here: clipping scales by exactly 1, so the state after the step is
# compared at fp64 precision, while the norm itself (summed in fp32) is compared on its own.
MAX_NORM = 1e9
# fp64 leaves only the sharded sums' order: the errors seen across the table are below
# 1e-13, and the defects show at 1e-3 and above.
FP64_TOLERANCE = dict(rtol=1e-9, atol=1e-11)
FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


class ConformanceFailure(AssertionError):
    """The sharded model computes something other than the unsharded model."""


class Refused(ConformanceFailure):
    """plan() or parallelize() raised."""


class LogitsMismatch(ConformanceFailure):
    pass


class GradientMismatch(ConformanceFailure):
    pass


class CommMismatch(ConformanceFailure):
    pass


class NormMismatch(ConformanceFailure):
    pass


class StateMismatch(ConformanceFailure):
    pass


class PlanSilent(ConformanceFailure):
    """print(plan) does not say what the plan did with the model's idiom."""


class NothingSharded(ConformanceFailure):
    """Every layer was replicated: the other checks would pass without testing anything."""


@dataclass
class Report:
    rank: int
    refused: str = ""
    styles: Dict[str, int] = field(default_factory=dict)
    outputs: List[str] = field(default_factory=list)  # one line per output that differs
    gradients: List[str] = field(default_factory=list)  # one line per parameter that differs
    comm: Dict[str, tuple] = field(default_factory=dict)  # phase -> (counted, predicted)
    norm: tuple = ()  # (autoshard's, torch's)
    state: List[str] = field(default_factory=list)
    worst: Dict[str, float] = field(default_factory=dict)  # per check: the largest error / its tolerance
    held: float = 1.0  # the largest fraction of the model's parameters any rank holds
    largest_whole: str = ""  # the reason of the largest part held whole on every rank
    plan_text: str = ""  # print(plan)


def _flat_outputs(out) -> List[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _bound(want: torch.Tensor, tol: dict) -> torch.Tensor:
    """The error allowed at each element. With `of_largest`, rtol scales the tensor's largest
    magnitude: a sum computed in float32 is off by its rounding of the largest summands, which
    a small element of the result does not bound."""
    scale = want.abs().max() if tol.get("of_largest") and want.numel() else want.abs()
    return tol["atol"] + tol["rtol"] * scale


def _differs(got: torch.Tensor, want: torch.Tensor, tol: dict) -> Optional[str]:
    """None if close, else a line naming the largest error."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    error = (got - want).abs()
    bound = _bound(want, tol)
    if bool((error <= bound).all()):
        return None
    scale = float(want.abs().max()) or 1.0
    return f"max abs error {float(error.max()):.3g} (largest value {scale:.3g})"


def _tolerance_used(got: torch.Tensor, want: torch.Tensor, tol: dict) -> float:
    """The largest error as a fraction of what the tolerance allows there (above 1 fails)."""
    if got.shape != want.shape:
        return float("inf")
    got, want = got.detach().double(), want.detach().double()
    return float(((got - want).abs() / _bound(want, tol)).max()) if want.numel() else 0.0


def _local_piece(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's piece of an unsharded tensor, by its ShardSpec (local order)."""
    return torch.cat([full.narrow(spec.dim, start, length) for start, length in spec.local_ranges()], spec.dim)


def check(arch) -> Report:
    """Runs on every rank of the default process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    report = Report(rank=rank)
    dtype = torch.float64 if arch.fp64 else torch.float32
    tol = arch.tolerance or (FP64_TOLERANCE if arch.fp64 else FP32_TOLERANCE)
    torch.manual_seed(0)
    model = arch.build().to(dtype).eval()
    reference = copy.deepcopy(model)
    inputs = arch.inputs(torch.Generator().manual_seed(1))
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

    try:
        if arch.planning == "plan":
            plan = autoshard.plan(model, world_size=world, example_inputs=inputs)
            autoshard.parallelize(model, plan)
        elif arch.planning == "parallelize":
            autoshard.parallelize(model, example_inputs=inputs)
        else:  # "auto": the plan's inputs made from the model (its config, or its first layer)
            autoshard.parallelize(model)
        plan = state_of(model).plan
    except Exception as error:  # plan and parallelize raise alike on every rank, before any collective
        report.refused = f"{type(error).__name__}: {error}"
        return report
    report.plan_text = str(plan)
    for layer in plan.layers:
        report.styles[layer.style] = report.styles.get(layer.style, 0) + 1
    report.held = held_fraction(plan)
    whole = replicated(plan)
    report.largest_whole = whole[0].reason if whole else ""

    # 1. forward
    with autoshard.CommCounter() as forward:
        outputs = _flat_outputs(model(**inputs))
    expected = _flat_outputs(reference(**inputs))
    if len(outputs) != len(expected):
        report.outputs.append(f"{len(outputs)} floating-point outputs instead of {len(expected)}")
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(e.shape, generator=generator, dtype=dtype) for e in expected]
    report.worst["outputs"] = 0.0
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if (line := _differs(got, want, tol)) is not None:
            report.outputs.append(f"output {i} {tuple(want.shape)}: {line}")
        report.worst["outputs"] = max(report.worst["outputs"], _tolerance_used(got, want, tol))

    # 2. backward and every gradient
    with autoshard.CommCounter() as backward:
        sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
    sum((e * w).sum() for e, w in zip(expected, weights)).backward()
    # In the model's mode (eval: a split BatchNorm reads its running statistics, gathering none).
    report.comm = {"forward": (nonzero_counts(forward), plan.collectives("forward", training=model.training)),
                   "backward": (nonzero_counts(backward), plan.collectives("backward"))}
    shards = state_of(model).shards()
    params = dict(model.named_parameters(remove_duplicate=False))
    report.worst["gradients"] = 0.0
    for name, ref in reference.named_parameters():
        p = params.get(name)
        if p is None:
            report.gradients.append(f"{name}: missing from the sharded model")
            continue
        if (p.grad is None) != (ref.grad is None):
            report.gradients.append(f"{name}: gradient is {'None' if p.grad is None else 'set'} "
                                    f"but the unsharded model's is {'None' if ref.grad is None else 'set'}")
            continue
        if ref.grad is None:
            continue
        want = _local_piece(ref.grad, shards[id(p)][0]) if id(p) in shards else ref.grad
        kind = "sharded" if id(p) in shards else "replicated"
        if (line := _differs(p.grad, want, tol)) is not None:
            report.gradients.append(f"{name} ({kind}, {tuple(p.shape)}): {line}")
        report.worst["gradients"] = max(report.worst["gradients"], _tolerance_used(p.grad, want, tol))

    # 4. clipping's norm, then 5. one step
    # The norm of the unsharded gradients summed in fp64 is the truth both fp32 sums round from.
    true_norm = torch.stack([p.grad.double().norm() for p in reference.parameters() if p.grad is not None]).norm()
    got_norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
    want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    report.norm = (float(got_norm), float(want_norm), float(true_norm))
    autoshard.optim.SGD(model.parameters(), lr=SGD_LR).step()
    torch.optim.SGD(reference.parameters(), lr=SGD_LR).step()
    got_state, want_state = autoshard.full_state_dict(model), reference.state_dict()
    if got_state.keys() != want_state.keys():
        report.state.append(f"keys differ: missing {sorted(want_state.keys() - got_state.keys())}, "
                            f"extra {sorted(got_state.keys() - want_state.keys())}")
    report.worst["state"] = 0.0
    for name in sorted(want_state.keys() & got_state.keys()):
        got, want = got_state[name], want_state[name]
        if not want.is_floating_point():
            if not torch.equal(got, want):
                report.state.append(f"{name}: differs")
            continue
        if (line := _differs(got, want, tol)) is not None:
            report.state.append(f"{name}: {line}")
        report.worst["state"] = max(report.worst["state"], _tolerance_used(got, want, tol))
    return report


def norm_agrees(norm: float, torch_norm: float, true_norm: float) -> bool:
    """Whether clip_grad_norm_'s global norm is right: within 1e-5 of torch's on the unsharded
    model, or no further from the norm summed in fp64 than twice torch's own fp32 rounding (a
    large fp32 norm sums with a rounding of 1e-4 in torch too)."""
    if abs(norm - torch_norm) <= 1e-5 * abs(torch_norm) + 1e-7:
        return True
    return abs(norm - true_norm) <= max(1e-5 * abs(true_norm), 2 * abs(torch_norm - true_norm)) + 1e-7


def _lines(reports, attribute: str, limit: int = 8) -> List[str]:
    found = []
    for report in reports:
        for line in getattr(report, attribute):
            found.append(f"rank {report.rank}: {line}")
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


def judge(arch, world_size: int, reports: List[Report]) -> Dict[str, float]:
    """Raises the first failing check's exception; returns the largest error per check as a
    fraction of its tolerance."""
    refusals = {r.refused for r in reports}
    expected_refusal = arch.refused.get(world_size) if isinstance(arch.refused, dict) else arch.refused
    if expected_refusal:
        assert refusals != {""}, f"{arch.name}: expected the plan to be refused ({expected_refusal!r}), it was not"
        for text in refusals:
            assert re.search(expected_refusal, text), f"{arch.name}: refused with {text!r}, expected {expected_refusal!r}"
        return {}
    if refusals != {""}:
        raise Refused(f"{arch.name} on {world_size} ranks: " + " | ".join(sorted(refusals)))
    findings = []
    first = None
    for attribute, error in (("outputs", LogitsMismatch), ("gradients", GradientMismatch)):
        lines = _lines(reports, attribute)
        if lines:
            findings.append(f"{attribute}:\n  " + "\n  ".join(lines))
            first = first or error
    for report in reports:
        for phase, (counted, predicted) in report.comm.items():
            if counted != predicted:
                findings.append(f"rank {report.rank} {phase} collectives: counted {counted}, the plan predicts {predicted}")
                first = first or CommMismatch
    if not norm_agrees(*reports[0].norm):
        norm, want_norm, true_norm = reports[0].norm
        findings.append(f"clip_grad_norm_: {norm!r}, torch computes {want_norm!r} (in fp64: {true_norm!r})")
        first = first or NormMismatch
    lines = _lines(reports, "state")
    if lines:
        findings.append("full_state_dict after one step:\n  " + "\n  ".join(lines))
        first = first or StateMismatch
    says = arch.plan_says_at(world_size)
    if first is None and says and not re.search(says, reports[0].plan_text):
        findings.append(f"print(plan) does not match {says!r}:\n{reports[0].plan_text}")
        first = PlanSilent
    if first is None and not any(style != "replicate" for style in reports[0].styles):
        findings.append(f"the plan replicates every layer: {reports[0].styles}")
        first = NothingSharded
    if first is not None:
        raise first(f"{arch.name} on {world_size} ranks (plan styles {reports[0].styles}):\n" + "\n".join(findings))
    return {k: max(r.worst.get(k, 0.0) for r in reports) for k in reports[0].worst}
