"""Planning time (issue 9): `plan --plan auto` at production shapes, the split search with and
without constraint tables, and the GPT-3 175B plan against Megatron-LM's configuration.

    python benchmarks/bench_planning.py                 # writes benchmarks/BENCH_PLANNING.md
    python benchmarks/bench_planning.py --before DIR    # also times the commands on an older checkout

Part 1 runs each command as a user would (a fresh process; wall and CPU time, the load average
beside it: this machine is shared). Part 2 splits one process's time into trace + graph and
search. Part 3 times one tensor-parallel axis of the GPT fixture at 12 to 96 layers, by
variable elimination (this version) and by z3's optimiser (the search before it), with the
Megatron table and over the full space. Part 4 prices Megatron-LM's published configuration of
GPT-3 175B with the same cost model the search uses. Part 5 holds the cost model's estimate of a
training step against the step measured on this CPU (bench_cpu_step.py).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cpu_step  # noqa: E402
from _common import revision  # noqa: E402

GIB = 2 ** 30


def load() -> str:
    return "{:.1f}".format(os.getloadavg()[0])


def timed_command(args: list[str], cwd: Path = ROOT) -> dict:
    """Wall and CPU seconds (user + system of the child) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, load_before = time.perf_counter(), load()
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    chosen = next((line for line in result.stdout.splitlines() if line.startswith("--plan auto chose")), "")
    return {"wall": wall, "cpu": cpu, "load": f"{load_before}/{load()}", "ok": result.returncode == 0,
            "chosen": chosen.removeprefix("--plan auto chose ").split(":")[0],
            "error": result.stderr.strip().splitlines()[-1] if result.returncode else ""}


def gpt_copy(folder: Path, layers: int) -> Path:
    path = folder / f"gpt_{layers}.py"
    path.write_text((ROOT / "fixtures" / "gpt.py").read_text().replace("n_layer: int = 4", f"n_layer: int = {layers}"))
    return path


def commands(folder: Path) -> list[tuple[str, list[str]]]:
    auto = ["--plan", "auto"]
    return [
        ("Llama-2 7B shape, 8 H100", ["benchmarks/llama_7b.py", *auto, "--devices", "8", "--cluster", "h100-node",
                                      "--memory-budget", "80GB"]),
        ("Llama-2 7B shape, 64 H100", ["benchmarks/llama_7b.py", *auto, "--devices", "64", "--cluster", "h100-node",
                                       "--memory-budget", "80GB"]),
        ("Llama-2 7B shape, 512 H100", ["benchmarks/llama_7b.py", *auto, "--devices", "512", "--cluster",
                                        "h100-node", "--memory-budget", "80GB"]),
        ("GPT-3 175B shape, 1536 A100 (bf16)", ["benchmarks/gpt3_175b.py", *auto, "--devices", "1536", "--cluster",
                                                "a100-node", "--precision", "bf16", "--memory-budget", "80GB"]),
        ("GPT fixture, 96 layers, 8 devices", [str(gpt_copy(folder, 96)), *auto, "--devices", "8"]),
        ("fixtures/complex_rotary.py (defaults)", ["fixtures/complex_rotary.py"]),
        ("fixtures/hf_llama.py (defaults)", ["fixtures/hf_llama.py"]),
    ]


FLOORS = [("python + torch (what a model without transformers imports; the fake trace no longer imports "
           "torch._dynamo)", "import torch"),
          ("... + transformers' Llama (what the Llama entries import; it imports torch._dynamo itself)",
           "import torch; from transformers import LlamaForCausalLM")]


def part1(folder: Path, before: Path | None) -> list[str]:
    lines = ["## 1. `plan` end to end", "",
             "One fresh process per command (`python -m nnscaler_cst plan ...`), run once; CPU is user + system "
             "time of the process, wall includes waiting for the shared cores. Load: the 1-minute load "
             "average before/after (2 cores).", "",
             "| command | wall s | CPU s | load | chosen |", "|---|---|---|---|---|"]
    rows = []
    for label, args in commands(folder):
        got = timed_command([sys.executable, "-m", "nnscaler_cst", "plan", *args])
        rows.append((label, args, got))
        print(label, got, flush=True)
        lines.append(f"| {label} | {got['wall']:.1f} | {got['cpu']:.1f} | {got['load']} | "
                     f"{got['chosen'] or ('default plan' if got['ok'] else 'failed: ' + got['error'][:80])} |")
    lines += ["", "Imports alone, the floor under every command above (same conditions):", "",
              "| imports | wall s | CPU s | load |", "|---|---|---|---|"]
    for label, code in FLOORS:
        got = timed_command([sys.executable, "-c", code])
        print(label, got, flush=True)
        lines.append(f"| {label} | {got['wall']:.1f} | {got['cpu']:.1f} | {got['load']} |")
    lines += ["", "Commands, from the repository root:", "", "```"]
    lines += [f"nnscaler-rewrite plan {' '.join(args)}".replace(str(folder), "/tmp/gpt_96") for _, args, _ in rows]
    lines += ["```", "(`/tmp/gpt_96/gpt_96.py` is fixtures/gpt.py with `n_layer: int = 96`.)", ""]
    if before is not None:
        base = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=before, capture_output=True,
                              text=True).stdout.strip() or "unknown"
        lines += [f"The same commands at an older checkout (`--before`, {base}):", "",
                  "| command | wall s | CPU s | load | chosen |", "|---|---|---|---|---|"]
        for label, args, _ in rows:
            old_args = [a.replace(str(ROOT), str(before)) for a in args]
            got = timed_command([sys.executable, "-m", "nnscaler_cst", "plan", *old_args], cwd=before)
            print("before:", label, got, flush=True)
            result = got["chosen"] or ("default plan" if got["ok"] else "failed: " + got["error"][:80])
            lines.append(f"| {label} | {got['wall']:.1f} | {got['cpu']:.1f} | {got['load']} | {result} |")
        lines.append("")
    return lines


def part2(folder: Path) -> list[str]:
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import search_auto
    from nnscaler_cst.plan.cost import load_cluster
    lines = ["## 2. Where the time goes", "",
             "In one process per model: trace + graph once, then `search_auto` for each device count "
             "(CPU seconds; the first search also builds what every later one reuses).", "",
             "| model | traced ops | trace + graph CPU s | devices | search CPU s | configurations priced | "
             "chosen | est. step | peak memory per device |", "|---|---|---|---|---|---|---|---|---|"]
    cases = [("Llama-2 7B shape (h100-node, 80 GB)", ROOT / "benchmarks" / "llama_7b.py", "h100-node", None,
              [8, 64, 512]),
             ("GPT-3 175B shape (a100-node, bf16, 80 GB)", ROOT / "benchmarks" / "gpt3_175b.py", "a100-node", "bf16",
              [1536]),
             ("GPT fixture, 96 layers (cpu-gloo)", gpt_copy(folder, 96), "cpu-gloo", None, [8, 64])]
    for label, path, cluster_name, precision, device_counts in cases:
        start = time.process_time()
        graph = analyze(path).graph
        analysed = time.process_time() - start
        cluster = load_cluster(cluster_name).with_precision(precision)
        for devices in device_counts:
            start = time.process_time()
            choice = search_auto(graph, devices, cluster, [], 80e9 if cluster_name != "cpu-gloo" else None)
            searched = time.process_time() - start
            best = choice.best
            print(label, devices, searched, choice.config.describe(), flush=True)
            lines.append(f"| {label} | {len(graph.nodes)} | {analysed:.1f} | {devices} | {searched:.2f} | "
                         f"{choice.evaluated} | {choice.config.describe()} | {best.seconds * 1e3:.0f} ms | "
                         f"{best.memory / GIB:.1f} GiB |")
    return lines + [""]


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def part3(folder: Path, with_z3: bool) -> list[str]:
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan import search
    from nnscaler_cst.plan.tables import load_table
    megatron = load_table("megatron").for_axis("tp")
    lines = ["## 3. One tensor-parallel axis: constraint tables and the solver", "",
             "The GPT fixture, tp=2 on the cpu-gloo spec, `search_axis` alone (CPU s; elimination median of 3, "
             "z3 one run). Elimination: this version (exact minimum by variable elimination over the per-site "
             "choices, z3 checking the facts that are not pairs). z3: the same problem handed whole to z3's "
             "optimiser, as the search did before. Both find the same least cost in every row.", "",
             "| layers | traced ops | sites | elimination, megatron table | elimination, full space | "
             "full / table | z3, megatron table | z3, full space | full / table | same cost |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for layers in (12, 24, 48, 96):
        graph = analyze(gpt_copy(folder, layers)).graph
        search.search_axis(graph, "tp", 2, megatron)          # the per-graph caches, once
        fast_table = median_seconds(lambda: search.search_axis(graph, "tp", 2, megatron), 3)
        fast_full = median_seconds(lambda: search.search_axis(graph, "tp", 2, []), 3)
        costs = (search.search_axis(graph, "tp", 2, megatron).cost, search.search_axis(graph, "tp", 2, []).cost)
        row = f"| {layers} | {len(graph.nodes)} | {len(graph.sites)} | {fast_table:.3f} | {fast_full:.3f} | " \
              f"{fast_full / fast_table:.1f}x |"
        if with_z3:
            eliminated = search._eliminated
            search._eliminated = lambda *args, **kwargs: None   # every solve goes to z3's optimiser
            try:
                slow_table = median_seconds(lambda: search.search_axis(graph, "tp", 2, megatron), 1)
                slow_full = median_seconds(lambda: search.search_axis(graph, "tp", 2, []), 1)
                slow_costs = (search.search_axis(graph, "tp", 2, megatron).cost,
                              search.search_axis(graph, "tp", 2, []).cost)
            finally:
                search._eliminated = eliminated
            same = "yes" if all(abs(a - b) < 1e-12 for a, b in zip(costs, slow_costs)) else "NO"
            row += f" {slow_table:.2f} | {slow_full:.2f} | {slow_full / slow_table:.1f}x | {same} |"
        else:
            row += " - | - | - | - |"
        print(row, flush=True)
        lines.append(row)
    if with_z3:
        lines += ["", *fixtures_against_z3()]
    return lines + [""]


# Split searches that z3's optimiser takes minutes on (from tests/test_auto_search.py, where only
# the quick case stays): the fixture, the constraint table (None: the full space), tp, dp.
Z3_CASES = [("gpt", None, 2, 2), ("gpt", "sequence_parallel", 2, 1), ("hf_llama", None, 2, 2),
            ("complex_rotary", None, 2, 1)]


def fixtures_against_z3() -> list[str]:
    """Elimination against z3's optimiser on other fixtures: the same least cost and memory."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan import search
    from nnscaler_cst.materialize.conversions import fused_collectives
    from nnscaler_cst.plan.cost import load_cluster
    from nnscaler_cst.plan.tables import load_table
    lines = ["Other fixtures, one `search_axis` each (CPU s, one run): elimination against z3's optimiser.", "",
             "| fixture | table | tp | dp | elimination | z3 | same cost and memory |", "|---|---|---|---|---|---|---|"]
    for fixture, table, tp, dp in Z3_CASES:
        graph = analyze(ROOT / "fixtures" / f"{fixture}.py").graph
        constraints = load_table(table).for_axis("tp") if table else []
        device = load_cluster("cpu-gloo").axis(1, tp)
        eliminated = search._eliminated
        with fused_collectives(table == "sequence_parallel"):
            start = time.process_time()
            fast = search.search_axis(graph, "tp", tp, constraints, device, data_parallel=dp)
            fast_s = time.process_time() - start
            search._eliminated = lambda *args, **kwargs: None
            try:
                start = time.process_time()
                slow = search.search_axis(graph, "tp", tp, constraints, device, data_parallel=dp)
                slow_s = time.process_time() - start
            finally:
                search._eliminated = eliminated
        same = abs(fast.cost - slow.cost) <= 1e-12 * max(1.0, abs(slow.cost)) and fast.memory == slow.memory
        row = f"| {fixture} | {table or 'full space'} | {tp} | {dp} | {fast_s:.2f} | {slow_s:.1f} | " \
              f"{'yes' if same else 'NO'} |"
        print(row, flush=True)
        lines.append(row)
    return lines


def part4() -> list[str]:
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config, estimate_config, search_auto
    from nnscaler_cst.plan.cost import load_cluster
    graph = analyze(ROOT / "benchmarks" / "gpt3_175b.py").graph
    cluster = load_cluster("a100-node").with_precision("bf16")
    choice = search_auto(graph, 1536, cluster, [], 80e9)
    rows = [("`--plan auto` (this search)", choice.best, "its own split")]
    # Narayanan et al., SC'21, Table 1: t=8, p=16, d=12, batch 1536, micro-batch 1 (128 per pipeline),
    # activation recompute; the 2021 runs had no sequence parallelism (Korthikanti et al. 2022)
    megatron = Config(tp=8, dp=12, pp=16, micro_batches=128, zero=0, recompute=True)
    for table, note in (("megatron", "Megatron's split (rules/plans/megatron.toml)"),
                        (None, "the search's own split at tp=8")):
        rows.append((f"Megatron-LM: TP 8 x PP 16 x DP 12, 128 micro-batches of 1, recompute",
                     estimate_config(graph, megatron, cluster, [], 80e9, table=table), note))
    sp = Config(tp=8, dp=12, pp=16, micro_batches=128, zero=0, recompute=True, sequence_parallel=True)
    rows.append(("the same with sequence parallelism",
                 estimate_config(graph, sp, cluster, [], 80e9, table="sequence_parallel"), "rules/plans/sequence_parallel.toml"))
    lines = ["## 4. GPT-3 175B on 1536 A100s against Megatron-LM's configuration", "",
             "`benchmarks/gpt3_175b.py` (96 layers, hidden 12288, 96 heads, sequence 2048, global batch 1536, "
             "vocabulary padded to 51200), a100-node with bf16 matmuls, 80 GB budget. Each row is priced by "
             "the same cost and memory model (plan/auto.py `estimate_config`).", "",
             "| configuration | tensor-parallel split | est. step s | peak memory per device | fits |",
             "|---|---|---|---|---|"]
    for label, estimate, note in rows:
        c = estimate.config
        label = label if "Megatron" in label or "same" in label else f"{label}: {c.describe()}"
        lines.append(f"| {label} | {note} | {estimate.seconds:.2f} | {estimate.memory / GIB:.1f} GiB | "
                     f"{'yes' if estimate.why_not is None else 'no'} |")
    best, published = rows[0][1].seconds, rows[1][1].seconds
    lines += ["", f"The search's plan is estimated at {best:.2f} s per step, Megatron-LM's configuration at "
              f"{published:.2f} s under the same model ({published / best:.2f}x).", ""]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="an older checkout to time part 1 on as well")
    parser.add_argument("--no-z3", action="store_true", help="skip z3's optimiser in part 3 (minutes)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "BENCH_PLANNING.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lines = ["# Planning time", "",
                 f"Measured at {revision()} on this machine: 2 cores, no GPU, shared with other sessions' jobs "
                 "(the load averages are beside each figure). Reproduce with `python benchmarks/bench_planning.py "
                 "--before <checkout>`.", ""]
        lines += part1(folder, args.before)
        lines += part2(folder)
        # timed before part 3's z3 runs (minutes on one core), so that the machine can be used beside them
        later = part4() + bench_cpu_step.section()
        lines += part3(folder, not args.no_z3) + later
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
