#!/usr/bin/env python
"""Pipeline benchmarks of the generated 1F1B code, on gloo + CPU.

    python benchmarks/bench_pipeline.py [--pp 2,4] [--micro 2,4,8] [--layers 8] [--schedule 1f1b]
        [--rounds 5] [--warmup 1] [--steps 4] [--compare-micro 8] [--compare-rounds 12]
        [--compare-warmup 1] [--compare-steps 3] [--json out.json] [--keep DIR]

Everything is measured in one run; figures are ratios against a baseline of the same run.
``--schedule chimera`` (or any table) measures that schedule's bubble instead, against its own
formula when the table states one (part 2, the comparison with pipelining, is 1F1B's only).
``--schedule interlaced,1f1b`` (a comma list) runs both schedules' outputs in the same rank
processes, every (schedule, M) variant taking turns, and prints the first against 1F1B.
Interlaced: the GPT copy ties lm_head to wte, which the plan splits on the vocabulary over all
ranks; each rank's shares of the owners' steps (sEk / sGk: ``_comm.vocab_share``) are timed as
actions too. simulate() gives a share no length (the sharer only waits to join the owner's
step), so its bubble compares with the "own-steps" bubble (only the rank's own F and B busy);
the schedule bubble counts the shares busy. replay() knows no collective step: for interlaced
its column repeats simulate() with the measured F.

Model: a benchmark-local copy of fixtures/gpt.py with only the numbers changed (n_embd 256,
n_layer --layers, block_size 64, batch 16 x 64 tokens; vocab 128 and n_head 4 as in the
fixture), rewritten with the CLI for every (D, M):
``nnscaler-rewrite gpt_pipe.py --pp D --micro-batches M --schedule 1f1b -o gpt_pipe_ppD_mM``.
Every process runs one intra-op thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)): with
D = 2 each rank has one of the 2 cores, D = 4 runs 4 processes on 2 cores.

1. Bubble (role ``_bubble``: D processes per D, holding the outputs of every M at once; the
   M variants take turns, in rounds with a rotating order, so a drift in machine load hits
   them alike). Each rank imports the generated package as nnscaler_cst/verify/worker.py
   does (``import nnscaler_cst`` made to fail), builds its stages, loads its share of one
   single-device init and runs the package's train_step (module.SCHEDULE with isend/recv,
   tied-gradient all-reduce, AdamW, loss all-reduce). Nothing of the tool is patched; the
   driver times, in its own process:

   * each stage forward: the stage modules' ``forward`` is wrapped on the instance (a
     forward post-hook would not fire: on every stage but the last the forward ends with
     pp_handoff raising StageBoundary). train.py receives before the call and sends after
     it, so the interval is compute only;
   * each backward: ``torch.autograd.backward`` is wrapped (Tensor.backward calls it too);
     train.py receives the incoming gradients while evaluating the arguments, before the
     call, so the interval is compute only.

   Per step and rank, busy = the sum of those intervals (wall clock: perf_counter, i.e.
   CLOCK_MONOTONIC, one clock for all processes). Two bubbles:

   * schedule bubble: 1 - sum_r busy_r / (D * span), span = first action start to last
     action end over all ranks -- what nnscaler_cst.verify.simulate.bubble_fraction
     computes from simulated events, and what (D-1)/(D-1+M) predicts for 1F1B;
   * step bubble (the brief's definition): 1 - busy / step wall, per rank, averaged over
     ranks; the step also holds the tied-gradient all-reduce, AdamW and the loss all-reduce
     after the schedule, which no formula counts.

   Compared against (D-1)/(D-1+M); bubble_fraction(simulate(orders)) with the orders read
   back from the output's schedule.csv, at unit cost (F = 1, B = 2); the bubble the tool's
   cost model prints (``nnscaler-rewrite schedule``). To explain the gap: a replay of the
   same orders with the measured median F and B per stage and free communication (stage
   imbalance only), the one-way latency of one micro-batch's activation over the generated
   code's own p2p path (send_values / recv_values ping-pong, rank 0 <-> 1), simulate() with
   the measured F and that latency, and the CPU share inside the timed actions (thread CPU
   time / wall time: 1.0 when nothing else ran on the rank's core).

2. Step time (role ``_compare``, 2 processes): the generated pp=2 code against
   torch.distributed.pipelining.Schedule1F1B on the same stages: the same model copy, the
   same block split (read from the output's STAGE_BLOCKS), the same initial weights, the
   same micro-batches and batches. The pipelining stages are built by hand from the same
   modules: stage 0 = wte + wpe + drop + its blocks, stage 1 = its blocks + ln_f + lm_head,
   loss_fn = the model's cross entropy. Both steps include the tied wte/lm_head gradient
   all-reduce (the generated code does it in train.py; for pipelining the driver does it
   with the same _comm.sync_grads, since each stage holds one copy of the weight) and AdamW
   step + zero_grad. The variants take turns in rounds with a rotating order; a step is
   timed between a barrier and its end on every rank, its time is the max over ranks (CPU:
   process CPU time summed over ranks), the figure is the median over timed steps, and the
   median over rounds of the per-round ratio (the two blocks of a round run back to back,
   so a drift in machine load cancels in it). The losses of both are compared step by step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import join_ranks, launch_ranks, load_file, load_package, revision  # noqa: E402
FIXTURE = ROOT / "fixtures" / "gpt.py"

CONFIG_KEYS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
INPUTS_RE = re.compile(r"torch\.randint\(0, (\d+), \((\d+), (\d+)\)\)")


def bench_config(layers: int) -> dict:
    return dict(block_size=64, vocab_size=128, n_layer=layers, n_head=4, n_embd=256, batch=16)


# --------------------------------------------------------------------------
# Helpers (parent and ranks)
# --------------------------------------------------------------------------

def write_model_file(dst: Path, cfg: dict) -> Path:
    """A copy of fixtures/gpt.py with GPTConfig's defaults and example_inputs() resized
    (sequence length = block_size). Only the numbers change."""
    text = FIXTURE.read_text()
    for key in CONFIG_KEYS:
        text, n = re.subn(rf"^(\s+{key}: int = )\d+(\s*)$", rf"\g<1>{cfg[key]}\g<2>", text, flags=re.M)
        if n != 1:
            raise SystemExit(f"bench: cannot find GPTConfig.{key} in {FIXTURE}")
    text, n = INPUTS_RE.subn(f"torch.randint(0, {cfg['vocab_size']}, ({cfg['batch']}, {cfg['block_size']}))",
                             text)
    if n != 2:
        raise SystemExit(f"bench: expected two torch.randint(0, V, (B, T)) in {FIXTURE}, found {n}")
    dst.write_text(text)
    return dst


def cli() -> list[str]:
    exe = shutil.which("nnscaler-rewrite")
    return [exe] if exe else [sys.executable, "-m", "nnscaler_cst.cli"]


class ToolError(Exception):
    pass


def run_cli(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, COLUMNS="400")    # rich wraps long lines otherwise
    proc = subprocess.run([*cli(), *args], capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode == 2:                  # an error the tool reports on its input
        raise ToolError(" ".join((proc.stdout + proc.stderr).split()))
    if proc.returncode != 0:
        raise SystemExit(f"bench: nnscaler-rewrite {' '.join(args)} failed ({proc.returncode}):\n"
                         f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def launch(role: str, args: list[str], world: int, timeout: float = 3600.0) -> None:
    """Run ``this_script ROLE ARGS`` on ``world`` processes (see _common.launch_ranks)."""
    launch_ranks([sys.executable, str(Path(__file__).resolve()), role, *args], world, timeout, f"{role} ")


def machine() -> dict:
    import torch
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg": os.getloadavg(), "revision": revision()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------
# Role _bubble: one rank of the generated code, every schedule action timed
# --------------------------------------------------------------------------

def rank_bubble(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("out_dirs", nargs="+", help="one generated output per M, all for the same D")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant per round")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pings", type=int, default=30)
    p.add_argument("--act-shape", required=True, help="B,T,C of the full batch's activation")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sys.modules["nnscaler_cst"] = None      # the generated code must not need the tool

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    clock, cpu_clock = time.perf_counter, time.thread_time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = torch.load(Path(a.workdir) / "init.pt")
    intervals: list[tuple[str, float, float, float]] = []   # kind, start, end, thread CPU seconds

    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            t0, c0 = clock(), cpu_clock()
            try:
                return fn(*args, **kwargs)
            finally:
                intervals.append((kind, t0, clock(), cpu_clock() - c0))
        return wrapper

    variants = []
    for out_dir in a.out_dirs:
        package, train, comm = load_package(Path(out_dir))
        # the first setup initialises the process group, the others only build their groups
        comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo",
                   pp_replicas=package.rank_module(rank).PIPELINE_REPLICAS)
        module = package.rank_module(rank)
        torch.manual_seed(a.seed)
        stages = package.build(rank)
        stages.load_state_dict(package.shard_state_dict(init, rank))
        stages.train()
        for stage_module in stages:
            stage_module.forward = timed("F", stage_module.forward)   # on the instance: driver-side only
        if getattr(module, "VOCAB_CALLS", None):    # interlaced: time this rank's shares (sEk / sGk) too
            comm.vocab_share = (lambda share: lambda kind, *rest: timed(kind, share)(kind, *rest))(comm.vocab_share)
        variants.append({"name": Path(out_dir).name, "package": package, "train": train, "comm": comm,
                         "module": module, "stages": stages,
                         "optimizer": torch.optim.AdamW(stages.parameters(), lr=a.lr),
                         "actions": module.SCHEDULE.split(), "steps": [], "next": 0})
    torch.autograd.backward = timed("B", torch.autograd.backward)

    # one-way p2p latency of one micro-batch's activation over the generated code's own path
    # (send_values / recv_values: the P2POps train.py posts with batch_isend_irecv; the header
    # goes with the first ping only, as with the first micro-batch), rank 0 <-> rank 1 ping-pong
    B, T, C = (int(x) for x in a.act_shape.split(","))
    for v in variants:
        comm, M = v["comm"], v["package"].MICRO_BATCHES
        x = torch.randn(B // M, T, C)
        rtts, raw = [], []
        dist.barrier()
        if rank < 2:
            for i in range(a.pings):
                t0 = clock()
                if rank == 0:
                    for request in comm.send_values((x,), 1, 1, i):
                        request.wait()
                    comm.recv_values(1, 1, i)
                else:
                    comm.recv_values(0, 1, i)
                    for request in comm.send_values((x,), 0, 1, i):
                        request.wait()
                rtts.append(clock() - t0)
            y = torch.empty_like(x)
            for i in range(a.pings):             # the same tensor alone: one isend, one recv
                t0 = clock()
                if rank == 0:
                    dist.isend(x, 1, tag=7).wait()
                    dist.recv(y, 1, tag=7)
                else:
                    dist.recv(y, 0, tag=7)
                    dist.isend(x, 0, tag=7).wait()
                raw.append(clock() - t0)
        v["one_way_s"] = statistics.median(rtts[a.pings // 5:]) / 2 if rtts else None
        v["one_way_raw_s"] = statistics.median(raw[a.pings // 5:]) / 2 if raw else None
        dist.barrier()

    for rnd in range(a.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for v in order:
            for i in range(a.warmup + a.steps):
                k = v["next"]
                v["next"] += 1
                batch = v["train"].batch_for(v["module"], k, a.seed, torch.device("cpu"))
                dist.barrier()
                intervals.clear()
                t0, c0 = clock(), time.process_time()
                loss = v["package"].train_step(v["stages"], v["optimizer"], batch)
                t1, c1 = clock(), time.process_time()
                acts = v["actions"]
                if len(intervals) != len(acts) or any(kind not in act for (kind, *_), act in zip(intervals, acts)):
                    raise SystemExit(f"rank {rank}: timed {[i[0] for i in intervals]} but SCHEDULE is {acts}")
                v["steps"].append({"timed": i >= a.warmup, "round": rnd, "start": t0, "end": t1,
                                   "process_cpu": c1 - c0, "loss": loss, "loadavg": os.getloadavg()[0],
                                   "actions": [[act, s, e, c] for act, (_, s, e, c) in zip(acts, intervals)]})
    for v in variants:
        module = v["module"]
        record = {"rank": rank, "stages": list(module.PIPELINE_STAGES),
                  "micro_batches": v["package"].MICRO_BATCHES, "one_way_s": v["one_way_s"],
                  "vocab_stages": sorted(getattr(module, "VOCAB_CALLS", None) or {}),
                  "vocab_calls": {str(k): n for k, n in (getattr(module, "VOCAB_CALLS", None) or {}).items()},
                  "vocab_deferred": {str(k): c for k, c in (getattr(module, "VOCAB_DEFERRED", None) or {}).items()},
                  "one_way_raw_s": v["one_way_raw_s"],
                  "stage_blocks": {str(s): list(module.STAGE_BLOCKS[s]) for s in module.PIPELINE_STAGES},
                  "steps": v["steps"]}
        (Path(a.workdir) / f"{v['name']}_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    variants[0]["comm"].teardown()


# --------------------------------------------------------------------------
# Role _compare: generated 1F1B against torch.distributed.pipelining.Schedule1F1B
# --------------------------------------------------------------------------

def pipelining_stage_module(full, stage: int, stages: int, blocks: tuple[int, int]):
    """The hand-built stage for torch.distributed.pipelining, sharing the modules of `full`
    (the single-device model): what the generated code's stage runs, as its own nn.Module."""
    import torch
    import torch.nn as nn

    class FirstStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.drop = full.transformer.wte, full.transformer.wpe, full.transformer.drop
            self.h = nn.ModuleList(list(full.transformer.h)[blocks[0]:blocks[1]])

        def forward(self, idx):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            return x

    class MiddleStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(list(full.transformer.h)[blocks[0]:blocks[1]])

        def forward(self, x):
            for block in self.h:
                x = block(x)
            return x

    class LastStage(MiddleStage):
        def __init__(self):
            super().__init__()
            self.ln_f, self.lm_head = full.transformer.ln_f, full.lm_head

        def forward(self, x):
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    if stage == 0:
        return FirstStage()
    return LastStage() if stage == stages - 1 else MiddleStage()


def rank_compare(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_file")
    p.add_argument("out_dir")
    p.add_argument("workdir")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world, package, train, comm = join_ranks(Path(a.out_dir))
    if package.TP_SIZE * package.DP_SIZE != 1:
        raise SystemExit("compare: expects a pure pipeline output (tp = dp = 1)")
    module = package.rank_module(rank)
    init = torch.load(Path(a.workdir) / "init.pt")
    M = package.MICRO_BATCHES
    (stage,) = module.PIPELINE_STAGES
    n_stages = module.PIPELINE_STAGE_COUNT
    blocks = tuple(module.STAGE_BLOCKS[stage])

    # generated: exactly what verify/worker.py does
    torch.manual_seed(a.seed)
    gen_stages = package.build(rank)
    gen_stages.load_state_dict(package.shard_state_dict(init, rank))
    gen_stages.train()
    gen_opt = torch.optim.AdamW(gen_stages.parameters(), lr=a.lr)

    # torch.distributed.pipelining on the same split
    entry = load_file(Path(a.model_file), "bench_entry")
    torch.manual_seed(a.seed)
    full = entry.build()
    full.load_state_dict(init)
    sub = pipelining_stage_module(full, stage, n_stages, blocks)
    sub.train()

    def loss_fn(logits, targets):       # the model's own loss line
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    pstage = PipelineStage(sub, stage_index=stage, num_stages=n_stages, device=torch.device("cpu"))
    schedule = Schedule1F1B(pstage, n_microbatches=M, loss_fn=loss_fn)
    pipe_opt = torch.optim.AdamW(sub.parameters(), lr=a.lr)
    tied = [sub.wte.weight] if stage == 0 else [sub.lm_head.weight] if stage == n_stages - 1 else []
    ends = comm.PP_ENDS

    def generated_step(batch):
        return package.train_step(gen_stages, gen_opt, batch)

    def pipelining_step(batch):
        idx, targets = batch
        losses = []
        if stage == 0:
            schedule.step(idx)
        elif stage == n_stages - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        if tied:    # the tied wte / lm_head weight lives on the first and the last stage: sum
            comm.sync_grads(tied, ends, average=False)
        pipe_opt.step()
        pipe_opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else float("nan")

    steppers = {"generated": generated_step, "pipelining": pipelining_step}
    names = list(steppers)
    times = {n: [] for n in names}          # wall seconds per timed step, max over ranks
    cpu = {n: [] for n in names}            # process CPU seconds per timed step, summed over ranks
    losses = {n: [] for n in names}
    next_step = {n: 0 for n in names}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            local, local_cpu = [], []
            for i in range(a.warmup + a.steps):
                s = next_step[name]
                next_step[name] += 1
                batch = train.batch_for(module, s, a.seed, torch.device("cpu"))
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = steppers[name](batch)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                losses[name].append(loss)
                if i >= a.warmup:
                    local.append(dt)
                    local_cpu.append(dc)
            dist.barrier()
            t = torch.tensor(local, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] += t.tolist()
            c = torch.tensor(local_cpu, dtype=torch.float64)
            dist.all_reduce(c)
            cpu[name] += c.tolist()
    # the last stage holds the pipelining losses: hand them to rank 0
    last_losses = torch.tensor(losses["pipelining"], dtype=torch.float64)
    dist.broadcast(last_losses, src=world - 1)
    losses["pipelining"] = last_losses.tolist()
    if rank == 0:
        result = {"times": times, "cpu": cpu, "losses": losses, "micro_batches": M, "stage_blocks": list(blocks)}
        (Path(a.workdir) / "compare.json").write_text(json.dumps(result))
    dist.barrier()
    comm.teardown()


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def read_orders(out_dir: Path):
    from nnscaler_cst.plan.schedules import Action
    orders = []
    for line in (out_dir / "schedule.csv").read_text().split():
        row = []
        for text in line.split(","):
            kind = next(k for k in "FBEG" if k in text)
            stage, micro = (int(x) for x in text.split(kind))
            row.append(Action(kind, stage, micro))
        orders.append(row)
    return orders


def replay(orders, forward: list[float], backward: list[float], place=None) -> float:
    """The bubble the orders give with these per-stage forward and backward seconds and free,
    instant communication: simulate()'s walk (a forward waits for the previous stage's forward
    of its micro-batch, a backward for its own forward and the next stage's backward), but
    with the measured backward time instead of simulate()'s B = 2F. `place`: the schedule's
    Placement (default: one pipeline of all the stages)."""
    stages = len(forward)
    first = (lambda s: place.first(s)) if place else (lambda s: s == 0)
    last = (lambda s: place.last(s)) if place else (lambda s: s == stages - 1)
    done, clock, pos, busy = {}, [0.0] * len(orders), [0] * len(orders), 0.0
    while any(pos[r] < len(orders[r]) for r in range(len(orders))):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                act = order[pos[r]]
                needs = [("F", act.stage - 1, act.micro)] if act.kind == "F" and not first(act.stage) else []
                if act.kind == "B":
                    needs.append(("F", act.stage, act.micro))
                    if not last(act.stage):
                        needs.append(("B", act.stage + 1, act.micro))
                if any(n not in done for n in needs):
                    break
                length = (forward if act.kind == "F" else backward)[act.stage]
                done[(act.kind, act.stage, act.micro)] = clock[r] = max([clock[r]] + [done[n] for n in needs]) + length
                busy += length
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("replay: the orders deadlock")
    return 1.0 - busy / (len(orders) * max(clock))


def bubble_figures(records: list[dict], D: int) -> dict:
    """Per timed step: step bubble (mean over ranks of 1 - busy/step wall), schedule bubble
    (1 - total busy / (D * span of all actions)); medians over steps. Plus per-stage median
    forward / backward seconds, and the CPU share of the actions (thread CPU time / wall time
    inside them: 1.0 when nothing else ran on the rank's core)."""
    n = len(records[0]["steps"])
    step_b, sched_b, own_b, shares, walls, tails, loads, rounds = [], [], [], [], [], [], [], []
    per_stage = {}
    for k in range(n):
        if not records[0]["steps"][k]["timed"]:
            continue
        steps = [rec["steps"][k] for rec in records]
        loads.append(steps[0]["loadavg"])
        busy = [sum(e - s for _, s, e, _ in st["actions"]) for st in steps]
        own = [sum(e - s for act, s, e, _ in st["actions"] if "E" not in act and "G" not in act) for st in steps]
        busy_cpu = [sum(c for *_, c in st["actions"]) for st in steps]
        wall = [st["end"] - st["start"] for st in steps]
        first = min(st["actions"][0][1] for st in steps)
        last = max(st["actions"][-1][2] for st in steps)
        span = last - first
        step_b.append(statistics.mean(1 - b / w for b, w in zip(busy, wall)))
        sched_b.append(1 - sum(busy) / (D * span))
        own_b.append(1 - sum(own) / (D * span))
        shares.append(sum(busy_cpu) / sum(busy))
        walls.append(max(wall))
        rounds.append(steps[0]["round"])
        tails.append(statistics.mean((st["end"] - st["actions"][-1][2]) / (st["end"] - st["start"]) for st in steps))
        for st in steps:
            for act, s, e, c in st["actions"]:
                kind = next(k for k in "FBEG" if k in act)
                stage = int(act.split(kind)[0])
                per_stage.setdefault((stage, kind), []).append(e - s)
                per_stage.setdefault((stage, kind + "cpu"), []).append(c)
    med = statistics.median
    count = 1 + max(s for s, k in per_stage if k in "FB")        # D stages, or more (interleaving, Chimera)
    stage_f = [med(per_stage[(s, "F")]) for s in range(count)]
    stage_b = [med(per_stage[(s, "B")]) for s in range(count)]
    stage_f_cpu = [med(per_stage[(s, "Fcpu")]) for s in range(count)]
    stage_b_cpu = [med(per_stage[(s, "Bcpu")]) for s in range(count)]
    losses = [rec["steps"][k]["loss"] for k in range(n) for rec in records[:1]]
    share_s = {f"{s}{k}": med(t) for (s, k), t in per_stage.items() if k in "EG"}
    return {"step_bubble": med(step_b), "schedule_bubble": med(sched_b), "own_bubble": med(own_b),
            "share_s": share_s, "vocab_stages": records[0].get("vocab_stages", []),
            "cpu_share": med(shares), "loadavg": med(loads), "one_way_s": records[0]["one_way_s"],
            "step_wall_s": med(walls), "tail_fraction": med(tails), "step_walls": walls, "step_rounds": rounds,
            "stage_forward_s": stage_f, "stage_backward_s": stage_b,
            "stage_forward_cpu_s": stage_f_cpu, "stage_backward_cpu_s": stage_b_cpu,
            "one_way_raw_s": records[0]["one_way_raw_s"],
            "step_bubbles": step_b, "schedule_bubbles": sched_b, "losses": losses,
            "stage_blocks": {s: b for rec in records for s, b in rec["stage_blocks"].items()}}


def paired_ratios(f: dict, g: dict) -> list[float]:
    """Per round, f's median step over g's (their blocks of a round ran in the same processes,
    close in time, so a drift in machine load mostly cancels)."""
    def by_round(fig):
        out = {}
        for r, w in zip(fig["step_rounds"], fig["step_walls"]):
            out.setdefault(r, []).append(w)
        return out
    a, b = by_round(f), by_round(g)
    return [statistics.median(a[r]) / statistics.median(b[r]) for r in sorted(a) if r in b]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_bubble":
        return rank_bubble(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_compare":
        return rank_compare(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", default="2,4", help="pipeline sizes D for the bubble part")
    p.add_argument("--schedule", default="1f1b",
                   help="the schedule table(s) of the bubble part (1f1b, chimera, interlaced, ...); a comma list "
                        "(interlaced,1f1b) runs them in the same processes, taking turns with the M variants")
    p.add_argument("--micro", default="2,4,8", help="micro-batch counts M for the bubble part")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="bubble part: rounds (the M variants take turns)")
    p.add_argument("--warmup", type=int, default=1, help="bubble part: untimed steps per M per round")
    p.add_argument("--steps", type=int, default=4, help="bubble part: timed steps per M per round")
    p.add_argument("--compare-micro", type=int, default=8, help="M for the pipelining comparison (0: skip)")
    p.add_argument("--compare-rounds", type=int, default=12)
    p.add_argument("--compare-warmup", type=int, default=1)
    p.add_argument("--compare-steps", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep", help="keep the model copy, outputs and raw timings in this folder")
    a = p.parse_args()

    import torch
    from nnscaler_cst.plan.schedules import VocabSteps, load_schedule, placement
    from nnscaler_cst.verify.simulate import bubble_fraction, simulate

    names = [x for x in a.schedule.split(",") if x]
    tables = {name: load_schedule(name) for name in names}
    if "1f1b" not in names and a.compare_micro:
        p.error("the pipelining comparison is of 1F1B: with another --schedule pass --compare-micro 0")

    def out_name(S, D, M):
        return f"gpt_pipe_pp{D}_m{M}" if len(names) == 1 else f"gpt_pipe_{S}_pp{D}_m{M}"

    pps = [int(x) for x in a.pp.split(",") if x]
    micros = [int(x) for x in a.micro.split(",") if x]
    cfg = bench_config(a.layers)
    before = machine()
    tmp = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    tmp.mkdir(parents=True, exist_ok=True)
    out = {"machine_before": before, "config": cfg, "bubble": [], "compare": None,
           "warmup": a.warmup, "steps": a.steps}
    try:
        model_file = write_model_file(tmp / "gpt_pipe.py", cfg)
        entry = load_file(model_file, "bench_entry_driver")
        torch.manual_seed(0)
        model = entry.build()
        out["n_params"] = sum(p.numel() for p in model.parameters())
        torch.save(model.state_dict(), tmp / "init.pt")
        outputs = {}
        configs = sorted({(S, D, M) for S in names for D in pps for M in micros} |
                         ({("1f1b", 2, a.compare_micro)} if a.compare_micro else set()))
        for S, D, M in configs:
            out_dir = tmp / out_name(S, D, M)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            try:
                run_cli([str(model_file), "--pp", str(D), "--micro-batches", str(M), "--schedule",
                         S, "-o", str(out_dir)], tmp)
                outputs[(S, D, M)] = out_dir
            except ToolError as error:
                outputs[(S, D, M)] = None
                out["bubble"].append({"schedule": S, "D": D, "M": M, "tool_error": str(error)})
                print(f"{S} D={D} M={M}: the rewrite exits 2: {error}", flush=True)
        print(f"machine: {before['cores']} cores ({before['cpu']}), no GPU, torch {before['torch']}, "
              f"1-min loadavg {before['loadavg'][0]:.2f}, revision {before['revision']}")
        print(f"model: fixtures/gpt.py resized to {cfg} ({out['n_params'] / 1e6:.2f} M params)\n")

        for D in pps:
            ms = [(S, M) for M in micros for S in names if outputs.get((S, D, M))]
            if not ms:
                continue
            workdir = tmp / f"bubble_pp{D}"
            workdir.mkdir(exist_ok=True)
            shutil.copy(tmp / "init.pt", workdir / "init.pt")
            t0 = time.perf_counter()
            launch("_bubble", [str(workdir), *[str(outputs[(S, D, M)]) for S, M in ms], "--warmup", str(a.warmup),
                               "--steps", str(a.steps), "--rounds", str(a.rounds),
                               "--act-shape", f"{cfg['batch']},{cfg['block_size']},{cfg['n_embd']}"], world=D)
            took = time.perf_counter() - t0
            for S, M in ms:
                out_dir, table = outputs[(S, D, M)], tables[S]
                text = run_cli(["schedule", str(model_file), "--pp", str(D), "--micro-batches", str(M),
                                "--schedule", S], tmp)
                m = re.search(r"bubble ([0-9.]+)% \(cost model\)", text)
                records = [json.loads((workdir / f"{out_dir.name}_rank{r}.json").read_text()) for r in range(D)]
                fig = bubble_figures(records, D)
                orders = read_orders(out_dir)
                F = fig["stage_forward_s"]
                place = placement(table, D)
                own = table.formula(D, M)
                fig["formula"] = own[1] if own else (D - 1) / (D - 1 + M)
                fig["formula_1f1b"] = (D - 1) / (D - 1 + M)
                n = len(place.ranks)
                shared = fig["vocab_stages"]    # interlaced: each vocabulary call a step of every rank
                calls, later = records[0].get("vocab_calls", {}), records[0].get("vocab_deferred", {})
                vocab = {int(s): VocabSteps((0.0,) * c, deferred=tuple(c - 1 - i in later.get(s, ()) for i in range(c)))
                         for s, c in calls.items()}
                fig["sim_unit"] = bubble_fraction(simulate(orders, n, placement=place, vocab=vocab), D)
                fig["sim_measured_f"] = bubble_fraction(simulate(orders, n, forward_seconds=F, placement=place,
                                                                 vocab=vocab), D)
                fig["sim_measured_f_latency"] = bubble_fraction(
                    simulate(orders, n, forward_seconds=F, latency=fig["one_way_s"], placement=place,
                             vocab=vocab), D)
                # replay() knows no collective step: for interlaced, simulate() with the measured F stands in
                fig["replay_measured_fb"] = fig["sim_measured_f"] if shared else \
                    replay(orders, F, fig["stage_backward_s"], place)
                fig["tool_cost_model"] = float(m.group(1)) / 100 if m else float("nan")
                fig.update(schedule=S, D=D, M=M, run_seconds=took, oversubscribed=D > (os.cpu_count() or 1))
                out["bubble"].append(fig)
                print(f"{S} D={D} M={M}: schedule bubble {fig['schedule_bubble']:.3f}, step bubble "
                      f"{fig['step_bubble']:.3f}, formula {fig['formula']:.3f}, simulated {fig['sim_unit']:.3f}, "
                      f"replay {fig['replay_measured_fb']:.3f}; step {fig['step_wall_s'] * 1e3:.0f} ms, "
                      f"one-way p2p {fig['one_way_s'] * 1e3:.2f} ms, CPU share {fig['cpu_share']:.2f}", flush=True)

        if a.compare_micro:
            workdir = tmp / "compare"
            workdir.mkdir(exist_ok=True)
            shutil.copy(tmp / "init.pt", workdir / "init.pt")
            launch("_compare", [str(model_file), str(outputs[("1f1b", 2, a.compare_micro)]), str(workdir),
                                "--warmup", str(a.compare_warmup), "--steps", str(a.compare_steps),
                                "--rounds", str(a.compare_rounds)], world=2)
            out["compare"] = json.loads((workdir / "compare.json").read_text())
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    out["machine_after"] = machine()
    out["bubble"].sort(key=lambda f: (f["D"], f["M"], names.index(f["schedule"])))
    report(out, a)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


def report(out: dict, a) -> None:
    after = out["machine_after"]
    print(f"\n1-min loadavg after: {after['loadavg'][0]:.2f}\n")
    if out["bubble"]:
        print(f"## 1. {a.schedule.replace(',', ' and ')} bubble of the generated code on gloo ({a.rounds} rounds x ({a.warmup} warm-up + "
              f"{a.steps} timed) steps per (D, M), the M variants taking turns; medians over the "
              f"{a.rounds * a.steps} timed steps)\n")
        print("| schedule | D | M | blocks per stage | step ms | step / step at the smallest M | measured schedule bubble "
              "| measured step bubble | formula (the schedule's own; 1F1B: (D-1)/(D-1+M)) | simulate(), unit cost | tool cost model (`schedule`) "
              "| measured schedule bubble / formula |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = {}
        for f in out["bubble"]:
            if "tool_error" not in f:
                base.setdefault((f["schedule"], f["D"]), f["step_wall_s"])
        for f in out["bubble"]:
            if "tool_error" in f:
                print(f"| {f['schedule']} | {f['D']} | {f['M']} | | | | the rewrite exits 2: {f['tool_error'][:120]}... | | "
                      f"{(f['D'] - 1) / (f['D'] - 1 + f['M']):.3f} | | | |")
                continue
            blocks = " ".join(f"{b[1] - b[0]}" for _, b in sorted(f["stage_blocks"].items(), key=lambda x: int(x[0])))
            flag = f" ({f['D']} procs, {out['machine_before']['cores']} cores)" if f["oversubscribed"] else ""
            print(f"| {f['schedule']} | {f['D']}{flag} | {f['M']} | {blocks} | {f['step_wall_s'] * 1e3:.0f} "
                  f"| {f['step_wall_s'] / base[(f['schedule'], f['D'])]:.2f} | {f['schedule_bubble']:.3f} | {f['step_bubble']:.3f} | {f['formula']:.3f} "
                  f"| {f['sim_unit']:.3f} | {f['tool_cost_model']:.3f} "
                  f"| {f['schedule_bubble'] / f['formula'] if f['formula'] else float('inf'):.2f} |")
        print("\n| schedule | D | M | per-stage F ms, wall (CPU) | per-stage B ms, wall (CPU) | replay, measured F+B, free comm "
              "| one-way p2p ms: send_values (1 tensor alone; ratio) | simulate(), measured F + that latency "
              "| CPU share in actions | loadavg | tail after last action / step | schedule bubble per step, min / max |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for f in out["bubble"]:
            if "tool_error" in f:
                continue
            fs = " ".join(f"{x * 1e3:.0f} ({c * 1e3:.0f})" for x, c in zip(f["stage_forward_s"], f["stage_forward_cpu_s"]))
            bs = " ".join(f"{x * 1e3:.0f} ({c * 1e3:.0f})" for x, c in zip(f["stage_backward_s"], f["stage_backward_cpu_s"]))
            print(f"| {f['schedule']} | {f['D']} | {f['M']} | {fs} | {bs} | {f['replay_measured_fb']:.3f} "
                  f"| {f['one_way_s'] * 1e3:.2f} ({f['one_way_raw_s'] * 1e3:.2f}; "
                  f"{f['one_way_s'] / f['one_way_raw_s']:.1f}x) "
                  f"| {f['sim_measured_f_latency']:.3f} | {f['cpu_share']:.2f} "
                  f"| {f['loadavg']:.1f} | {f['tail_fraction']:.3f} "
                  f"| {min(f['schedule_bubbles']):.3f} / {max(f['schedule_bubbles']):.3f} |")
        ref = {(f["D"], f["M"]): f for f in out["bubble"] if f["schedule"] == "1f1b" and "tool_error" not in f}
        others = [f for f in out["bubble"] if f["schedule"] != "1f1b" and "tool_error" not in f
                  and (f["D"], f["M"]) in ref]
        if others:
            print("\nAgainst 1F1B in the same processes (the variants taking turns). Schedule bubble: the shares "
                  "(interlaced sEk / sGk) counted busy, as simulate() counts them; own-steps bubble: only the "
                  "rank's own F and B counted busy. Share ms: median wall time of one share, per owner stage.\n")
            print("| schedule | D | M | step ms | 1F1B step ms | step / 1F1B | paired per round: median (min / max) "
                  "| schedule bubble | own-steps bubble "
                  "| 1F1B schedule bubble | simulate(), unit cost | 1F1B simulate(), unit cost "
                  "| simulate(), measured F + latency | share ms |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for f in others:
                g = ref[(f["D"], f["M"])]
                f["paired_round_ratios"] = paired = paired_ratios(f, g)
                shares = " ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(f.get("share_s", {}).items()))
                print(f"| {f['schedule']} | {f['D']} | {f['M']} | {f['step_wall_s'] * 1e3:.0f} "
                      f"| {g['step_wall_s'] * 1e3:.0f} | {f['step_wall_s'] / g['step_wall_s']:.2f} "
                      f"| {statistics.median(paired):.2f} ({min(paired):.2f} / {max(paired):.2f}) "
                      f"| {f['schedule_bubble']:.3f} | {f['own_bubble']:.3f} | {g['schedule_bubble']:.3f} "
                      f"| {f['sim_unit']:.3f} | {g['sim_unit']:.3f} | {f['sim_measured_f_latency']:.3f} | {shares} |")
    c = out["compare"]
    if c:
        med = {n: statistics.median(t) for n, t in c["times"].items()}
        n_timed = len(c["times"]["generated"])
        k = min(len(c["losses"]["generated"]), len(c["losses"]["pipelining"]))
        dloss = max(abs(x - y) for x, y in zip(c["losses"]["generated"][:k], c["losses"]["pipelining"][:k]))
        print(f"\n## 2. Step time, D=2, M={c['micro_batches']}: generated 1F1B vs "
              f"torch.distributed.pipelining.Schedule1F1B ({a.compare_rounds} rounds x ({a.compare_warmup} "
              f"warm-up + {a.compare_steps} timed) steps each, alternating; median of {n_timed})\n")
        cpu = {n: statistics.median(t) for n, t in c["cpu"].items()}
        print("| variant | median step ms | min ms | max ms | wall / pipelining | CPU ms per step (both ranks) "
              "| CPU / pipelining |")
        print("|---|---|---|---|---|---|---|")
        for n in ("generated", "pipelining"):
            t = c["times"][n]
            print(f"| {n} | {med[n] * 1e3:.1f} | {min(t) * 1e3:.1f} | {max(t) * 1e3:.1f} "
                  f"| {med[n] / med['pipelining']:.3f} | {cpu[n] * 1e3:.1f} | {cpu[n] / cpu['pipelining']:.3f} |")
        c["cpu_generated_over_pipelining"] = cpu["generated"] / cpu["pipelining"]
        per = a.compare_steps
        rounds = len(c["times"]["generated"]) // per
        paired = [statistics.median(c["times"]["generated"][r * per:(r + 1) * per]) /
                  statistics.median(c["times"]["pipelining"][r * per:(r + 1) * per]) for r in range(rounds)]
        c["paired_round_ratios"] = paired
        q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
        print(f"\npaired: generated / pipelining per round (the two blocks of a round run back to back): "
              f"median {statistics.median(paired):.3f}, quartiles {q[0]:.3f} / {q[2]:.3f}, "
              f"min {min(paired):.3f}, max {max(paired):.3f} over {rounds} rounds")
        print(f"\nmax |loss generated - loss pipelining| over {k} steps: {dloss:.2e} "
              f"(first losses {c['losses']['generated'][0]:.6f} / {c['losses']['pipelining'][0]:.6f})")
        c["generated_over_pipelining"] = med["generated"] / med["pipelining"]
        c["max_loss_diff"] = dloss


if __name__ == "__main__":
    main()
