"""The sweep: every architecture of the installed transformers (base model and causal-LM head),
built from a tiny config, sharded by autoshard at N gloo ranks and judged against the same model
unsharded (see sweep_check for the classes).

    python benchmarks/sweep/run.py [--jobs 2] [--world-size 2] [--only REGEX] [--fresh] [--retry wrong,crash]
                                   [--planning auto]

`--jobs` processes each drive their own pool of ranks; each record is appended to
benchmarks/results/sweep_progress_cpu.jsonl as soon as it is known, so an interrupted sweep
resumes where it stopped (`--fresh` starts over; `--retry` judges the variants of the given
classes again, after a fix). At the end the table of totals and every
architecture's line go to benchmarks/results/sweep_cpu.txt, the records to sweep_cpu.json.
`--planning auto` plans and judges each model on the inputs autoshard makes itself (no
example_inputs), its files named sweep_auto_* beside the others. A world size other than 2 has
files of its own too (`--world-size 3`: sweep_3ranks_cpu.txt, sweep_progress_3ranks_cpu.jsonl).

A model that takes images or audio beside its input_ids is judged on text with them where they
run unsharded (catalogue.media_inputs); each record's `inputs` says what it was judged on, and
`media_failed` why a model of that kind was judged on its text alone.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

RESULTS = os.path.join(HERE, "..", "results")
# Planned with the sweep's inputs by parallelize, the README's way (--planning plan: autoshard.plan,
# then parallelize with that plan), or with the inputs autoshard makes itself (--planning auto).
SWEEP = {"auto": "sweep_auto", "plan": "sweep_readme"}.get(os.environ.get("AUTOSHARD_SWEEP_PLANNING"), "sweep")
PROGRESS = os.path.join(RESULTS, f"{SWEEP.replace('sweep', 'sweep_progress')}_cpu.jsonl")


def _at_world_size(world_size: int) -> None:
    """Results at another world size than 2 go to files of their own (sweep_3ranks_cpu.txt,
    sweep_progress_3ranks_cpu.jsonl), so that each world size's table is judged alone."""
    global SWEEP, PROGRESS
    if world_size != 2:
        SWEEP = f"{SWEEP}_{world_size}ranks"
        PROGRESS = os.path.join(RESULTS, f"{SWEEP.replace('sweep', 'sweep_progress', 1)}_cpu.jsonl")
# A tiny model plans, runs and steps in seconds; a hung collective must not stall the sweep.
TIMEOUT = 240


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _done() -> dict:
    """The records judged so far with the installed transformers (another release's catalogue and
    models differ, so its records are judged again)."""
    records, installed = {}, _transformers_version()
    if os.path.exists(PROGRESS):
        with open(PROGRESS) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    if record.get("transformers") == installed:
                        records[record["name"]] = record
    return records


def _append(record: dict) -> None:
    # One write of one line with O_APPEND: the jobs' lines never interleave.
    fd = os.open(PROGRESS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _work(names, world_size: int) -> None:
    """One job: each architecture on this job's pool of ranks, one after another."""
    from sweep_check import check_variant, classify  # puts tests/support on the path
    from multirank import run_on_ranks

    for name in names:
        start = time.monotonic()
        try:
            record = classify(name, world_size, run_on_ranks(check_variant, world_size, name, timeout=TIMEOUT))
        except Exception as error:  # a rank died or hung: the pool is replaced by the next call
            record = {"name": name, "class": "crash", "why": f"{type(error).__name__}: {str(error)[:600]}"}
        record["seconds"] = round(time.monotonic() - start, 1)
        record["world_size"] = world_size
        record["transformers"] = _transformers_version()
        _append(record)
        print(f"{name:40s} {record['class']:16s} {record['seconds']:6.1f}s", flush=True)


def _table(records: dict, world_size: int) -> str:
    from sweep_check import CLASSES

    counts = collections.Counter(r["class"] for r in records.values())
    causal = collections.Counter(r["class"] for r in records.values() if r["name"].endswith(":causal"))
    ran = sum(counts[c] for c in CLASSES if c != "skipped")
    lines = [f"transformers sweep at {world_size} gloo ranks: {len(records)} variants, {ran} ran unsharded", "",
             f"{'class':18s} {'all':>6s} {'causal':>7s}"]
    for c in CLASSES:
        lines.append(f"{c:18s} {counts[c]:6d} {causal[c]:7d}")
    predicted = sum(1 for r in records.values() if r.get("prediction"))
    lines.append(f"{'prediction differs':18s} {predicted:6d}")
    whole = collections.Counter(r.get("largest_whole") or "-" for r in records.values() if r["class"] == "exact_over")
    lines += ["", "exact_over, by the largest part held whole: " + ", ".join(f"{k} {v}" for k, v in whole.most_common())]
    # The models that take images or audio beside their text: what each was judged on (its text
    # alone where no layout of them runs unsharded; "skipped" where nothing runs).
    media = collections.Counter(r.get("inputs") or "skipped" for r in records.values()
                                if r.get("inputs", "").startswith("text+") or r.get("media_failed"))
    lines += ["", "models of text and images or audio, judged on: " + ", ".join(
        f"{k} {v}" for k, v in media.most_common())]
    lines += ["", f"{'variant':40s} {'class':16s} {'held':>5s} {'inputs':12s} why"]
    for name in sorted(records):
        r = records[name]
        held = f"{r['held']:.2f}" if "held" in r else ""
        why = r.get("why") or r.get("largest_whole") or ""
        lines.append(f"{name:40s} {r['class']:16s} {held:>5s} {r.get('inputs', '-'):12s} {why[:160]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", default=None, help="a regex on variant names (model_type:head)")
    parser.add_argument("--fresh", action="store_true", help="forget the progress of an earlier sweep")
    parser.add_argument("--retry", default="", help="classes to judge again, comma-separated (e.g. wrong,crash)")
    parser.add_argument("--planning", choices=("parallelize", "plan", "auto"), default=None,
                        help="plan: the README's way, autoshard.plan(model) handed to parallelize; "
                             "auto: plan and judge on the inputs autoshard makes itself")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "k/jobs": one job's share
    args = parser.parse_args()
    if args.planning is not None and args.planning != os.environ.get("AUTOSHARD_SWEEP_PLANNING", "parallelize"):
        # The choice travels to the jobs and their ranks in the environment, read at import.
        os.environ["AUTOSHARD_SWEEP_PLANNING"] = args.planning
        os.execv(sys.executable, [sys.executable, __file__] + sys.argv[1:])
    os.makedirs(RESULTS, exist_ok=True)
    _at_world_size(args.world_size)

    from catalogue import variants

    names = [v.name for v in variants() if args.only is None or re.search(args.only, v.name)]
    if args.worker is not None:
        k, jobs = map(int, args.worker.split("/"))
        done = _done()
        _work([n for n in names if n not in done][k::jobs], args.world_size)
        return
    if args.fresh and os.path.exists(PROGRESS):
        os.remove(PROGRESS)
    retry = set(filter(None, args.retry.split(",")))
    if retry:
        kept = [r for r in _done().values() if not (r["class"] in retry and r["name"] in set(names))]
        with open(PROGRESS, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
    todo = [n for n in names if n not in _done()]
    print(f"{len(names)} variants, {len(names) - len(todo)} already judged, {len(todo)} to run on {args.jobs} jobs",
          flush=True)
    start = time.monotonic()
    jobs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{k}/{args.jobs}",
                              "--world-size", str(args.world_size)] + (["--only", args.only] if args.only else []))
            for k in range(args.jobs)]
    for job in jobs:
        job.wait()
    records = {n: r for n, r in _done().items() if n in set(names)}
    text = _table(records, args.world_size)
    import torch
    import transformers
    from common import save_json, save_text

    cpu = torch.device("cpu")
    save_text(SWEEP, cpu, text)
    save_json(SWEEP, cpu, [{"transformers": transformers.__version__, "world_size": args.world_size,
                              "seconds": round(time.monotonic() - start, 1)}] + [records[n] for n in sorted(records)])
    print(text.split("\n\nvariant")[0] if "\n\nvariant" in text else text)


if __name__ == "__main__":
    main()
