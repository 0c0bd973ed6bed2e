"""One architecture of the sweep on the ranks of a gloo pool, and the judge's class for it.

Each rank first runs the model unsharded (fp64, or fp32 where an op has no fp64 kernel): a
model that fails there fails in transformers itself with a tiny config and is skipped. The
rest goes through the conformance check (tests/conformance/conformance_harness.py): logits,
every gradient, the collectives counted in forward and backward against the plan's, clipping's
norm and the state after one step, against the unsharded model.

Classes:
- exact: equal to the unsharded model, and no rank holds more than 1/N + 0.1 of the parameters;
- exact_over: equal, but some rank holds more (the largest part held whole says why);
- refused: plan() or parallelize() refused the model with its own error (dry_run_refused: the
  plan's own prediction of the shapes or collectives failed on the meta copy);
- crash: anything else raised, a rank died or hung;
- wrong: some output, gradient, norm or state differs: silently wrong;
- skipped: the model fails unsharded, or the sweep cannot make its inputs.

A model that takes images, videos or audio beside its input_ids is run, planned and judged on
text with them (their tokens placed in the ids, catalogue.media_inputs), so that its vision or
audio tower is planned too; on its text alone only where no such layout runs unsharded (the
record's `media_failed` says why). The record's `inputs` names what was judged ("text+images",
"text+audio", "text", ...).

With PLANNING=plan (run.py --planning plan) the model is planned the README's way,
autoshard.plan(model, example_inputs=...) handed to parallelize. With PLANNING=auto in the
environment (run.py --planning auto) the model is planned and judged
on the inputs autoshard makes itself (parallelize(model) with no example_inputs), not the sweep's.
A plan whose predicted collectives differ from those counted is flagged (`prediction`) in
whichever class it lands.
"""

import os
import sys
import traceback
from types import SimpleNamespace
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests")
for path in (os.path.join(TESTS, "support"), os.path.join(TESTS, "conformance")):
    if path not in sys.path:
        sys.path.insert(0, path)

import catalogue  # noqa: E402
from conformance_harness import check, norm_agrees  # noqa: E402

# "parallelize": the sweep's own inputs given to parallelize; "auto": autoshard makes them.
PLANNING = os.environ.get("AUTOSHARD_SWEEP_PLANNING", "parallelize")
CLASSES = ("exact", "exact_over", "refused", "dry_run_refused", "crash", "wrong", "skipped")
# The first words of autoshard's own refusals.
_OWN_ERROR_PREFIXES = ("plan", "parallelize", "autoshard")
# Used where an op of the model has no fp64 kernel on CPU (grouped matmuls of experts), or the
# model computes part of its forward in float32 whatever its dtype.
# rtol relative to each tensor's largest magnitude: float32's rounding there (1.2e-7), through
# a few hundred sums and two blocks' backward, was seen up to 1.05e-5; atol as the MoE entries of the
# conformance table (a router's gradient, near zero, is float32 noise of the values around it).
# The defects this sweep looks for (a lost partial sum, a wrong shard) show at 1e-2 and above.
SWEEP_FP32_TOLERANCE = dict(rtol=1e-4, atol=5e-5, of_largest=True)


class _LowerPrecision(TorchDispatchMode):
    """Notes whether any op of an fp64 forward gives a floating-point tensor of lower precision
    (a norm or a rotary embedding computed in float32 whatever the model's dtype)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.seen = True
        return out


def _floats(out) -> list:
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    return [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _runs_unsharded(variant, dtype, kind: int) -> bool:
    """Runs the model's forward and backward on the `kind` of example inputs; whether some of
    it computes below fp64."""
    torch.manual_seed(0)
    model = catalogue.build(variant).to(dtype)
    inputs = _inputs(model, torch.Generator().manual_seed(1), kind)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    torch.manual_seed(1)
    with torch.no_grad():
        again = model(**inputs)
    torch.manual_seed(2)
    with _LowerPrecision() as lower:
        out = model(**inputs)
    if not all(torch.equal(a, b) for a, b in zip(_floats(again), _floats(out))):
        raise LookupError("the forward draws random numbers (two runs differ: random masking or sampling)")
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    flat = [t for t in torch.utils._pytree.tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not flat:
        raise LookupError("no floating-point output with a gradient")
    if not all(bool(t.isfinite().all()) for t in flat):
        raise FloatingPointError("an output is not finite (NaN or inf): nothing to compare a shard against")
    sum(t.sum() for t in flat).backward()
    if not all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None):
        raise FloatingPointError("a gradient is not finite (NaN or inf): nothing to compare a shard against")
    return lower.seen


_NoSuchInputs = catalogue.NoSuchInputs


def _inputs(model, generator, kind):
    if PLANNING == "auto":
        if kind != 0:
            raise _NoSuchInputs("autoshard makes one set of inputs")
        return catalogue.autoshard_inputs(model, generator)
    if kind == "media":
        return catalogue.media_inputs(model, generator)
    return catalogue.example_inputs(model, generator, kind)


def _informative(failure: str) -> bool:
    """Whether a kind's failure (empty where it was not tried) says more than that the model
    takes no such inputs."""
    return bool(failure) and not failure.startswith(_NoSuchInputs.__name__)


def _why_skipped(failures: Dict[object, str]) -> str:
    """The main inputs' (kind 0) failure; kind 1's only where it says more than that the model
    takes no such inputs (a dual encoder failing with images beside text)."""
    why = failures[0]
    if _informative(failures.get(1, "")):
        why += "; with images beside text: " + failures[1]
    return why


def check_variant(name: str) -> dict:
    """Runs on every rank of the default process group; never raises for the model's sake."""
    variant = catalogue.by_name(name)
    failures: Dict[object, str] = {}  # per kind of inputs, the last (fp32) failure
    fp64 = None
    kinds = catalogue.INPUT_KINDS if PLANNING != "auto" else (0,)
    for kind in kinds:
        for dtype in (torch.float64, torch.float32):
            try:
                lower = _runs_unsharded(variant, dtype, kind)
                fp64 = dtype == torch.float64
                break
            except _NoSuchInputs as error:  # the sweep has no such inputs: no dtype would help
                failures[kind] = f"{type(error).__name__}: {str(error)[:300]}"
                break
            except Exception as error:
                if dtype == torch.float32:
                    failures[kind] = f"{dtype}: {type(error).__name__}: {str(error)[:300]}"
        if fp64 is not None:
            break
    # Why a model that takes images or audio beside its text is judged on other inputs.
    media = {"media_failed": failures["media"]} if _informative(failures.get("media", "")) else {}
    if fp64 is None:
        return {"class": "skipped", "why": "fails unsharded: " + _why_skipped(failures), **media}
    # The inputs judged, for the record ("text+images", "text", ...), and the same for every rank.
    label = catalogue.inputs_label(_inputs(catalogue.build(variant), torch.Generator().manual_seed(1), kind))
    # A model that computes part of an fp64 forward in float32 is compared at float32's precision.
    exact_in_fp64 = fp64 and not lower
    arch = SimpleNamespace(name=name, build=lambda: catalogue.build(variant), fp64=fp64, planning=PLANNING,
                           tolerance=None if exact_in_fp64 else SWEEP_FP32_TOLERANCE,
                           inputs=lambda generator: _inputs(catalogue.build(variant), generator, kind))
    try:
        report = check(arch)
    except Exception as error:
        return {"class": "crash", "why": f"{type(error).__name__}: {str(error)[:500]}", "inputs": label, **media,
                "where": traceback.format_exc(limit=-3)[-1500:], "fp64": fp64}
    return {"report": vars(report), "fp64": fp64, "fp32_inside": bool(lower), "inputs": label, **media}


def classify(name: str, world_size: int, answers: List[dict]) -> Dict[str, object]:
    """The judge's record of one architecture from every rank's answer."""
    first = answers[0]
    if "class" in first:
        crashed = next((a for a in answers if a["class"] == "crash"), first)
        return {"name": name, **crashed}
    reports = [a["report"] for a in answers]
    record: Dict[str, object] = {"name": name, "fp64": first["fp64"], "fp32_inside": first["fp32_inside"],
                                 "inputs": first["inputs"]}
    if "media_failed" in first:
        record["media_failed"] = first["media_failed"]
    refusal = next((r["refused"] for r in reports if r["refused"]), "")
    if refusal:
        kind, _, message = refusal.partition(": ")
        if "on a meta copy" in message:
            record["class"] = "dry_run_refused"
        elif kind in ("ValueError", "NotImplementedError", "TypeError", "RuntimeError") and message.startswith(_OWN_ERROR_PREFIXES):
            record["class"] = "refused"
        else:
            record["class"] = "crash"
        record["why"] = refusal[:600]
        return record
    findings = []
    for r in reports:
        findings += [f"rank {r['rank']} {what}: {line}" for what in ("outputs", "gradients", "state") for line in r[what]]
    if not norm_agrees(*reports[0]["norm"]):
        norm, want, true_norm = reports[0]["norm"]
        findings.append(f"clip_grad_norm_ {norm!r}, torch {want!r}, in fp64 {true_norm!r}")
    prediction = [f"rank {r['rank']} {phase}: counted {counted}, predicted {predicted}"
                  for r in reports for phase, (counted, predicted) in r["comm"].items() if counted != predicted]
    held = max(r["held"] for r in reports)
    record.update(held=round(held, 4), largest_whole=reports[0]["largest_whole"])
    if prediction:
        record["prediction"] = prediction[:4]
    if findings:
        record.update({"class": "wrong", "why": "; ".join(findings[:6])})
    else:
        record["class"] = "exact" if held <= 1 / world_size + 0.1 else "exact_over"
    return record
