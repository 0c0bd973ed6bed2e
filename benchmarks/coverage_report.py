"""What the plan splits on every architecture of the conformance table (tests/conformance:
Hugging Face models from tiny configs and models of our own, hidden 48, 6 heads, 2 layers
unless the table says otherwise), where an unsharded copy would hold 1.0 on every rank:

    python benchmarks/coverage_report.py [--world-size 2]

For each entry, planned offline with its example inputs at --world-size: the largest fraction
of the parameters any rank holds, the bound 1/N + 0.1, and the largest part held whole on
every rank with the reason (holdings.REASONS). Entries the table expects plan() to refuse are
listed as refused. Prints a table and writes benchmarks/results/coverage_report_cpu.json and .txt.
"""

import argparse
import os
import sys
import warnings

import torch

import autoshard
from common import save_json, save_text, table_text

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests", "conformance"))
from conformance_table import TABLE  # noqa: E402
from autoshard.planner.holdings import REASONS  # noqa: E402


def _row(arch, world_size: int):
    dtype = torch.float64 if arch.fp64 else torch.float32
    torch.manual_seed(0)
    model = arch.build().to(dtype)
    inputs = arch.inputs(torch.Generator().manual_seed(1))
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(model, world_size=world_size, example_inputs=inputs)
    held = max(plan.held_fraction(r) for r in range(world_size))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    whole = plan.replicated()
    largest = whole[0] if whole else None
    return {
        "architecture": arch.name,
        "held / rank": held,
        "within 1/N+0.1": "yes" if held <= 1 / world_size + 0.1 else "no",
        "largest whole part": f"{largest.module} ({largest.params / total:.0%})" if largest else "-",
        "why": REASONS.get(largest.reason, largest.reason) if largest else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for arch in TABLE:
        if arch.refused or arch.planning == "auto" and arch.name.endswith("no_inputs"):
            rows.append({"architecture": arch.name, "held / rank": None, "within 1/N+0.1": "refused",
                         "largest whole part": "-", "why": "plan() refuses it, as the table expects"})
            continue
        rows.append(_row(arch, args.world_size))
    columns = ["architecture", "held / rank", "within 1/N+0.1", "largest whole part", "why"]
    within = sum(r["within 1/N+0.1"] == "yes" for r in rows)
    text = (f"N = {args.world_size}: {within} of {len(rows)} entries within 1/N + 0.1\n"
            + table_text(rows, columns))
    print(text)
    print("saved", save_json("coverage_report", torch.device("cpu"), rows),
          save_text("coverage_report", torch.device("cpu"), text))


if __name__ == "__main__":
    main()
