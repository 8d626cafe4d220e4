"""Wall time of `nnscaler-rewrite inspect` relative to simply running the model once.

For each model file, two fresh processes are timed, alternately, `--repeat` times each:

- baseline: import the entry file (torch, and transformers for the hf_* entries), build() the
  model, and run one plain forward on example_inputs();
- inspect:  `python -m nnscaler_cst.cli inspect FILE --json` (load, trace forward + loss +
  backward, annotate, print).

The medians and their ratio are printed as a markdown table and written, with the command that
reproduces them, to benchmarks/BENCH_INSPECT.md. The CPU time (user + sys) of the same processes
is reported beside the wall time: it barely moves when other processes load the machine.
Not a test: timings depend on the machine.

    python benchmarks/bench_inspect.py [--repeat 3] [--out benchmarks/BENCH_INSPECT.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ["fixtures/mlp.py", "fixtures/gpt.py", "fixtures/hf_gpt2.py", "fixtures/hf_llama.py"]

BASELINE = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("entry", sys.argv[1])
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
model = entry.build()
inputs = entry.example_inputs()
output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process."""
    cpu, start = _children_cpu(), time.perf_counter()
    result = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return elapsed, _children_cpu() - cpu


def measure(model: str, repeat: int) -> dict[str, float]:
    runs = {"baseline": [], "inspect": []}
    for _ in range(repeat):          # alternate, so drift in machine load hits both alike
        runs["baseline"].append(timed([sys.executable, "-c", BASELINE, model]))
        runs["inspect"].append(timed([sys.executable, "-m", "nnscaler_cst.cli", "inspect", model, "--json"]))
    return {f"{name} {what}": statistics.median(t[i] for t in times)
            for name, times in runs.items() for i, what in enumerate(("wall", "cpu"))}


def versions() -> str:
    import torch
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    return (f"Python {platform.python_version()}, torch {torch.__version__}, transformers {hf}, "
            f"{os.cpu_count()} CPU cores ({platform.machine()}, {platform.system()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each process per model (median taken)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "BENCH_INSPECT.md")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    rows = ["| model | baseline s | inspect s | ratio | baseline CPU s | inspect CPU s | CPU ratio |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for model in MODELS:
        t = measure(model, args.repeat)
        rows.append(f"| {model} | {t['baseline wall']:.2f} | {t['inspect wall']:.2f} | "
                    f"{t['inspect wall'] / t['baseline wall']:.2f} | {t['baseline cpu']:.2f} | "
                    f"{t['inspect cpu']:.2f} | {t['inspect cpu'] / t['baseline cpu']:.2f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    load = f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print()
    print(table)

    command = f"python benchmarks/bench_inspect.py --repeat {args.repeat}"
    args.out.write_text(f"""# `inspect` wall time

Wall time of `python -m nnscaler_cst.cli inspect FILE --json` in a fresh process, against a
baseline fresh process that imports the entry file (torch, and transformers for the `hf_*`
entries), calls `build()` and runs one plain forward on `example_inputs()`. Median of
{args.repeat} alternating runs of each; ratio = inspect / baseline. Both include interpreter
start-up and imports, which dominate for these tiny models. The CPU columns are the same
processes' user + sys time, which other load on the machine hardly changes.

{table}

Measured {datetime.date.today().isoformat()} on {versions()}; {load}.
A load above the core count means other processes competed for the CPU: wall seconds are
then inflated, CPU seconds much less so.

Reproduce from the repository root:

```
{command}
```
""")
    print(f"\nwritten to {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
