"""Writes the sweep's results into docs/coverage.md, between two marker lines, from
benchmarks/results/sweep_cpu.json: the classes' totals (all variants and causal LMs), the
exact variants a rank holds more of, by the reason for the largest part held whole, and every
refused or skipped architecture by its reason; then the totals of each sweep at another world
size (sweep_3ranks_cpu.json, ...). The docs never hold a figure the sweep did not
produce; tests/toolchain/test_coverage_doc.py checks that the committed page matches the
committed results.

    python benchmarks/sweep/coverage_doc.py           # rewrite the section in docs/coverage.md
    python benchmarks/sweep/coverage_doc.py --check   # exit 1 where the page differs
"""

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "sweep_cpu.json"
PAGE = ROOT / "docs" / "coverage.md"
BEGIN = "<!-- sweep results: written by benchmarks/sweep/coverage_doc.py from benchmarks/results/sweep_cpu.json -->"
END = "<!-- end of sweep results -->"

_CLASSES = (("exact", "exact, every rank within 1/N + 0.1 of the parameters"),
            ("exact_over", "exact, a rank holds more than 1/N + 0.1"),
            ("refused", "refused with an error naming why"),
            ("dry_run_refused", "refused by the dry run"),
            ("crash", "crashed"),
            ("wrong", "silently wrong"),
            ("skipped", "skipped (fails unsharded, or inputs the sweep cannot make)"))


def _architectures(names: List[str]) -> str:
    """`model_type` names, each once, heads folded: "bert (base, causal)"."""
    heads: Dict[str, List[str]] = collections.defaultdict(list)
    for name in sorted(names):
        model_type, _, head = name.partition(":")
        heads[model_type].append(head)
    return ", ".join(f"{m} ({', '.join(h)})" if len(h) > 1 else f"{m} ({h[0]})" for m, h in heads.items())


def _reason(text: str) -> str:
    """A refusal's or a skip's reason without what varies between architectures (sizes, names
    in quotes, the dtype it was tried in), short enough for a table row."""
    text = text.replace("fails unsharded: torch.float32: ", "fails unsharded: ").replace("\n", " ")
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\d+", "N", text)
    return text[:110].rstrip() + ("…" if len(text) > 110 else "")


def _media_lines(rows: List[dict]) -> List[str]:
    """How the variants that take images or audio beside their text were judged: on them, or on
    their text alone (with the classes of each)."""
    on_media = [r for r in rows if r.get("inputs", "").startswith("text+")]
    text_alone = [r for r in rows if r.get("media_failed") and r["class"] != "skipped"]
    if not on_media and not text_alone:
        return []
    classes = lambda group: ", ".join(f"{n} {c}" for c, n in collections.Counter(r["class"] for r in group).most_common())
    lines = [f"Models that take images, videos or audio beside their text are judged on text with them "
             f"(their tokens placed in the ids), so that the vision or audio tower runs, is planned and "
             f"its gradients are compared: {len(on_media)} variants ({classes(on_media)})."]
    if text_alone:
        lines[0] += (f" {len(text_alone)} more, whose images or audio as the sweep makes them fail unsharded, "
                     f"are judged on their text alone ({classes(text_alone)}): {_architectures([r['name'] for r in text_alone])}.")
    return lines + [""]


def other_world_sizes() -> List[dict]:
    """The sweeps at other world sizes than 2 (run.py --world-size N: sweep_Nranks_cpu.json), by N."""
    found = sorted(RESULTS.parent.glob("sweep_*ranks_cpu.json"),
                   key=lambda p: int(re.search(r"sweep_(\d+)ranks", p.name).group(1)))
    return [json.loads(p.read_text()) for p in found]


def _at_world_size(data: dict) -> List[str]:
    """A sweep at another world size: its classes' totals, and its exact variants a rank holds
    more of by reason."""
    header, rows = data["rows"][0], data["rows"][1:]
    counts = collections.Counter(r["class"] for r in rows)
    ran = sum(n for c, n in counts.items() if c != "skipped")
    n = header["world_size"]
    which = "causal LMs" if rows and all(r["name"].endswith(":causal") for r in rows) else "variants"
    over = collections.Counter(r.get("largest_whole") or "-" for r in rows if r["class"] == "exact_over")
    lines = ["", f"At {n} gloo ranks ({data['date']}), {len(rows)} {which}, {ran} of them run unsharded: "
                 f"**{counts['exact']} of {ran} ({100 * counts['exact'] / ran:.0f}%) are exact and within 1/{n} + 0.1 "
                 f"per rank**.", "", f"| result | {which} |", "| --- | --- |"]
    lines += [f"| {words} | {counts[c]} |" for c, words in _CLASSES]
    lines += ["", f"Exact at {n} ranks with a rank holding more, by the reason for the largest part held whole: "
              + ", ".join(f"`{reason}` {count}" for reason, count in over.most_common()) + "."]
    return lines


def section(data: dict, others: List[dict] = ()) -> str:
    """The markdown of the sweep's results (`others`: sweeps at other world sizes)."""
    header, rows = data["rows"][0], data["rows"][1:]
    counts = collections.Counter(r["class"] for r in rows)
    causal = collections.Counter(r["class"] for r in rows if r["name"].endswith(":causal"))
    ran = sum(n for c, n in counts.items() if c != "skipped")
    ran_causal = sum(n for c, n in causal.items() if c != "skipped")
    share = lambda n, d: f"{100 * n / d:.0f}%" if d else "-"
    lines = [BEGIN, "",
             f"On transformers {header['transformers']} at {header['world_size']} gloo ranks ({data['torch']}, "
             f"{data['date']}): {len(rows)} variants, {ran} of them run unsharded from a tiny config; "
             f"**{counts['exact']} of {ran} ({share(counts['exact'], ran)}) are exact and within 1/N + 0.1 per rank**, "
             f"{causal['exact']} of {ran_causal} causal LMs ({share(causal['exact'], ran_causal)}).", "",
             "| result | variants | causal LMs |", "| --- | --- | --- |"]
    lines += [f"| {words} | {counts[c]} | {causal[c]} |" for c, words in _CLASSES]
    mismatched = sum(1 for r in rows if r.get("prediction"))
    lines += [f"| collectives counted differ from the plan's | {mismatched} | |", ""]
    lines += _media_lines(rows)
    over = collections.defaultdict(list)
    for r in rows:
        if r["class"] == "exact_over":
            over[r.get("largest_whole") or "-"].append(r["name"])
    lines += ["Exact, with a rank holding more than 1/N + 0.1, by the reason for the largest part held whole "
              "(the plan's reason codes, [plan.md](plan.md)):", "",
              "| reason | variants | architectures |", "| --- | --- | --- |"]
    for reason, names in sorted(over.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| `{reason}` | {len(names)} | {_architectures(names)} |")
    for cls, title in (("refused", "Refused"), ("skipped", "Skipped")):
        grouped = collections.defaultdict(list)
        for r in rows:
            if r["class"] == cls:
                grouped[_reason(r.get("why") or "")].append(r["name"])
        if not grouped:
            continue
        lines += ["", f"{title}, by reason:", "", "| reason | variants | architectures |", "| --- | --- | --- |"]
        for reason, names in sorted(grouped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"| {reason.replace('|', '/')} | {len(names)} | {_architectures(names)} |")
    for other in others:
        lines += _at_world_size(other)
    return "\n".join(lines + ["", END])


def rewritten(page: str, block: str) -> str:
    """`page` with its section between the markers replaced by `block`."""
    if BEGIN not in page or END not in page:
        raise SystemExit(f"coverage_doc: {PAGE} has no section between {BEGIN!r} and {END!r}")
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + block + page[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where docs/coverage.md differs")
    args = parser.parse_args()
    page = PAGE.read_text()
    new = rewritten(page, section(json.loads(RESULTS.read_text()), other_world_sizes()))
    if args.check:
        sys.exit(0 if new == page else 1)
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
