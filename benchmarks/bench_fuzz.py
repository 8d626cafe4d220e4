#!/usr/bin/env python
"""Fuzzed equivalence, the long run: models drawn from the op grammar (tests/fuzz/models.py),
each crossed with every plan that applies (TP=2, DP=2, PP=2 when it loops over blocks, DP×TP
2×2) and run as `nnscaler-rewrite verify` (tests/fuzz/runner.py). Writes benchmarks/FUZZ.md.

    nice -n 10 python benchmarks/bench_fuzz.py [--models 250] [--minutes 60] [--seed 0]
        [--shrink-minutes 10] [--out benchmarks/FUZZ.md] [--fresh-processes]

Counts: examples (model × plan) run, passed, refused (top reasons, sizes and names stripped),
failures (grouped by reason, the first of each group shrunk by hypothesis within the shrink
budget, its source shown). FUZZ.md is rewritten after every example, so a run stopped early
still leaves its counts. Seeded: the same seed draws the same models.
"""
from __future__ import annotations

import argparse
import collections
import resource
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import revision  # noqa: E402
from fuzz import forked  # noqa: E402
from fuzz.known import known_failure  # noqa: E402
from fuzz.models import DrawnModel, models  # noqa: E402
from fuzz.runner import Outcome, plans_for, refusal_group, run, subprocess_cli  # noqa: E402


class Runs:
    """Outcomes by (source, plan), run once each."""

    def __init__(self, cli=subprocess_cli):
        self.done: dict[tuple[str, str], Outcome] = {}
        self.cli = cli
        self.cpu_s = 0.0          # CPU time of every process the examples ran (a shared machine's wall time varies)

    def outcome(self, model: DrawnModel, plan: str) -> Outcome:
        key = (model.source(), plan)
        if key not in self.done:
            before = _children_cpu()
            with tempfile.TemporaryDirectory(prefix="fuzz-") as workdir:
                self.done[key] = run(model, plan, Path(workdir), self.cli)
            self.cpu_s += _children_cpu() - before
        return self.done[key]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _settings(max_examples: int, phases) -> settings:
    return settings(max_examples=max_examples, database=None, deadline=None, phases=phases,
                    suppress_health_check=list(HealthCheck))


def explore(runs: Runs, n_models: int, seed_value: int, budget_s: float, record) -> None:
    started = time.monotonic()

    @_settings(n_models, [Phase.generate])
    @seed(seed_value)
    @given(models())
    def each(model):
        for plan in plans_for(model):
            if time.monotonic() - started > budget_s:
                return
            record(model, plan, runs.outcome(model, plan))
    each()


def shrink(runs: Runs, target: DrawnModel, plan: str, group: str, n_models: int, seed_value: int,
           budget_s: float) -> tuple[DrawnModel, Outcome]:
    """The smallest model hypothesis finds, within budget_s, that fails under `plan` for the same
    reason as `target`: the exploration's sequence is replayed (same seed) up to `target`, then
    hypothesis shrinks from there."""
    state = {"found": False, "deadline": None, "best": (target, runs.outcome(target, plan))}

    def fails_alike(model: DrawnModel) -> bool:
        outcome = runs.outcome(model, plan)
        return outcome.kind == "FAILURE" and refusal_group(outcome.reason) == group

    @_settings(n_models, [Phase.generate, Phase.shrink])
    @seed(seed_value)
    @given(models())
    def search(model):
        if not state["found"]:
            if model.source() != target.source():
                return
            state["found"], state["deadline"] = True, time.monotonic() + budget_s
        if (model.source(), plan) not in runs.done and time.monotonic() > state["deadline"]:
            return
        if fails_alike(model):
            if len(model.source()) < len(state["best"][0].source()):
                state["best"] = (model, runs.outcome(model, plan))
            raise AssertionError("fails alike")
    try:
        search()
    except AssertionError:
        pass
    return state["best"]


def render(counts, refusals, failures, per_plan, seconds: float, args, finished: bool, cpu_s: float) -> str:
    run_total = sum(counts.values())
    rate = seconds / run_total if run_total else 0.0
    cpu_rate = cpu_s / run_total if run_total else 0.0
    lines = [
        "# Fuzzed equivalence (benchmarks/bench_fuzz.py)", "",
        f"Command: `nice -n 10 python benchmarks/bench_fuzz.py --models {args.models} --minutes {args.minutes:g} "
        f"--seed {args.seed} --shrink-minutes {args.shrink_minutes:g}{' --fresh-processes' if args.fresh_processes else ''}`, revision {revision()}, "
        f"{'finished' if finished else 'in progress (rewritten after every example)'}.", "",
        "Each example is one drawn model (tests/fuzz/models.py) under one plan, run as "
        "`nnscaler-rewrite verify ENTRY <plan> -o out --json` in a fresh folder (tests/fuzz/runner.py). "
        "PASSED: verify equal; REFUSED: exit 2 at a `path:line:col: error:`, nothing written; "
        "FAILURE: anything else.", "",
        f"- examples run: **{run_total}** in {seconds / 60:.1f} min on this shared 2-core machine "
        f"({rate:.1f} s per example, {cpu_rate:.1f} s of CPU per example; 1,000 examples would take about "
        f"{rate * 1000 / 3600:.1f} h); {'each example a new process' if args.fresh_processes else 'each example a fork of the prepared bench process (tests/fuzz/forked.py)'}",
        f"- passed: **{counts['PASSED']}**", f"- refused: **{counts['REFUSED']}**"
        f" ({100 * counts['REFUSED'] / max(run_total, 1):.0f}%)",
        f"- failures: **{counts['FAILURE']}**", "",
        "| plan | passed | refused | failures |", "| --- | --- | --- | --- |",
    ]
    for plan, c in sorted(per_plan.items()):
        lines.append(f"| {plan} | {c['PASSED']} | {c['REFUSED']} | {c['FAILURE']} |")
    lines += ["", "## Top refusal reasons", "", "| count | reason (sizes and names stripped) |", "| --- | --- |"]
    for group, n in refusals.most_common(10):
        lines.append(f"| {n} | {group.replace('|', '/')} |")
    lines += ["", "## Failures", ""]
    if not failures:
        lines.append("None.")
    for group, items in failures.items():
        model, plan, outcome = items[0]
        known = known_failure(outcome.reason, model)
        lines += [f"### {len(items)} × {group}", "",
                  f"Known bug (tests/fuzz/known.py): {known}." if known else "A new bug: not in tests/fuzz/known.py.", "",
                  f"Plans: {', '.join(sorted({p for _, p, _ in items}))}. The "
                  f"{'shrunk' if outcome.detail.startswith('(shrunk)') else 'first'} example: "
                  f"`{outcome.command}`", "", "```python", model.source().rstrip(), "```", "",
                  "```", outcome.detail.replace("(shrunk)\n", "").strip()[-2500:], "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=250, help="models to draw (each runs under 3-4 plans)")
    parser.add_argument("--minutes", type=float, default=60.0, help="stop drawing after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shrink-minutes", type=float, default=10.0, help="per failure group")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "FUZZ.md")
    parser.add_argument("--fresh-processes", action="store_true",
                        help="run each example as a new `python -m nnscaler_cst.cli` (else a fork of this "
                             "process, which imports the tool once: fuzz/forked.py)")
    args = parser.parse_args()

    if args.fresh_processes or not sys.platform.startswith("linux"):
        runs = Runs()
    else:
        forked.prepare()
        runs = Runs(forked.run_cli)
    counts, refusals = collections.Counter(), collections.Counter()
    per_plan = collections.defaultdict(collections.Counter)
    failures: dict[str, list] = {}
    started = time.monotonic()

    def record(model, plan, outcome):
        counts[outcome.kind] += 1
        per_plan[plan][outcome.kind] += 1
        if outcome.kind == "REFUSED":
            refusals[refusal_group(outcome.reason)] += 1
        elif outcome.kind == "FAILURE":
            failures.setdefault(refusal_group(outcome.reason), []).append((model, plan, outcome))
        print(f"{sum(counts.values()):4d} {time.monotonic() - started:7.0f}s {runs.cpu_s:6.0f}s cpu {plan:8s} "
              f"{outcome.kind:8s} "
              f"{','.join(model.kinds)} {outcome.reason[:120]}", flush=True)
        args.out.write_text(render(counts, refusals, failures, per_plan, time.monotonic() - started, args, False,
                                    runs.cpu_s))

    explore(runs, args.models, args.seed, args.minutes * 60, record)
    explored = time.monotonic() - started
    for group, items in failures.items():
        model, plan, _ = items[0]
        small, outcome = shrink(runs, model, plan, group, args.models, args.seed, args.shrink_minutes * 60)
        outcome = Outcome(outcome.kind, outcome.reason, outcome.command, outcome.seconds, "(shrunk)\n" + outcome.detail)
        items[0] = (small, plan, outcome)
        print(f"shrunk {group[:80]}: {len(model.source())} -> {len(small.source())} characters", flush=True)
    args.out.write_text(render(counts, refusals, failures, per_plan, explored, args, True, runs.cpu_s))


if __name__ == "__main__":
    main()
