#!/usr/bin/env python
"""How long `nnscaler-rewrite plan --tp 2` takes per architecture, one process at a time, and
how much of it is the model's own import and build.

    python benchmarks/bench_plan_time.py --into benchmarks/coverage_results.json --work /tmp/entries
        [--only llama,bert] [--repeat 1]
    python benchmarks/bench_plan_time.py --work DIR        # entries bench_coverage.py --dry-run wrote

The coverage sweep times `plan` while other runs share the machine; this bench runs nothing
else. Per architecture (the entry `<work>/<type>/hf_<type>.py`: with --into, written again from
that results file's record of each architecture that ran, as the sweep wrote it), alternately,
`--repeat` times each:

- the baseline: a fresh interpreter that imports the entry file and calls build(), which is
  what any program using the model pays (torch, transformers, the model's own modules);
- the tool: a fresh `nnscaler-rewrite plan ENTRY --tp 2 --json`.

The fastest of the repeats of each is kept. The tool's own seconds are the difference: tracing,
derivation, search and rendering of the plan. The 1-minute load average is recorded before each
architecture, so a busy machine shows. With --into, each architecture's record in a coverage
results file gains "plan_time" and COVERAGE.md (`bench_coverage.py --render`) reports it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import revision  # noqa: E402
from bench_coverage import cli, entry_source, enumerate_archs, plan_time_line  # noqa: E402

BASELINE = ("import runpy, sys; sys.path.insert(0, {folder!r}); "
            "runpy.run_path({entry!r})['build']()")


def timed(argv: list[str], cwd: Path, timeout: float) -> tuple[float | None, str]:
    """Wall seconds of one fresh process, or None with the last line of its error output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:300]
    return seconds, ""


def measure(entry: Path, repeat: int, timeout: float) -> dict:
    baseline = [sys.executable, "-c", BASELINE.format(folder=str(entry.parent), entry=str(entry))]
    tool = cli() + ["plan", str(entry), "--tp", "2", "--json"]
    load = os.getloadavg()[0]
    base_times, plan_times = [], []
    for _ in range(repeat):
        for argv, into in ((baseline, base_times), (tool, plan_times)):
            seconds, reason = timed(argv, entry.parent, timeout)
            if seconds is None:
                return {"ok": False, "reason": reason, "load": round(load, 2)}
            into.append(seconds)
    return {"ok": True, "reason": "", "baseline_seconds": round(min(base_times), 2),
            "plan_seconds": round(min(plan_times), 2), "own_seconds": round(min(plan_times) - min(base_times), 2),
            "load": round(load, 2)}


def write_entries(results: dict, work: Path) -> None:
    """The entry of each architecture that ran in the sweep, as the sweep wrote it (its config
    overrides and loss() as recorded)."""
    known = {a.name: a for a in enumerate_archs()[0]}
    for record in results["architectures"]:
        arch = known.get(record["arch"])
        if arch is None or not record["check"]["ok"]:
            continue
        arch.overrides = record["overrides"]
        folder = work / arch.name.replace("-", "_")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"hf_{arch.name.replace('-', '_')}.py").write_text(entry_source(arch, with_loss=record["with_loss"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="folder of the entries, <type>/hf_<type>.py")
    p.add_argument("--only", help="comma-separated model types")
    p.add_argument("--repeat", type=int, default=1, help="runs of each process; the fastest is kept")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--results", help="JSON of this bench's records (default: <work>/plan_time.json)")
    p.add_argument("--into", help="a coverage results file: write its architectures' entries, and add each "
                   "one's plan_time to it")
    args = p.parse_args()

    work = Path(args.work)
    if args.into:
        write_entries(json.loads(Path(args.into).read_text()), work)
    entries = sorted(work.glob("*/hf_*.py"))
    if args.only:
        names = {name.replace("-", "_") for name in args.only.split(",")}
        entries = [e for e in entries if e.parent.name in names]
    if not entries:
        raise SystemExit(f"no entries under {work}: give --into a coverage results file")
    meta = {"command": " ".join(["python", "benchmarks/bench_plan_time.py", *sys.argv[1:]]),
            "revision": revision(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cores": os.cpu_count()}
    records = []
    results = Path(args.results or work / "plan_time.json")
    for entry in entries:
        record = {"arch": entry.parent.name, **measure(entry.resolve(), args.repeat, args.timeout)}
        records.append(record)
        shown = (f"plan {record['plan_seconds']:6.1f} s  import+build {record['baseline_seconds']:5.1f} s  "
                 f"own {record['own_seconds']:5.1f} s" if record["ok"] else f"failed: {record['reason']}")
        print(f"{record['arch']:28s} {shown}  load {record['load']:.1f}", flush=True)
        results.write_text(json.dumps({**meta, "summary": plan_time_line(records), "architectures": records}, indent=1))
    print(plan_time_line(records))
    if args.into:
        into = Path(args.into)
        data = json.loads(into.read_text())
        by_folder = {r["arch"]: r for r in records}       # folders are named with _ for - (xlm-roberta)
        for arch in data["architectures"]:
            found = by_folder.get(arch["arch"].replace("-", "_"))
            if found is not None:
                arch["plan_time"] = {**found, "revision": meta["revision"], "date": meta["date"]}
        data["plan_time_command"] = meta["command"]
        into.write_text(json.dumps(data, indent=1))
        print(f"added plan_time to {into}")


if __name__ == "__main__":
    main()
