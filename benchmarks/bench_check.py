"""Wall time of `nnscaler-rewrite MODEL --check` (the pre-commit hook), against `python -c pass`.

For each model file a project is made in a temporary folder (the file copied as model.py, its
TP=2 output written), then fresh processes are timed, interleaved round by round:

- baseline:        `python -c pass` (the interpreter's start-up, the floor of any hook);
- check, current:  `nnscaler-rewrite model.py --tp 2 -o parallel --check` with nothing changed,
                   answered from the output's cache (no torch, no tracing);
- check, changed:  the same after a comment is added to model.py (the cache cannot answer:
                   the full check traces and rewrites);
- rewrite, changed: the rewrite that makes the output current again.

`nnscaler-rewrite` is the console script next to this Python (`pip install -e .` writes it); a
pyenv shim in front of it, when the command is run by name, adds its own start-up (a bash
script and `pyenv` itself: about 0.25 s here). Medians, and each median as a
ratio to the baseline's, are printed as markdown and written to benchmarks/BENCH_CHECK.md.
Not a test: timings depend on the machine.

    python benchmarks/bench_check.py [--repeat 10] [--slow-repeat 2] [--out benchmarks/BENCH_CHECK.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ["fixtures/gpt.py", "fixtures/hf_llama.py"]
BUDGET_S = {"check, current": 0.5, "rewrite, changed": 3.0}     # issue 11's targets


def timed(cmd: list[str], cwd: Path, expect: set[int]) -> float:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode not in expect:
        raise SystemExit(f"{' '.join(cmd)}: exit {result.returncode}, expected {expect}\n{result.stderr}")
    return elapsed


def measure(model: str, repeat: int, slow_repeat: int) -> dict[str, list[float]]:
    script = Path(sys.executable).parent / "nnscaler-rewrite"
    tool = [str(script), "model.py", "--tp", "2", "-o", "parallel"]
    times: dict[str, list[float]] = {"baseline": [], "check, current": [], "check, changed": [],
                                     "rewrite, changed": []}
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        shutil.copy(REPO / model, project / "model.py")
        timed(tool, project, {0})
        for _ in range(repeat):
            times["baseline"].append(timed([sys.executable, "-c", "pass"], project, {0}))
            times["check, current"].append(timed([*tool, "--check"], project, {0}))
        for round_ in range(slow_repeat):
            with open(project / "model.py", "a") as f:
                f.write(f"# changed {round_}\n")
            # exit 1 (stale), or 0 where the output does not carry the comment (an entry file's
            # trailing comment in hf_*): either way the cache cannot answer and the full check runs
            times["check, changed"].append(timed([*tool, "--check"], project, {0, 1}))
            times["rewrite, changed"].append(timed(tool, project, {0}))
    return times


def revision() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "nnscaler_cst", "fixtures", "rules"], cwd=REPO,
                           capture_output=True, text=True).stdout
    return rev.strip() + ("+dirty" if dirty.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="rounds of the fast commands")
    parser.add_argument("--slow-repeat", type=int, default=2, help="rounds after a model change")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "BENCH_CHECK.md")
    args = parser.parse_args()
    rows = []
    for model in MODELS:
        times = measure(model, args.repeat, args.slow_repeat)
        base = statistics.median(times["baseline"])
        for name, values in times.items():
            median = statistics.median(values)
            budget = BUDGET_S.get(name) if name != "rewrite, changed" or "llama" in model else None
            verdict = "" if budget is None else (" (within)" if median <= budget else " (**over**)")
            rows.append(f"| {model} | {name} | {len(values)} | {median:.3f} | {min(values):.3f} | "
                        f"{median / base:.1f}x | {'' if budget is None else f'{budget} s{verdict}'} |")
    load = os.getloadavg()
    table = "\n".join(["| model | command | runs | median s | min s | / `python -c pass` | budget |",
                       "| --- | --- | --- | --- | --- | --- | --- |", *rows])
    text = (f"# `--check` wall time (the pre-commit hook)\n\n"
            f"Reproduce: `python benchmarks/bench_check.py --repeat {args.repeat} --slow-repeat {args.slow_repeat}` "
            f"(see its docstring for what each command is).\n\n"
            f"Measured {datetime.date.today()} at {revision()}, {platform.python_version()}, "
            f"{os.cpu_count()} cores, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
            "(a shared machine: absolute seconds move with the load; the ratio to `python -c pass`, "
            f"measured in the same rounds, moves less).\n\n{table}\n"
            "\n`check, current` is what the pre-commit hook costs when nothing changed: the cache answers "
            "after reading the inputs it lists, with no torch, LibCST, typer or rich imported. Every other "
            "row traces, plans and rewrites; the 3 s budget issue 11 sets for that on hf_llama is not met "
            "on this machine (tracing and planning dominate; this benchmark only records it).\n")
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
