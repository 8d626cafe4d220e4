#!/usr/bin/env python
"""Step time of the generated TP=2 GPT against torch's own DTensor tensor parallelism.

    python benchmarks/bench_tp_step.py [--warmup 2] [--steps 6] [--rounds 5] [--json out.json]

What it does (all in one run, so the figures are ratios of things measured side by side):

1. Writes a benchmark-local copy of fixtures/gpt.py with a bigger config (BIG below: n_embd
   256, n_layer 4, n_head 8, block 128, vocab 512, batch 8 x 128 tokens) into a temp dir and
   rewrites THAT copy with the CLI: ``nnscaler-rewrite gpt_big.py --tp 2 -o gpt_big_tp2``.
2. Starts 2 gloo processes (1 intra-op thread each: 2 cores, 2 ranks). Each process holds
   every variant at once and the variants take turns, in rounds with a rotating order, so
   a drift in machine load (other jobs share these 2 cores) hits them all alike:

   * ``generated``      the tool's model.py + the package's train_step (Megatron TP: column/
                        row-parallel linears, vocab-parallel embedding, LM head and loss).
   * ``dtensor_blocks`` the original GPT, parallelize_module on a DeviceMesh("cpu", [0, 1]):
                        ColwiseParallel c_attn, c_fc; RowwiseParallel attn.c_proj, mlp.c_proj.
                        Embeddings, LM head and loss stay replicated (computed in full on both
                        ranks).
   * ``dtensor_full``   dtensor_blocks plus RowwiseParallel(input_layouts=Replicate()) on wte,
                        ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) on
                        lm_head, weights re-tied, loss under ``loss_parallel()``: the parts
                        the generated code splits (it also splits wpe; DTensor keeps it whole).
   * ``single_1t`` / ``single_2t``  the original model in one process (rank 0, rank 1
                        idles in a gloo barrier, which does not spin), with 1 and 2 threads.

   DTensor needs the model's attention edited, as every DTensor user of nanoGPT does: after
   the split each rank holds n_head/2 heads, so the bench sets ``attn.n_head`` and
   ``attn.n_embd`` to the local values and replaces CausalSelfAttention.forward on those
   instances by a copy that differs in two places: the head size is ``self.n_embd //
   self.n_head`` instead of ``C // self.n_head`` (C is the full width of the replicated
   input) and the heads are re-assembled with ``.view(B, T, self.n_embd)`` instead of
   ``.view(B, T, C)``. c_attn's rows are permuted to [q0 k0 v0 | q1 k1 v1] (heads of rank
   0, then rank 1) so that ColwiseParallel's contiguous split hands each rank its own heads
   of q, k and v -- the fused-qkv handling the generated code does with groups=3.

Every variant starts from the same single-device initial weights (sharded by the output's
shard_state_dict for ``generated``, by parallelize_module for DTensor) and trains on the
same batches (seed + step -> example_inputs()); every variant's losses are compared with
single_1t's (printed; a warning beyond 1e-3) so the timed code is known to compute the same
thing.

A step is forward + backward + AdamW step + zero_grad + loss.item(). Per timed step:
``wall`` = time from a barrier to the end of the step, max over ranks; ``cpu`` = process
CPU time (time.process_time: every thread, gloo's included), summed over ranks -- the figure
that does not depend on how a shared machine schedules the two ranks; ``wire`` = bytes the
process wrote to its sockets (/proc/self/io wchar), max over ranks. Each figure is the median
over all timed steps (rounds x steps), after ``warmup`` untimed steps per variant per round.
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
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import join_ranks, launch_ranks, load_file, revision  # noqa: E402
FIXTURE = ROOT / "fixtures" / "gpt.py"

# The bigger config for the step-time benchmark.
BIG = dict(block_size=128, vocab_size=512, n_layer=4, n_head=8, n_embd=256, batch=8)
CONFIG_KEYS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")
INPUTS_RE = re.compile(r"torch\.randint\(0, (\d+), \((\d+), (\d+)\)\)")

VARIANTS = ["generated", "dtensor_blocks", "dtensor_full", "single_1t", "single_2t"]


# --------------------------------------------------------------------------
# Shared with bench_comm_bytes.py
# --------------------------------------------------------------------------

def fixture_config(text: str | None = None) -> dict:
    """GPTConfig's defaults and example_inputs()' sizes, read from fixtures/gpt.py."""
    text = FIXTURE.read_text() if text is None else text
    cfg = {}
    for key in CONFIG_KEYS:
        m = re.search(rf"^\s+{key}: int = (\d+)\s*$", text, re.M)
        if not m:
            raise SystemExit(f"bench: cannot find GPTConfig.{key} in {FIXTURE}")
        cfg[key] = int(m.group(1))
    found = INPUTS_RE.findall(text)
    if len(found) != 2 or found[0] != found[1]:
        raise SystemExit(f"bench: expected two torch.randint(0, V, (B, T)) in {FIXTURE}'s "
                         f"example_inputs, found {found}")
    cfg["batch"], cfg["seq"] = int(found[0][1]), int(found[0][2])
    return cfg


def write_model_file(dst: Path, cfg: dict) -> Path:
    """A copy of fixtures/gpt.py with GPTConfig's defaults and example_inputs() resized
    (sequence length = block_size). Only the numbers change; every other line is the
    fixture's own."""
    text = FIXTURE.read_text()
    fixture_config(text)  # fails loudly if the fixture no longer has the expected shape
    for key in CONFIG_KEYS:
        text = re.sub(rf"^(\s+{key}: int = )\d+(\s*)$", rf"\g<1>{cfg[key]}\g<2>", text, flags=re.M)
    text = INPUTS_RE.sub(f"torch.randint(0, {cfg['vocab_size']}, ({cfg['batch']}, {cfg['block_size']}))",
                         text)
    dst.write_text(text)
    return dst


def cli() -> list[str]:
    exe = shutil.which("nnscaler-rewrite")
    return [exe] if exe else [sys.executable, "-m", "nnscaler_cst.cli"]


def rewrite(model_file: Path, out_dir: Path, tp: int = 2) -> tuple[float, float | None]:
    """Run the CLI rewrite; returns its wall time in seconds and the step time (s) the
    tool's cost model estimates (from its "est. step X ms" line), if it printed one."""
    t0 = time.perf_counter()
    proc = subprocess.run([*cli(), str(model_file), "--tp", str(tp), "-o", str(out_dir)],
                          capture_output=True, text=True, cwd=model_file.parent)
    if proc.returncode != 0:
        raise SystemExit(f"bench: rewrite of {model_file} failed ({proc.returncode}):\n"
                         f"{proc.stdout}\n{proc.stderr}")
    m = re.search(r"est\. step ([0-9.]+) ms", proc.stdout)
    return time.perf_counter() - t0, float(m.group(1)) / 1e3 if m else None


def launch(script: Path, args: list[str], world: int = 2, timeout: float = 1800.0) -> None:
    """Run ``script _rank ARGS`` on ``world`` processes (see _common.launch_ranks)."""
    launch_ranks([sys.executable, str(script), "_rank", *args], world, timeout)


def wchar() -> int:
    """Bytes this process (every thread, gloo's included) handed to write-family syscalls:
    with nothing else written during a step, what gloo's TCP transport sent."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def machine() -> dict:
    import torch
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg": os.getloadavg(),
            "revision": revision()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------
# DTensor variants
# --------------------------------------------------------------------------

def dtensor_attention_forward(self, x):
    """CausalSelfAttention.forward of fixtures/gpt.py with the two edits DTensor needs:
    head size from the local ``self.n_embd`` (not the full ``C``), re-assembly to the local
    width. ``self.n_head`` / ``self.n_embd`` hold the local head count and width."""
    import math
    import torch.nn.functional as F
    B, T, C = x.size()
    hs = self.n_embd // self.n_head                                   # was: C // self.n_head
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(B, T, self.n_head, hs).transpose(1, 2)
    q = q.view(B, T, self.n_head, hs).transpose(1, 2)
    v = v.view(B, T, self.n_head, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.causal_mask(T) == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)
    y = att @ v
    y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)        # was: .view(B, T, C)
    y = self.resid_dropout(self.c_proj(y))
    return y


def qkv_rows_by_rank(t, tp: int):
    """Permute the fused q|k|v rows (dim 0) to [q0 k0 v0 | q1 k1 v1 | ...], rank-major."""
    rest = t.shape[1:]
    return t.reshape(3, tp, t.shape[0] // (3 * tp), *rest).transpose(0, 1).reshape(t.shape)


def build_dtensor(entry, init: dict, mesh, tp: int, full: bool):
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    model = entry.build()
    model.load_state_dict(init)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.copy_(qkv_rows_by_rank(block.attn.c_attn.weight, tp))
            if block.attn.c_attn.bias is not None:
                block.attn.c_attn.bias.copy_(qkv_rows_by_rank(block.attn.c_attn.bias, tp))
    plan = {}
    for i in range(len(model.transformer.h)):
        plan[f"transformer.h.{i}.attn.c_attn"] = ColwiseParallel()
        plan[f"transformer.h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_proj"] = RowwiseParallel()
    if full:
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    if full:  # parallelize_module replaced the tied Parameter twice: tie the shards again
        model.transformer.wte.weight = model.lm_head.weight
    for block in model.transformer.h:
        attn = block.attn
        attn.n_head //= tp
        attn.n_embd //= tp
        attn.forward = types.MethodType(dtensor_attention_forward, attn)
    return model


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------

def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_file")
    p.add_argument("out_dir")
    p.add_argument("workdir")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    rank, world, package, train, comm = join_ranks(Path(a.out_dir))
    tp = package.TP_SIZE
    mesh = DeviceMesh("cpu", list(range(world)))
    entry = load_file(Path(a.model_file), "bench_entry")
    init = torch.load(Path(a.workdir) / "init.pt")
    names = a.variants.split(",")

    def batch(step):
        torch.manual_seed(a.seed + step)
        return entry.example_inputs()

    steppers = {}
    for name in names:
        torch.manual_seed(a.seed)
        if name == "generated":
            module = package.rank_module(rank)
            m = module.build()
            m.load_state_dict(package.shard_state_dict(init, rank))
            m.train()
            opt = torch.optim.AdamW(m.parameters(), lr=a.lr)
            steppers[name] = (lambda m, opt: lambda b: package.train_step(m, opt, b))(m, opt)
            continue
        if name.startswith("single"):
            if rank != 0:
                steppers[name] = None
                continue
            m = entry.build()
            m.load_state_dict(init)
            threads = int(name.split("_")[1][0])
        else:
            full = name == "dtensor_full"
            m = build_dtensor(entry, init, mesh, tp, full=full)
            threads = 1
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=a.lr)
        par_loss = name == "dtensor_full"

        def step(b, m=m, opt=opt, threads=threads, par_loss=par_loss):
            if threads != 1:
                torch.set_num_threads(threads)
            if par_loss:
                with loss_parallel():
                    loss = m(*b)
                    loss.backward()
            else:
                loss = m(*b)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if isinstance(loss, torch.distributed.tensor.DTensor):
                loss = loss.full_tensor()
            value = loss.item()
            if threads != 1:
                torch.set_num_threads(1)
            return value
        steppers[name] = step

    times = {n: [] for n in names}           # timed steps: wall time, max over ranks
    cpu = {n: [] for n in names}             # timed steps: process CPU time, sum over ranks
    wire = {n: [] for n in names}            # timed steps: bytes written to sockets, max over ranks
    round_medians = {n: [] for n in names}
    losses = {n: [] for n in names}          # every step, warm-up included
    next_step = {n: 0 for n in names}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            local, local_cpu, local_wire = [], [], []
            for i in range(a.warmup + a.steps):
                s = next_step[name]
                next_step[name] += 1
                b = batch(s)
                dist.barrier()
                if steppers[name] is None:   # single-process variant, rank != 0: idle
                    continue
                w0, c0, t0 = wchar(), time.process_time(), time.perf_counter()
                loss = steppers[name](b)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                dw = wchar() - w0
                losses[name].append(loss)
                if i >= a.warmup:
                    local.append(dt)
                    local_cpu.append(dc)
                    local_wire.append(dw)
            dist.barrier()
            t = torch.tensor(local if local else [0.0] * a.steps, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] += t.tolist()
            c = torch.tensor(local_cpu if local_cpu else [0.0] * a.steps, dtype=torch.float64)
            dist.all_reduce(c)
            cpu[name] += c.tolist()
            w = torch.tensor(local_wire if local_wire else [0] * a.steps, dtype=torch.float64)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            wire[name] += w.tolist()
            round_medians[name].append(statistics.median(t.tolist()))
    if rank == 0:
        result = {"times": times, "cpu": cpu, "wire": wire, "round_medians": round_medians, "losses": losses}
        (Path(a.workdir) / "result.json").write_text(json.dumps(result))
    dist.barrier()
    comm.teardown()


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        return rank_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant per round")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep", help="keep the generated code and model file in this folder")
    a = p.parse_args()

    import torch
    before = machine()
    tmp = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="bench-tp-step-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        model_file = write_model_file(tmp / "gpt_big.py", BIG)
        out_dir = tmp / "gpt_big_tp2"
        if out_dir.exists():
            shutil.rmtree(out_dir)
        rewrite_s, estimate_s = rewrite(model_file, out_dir, tp=2)
        entry = load_file(model_file, "bench_entry_driver")
        torch.manual_seed(0)
        model = entry.build()
        n_params = sum(p.numel() for p in model.parameters())
        torch.save(model.state_dict(), tmp / "init.pt")
        launch(Path(__file__).resolve(),
               [str(model_file), str(out_dir), str(tmp), "--warmup", str(a.warmup),
                "--steps", str(a.steps), "--rounds", str(a.rounds), "--variants", a.variants])
        res = json.loads((tmp / "result.json").read_text())
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    after = machine()
    report(res, a, before, after, n_params, rewrite_s, estimate_s)


def report(res: dict, a, before: dict, after: dict, n_params: int, rewrite_s: float,
           estimate_s: float | None) -> None:
    names = a.variants.split(",")
    med = {n: statistics.median(res["times"][n]) for n in names}
    cpu = {n: statistics.median(res["cpu"][n]) for n in names}
    wire = {n: statistics.median(res["wire"][n]) for n in names}
    ref_losses = res["losses"].get("single_1t")
    print(f"machine: {before['cores']} cores ({before['cpu']}), no GPU, torch {before['torch']}; "
          f"1-min loadavg before {before['loadavg'][0]:.2f}, after {after['loadavg'][0]:.2f}; "
          f"revision {before['revision']}")
    print(f"model: fixtures/gpt.py resized to {BIG} ({n_params / 1e6:.2f} M params); "
          f"rewrite took {rewrite_s:.1f} s")
    print(f"{a.rounds} rounds x ({a.warmup} warm-up + {a.steps} timed) steps per variant; "
          f"step = fwd + bwd + AdamW + loss.item(); wall = max over ranks, cpu = process CPU "
          f"time summed over ranks, wire = bytes gloo wrote to its sockets (/proc/self/io wchar), max over "
          f"ranks; medians over {a.rounds * a.steps} timed steps\n")
    base = "dtensor_blocks" if "dtensor_blocks" in med else names[0]
    header = (f"{'variant':<16}{'wall ms':>9}{'per-round wall ms':>32}{'wall/' + base:>20}"
              f"{'wall/generated':>16}{'cpu ms':>9}{'cpu/generated':>15}{'wire MB':>9}"
              f"{'max|dloss| vs single_1t':>25}")
    print(header)
    print("-" * len(header))
    out = {"machine_before": before, "machine_after": after, "config": BIG, "n_params": n_params,
           "rounds": a.rounds, "warmup": a.warmup, "steps": a.steps, "variants": {}}
    for n in names:
        rounds = ", ".join(f"{x * 1e3:.0f}" for x in res["round_medians"][n])
        dloss = float("nan")
        if ref_losses and res["losses"][n]:
            k = min(len(ref_losses), len(res["losses"][n]))
            dloss = max(abs(x - y) for x, y in zip(ref_losses[:k], res["losses"][n][:k]))
        gen = med[n] / med["generated"] if "generated" in med else float("nan")
        gen_cpu = cpu[n] / cpu["generated"] if "generated" in cpu else float("nan")
        print(f"{n:<16}{med[n] * 1e3:>9.1f}{rounds:>32}{med[n] / med[base]:>20.3f}{gen:>16.3f}"
              f"{cpu[n] * 1e3:>9.1f}{gen_cpu:>15.3f}{wire[n] / 1e6:>9.2f}{dloss:>25.2e}")
        out["variants"][n] = {"wall_median_s": med[n], "cpu_median_s": cpu[n], "wire_bytes": wire[n],
                              "round_wall_medians_s": res["round_medians"][n],
                              "max_loss_diff_vs_single_1t": dloss,
                              "first_loss": res["losses"][n][0] if res["losses"][n] else None}
    print()
    for n, v in out["variants"].items():
        if v["max_loss_diff_vs_single_1t"] > 1e-3:
            print(f"WARNING: {n}'s losses differ from single_1t's by up to "
                  f"{v['max_loss_diff_vs_single_1t']:.3g}: it does not compute the same thing")
    for n in ("dtensor_blocks", "dtensor_full", "single_1t", "single_2t"):
        if n in med and "generated" in med:
            print(f"generated / {n:<15} wall {med['generated'] / med[n]:.3f}   "
                  f"cpu {cpu['generated'] / cpu[n]:.3f}")
            out[f"generated_over_{n}"] = {"wall": med["generated"] / med[n],
                                          "cpu": cpu["generated"] / cpu[n]}
    if estimate_s and "generated" in med:
        print(f"the tool's cost model estimated {estimate_s * 1e3:.1f} ms per step; measured wall / "
              f"estimate = {med['generated'] / estimate_s:.2f}, per-rank cpu / estimate = "
              f"{cpu['generated'] / 2 / estimate_s:.2f}")
        out["tool_estimate_s"] = estimate_s
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
