#!/usr/bin/env python
"""Wall time of ``nnscaler-rewrite verify fixtures/gpt.py --tp 2 -o DIR`` against the
single-device work it checks, measured in the same run.

    python benchmarks/bench_verify.py [--reps 3] [--json out.json]

Each repetition runs, as fresh subprocesses and in this order:

* ``baseline``: one ``python`` that imports torch, builds the fixture's model (seed 0) and
  runs its 3 single-device AdamW steps on the batches verify uses (seed + step ->
  example_inputs()), i.e. what the reference process of verify computes (BASELINE below),
  with OMP_NUM_THREADS=1 as verify starts its own processes;
* ``verify``: ``nnscaler-rewrite verify fixtures/gpt.py --tp 2 -o DIR --json`` into a fresh
  DIR (so it rewrites, then runs 1 reference + 2 gloo rank processes and compares); its JSON
  ``seconds`` is the part after the rewrite (``run_verify``: the 3 processes + comparison);
* ``verify, fresh processes``: the same verify with NNSCALER_VERIFY_FORK=0, i.e. its reference
  and rank processes started as fresh interpreters (each importing torch) instead of forks of
  verify's fork server (nnscaler_cst/verify/forkserver.py): the fork server's gain, measured in
  the same repetition;
* ``rewrite``: ``nnscaler-rewrite fixtures/gpt.py --tp 2 -o DIR`` alone, into a fresh DIR;
* ``import torch``: ``python -c "import torch"``, the floor of every process above.

Figures: the median over the repetitions of each, and each as a ratio to the baseline's
median; also the CPU seconds of each command and its processes (on a shared machine wall time
follows the load, CPU time much less). verify must pass (exit 0) or the bench stops.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import revision  # noqa: E402
FIXTURE = ROOT / "fixtures" / "gpt.py"

# verify starts its reference and rank processes with OMP_NUM_THREADS=1 unless the caller
# set it (nnscaler_cst/verify/equivalence.py, _env); the baseline runs the same way.
ONE_THREAD = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

BASELINE = r"""
import importlib.util, sys
import torch
torch.use_deterministic_algorithms(True, warn_only=True)
spec = importlib.util.spec_from_file_location("fixture", sys.argv[1])
entry = importlib.util.module_from_spec(spec); spec.loader.exec_module(entry)
torch.manual_seed(0)
model = entry.build()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    torch.manual_seed(0 + step)
    loss = model(*entry.example_inputs())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(step, loss.item())
"""


def cli() -> list[str]:
    exe = shutil.which("nnscaler-rewrite")
    return [exe] if exe else [sys.executable, "-m", "nnscaler_cst.cli"]


CPU: dict[str, list[float]] = {}     # label -> CPU seconds of each run (the command and its processes)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], label: str = "", **env) -> tuple[float, subprocess.CompletedProcess]:
    t0, cpu0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, **env))
    dt = time.perf_counter() - t0
    CPU.setdefault(label, []).append(_children_cpu() - cpu0)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return dt, proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    rel = FIXTURE.relative_to(ROOT)
    runs = {"baseline": [], "verify": [], "verify_part": [], "verify_fresh": [], "verify_part_fresh": [],
            "rewrite": [], "import_torch": []}
    load = [os.getloadavg()[0]]
    tmp = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        for rep in range(a.reps):
            dt, _ = timed([sys.executable, "-c", BASELINE, str(rel)], "baseline", **ONE_THREAD)
            runs["baseline"].append(dt)
            for suffix, forks in (("", "1"), ("_fresh", "0")):
                dt, proc = timed([*cli(), "verify", str(rel), "--tp", "2", "-o", str(tmp / f"v{rep}{suffix}"),
                                  "--json"], "verify" + suffix, NNSCALER_VERIFY_FORK=forks)
                res = json.loads(proc.stdout[proc.stdout.index("{"):])
                if not res["passed"]:
                    raise SystemExit(f"bench: verify did not pass:\n{proc.stdout}")
                runs["verify" + suffix].append(dt)
                runs["verify_part" + suffix].append(res["seconds"])
            dt, _ = timed([*cli(), str(rel), "--tp", "2", "-o", str(tmp / f"r{rep}")], "rewrite")
            runs["rewrite"].append(dt)
            dt, _ = timed([sys.executable, "-c", "import torch"], "import_torch", **ONE_THREAD)
            runs["import_torch"].append(dt)
            load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = statistics.median(runs["baseline"])
    labels = {"baseline": "baseline: import torch + build + 3 AdamW steps (1 process)",
              "verify": f"nnscaler-rewrite verify {rel} --tp 2 -o DIR",
              "verify_part": "  of which run_verify (3 processes + compare; its JSON 'seconds')",
              "verify_fresh": "the same verify, NNSCALER_VERIFY_FORK=0 (fresh processes)",
              "verify_part_fresh": "  of which run_verify",
              "rewrite": f"nnscaler-rewrite {rel} --tp 2 -o DIR (rewrite alone)",
              "import_torch": 'python -c "import torch"'}
    print(f"machine: {os.cpu_count()} cores, no GPU; revision {revision()}; 1-min loadavg during "
          f"the run: {', '.join(f'{x:.2f}' for x in load)}")
    print(f"{a.reps} repetitions, interleaved; seconds per repetition, median, median / baseline median\n")
    width = max(len(v) for v in labels.values())
    print(f"{'':<{width}}  {'runs s':>22}{'median s':>10}{'/baseline':>11}{'CPU s':>8}")
    out = {"reps": a.reps, "loadavg": load, "runs": runs, "cpu_s": CPU, "median_s": {}, "over_baseline": {}}
    for key, label in labels.items():
        med = statistics.median(runs[key])
        cpu = f"{statistics.median(CPU[key]):>8.2f}" if key in CPU else ""
        print(f"{label:<{width}}  {', '.join(f'{x:.2f}' for x in runs[key]):>22}{med:>10.2f}{med / base:>11.2f}{cpu}")
        out["median_s"][key] = med
        out["over_baseline"][key] = med / base
    print(f"\nverify / baseline = {out['over_baseline']['verify']:.2f}")
    print(f"fresh processes / fork server, same repetitions: wall {out['median_s']['verify_fresh'] / out['median_s']['verify']:.2f}x, "
          f"CPU {statistics.median(CPU['verify_fresh']) / statistics.median(CPU['verify']):.2f}x, run_verify wall "
          f"{out['median_s']['verify_part_fresh'] / out['median_s']['verify_part']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
