"""docs/coverage.md's sweep section is what benchmarks/sweep/coverage_doc.py writes from the
committed sweep results: no figure in it was typed by hand, and none is stale."""

import ast
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _coverage_doc():
    spec = importlib.util.spec_from_file_location("coverage_doc", ROOT / "benchmarks" / "sweep" / "coverage_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_coverage_page_holds_the_committed_sweep_results():
    doc = _coverage_doc()
    data = json.loads(doc.RESULTS.read_text())
    block = doc.section(data, doc.other_world_sizes())
    page = doc.PAGE.read_text()
    assert block in page, "docs/coverage.md differs from the sweep results: run python benchmarks/sweep/coverage_doc.py"
    # Its totals are the results' own, class by class.
    rows = data["rows"][1:]
    for cls, _ in doc._CLASSES:
        count = sum(1 for r in rows if r["class"] == cls)
        assert any(line.endswith(f"| {count} |") or f"| {count} | " in line
                   for line in block.splitlines() if line.startswith(f"| {dict(doc._CLASSES)[cls]} |"))
    assert sum(1 for r in rows if r["class"] == "exact") == int(block.split("**")[1].split()[0])


def test_the_page_names_every_class_the_sweep_gives():
    tree = ast.parse((ROOT / "benchmarks" / "sweep" / "sweep_check.py").read_text())
    classes = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(t, "id", None) == "CLASSES" for t in node.targets))
    assert [c for c, _ in _coverage_doc()._CLASSES] == list(classes)


def test_a_changed_result_is_found():
    doc = _coverage_doc()
    data = json.loads(doc.RESULTS.read_text())
    next(r for r in data["rows"][1:] if r["class"] == "exact")["class"] = "wrong"
    assert doc.section(data) not in doc.PAGE.read_text()
