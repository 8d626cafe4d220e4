#!/usr/bin/env python
"""Peak memory of the generated code against the planner's estimate and torch's engines, and the
step time of generated DP / ZeRO-3 against DDP / FSDP2, on 2 gloo ranks.

    python benchmarks/bench_memory.py [--modes dp,zero1,...] [--steps 2] [--rounds 3] [--out FILE]

The model: fixtures/gpt.py resized (MODEL below: 48 blocks, 384 wide, vocabulary 16384: 91 M
parameters), a short batch (2 x 64 tokens) so that a step takes seconds on this CPU; the
training state (parameters, gradients, AdamW) dominates, as it does in the runs ZeRO is for.

Memory, one pair of processes per mode (peak RSS is a per-process high-water mark): each rank
imports torch and sets up its process groups, then measures its baseline (VmRSS) after two steps of the
fixture at its own tiny size (the first use of torch's kernels maps ~170 MB of code and
workspaces, whatever the mode), resets the kernel's high-water mark (/proc/self/clear_refs, 5),
then builds its model from a seed,
its optimizer (AdamW) and runs `--steps` training steps; its peak is VmHWM minus the baseline.
The figure is the largest rank's (per stage for the pipeline). Every process runs with
MALLOC_MMAP_THRESHOLD_=65536, so that a freed tensor goes back to the kernel at once (glibc's
default threshold grows with the frees and keeps freed blocks in its heap), for every mode
alike. The estimate is the planner's per-device memory for the same configuration
(plan/auto.py's estimate_config on the fake-tensor trace, cluster cpu-gloo), never fitted to
these figures.

Modes: the generated code under `--dp 2`, `--dp 2 --zero 1|2|3`, `--tp 2`,
`--pp 2 --micro-batches 2` (each stage), `--dp 2 --recompute`; on the same model with 512 tokens
(LONG: attention's scores and probabilities dominate, what co-shard is for) `--tp 2` and
`--plan coshard --tp 2` (each block's attention core in C pieces per device, the C the planner
chose by its memory estimate, `Plan.coshard_memory`, which is the figure compared); and torch's own
DistributedDataParallel (defaults: 25 MB buckets) and FSDP2 (`fully_shard` on every block, then
on the model) on the same model, weights and batches.

Step time (`--rounds`): one pair of processes holds generated DP and DDP, another generated
ZeRO-3 and FSDP2; each pair alternates its two variants in rounds (order rotating), 1 warm-up and
`--steps` timed steps each per round; a step's wall time is the max over ranks; medians. Losses
are compared so the timed variants are known to compute the same thing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from _common import launch_ranks, load_file, load_package, revision  # noqa: E402
from bench_tp_step import cli, fixture_config, machine, write_model_file  # noqa: E402

MODEL = dict(block_size=64, vocab_size=16384, n_layer=48, n_head=6, n_embd=384, batch=2)
# co-shard is for attention matrices that outweigh the rest: the same model on 512 tokens, where
# each block's (2, 6, 512, 512) scores and probabilities are most of what a step keeps
LONG = dict(MODEL, block_size=512)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# mode: (CLI arguments of the rewrite, the planner's configuration (None: the co-shard plan's own
# estimate, plan/coshard.py, which the planner chooses C by), the model: MODEL or LONG)
GENERATED = {
    "dp": ("--dp 2", dict(tp=1, dp=2), "short"),
    "zero1": ("--dp 2 --zero 1", dict(tp=1, dp=2, zero=1), "short"),
    "zero2": ("--dp 2 --zero 2", dict(tp=1, dp=2, zero=2), "short"),
    "zero3": ("--dp 2 --zero 3", dict(tp=1, dp=2, zero=3), "short"),
    "tp": ("--tp 2", dict(tp=2, dp=1), "short"),
    "pp": ("--pp 2 --micro-batches 2", dict(tp=1, dp=1, pp=2, micro_batches=2), "short"),
    "recompute": ("--dp 2 --recompute", dict(tp=1, dp=2, recompute=True), "short"),
    "tp_long": ("--tp 2", dict(tp=2, dp=1), "long"),
    "coshard_long": ("--plan coshard --tp 2", None, "long"),
}
TORCH = ("ddp", "fsdp2")
MODES = list(GENERATED) + list(TORCH)
PAIRS = (("dp", "ddp"), ("zero3", "fsdp2"))


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------

def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def build_variant(mode: str, model_file: Path, out_dir: Path | None, rank: int, lr: float = 1e-3):
    """(a function running one step on a full batch and returning its loss, the package's
    rank module or the entry file) for `mode`, built from seed 0."""
    import torch
    import torch.distributed as dist
    entry = load_file(model_file, f"entry_{mode}")
    torch.manual_seed(0)
    if mode in TORCH:
        model = entry.build().train()
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
                for block in blocks:
                    fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

        def step(batch):
            share = tuple(x.chunk(dist.get_world_size())[rank] for x in batch)
            loss = model(*share)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.detach().clone()
            dist.all_reduce(value)
            return value.item() / dist.get_world_size()
        return step, entry
    package, _, _ = load_package(out_dir)
    model = package.build(rank).train()
    optimizer = torch.optim.AdamW(package.optimizer_params(model), lr=lr)
    return (lambda batch: package.train_step(model, optimizer, batch)), package.rank_module(rank)


def setup_ranks(out_dirs: list[Path]):
    """Every generated package's mesh over one gloo world (the first setup starts it)."""
    import torch
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for out_dir in out_dirs:
        package, _, comm = load_package(out_dir)
        comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo")
    if not out_dirs:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def warm_up(tiny_file: Path) -> None:
    """Two training steps of the fixture at its own tiny size, in this process alone: the first
    use of torch's kernels maps ~170 MB of library code and workspaces into the process, a cost
    of any first step, not of the mode measured after it."""
    import torch
    tiny = load_file(tiny_file, "entry_tiny")
    torch.manual_seed(0)
    model = tiny.build()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(*tiny.example_inputs()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def rank_memory(mode: str, model_file: Path, out_dir: Path | None, steps: int, result: Path) -> None:
    import gc
    import torch
    import torch.distributed as dist
    rank, world = setup_ranks([out_dir] if out_dir else [])
    warm_up(model_file.parent / "gpt_tiny.py")
    gc.collect()
    baseline = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")       # VmHWM := VmRSS from here on
    step, module = build_variant(mode, model_file, out_dir, rank)
    losses = []
    for k in range(steps):
        torch.manual_seed(k)
        losses.append(step(module.example_inputs()))
    peak = status_kb("VmHWM") - baseline
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "peak_mb": peak / 1024, "baseline_mb": baseline / 1024})
    if rank == 0:
        result.write_text(json.dumps({"ranks": everyone, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def rank_timing(pair: str, model_file: Path, out_dir: Path, steps: int, rounds: int, result: Path) -> None:
    import torch
    import torch.distributed as dist
    rank, world = setup_ranks([out_dir])
    names = pair.split(",")
    steppers = {n: build_variant(n, model_file, out_dir if n in GENERATED else None, rank) for n in names}
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for rnd in range(rounds):
        for name in names[rnd % 2:] + names[:rnd % 2]:
            step, module = steppers[name]
            for i in range(1 + steps):
                torch.manual_seed(len(losses[name]))
                batch = module.example_inputs()
                dist.barrier()
                t0 = time.perf_counter()
                losses[name].append(step(batch))
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i:
                    times[name].append(dt.item())
    if rank == 0:
        result.write_text(json.dumps({"times": times, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def rewrite(model_file: Path, out_dir: Path, args: str) -> None:
    proc = subprocess.run([*cli(), str(model_file), *args.split(), "-o", str(out_dir)], capture_output=True,
                          text=True, cwd=model_file.parent)
    if proc.returncode != 0:
        raise SystemExit(f"bench: rewrite {args} failed:\n{proc.stdout}\n{proc.stderr}")


def estimates(model_files: dict[str, Path], modes: list[str]) -> dict:
    """The planner's per-stage memory (bytes) for each generated mode."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config, estimate_config
    from nnscaler_cst.plan.cost import load_cluster
    from nnscaler_cst.rewrite import PlanRequest, build_plan
    cluster = load_cluster("cpu-gloo")
    analyses, out = {}, {}
    for m in modes:
        if m not in GENERATED:
            continue
        args, config, model = GENERATED[m]
        if model not in analyses:
            analyses[model] = analyze(model_files[model])
        if config is None:      # co-shard: the memory the plan chose C by
            plan, _ = build_plan(analyses[model], PlanRequest(plan="coshard", tp=int(args.split()[-1])))
            out[m] = [plan.coshard_memory]
        else:
            out[m] = estimate_config(analyses[model].graph, Config(**config), cluster, [], float("inf")).stage_memory
    return out


def launch(args: list[str], label: str) -> None:
    os.environ.update(MALLOC)
    launch_ranks([sys.executable, str(Path(__file__).resolve()), *args], 2, 3600, label)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory":
        mode, model_file, out_dir, steps, result = sys.argv[2:7]
        return rank_memory(mode, Path(model_file), Path(out_dir) if out_dir != "-" else None, int(steps),
                           Path(result))
    if len(sys.argv) > 1 and sys.argv[1] == "_timing":
        pair, model_file, out_dir, steps, rounds, result = sys.argv[2:8]
        return rank_timing(pair, Path(model_file), Path(out_dir), int(steps), int(rounds), Path(result))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=2, help="training steps per memory run; timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds per pair (0: no timing)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--layers", type=int, default=MODEL["n_layer"], help="blocks (fewer: a quick check of the script)")
    a = p.parse_args()
    MODEL["n_layer"] = a.layers
    modes = a.modes.split(",")
    before = machine()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tmp = Path(tmp)
        LONG["n_layer"] = a.layers
        model_files = {"short": write_model_file(tmp / "gpt_mem.py", MODEL),
                       "long": write_model_file(tmp / "gpt_long.py", LONG)}
        model_file = model_files["short"]
        write_model_file(tmp / "gpt_tiny.py", fixture_config())
        entry = load_file(model_file, "entry_driver")
        params = sum(p.numel() for p in entry.build().parameters())
        outs = {}
        for m in modes:
            if m in GENERATED:
                outs[m] = tmp / f"out_{m}"
                rewrite(model_files[GENERATED[m][2]], outs[m], GENERATED[m][0])
        estimate = estimates(model_files, modes)
        measured, losses = {}, {}
        for m in modes:
            result = tmp / f"memory_{m}.json"
            mfile = model_files[GENERATED[m][2]] if m in GENERATED else model_file
            launch(["_memory", m, str(mfile), str(outs.get(m, "-")), str(a.steps), str(result)], m)
            run = json.loads(result.read_text())
            measured[m] = [r["peak_mb"] for r in sorted(run["ranks"], key=lambda r: r["rank"])]
            losses[m] = run["losses"]
            print(m, [f"{x:.0f}" for x in measured[m]], "MB; estimate",
                  [f"{x / 2**20:.0f}" for x in estimate.get(m, [])], flush=True)
        timing = {}
        for pair in PAIRS if a.rounds else ():
            if not all(n in modes for n in pair):
                continue
            result = tmp / f"timing_{pair[0]}.json"
            launch(["_timing", ",".join(pair), str(model_file), str(outs[pair[0]]), str(a.steps), str(a.rounds),
                    str(result)], ",".join(pair))
            timing[pair] = json.loads(result.read_text())
    print(json.dumps({"params": params, "measured_mb": measured, "estimate_mb":
                      {m: [x / 2**20 for x in v] for m, v in estimate.items()}}, indent=1))
    report(params, measured, estimate, losses, timing, a, before, machine())
    if a.json:
        Path(a.json).write_text(json.dumps({"params": params, "measured_mb": measured, "losses": losses,
                                            "estimate_bytes": estimate,
                                            "timing": {",".join(k): v for k, v in timing.items()}}, indent=1))


def report(params, measured, estimate, losses, timing, a, before, after) -> None:
    print(f"\nmachine: {before['cores']} cores ({before['cpu']}), torch {before['torch']}; 1-min load "
          f"{before['loadavg'][0]:.1f} before, {after['loadavg'][0]:.1f} after; revision {before['revision']}")
    print(f"model: fixtures/gpt.py at {MODEL}, {params / 1e6:.1f} M parameters; the *_long modes on "
          f"{LONG['block_size']} tokens; {a.steps} steps per run\n")
    print("| mode | measured peak, MB (rank 0, rank 1) | estimate, MB | measured / estimate | losses |")
    print("|---|---|---|---|---|")
    for m, peaks in measured.items():
        est = estimate.get(m)
        if est is None:
            row = f"| {m} | {peaks[0]:.0f}, {peaks[1]:.0f} | - | - |"
        elif len(est) > 1:       # pipeline: rank r holds stage r
            ratios = ", ".join(f"{p / (e / 2**20):.2f}" for p, e in zip(peaks, est))
            row = f"| {m} (per stage) | {peaks[0]:.0f}, {peaks[1]:.0f} | " \
                  f"{', '.join(f'{e / 2**20:.0f}' for e in est)} | {ratios} |"
        else:
            row = f"| {m} | {peaks[0]:.0f}, {peaks[1]:.0f} | {est[0] / 2**20:.0f} | {max(peaks) / (est[0] / 2**20):.2f} |"
        print(row + " " + ", ".join(f"{x:.4f}" for x in losses[m]) + " |")
    for pair, run in timing.items():
        med = {n: statistics.median(t) for n, t in run["times"].items()}
        dloss = max(abs(x - y) for x, y in zip(*run["losses"].values()))
        print(f"\nstep time, {pair[0]} vs {pair[1]} interleaved ({a.rounds} rounds x {a.steps} timed steps): "
              + ", ".join(f"{n} {med[n] * 1e3:.0f} ms" for n in pair)
              + f"; {pair[0]} / {pair[1]} = {med[pair[0]] / med[pair[1]]:.3f}; max |dloss| {dloss:.1e}")
        print("  every timed step (ms): " + "; ".join(f"{n}: " + ", ".join(f"{t * 1e3:.0f}" for t in run["times"][n])
                                                   for n in pair))


if __name__ == "__main__":
    main()
