"""Every conformance entry's plan, at every world size of the matrix, as one JSON file: the
record-by-record comparison that shows a change to the planner or the plan's layers changed
no decision.

    python tests/conformance/plan_snapshot.py before.json      # on the old code
    python tests/conformance/plan_snapshot.py after.json       # on the new code
    python tests/conformance/plan_snapshot.py --compare before.json after.json

Plans are made with ``autoshard.plan(model, world_size=N, example_inputs=...)``, in one process
(planning needs no process group); a refusal is recorded as its message."""

import argparse
import json
import os
import sys
import warnings

import torch

# Some models iterate over a set of strings (ModernBERT's rotary tables per layer type), so the
# trace's order follows the process's string hashing: fixed here, plans compare op by op.
if os.environ.get("PYTHONHASHSEED") != "0":
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, "PYTHONHASHSEED": "0"})

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import autoshard  # noqa: E402
from conformance_table import TABLE  # noqa: E402


def _plan_of(arch, world_size: int):
    dtype = torch.float64 if arch.fp64 else torch.float32
    torch.manual_seed(0)
    model = arch.build().to(dtype).eval()
    inputs = arch.inputs(torch.Generator().manual_seed(1))
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autoshard.plan(model, world_size=world_size, example_inputs=inputs)
        document = json.loads(plan.to_json())
        document.pop("autoshard_version", None)
        return {"plan": document, "printout": str(plan)}
    except Exception as error:  # a refusal is a decision too
        return {"refused": f"{type(error).__name__}: {error}"}


def snapshot(path: str, only=None) -> None:
    result = {}
    entries = [(a, n) for a in TABLE for n in a.world_sizes if only is None or a.name in only]
    for i, (arch, world_size) in enumerate(entries):
        key = f"{arch.name}-{world_size}"
        print(f"[{i + 1}/{len(entries)}] {key}", file=sys.stderr, flush=True)
        result[key] = _plan_of(arch, world_size)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


def _differences(a, b, where=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                yield f"{where}.{key}: only in {'after' if key not in a else 'before'}"
            else:
                yield from _differences(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _differences(x, y, f"{where}[{i}]")
    elif a != b:
        yield f"{where}: {str(a)[:200]!r} -> {str(b)[:200]!r}"


def compare(before: str, after: str) -> int:
    with open(before) as f:
        old = json.load(f)
    with open(after) as f:
        new = json.load(f)
    count = 0
    for key in sorted(set(old) | set(new)):
        for line in _differences(old.get(key), new.get(key), key):
            print(line)
            count += 1
    print(f"{len(old)} plans before, {len(new)} after, {count} differences")
    return 1 if count else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    sys.exit(compare(*args.paths) if args.compare else snapshot(args.paths[0], args.only))
