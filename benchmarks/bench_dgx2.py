"""The nnScaler paper's comparison (OSDI '24, section 7) on its testbed, priced by this tool's cost model:
rules/devices/dgx2-v100x32.toml (2 DGX-2 nodes, 32 V100 32 GB), fp16 matmuls, 32 GB per device.

    python benchmarks/bench_dgx2.py            # writes benchmarks/BENCH_DGX2.md and the SVGs beside it
    python benchmarks/bench_dgx2.py --only alphafold2    # (or t5-artifact, swin) that section only, in the file there is

Each model is traced once on fake tensors at full size (benchmarks/dgx2_*.py). Every plan is priced from the
same per-op costs: plan/auto.py's `_regions` (an op's compute and tensor-parallel conversions, per region of
the model: prologue, each block, epilogue) under the split `search_axis` solves for a table, and auto.py's
1F1B / gradient-accumulation arithmetic (`_estimate`, as `estimate_config` and bench_planning.py part 4 use
it). What the tool does not price by itself is composed here from those costs, each stated in the report:
co-shard's repeated forward and freed activations (plan/coshard.py's formulas). The interlaced pipeline
is priced by plan/interlaced.py `estimate` and 3F1B by auto's estimate (both the simulator's timeline of
their orders), each set against the tool's simulator over every micro-batch.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import revision  # noqa: E402

from nnscaler_cst.analysis import analyze  # noqa: E402
from nnscaler_cst.errors import UserError  # noqa: E402
from nnscaler_cst.materialize.conversions import fused_collectives  # noqa: E402
from nnscaler_cst.plan import auto  # noqa: E402
from nnscaler_cst.plan.auto import Config  # noqa: E402
from nnscaler_cst.plan.cost import load_cluster  # noqa: E402
from nnscaler_cst.plan.search import search_axis  # noqa: E402
from nnscaler_cst.plan.tables import load_table  # noqa: E402

GIB = 2 ** 30
DEVICES = 32
BUDGET = 32e9
CLUSTER = load_cluster("dgx2-v100x32").with_precision("fp16")


def load() -> str:
    return "{:.2f}".format(os.getloadavg()[0])


def traced(name: str):
    """The entry at its global batch, on fake tensors (calls too large to probe are probed at a
    small shape of themselves: graph/derive.py `at_small_shape`)."""
    start = time.perf_counter()
    analysis = analyze(ROOT / "benchmarks" / name, trace_mode="fake")
    seconds = time.perf_counter() - start
    print(f"traced {name}: {len(analysis.graph.nodes)} ops in {seconds:.0f} s (load {load()})", flush=True)
    return analysis.graph, seconds


def priced(graph, config: Config, table: str | None):
    """estimate_config, keeping the split and the per-region costs."""
    blocks = auto._blocks(graph)
    plan = None
    if config.tp > 1:
        rules = load_table(table).for_axis("tp") if table else []
        with fused_collectives(bool(table) and load_table(table).fused_collectives):
            plan = search_axis(graph, "tp", config.tp, rules, CLUSTER.axis(1, config.tp),
                               data_parallel=config.dp * config.micro_batches)
    cost = auto._regions(graph, blocks, plan, config.tp, CLUSTER.axis(1, config.tp))
    estimate = auto._estimate(config, cost, blocks, graph.trace.batch_size or 1, CLUSTER, BUDGET)
    return estimate, plan, cost, blocks


def row(label: str, estimate, note: str = "") -> str:
    fits = "yes" if estimate.memory <= BUDGET else "no"
    return (f"| {label} | {estimate.config.describe()} | {estimate.seconds:.2f} | {estimate.memory / GIB:.1f} GiB | "
            f"{fits} | {note} |")


TABLE_HEAD = ["| plan | configuration | est. step s | peak memory per device | fits 32 GB | note |",
              "|---|---|---|---|---|---|"]


def best(rows):
    fitting = [r for r in rows if r[1].memory <= BUDGET]
    return min(fitting, key=lambda r: r[1].seconds) if fitting else None


# ---------------------------------------------------------------------------------------------
# Swin: co-shard against Megatron tensor parallelism
# ---------------------------------------------------------------------------------------------

def coshard_estimate(graph, config: Config):
    """Megatron with the attention core co-sharded (rules/plans/coshard.toml): the split is the
    coshard table's; C is the smallest whose memory fits the budget (plan/coshard.py's choose_chunks,
    memory(C) = memory without co-shard - what the regions keep + one piece of one block's region / C,
    per micro-batch here); the time adds one more forward of every region's ops (their backward
    recomputes them), at the micro-batch's share of the traced batch, M times a step."""
    from nnscaler_cst.plan.coshard import plan_coshard
    from nnscaler_cst.plan.cost import node_time
    estimate, plan, cost, blocks = priced(graph, config, "coshard")
    constraints = load_table("coshard").for_axis("tp")
    fraction = 1.0 / (config.dp * config.micro_batches)
    # plan_coshard works at the traced batch: scale base and budget so that its test is the per-micro-batch one
    choice = plan_coshard(graph, constraints, config.tp, plan, estimate.memory / fraction, BUDGET / fraction,
                          search=None)
    device = CLUSTER.axis(1, config.tp)
    nodes = sorted({i for region in choice.regions for i in region.nodes})
    again = sum(node_time(graph.nodes[i], graph.dims.get(i), graph.trace, device, config.tp,
                          dims_of=graph.dims.get, forward_only=True) for i in nodes)
    seconds = estimate.seconds + config.micro_batches * fraction * again
    memory = choice.memory * fraction
    return replace(estimate, seconds=seconds, memory=memory), choice.chunks, config.micro_batches * fraction * again


def host_spec() -> dict:
    """The host side of the DGX-2 ([host] in rules/devices/dgx2-v100x32.toml: datasheet peaks, which the
    tool's cost model does not read: it plans no offload)."""
    import tomllib
    return tomllib.loads((ROOT / "rules" / "devices" / "dgx2-v100x32.toml").read_text())["host"]


# DeepSpeed's CPU Adam under fp16 (ZeRO-Offload, Ren et al., ATC '21): per parameter it reads the fp32 master
# weight, both moments and the fp32 gradient accumulated on the host, writes the weight and the moments back,
# and the fp16 copy the next forward fetches
CPU_ADAM_BYTES = 4 * 4 + 3 * 4 + 2
HALF = 2        # bytes of an fp16 parameter or gradient on the host link


def offloaded(estimate, cost, blocks, config: Config, host: dict):
    """DeepSpeed ZeRO-3 with its parameters and optimizer offloaded to the host (`offload_param` and
    `offload_optimizer` on the CPU, as the artifact's examples/swin/train_ds.py sets them), from the same ZeRO-3
    estimate: each device's shard of parameters, gradients and optimizer state leaves the device; every
    micro-batch fetches the fp16 parameter shard over the host link for each pass that gathers it (forward,
    backward, and the recompute's second forward) and sends its fp16 gradient shard back; the optimizer steps on
    the host's CPUs (a node's 16 shards at once, bound by the host's memory bandwidth) instead of the device.
    Datasheet peaks throughout and no link shared between two GPUs: a lower bound on DeepSpeed's step."""
    from nnscaler_cst.plan.zero import state_bytes_per_device
    params = auto._stages(cost, blocks, 1).params[0]        # elements one device holds after the tp split
    shard = params / config.dp
    device = CLUSTER.axis(1, config.tp)
    passes = 3 if config.recompute else 2
    link = config.micro_batches * (passes + 1) * HALF * shard / host["link_bandwidth"]
    cpu_adam = CLUSTER.devices_per_node * shard * CPU_ADAM_BYTES / host["memory_bandwidth"]
    gpu_adam = shard * device.seconds_per_param
    seconds = estimate.seconds - gpu_adam + link + cpu_adam
    memory = estimate.memory - state_bytes_per_device(int(params), 3, config.dp).total
    out = replace(estimate, seconds=seconds, memory=memory,
                  why_not=None if memory <= BUDGET else f"needs {memory / GIB:.1f} GiB per device")
    return out, link, cpu_adam


def per_micro_batch(message: str, micro_batches: int) -> str:
    """plan_coshard's refusal prices the traced batch (coshard_estimate scales its test to one micro-batch):
    its sizes written back per device and micro-batch, as the table's."""
    import re
    if "no co-shard factor fits" not in message:
        return message
    sizes = [f"C={c}: {float(tib) * 2 ** 40 / micro_batches / GIB:.1f} GiB"
             for c, tib in re.findall(r"C=(\d+): ([\d.]+) TiB", message)]
    return f"no co-shard factor fits 32 GB per device ({'; '.join(sizes)})"


def swin(lines: list[str]) -> dict:
    """Each side at its own best fitting configuration over tp (2 to 16; co-shard splits over tp): Megatron TP
    with and without recompute and co-shard, each with and without ZeRO-1 (Megatron-LM's distributed
    optimizer; nnScaler's zero), and DeepSpeed's ZeRO-3 over the data-parallel ranks with Megatron's TP."""
    graph, trace_seconds = traced("dgx2_swin.py")
    batch = graph.trace.batch_size
    rows = []

    def add(label: str, config: Config):
        start = time.perf_counter()
        found = priced(graph, config, "megatron")
        rows.append((label, found[0], f"{time.perf_counter() - start:.0f} s to plan"))
        print(label, found[0].config.describe(), f"{found[0].seconds:.2f}", found[0].memory / GIB, flush=True)
        return found
    for tp in (2, 4, 8, 16):
        dp = DEVICES // tp
        micro = batch // dp                       # micro-batch 1, as the artifact runs (--mbs 1)
        for zero in (0, 1):
            optimizer = " + distributed optimizer" if zero else ""
            for recompute in (False, True):
                add("Megatron TP" + (" + recompute" if recompute else "") + optimizer,
                    Config(tp=tp, dp=dp, micro_batches=micro, recompute=recompute, zero=zero))
            start = time.perf_counter()
            try:
                estimate, chunks, again = coshard_estimate(graph, Config(tp=tp, dp=dp, micro_batches=micro, zero=zero))
                rows.append((f"co-shard (C={chunks})" + (" + ZeRO-1" if zero else ""), estimate,
                             f"+{again:.2f} s repeated forward; {time.perf_counter() - start:.0f} s to plan"))
            except Exception as exc:            # a refusal is a finding: reported as it reads
                rows.append(("co-shard" + (" + ZeRO-1" if zero else ""),
                             auto.Estimate(Config(tp=tp, dp=dp, micro_batches=micro, zero=zero)),
                             f"refused: {type(exc).__name__}: {per_micro_batch(str(exc), dp * micro)}"))
            print(rows[-1][0], rows[-1][2], f"{rows[-1][1].seconds:.2f}", rows[-1][1].memory / GIB, flush=True)
    host = host_spec()
    for tp in (1, 2, 4, 8):
        dp = DEVICES // tp
        name = "DeepSpeed ZeRO-3" + (" + Megatron TP" if tp > 1 else "") + " + recompute"
        config = Config(tp=tp, dp=dp, micro_batches=batch // dp, recompute=True, zero=3)
        estimate, _, cost, blocks = add(name, config)
        estimate, link, cpu_adam = offloaded(estimate, cost, blocks, config, host)
        rows.append((name + " + CPU offload", estimate, f"+{link:.2f} s host link, {cpu_adam:.2f} s CPU Adam"
                     f"{' (the artifact ran DeepSpeed so: TP 8, offload cpu)' if tp == 8 else ''}"))
        print(rows[-1][0], rows[-1][2], f"{estimate.seconds:.2f}", estimate.memory / GIB, flush=True)
    start = time.perf_counter()
    choice = auto.search_auto(graph, DEVICES, CLUSTER, [], BUDGET)
    print("auto", choice.config.describe(), f"{choice.best.seconds:.2f}", flush=True)
    chosen = ("auto's choice", choice.best,
              f"`--plan auto --devices 32`'s choice, {time.perf_counter() - start:.0f} s to search")
    lines += ["## Swin-Transformer (Swin-H-like): co-shard against Megatron TP", "",
              f"`benchmarks/dgx2_swin.py` (traced in {trace_seconds:.0f} s): depths 2-2-18-2, C = 512, heads of 32, "
              "image 1536, window 48, global batch 256 in micro-batches of 1 (gradient accumulation), TP x DP = 32. "
              "Each side at its own best fitting configuration: tp 2 to 16 (co-shard splits over tp), with and "
              "without ZeRO-1 (Megatron-LM's distributed optimizer; nnScaler's zero); DeepSpeed's ZeRO-3 with "
              "Megatron's TP, without and with CPU offload. The artifact ran DeepSpeed at TP 8 with CPU offload "
              "(cupilot/evaluation/swin_32gpus.sh: `--tp 8 --offload cpu`, global batch 16; examples/swin/"
              "train_ds.py: `offload_param` and `offload_optimizer` on the CPU, `overlap_comm` off, fp16). The "
              "offload rows (`offloaded` in bench_dgx2.py) take the ZeRO-3 estimate, move each device's shard of "
              "parameters, gradients and optimizer state to the host, add each micro-batch's fp16 traffic on the "
              "host link (the parameter shard fetched for each pass that gathers it: forward, backward, recompute; "
              "the gradient shard sent back) in full, and step the optimizer on the host's CPUs (a node's 16 shards "
              "at once, 30 bytes a parameter through the host's memory) instead of the device, at the datasheet "
              "peaks of rules/devices/dgx2-v100x32.toml [host] (PCIe Gen3 x16 per GPU, 15.75 GB/s; 2 x Xeon "
              "Platinum 8168, 256 GB/s): a lower bound on each cost, though DeepSpeed's parameter prefetch can hide "
              "the fetches behind compute (the note gives the link time to subtract).",
              "", *TABLE_HEAD]
    lines += [row(label, estimate, note) for label, estimate, note in [*rows, chosen]]
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# Shared: blocks of both stacks (encoder-decoder), pass-corrected stage costs, the simulator
# ---------------------------------------------------------------------------------------------

def priced_with(graph, config: Config, blocks, constraints):
    """estimate_config under these tp constraints, keeping the split and the per-region costs."""
    plan = None
    if config.tp > 1:
        with fused_collectives(True):
            plan = search_axis(graph, "tp", config.tp, constraints, CLUSTER.axis(1, config.tp),
                               data_parallel=config.dp * config.micro_batches)
    cost = auto._regions(graph, blocks, plan, config.tp, CLUSTER.axis(1, config.tp))
    return auto._estimate(config, cost, blocks, graph.trace.batch_size or 1, CLUSTER, BUDGET), plan, cost


def simulated(orders, stages: int, forward: list[float], passes: int = 1, vocab=None, placement=None):
    from nnscaler_cst.verify.simulate import bubble_fraction, simulate
    events = simulate(orders, stages, forward_seconds=forward, passes=passes, vocab=vocab, placement=placement)
    return events, max(e.end for e in events), bubble_fraction(events, len(orders))


def picture(events, ranks: int, title: str, name: str) -> str:
    from nnscaler_cst.report.timeline import timeline_svg
    (ROOT / "benchmarks" / name).write_text(timeline_svg(events, ranks, title))
    return f"benchmarks/{name}"


def schedule_picture(entry: str, pp: int, micro: int, schedule: str, svg: str) -> str:
    """The paper plan's timeline as `nnscaler-rewrite schedule --picture` draws it (the tool's own stage
    cut, FLOP-proportional times); the command is recorded in the report."""
    import subprocess
    args = ["nnscaler-rewrite", "schedule", f"benchmarks/{entry}", "--pp", str(pp), "--micro-batches", str(micro),
            "--schedule", schedule, "--picture", f"benchmarks/{svg}"]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *args[1:]], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})
    summary = next((line for line in result.stdout.splitlines() if "bubble" in line), "")
    error = result.stderr.strip().splitlines()[-1] if result.returncode else ""
    print(" ".join(args), result.returncode, summary or error, flush=True)
    return f"`{' '.join(args)}` ({time.perf_counter() - start:.0f} s): " + (summary or f"failed: {error}")


# ---------------------------------------------------------------------------------------------
# T5-3B and mBART: interlaced pipeline against 1F1B + Megatron TP
# ---------------------------------------------------------------------------------------------



def encoder_decoder(lines: list[str], entry: str, title: str, tp: int = 8, pp: int = 4) -> dict:
    from nnscaler_cst.plan import interlaced
    from nnscaler_cst.plan.schedules import load_schedule, placement, schedule
    graph, trace_seconds = traced(entry)
    batch = graph.trace.batch_size                   # the artifact's GBS, 256
    dp = DEVICES // (tp * pp)
    micro = batch // dp                              # micro-batch 1 (the artifact's --mbs 1)
    blocks = auto._blocks(graph)     # the encoder's and the decoder's layers, cut as one chain
    megatron = load_table("megatron").for_axis("tp")
    rows, sim = [], {}
    base_ranges = auto._stage_ranges(blocks, pp)
    table = load_schedule("interlaced")
    place = placement(table, pp)
    for recompute in (False, True):
        config = Config(tp=tp, dp=dp, pp=pp, micro_batches=micro, recompute=recompute)
        estimate = priced_with(graph, config, blocks, megatron)[0]
        rows.append(("1F1B + Megatron TP" + (" + recompute" if recompute else ""), estimate,
                     "stages over encoder and decoder layers"))
        start = time.perf_counter()
        # the tool's simulator over the whole step's orders, every micro-batch (the estimate extrapolates from 3D)
        _, b_span, b_bubble = simulated(schedule(load_schedule("1f1b"), pp, micro), pp,
                                        [t / 3 for t in estimate.stage_seconds])
        b_sim = b_span + estimate.sync_seconds
        # interlaced: plan/interlaced.py's estimate (the planner's), and the simulator over the same orders
        result, vocab, stage_seconds = interlaced.price(graph, config, CLUSTER, [], BUDGET)
        forward = [t / 3 for t in stage_seconds]
        orders = interlaced.orders(table, pp, micro, place, vocab, forward)
        _, i_span, i_bubble = simulated(orders, pp, forward, vocab=vocab, placement=place)
        i_sim = i_span + result.sync_seconds
        steps = sum(sum(v.forward) + sum(v.backward) for v in vocab.values())
        owners = ", ".join(f"stage {s}: " + " ".join(f"{a:.2f}" for a in v.at) for s, v in sorted(vocab.items()))
        rows.append(("interlaced" + (" + recompute" if recompute else ""), result,
                     f"vocabulary steps {1e3 * steps:.1f} ms per micro-batch on every device; calls at "
                     f"(fraction of the owner's forward) {owners}; simulated {i_sim:.2f} s"))
        sim[recompute] = (estimate.seconds, b_sim, b_bubble, result.seconds, i_sim, i_bubble,
                          time.perf_counter() - start)
        print(rows[-2][0], f"{estimate.seconds:.2f} sim {b_sim:.2f}", rows[-1][0], f"{result.seconds:.2f} sim {i_sim:.2f}",
              f"{result.memory / GIB:.1f} GiB", flush=True)
    modules, _ = interlaced.vocab_modules(graph, interlaced.cut_blocks(graph), tp * pp, table.vocab, table.location)
    svg = f"dgx2_{entry.removeprefix('dgx2_').removesuffix('.py')}_interlaced.svg"
    command = schedule_picture(entry, pp, 8, "interlaced", svg)
    fitting_base = best([r for r in rows if r[0].startswith("1F1B")])
    fitting_inter = best([r for r in rows if r[0].startswith("interlaced")])
    lines += [f"## {title}: interlaced pipeline against 1F1B + Megatron TP", "",
              f"`benchmarks/{entry}` (traced in {trace_seconds:.0f} s, {len(graph.nodes)} ops): TP {tp} x PP {pp} x DP {dp}, "
              f"{micro} micro-batches of 1 (the artifact's max-pp 4, max-tp 8, --mbs 1). Stages cut over both stacks "
              f"({blocks.count} layers, auto's FLOP balance): 1F1B {base_ranges}. Interlaced (plan/interlaced.py `estimate`): "
              f"the vocabulary modules ({', '.join(modules)}) split over all {tp * pp} devices, each call an SPMD step "
              "of every rank, the stages balanced without them, in lock step.", "", *TABLE_HEAD]
    lines += [row(label, estimate, note) for label, estimate, note in rows]
    lines += ["", "The planner's estimate against the tool's simulator (verify/simulate.py) over the same per-stage "
              f"and per-call times, all {micro} micro-batches (the estimate simulates 2D, 3D ... micro-batches until "
              "its period is steady and extrapolates; 1F1B's is its closed formula):", "",
              "| | 1F1B + TP: estimate s | simulated s | bubble | interlaced: estimate s | simulated s | bubble |",
              "|---|---|---|---|---|---|---|"]
    for recompute, (be, bs, bb, ie, is_, ib, _) in sim.items():
        lines.append(f"| {'recompute' if recompute else 'no recompute'} | {be:.2f} | {bs:.2f} | {100 * bb:.1f}% | "
                     f"{ie:.2f} | {is_:.2f} | {100 * ib:.1f}% |")
    lines += ["", f"Picture: {command}", ""]
    return {"base": fitting_base, "paper": fitting_inter, "sim": sim, "svg": svg}


# ---------------------------------------------------------------------------------------------
# T5 at the artifact's setting: interlaced against the best fitting 1F1B + Megatron TP, and a vocabulary sweep
# ---------------------------------------------------------------------------------------------

T5_VOCABS = (32_000, 128_000, 256_000, 512_000, 1_024_000, 2_048_000)     # the artifact's VOCAB_K x 1000
# tp x pp = 32 (the artifact's --max-dp 1: a 46B model), every one: the interlaced pipeline splits the
# vocabulary over all 32 devices whatever tp is, so it may run its layers with little or no tp
T5_SHAPES = ((1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1))
SWEEP_SHAPES = tuple(s for s in T5_SHAPES if s[1] > 1)     # the vocabulary sweep's, both sides
T5_MICRO = (256, 128)                               # micro-batches of 1 (the artifact's --mbs 1) and of 2
CUT_LIMIT = 400                                     # 1F1B's searched cut beyond 8 stages: cuts priced at most


def even_cut(count: int, pp: int) -> list[tuple[int, int]]:
    """Megatron-LM's stages: the layers divided evenly (the artifact's megatron policy, mitr.divide)."""
    sizes = [count // pp + (1 if s < count % pp else 0) for s in range(pp)]
    ends = [sum(sizes[:s + 1]) for s in range(pp)]
    return [(0 if s == 0 else ends[s - 1], ends[s]) for s in range(pp)]


def fits_first(estimate) -> tuple:
    return (0, estimate.seconds) if estimate.memory <= BUDGET else (1, estimate.memory)


def light_cut(count: int, pp: int, heavy: list[int], ends: int, inner: int) -> list[tuple[int, int]] | None:
    """A cut whose stages holding the vocabulary are light: `ends` blocks on the first and the last
    stage (the embedding, the head), `inner` on a stage ending at each block of `heavy` (a block after
    which the model calls a vocabulary module: T5's decoder embedding, which Megatron-LM's T5 also
    keeps on the decoder's first stage), the other stages sharing the rest evenly, in proportion to
    each gap. What a Megatron-LM user sets by hand so that those stages fit; a local search moving
    one cut point at a time only moves their blocks to a neighbour. None where they do not fit."""
    light = sorted({(0, ends), (count - ends, count), *((h + 1 - inner, h + 1) for h in heavy)})
    if any(a < 0 or b > count or a >= b for a, b in light) or \
            any(light[i][1] > light[i + 1][0] for i in range(len(light) - 1)):
        return None
    gaps = [(light[i][1], light[i + 1][0]) for i in range(len(light) - 1) if light[i][1] < light[i + 1][0]]
    rest = pp - len(light)
    if rest < len(gaps):
        return None
    shares = [1] * len(gaps)
    for _ in range(rest - len(gaps)):       # each further stage to the gap with the most blocks a stage
        g = max(range(len(gaps)), key=lambda g: (gaps[g][1] - gaps[g][0]) / shares[g])
        shares[g] += 1
    cut = list(light)
    for (a, b), n in zip(gaps, shares):
        if n > b - a:
            return None
        cut += [(a + x, a + y) for x, y in even_cut(b - a, n)]
    return sorted(cut)


def cut_search(price_at, count: int, pp: int, seeds, limit: int = 10_000,
               starts: int = 2) -> tuple[list[tuple[int, int]], object, int]:
    """The fastest stage cut that fits (else the one needing least memory): every seed cut priced,
    then from the best `starts` of them move one cut point by 1, 2, 4 or 8 blocks while that improves,
    at most `limit` cuts priced; `price_at(ranges)` is the estimate."""
    def ranges_of(points):
        edges = [0, *points, count]
        return [(edges[s], edges[s + 1]) for s in range(pp)]
    best, tried = None, {}

    def priced_at(points):
        if points not in tried:
            tried[points] = price_at(ranges_of(points))
        return tried[points]
    seeds = sorted((tuple(b for _, b in seed[:-1]) for seed in seeds), key=lambda points: fits_first(priced_at(points)))
    for points in seeds[:starts]:
        current = priced_at(points)
        improved = True
        while improved and len(tried) < limit:
            improved = False
            for i in range(pp - 1):
                for step in (1, -1, 2, -2, 4, -4, 8, -8):
                    moved = list(points)
                    moved[i] += step
                    edges = [0, *moved, count]
                    if any(edges[s + 1] <= edges[s] for s in range(pp)) or len(tried) >= limit:
                        continue
                    candidate = priced_at(tuple(moved))
                    if fits_first(candidate) < fits_first(current):
                        points, current, improved = tuple(moved), candidate, True
        if best is None or fits_first(current) < fits_first(best[1]):
            best = (ranges_of(points), current)
    return best[0], best[1], len(tried)


def vocabulary_blocks(graph, blocks) -> list[int]:
    """The blocks after which the model calls a vocabulary module (code between blocks counts with the
    block before it: auto._Blocks)."""
    from nnscaler_cst.plan import interlaced
    from nnscaler_cst.plan.pipeline import cut_blocks
    table = interlaced.load_schedule("interlaced")
    modules, _ = interlaced.vocab_modules(graph, cut_blocks(graph), 1, table.vocab, table.location)
    return sorted({blocks.region[n.index] - 1 for n in interlaced.vocab_calls(graph, modules)
                   if 0 < blocks.region[n.index] <= blocks.count})


def megatron_1f1b(graph, blocks, tp: int, pp: int, micro: int, recompute: bool,
                  sequence_parallel: bool = False) -> list[tuple[str, object, str]]:
    """1F1B + Megatron TP at one (tp, pp, micro-batches, recompute, Megatron's sequence parallelism)
    under each stage cut: auto's FLOP balance, Megatron's even split, and the fastest cut that fits
    (cut_search from Megatron's, auto's and vocabulary-light seeds, auto's the ones `--plan auto`'s own stage-cut
    search starts from; at most CUT_LIMIT cuts beyond 8 stages, where each round tries 8 moves per cut point)."""
    config = Config(tp=tp, dp=1, pp=pp, micro_batches=micro, recompute=recompute, sequence_parallel=sequence_parallel)
    table = "sequence_parallel" if sequence_parallel else "megatron"
    estimate, _, cost = priced_with(graph, config, blocks, load_table(table).for_axis("tp"))
    if pp == 1:
        return [("", estimate, "")]

    def at(ranges):
        for key in ("_stages", "_parts"):
            cost.__dict__.pop(key, None)
        return auto._estimate(config, cost, replace(blocks, ranges={pp: ranges}), graph.trace.batch_size, CLUSTER,
                              BUDGET)
    flop_cut = auto._stage_ranges(blocks, pp)
    even = even_cut(blocks.count, pp)
    heavy = vocabulary_blocks(graph, blocks)
    light = [c for ends in range(1, blocks.count // pp + 1) for inner in range(1, blocks.count // pp + 1)
             if (c := light_cut(blocks.count, pp, heavy, ends, inner))] if pp > 2 else []
    fitting = auto._fitting_balanced(at(flop_cut), cost, blocks, BUDGET)
    seeds = [even, flop_cut, auto._time_balanced(config, cost, blocks, pp), *light]
    if fitting:
        edges = [0, *fitting, blocks.count]
        seeds.append([(edges[s], edges[s + 1]) for s in range(pp)])
    searched, found, tried = cut_search(at, blocks.count, pp, seeds,
                                        limit=10_000 if pp <= 8 else CUT_LIMIT)
    return [("FLOP-balanced cut", at(flop_cut), f"cut {flop_cut}"), ("Megatron's even cut", at(even), f"cut {even}"),
            ("searched cut", found, f"cut {searched} ({tried} cuts priced)")]


def interlaced_at(graph, blocks, tp: int, pp: int, micro: int, recompute: bool):
    """Interlaced at one configuration: the tool's cut (FLOPs without the vocabulary ops) and, where that
    does not fit, the fastest cut that fits, as the baseline gets (each cut a whole price: the simulator's
    walk, slow enough on this machine to search only where needed)."""
    from nnscaler_cst.plan import interlaced
    config = Config(tp=tp, dp=1, pp=pp, micro_batches=micro, recompute=recompute, schedule="interlaced")
    base, vocab, _ = interlaced.price(graph, config, CLUSTER, [], BUDGET)
    rows = [("tool's cut", base, vocab, "")]
    if base.memory <= BUDGET:
        return rows
    searched, found, tried = cut_search(lambda r: interlaced.price(graph, config, CLUSTER, [], BUDGET, ranges=r)[0],
                                        blocks.count, pp, [interlaced.stage_cut(graph, pp, tp * pp)], limit=60)
    rows.append(("searched cut", found, interlaced.price(graph, config, CLUSTER, [], BUDGET, ranges=searched)[1],
                 f"cut {searched} ({tried} cuts priced)"))
    return rows


def vocab_compute_seconds(graph, tp: int, pp: int, micro: int) -> float:
    """The vocabulary calls' compute per micro-batch on one of the tp x pp devices (what their steps
    cost without their collectives)."""
    from nnscaler_cst.plan import interlaced
    from nnscaler_cst.plan.cost import node_time
    from nnscaler_cst.plan.pipeline import cut_blocks
    table = interlaced.load_schedule("interlaced")
    modules, _ = interlaced.vocab_modules(graph, cut_blocks(graph), tp * pp, table.vocab, table.location)
    device = CLUSTER.axis(1, tp)
    return sum(node_time(n, graph.dims.get(n.index), graph.trace, device, 1, dims_of=graph.dims.get)
               for n in interlaced.vocab_calls(graph, modules)) / (micro * tp * pp)


def t5_best(graph, shapes=T5_SHAPES, micros=T5_MICRO, log=print, interlaced_shapes=T5_SHAPES):
    """Every 1F1B + Megatron TP and interlaced configuration priced; (rows, best fitting 1F1B, best fitting
    interlaced), rows as (label, estimate, note, vocabulary steps or None)."""
    blocks = auto._blocks(graph)
    rows = []
    for tp, pp in shapes:
        for recompute in (False, True):
            for micro in micros:
                for sequence_parallel in (False, True) if tp > 1 else (False,):
                    for cut, estimate, note in megatron_1f1b(graph, blocks, tp, pp, micro, recompute, sequence_parallel):
                        label = ("1F1B + Megatron TP" if pp > 1 else "Megatron TP, no pipeline") + \
                            (" + SP" if sequence_parallel else "") + (" + recompute" if recompute else "") + \
                            (f", {cut}" if cut else "")
                        rows.append((label, estimate, note, None))
                        log(label, estimate.config.describe(), f"{estimate.seconds:.2f}", f"{estimate.memory / GIB:.1f}")
                if pp > 1 and micro == micros[0] and (tp, pp) in interlaced_shapes:      # more micro-batches of 1: fewer in flight, less memory
                    for cut, estimate, vocab, note in interlaced_at(graph, blocks, tp, pp, micro, recompute):
                        label = "interlaced" + (" + recompute" if recompute else "") + f", {cut}"
                        rows.append((label, estimate, note, vocab))
                        log(label, estimate.config.describe(), f"{estimate.seconds:.2f}", f"{estimate.memory / GIB:.1f}")
    base = best([(r[0], r[1]) for r in rows if not r[0].startswith("interlaced")])    # Megatron-LM's best
    paper = best([(r[0], r[1]) for r in rows if r[0].startswith("interlaced")])
    return rows, base, paper


def t5_breakdown(graph, rows, paper, base) -> str:
    """The best fitting interlaced plan against the best fitting 1F1B (or, where none fits, 1F1B's
    least-memory configuration): their stage times, and the vocabulary steps' compute and collectives."""
    from nnscaler_cst.plan.zero import ADAMW_STATE_BYTES, GRAD_BYTES, PARAM_BYTES
    p = paper[1]
    vocab = next(r[3] for r in rows if r[1] is p)
    steps = sum(sum(v.forward) + sum(v.backward) for v in vocab.values())
    compute = vocab_compute_seconds(graph, p.config.tp, p.config.pp, p.config.micro_batches)
    text = (f"Best fitting interlaced: {paper[0]}, {p.config.describe()}, {p.seconds:.2f} s, {p.memory / GIB:.1f} GiB. Its "
            f"stages take {', '.join(f'{t:.3f}' for t in p.stage_seconds)} s per micro-batch without the vocabulary; its "
            f"vocabulary steps {1e3 * steps:.1f} ms per micro-batch on every device, of which {1e3 * compute:.1f} ms "
            "compute and the rest collectives (the head runs with its cross entropy as one vocabulary-parallel step: "
            "its input and targets broadcast along the pipeline lines, the loss's token-sized all-reduces over all "
            "32 devices, the input's gradient all-reduced; no logits gathered). ")
    if base:
        b = base[1]
        return text + (f"Best fitting Megatron-LM configuration: {base[0]}, {b.config.describe()}, {b.seconds:.2f} s "
                       f"(stages {', '.join(f'{t:.3f}' for t in b.stage_seconds)} s): **{b.seconds / p.seconds:.2f}x** "
                       "(paper: 2.2x).")
    least = min((r for r in rows if not r[0].startswith("interlaced")), key=lambda r: r[1].memory)
    return text + (f"No 1F1B + Megatron TP configuration fits 32 GB (32e9 bytes, 29.8 GiB): the least memory is "
                   f"{least[0]}, {least[1].config.describe()}, {least[1].memory / GIB:.1f} GiB at {least[1].seconds:.2f} s. "
                   f"The memory model counts {PARAM_BYTES + GRAD_BYTES + ADAMW_STATE_BYTES} bytes of state per parameter "
                   "(fp32 weights and gradients, AdamW's two moments: plan/zero.py); the table alone is 12.6 billion "
                   "parameters, whole on the first and the last stage's tp group under 1F1B.")


def t5_artifact(lines: list[str]) -> dict:
    import gc
    graph, trace_seconds = traced("dgx2_t5_artifact.py")
    start = time.perf_counter()
    rows, base, paper = t5_best(graph, log=lambda *a: print(*a, flush=True))
    search_seconds = time.perf_counter() - start
    # the table: per (configuration, cut kind), the fitting rows and the best of those that do not fit
    shown = [r for r in rows if r[1].memory <= BUDGET]
    for label in dict.fromkeys(r[0] for r in rows):
        if not any(r[0] == label for r in shown):
            shown.append(min((r for r in rows if r[0] == label), key=lambda r: r[1].memory))
    shown.sort(key=lambda r: (r[1].memory > BUDGET, r[1].seconds))
    blocks = auto._blocks(graph)
    lines += ["## T5 at the artifact's setting: interlaced against the best fitting 1F1B + Megatron TP", "",
              f"`benchmarks/dgx2_t5_artifact.py` (traced in {trace_seconds:.0f} s, {len(graph.nodes)} ops): transformers' "
              "T5 at the nnScaler artifact's T5 (cupilot/evaluation/t5_32gpus.sh, examples/t5/train.py): 32 encoder and "
              "32 decoder layers, hidden 6144, 96 heads of 64, d_ff 24576, sequence 1024, vocabulary 2,048,000, one "
              "weight for both embeddings and the head; global batch 256; 46 billion parameters, 12.6 billion of "
              "them the table. Every configuration of tp x pp = 32 (dp 1, the artifact's --max-dp 1: a second "
              f"replica of the model does not fit) at {' and '.join(str(m) for m in T5_MICRO)} micro-batches, with and "
              "without recompute; 1F1B with and without Megatron's sequence parallelism, under auto's FLOP-balanced cut, "
              "Megatron-LM's even cut (the artifact's megatron policy) and a searched cut (every seed priced: those two "
              "and cuts whose stages holding the table (the first, the one calling the decoder's embedding, the last) "
              "take 1 to 64 / pp blocks; then a local search over the cut points from the best two seeds, at most "
              f"{CUT_LIMIT} cuts beyond 8 stages; each cut priced by the planner: the fastest that fits, else the one "
              "needing least memory; beyond what Megatron-LM offered the paper), interlaced under the tool's cut and, where that does not fit, the same search from the tool's cut (at most 60 cuts, "
              f"each a whole interlaced price). {len(rows)} configurations priced in {search_seconds:.0f} s. The table: the fitting ones, "
              "fastest first, then for each kind that never fits its least-memory configuration.", "", *TABLE_HEAD]
    lines += [row(label, estimate, note) for label, estimate, note, _ in shown]
    lines.append("")
    if paper:
        lines += [t5_breakdown(graph, rows, paper, base), ""]
    del graph
    gc.collect()
    return {"base": base, "paper": paper, "rows": rows}


def win_sentence(out) -> str:
    """Where interlaced starts to win in the sweep, and whether by time or because 1F1B no longer fits."""
    wins = next(((v, b) for v, b, p, *_ in out if p and (not b or b[1].seconds > p[1].seconds)), None)
    if wins is None:
        return "Interlaced wins at none of these vocabularies."
    before = [(v, b[1].seconds / p[1].seconds) for v, b, p, *_ in out if v < wins[0] and b and p]
    return (f"Interlaced starts to win at a vocabulary of {wins[0]:,} (of those priced)"
            + (": there 1F1B + Megatron TP no longer fits 32 GB" if wins[1] is None else " (faster)")
            + ("; below it 1F1B fits and is faster (interlaced's speedups " + ", ".join(f"{r:.2f}x" for _, r in before)
               + ")" if before else "") + ".")


def t5_vocab_sweep(lines: list[str]) -> list:
    """The artifact's T5 at each vocabulary of T5_VOCABS: the best fitting of each side, both at every
    tp x pp = 32 with pp > 1 and 256 micro-batches, and what `--plan auto` chooses."""
    import gc
    out = []
    for vocab in T5_VOCABS:
        os.environ["DGX2_T5_VOCAB"] = str(vocab)
        graph, trace_seconds = traced("dgx2_t5_artifact.py")
        start = time.perf_counter()
        _, base, paper = t5_best(graph, shapes=SWEEP_SHAPES, micros=(256,), log=lambda *a: None,
                                 interlaced_shapes=SWEEP_SHAPES)
        # what the search picks on its own, over its whole space (every tp x dp x pp, schedule,
        # micro-batches, ZeRO, recompute, sequence parallelism), as `plan --plan auto` prints it
        try:
            chosen = auto.search_auto(graph, DEVICES, CLUSTER, [], BUDGET).best
        except UserError as exc:        # the search's own memory model fits nothing: say so
            chosen = exc.message
        out.append((vocab, base, paper, trace_seconds + time.perf_counter() - start, chosen))
        print("vocab", vocab, base and base[1].config.describe(), base and f"{base[1].seconds:.2f}",
              paper and paper[1].config.describe(), paper and f"{paper[1].seconds:.2f}", flush=True)
        del graph
        gc.collect()
    os.environ.pop("DGX2_T5_VOCAB")
    lines += ["### The vocabulary at which interlaced starts to win", "",
              "The same T5 (hidden 6144, 32 + 32 layers, batch 256) at each vocabulary (`DGX2_T5_VOCAB`), each side "
              "at its best fitting configuration over tp x pp in {" + ", ".join(f"{t} x {q}" for t, q in SWEEP_SHAPES) +
              "}, 256 micro-batches, recompute or not (1F1B: Megatron's sequence parallelism or not), the cuts as "
              "above; and what `--plan auto --devices 32` chooses on its own (the search's own price: "
              "plan/auto.py's analytic interlaced, which the walk above prices within 10%).", "",
              "| vocabulary | 1F1B + Megatron TP | est. step s | interlaced | est. step s | speedup | `--plan auto` chooses "
              "| s to trace and price |",
              "|---|---|---|---|---|---|---|---|"]
    for vocab, base, paper, seconds, chosen in out:
        b = f"{base[0]}: {base[1].config.describe()} | {base[1].seconds:.2f}" if base else "none fits | "
        p = f"{paper[0]}: {paper[1].config.describe()} | {paper[1].seconds:.2f}" if paper else "none fits | "
        speed = f"{base[1].seconds / paper[1].seconds:.2f}x" if base and paper else ("only interlaced fits" if paper else "-")
        picked = f"{chosen.config.describe()}: {chosen.seconds:.2f} s" if not isinstance(chosen, str) else \
            f"nothing: {chosen.split(': ', 1)[0]}"
        lines.append(f"| {vocab:,} | {b} | {p} | {speed} | {picked} | {seconds:.0f} |")
    lines += ["", win_sentence(out), ""]
    return out


# ---------------------------------------------------------------------------------------------
# AlphaFold2: 3F1B against tensor parallelism over the pair dims + data parallelism
# ---------------------------------------------------------------------------------------------

PASSES = 3


def af2_row(graph, blocks, config: Config, label: str, table):
    """One AlphaFold2 row: the estimate, and for 3F1B its order simulated over every micro-batch. A
    pipeline is priced at the stage cut `--plan auto` would search for it (auto's `_fitting_balanced`
    seed and `_cut_search`) where that cut fits and the FLOP-balanced one does not or is slower, the
    FLOP-balanced cut's figures in the note."""
    from nnscaler_cst.plan.schedules import schedule
    start = time.perf_counter()
    estimate, _, cost = priced_with(graph, config, blocks, [])     # 3F1B: the planner's (its order simulated)
    at_flops = ""
    if config.pp > 1:
        batch = graph.trace.batch_size or 1
        fitting = auto._fitting_balanced(estimate, cost, blocks, BUDGET)
        searched = auto._cut_search(estimate, cost, blocks, batch, CLUSTER, BUDGET, fitting)
        if searched.why_not is None and (estimate.why_not is not None or searched.seconds < estimate.seconds):
            at_flops = (f"; at the FLOP-balanced cut {estimate.seconds:.2f} s, {estimate.memory / GIB:.1f} GiB")
            estimate = searched
    planned = time.perf_counter() - start
    note = f"{planned:.0f} s to plan"
    if config.pp > 1:
        # the tool's 3f1b order over every micro-batch, simulated: a pass takes a fifth of the stage's
        # time per micro-batch (1 gradient forward + its backward at 2 forwards + 2 no-grad forwards)
        micro = config.micro_batches
        orders = schedule(table, config.pp, micro, PASSES)
        events, span, bubble = simulated(orders, config.pp, [t / (PASSES + 2) for t in estimate.stage_seconds],
                                         passes=PASSES)
        formula = sum(estimate.stage_seconds) + (micro - 1) * max(estimate.stage_seconds) + estimate.sync_seconds
        note = (f"simulated {span + estimate.sync_seconds:.2f} s, bubble {100 * bubble:.1f}% (1F1B's formula "
                f"over the same stage times: {formula:.2f} s); stages "
                f"{' / '.join(f'{s:.2f}' for s in estimate.stage_seconds)} s a micro-batch{at_flops}; {note}")
    print(label, estimate.config.describe(), f"{estimate.seconds:.2f}", f"{estimate.memory / GIB:.1f} GiB", note,
          flush=True)
    return label, estimate, note


def af2_auto(graph):
    """What `--plan auto --devices 32` chooses (search_auto, as the CLI calls it), and the fastest fitting
    configuration it priced without a pipeline (its ZeRO stages and sequence parallelism included)."""
    start = time.perf_counter()
    choice = auto.search_auto(graph, DEVICES, CLUSTER, [], BUDGET)
    note = f"`--plan auto --devices 32`'s choice, {time.perf_counter() - start:.0f} s to search"
    print("auto", choice.config.describe(), f"{choice.best.seconds:.2f}", flush=True)
    flat = min((e for e in choice.candidates if e.why_not is None and e.config.pp == 1), key=lambda e: e.seconds)
    label = ("DP" if flat.config.tp == 1 else "TP (the search's own split: pair and MSA dims) + DP") + \
        " (`--plan auto`'s best without a pipeline)"
    return ("auto's choice", choice.best, note), (label, flat, "the fastest fitting plan without a pipeline of "
                                                          "those `--plan auto` priced")


def af2_decides(paper, base, rows) -> str:
    """The cost-model terms between 3F1B's best and the best fitting plan without a pipeline: the
    busiest pipeline rank's work (M micro-batches of its stage) against the flat plan's (M of the
    whole model), the pipeline's idle time (auto's simulated timeline less that work), and the syncs;
    and the memory a pipeline frees on its first stage, against the flat plan at the pipeline's tp."""
    if paper is None or base is None:
        return ""
    pipe, flat = paper[1], base[1]
    work = pipe.config.micro_batches * max(pipe.stage_seconds)
    flat_work = flat.config.micro_batches * flat.stage_seconds[0]
    idle = pipe.pipeline_seconds - work
    terms = {"the busiest stage's load": work - flat_work, "the pipeline bubble": idle,
             "the gradient sync": pipe.sync_seconds - flat.sync_seconds}
    cut = (f"cut at blocks {','.join(map(str, pipe.config.cuts))} by `--plan auto`'s stage-cut search" if pipe.config.cuts
           else "cut by FLOPs, which the stage-cut search keeps")
    text = (f"3F1B's best ({pipe.config.describe()}) against {base[0]} ({flat.config.describe()}): "
            f"{pipe.seconds:.2f} s against {flat.seconds:.2f} s. The pipeline's busiest rank works "
            f"{pipe.config.micro_batches} x {max(pipe.stage_seconds):.2f} = {work:.2f} s (stages "
            f"{' / '.join(f'{t:.2f}' for t in pipe.stage_seconds)} s a micro-batch, {cut}; the first runs the "
            f"extra-MSA stack of every pass), the flat plan {flat.config.micro_batches} x "
            f"{flat.stage_seconds[0]:.2f} = {flat_work:.2f} s; the pipeline's timeline (auto's `simulated_seconds` "
            f"over the 3F1B table) adds {idle:.2f} s to its work; the syncs are {pipe.sync_seconds:.2f} s and "
            f"{flat.sync_seconds:.2f} s. ")
    if pipe.seconds < flat.seconds:
        gain = min(terms, key=terms.get)
        same_tp = min((r[1] for r in rows if r[1].config.pp == 1 and r[1].config.tp == pipe.config.tp
                       and not r[1].config.sequence_parallel),
                      key=lambda e: e.memory, default=None)
        text += f"**What 3F1B wins by is {gain}** ({-terms[gain]:.2f} s less than the flat plan's)"
        if same_tp is not None and same_tp.memory > BUDGET:
            text += (f": it fits at tp {pipe.config.tp}, where the flat plan needs {same_tp.memory / GIB:.1f} GiB "
                     f"({same_tp.config.describe()}) and so a wider split or sequence parallelism. Under recompute a device keeps the inputs "
                     "of the blocks it runs, for the micro-batches in flight on it, beside the one block rebuilt in "
                     "the backward: without a pipeline one protein's inputs of all 48 blocks beside the extra-MSA "
                     f"block's rebuild; on 3F1B's first stage ({pipe.stage_memory[0] / GIB:.1f} GiB) the same "
                     "rebuild beside the inputs of its few blocks for each micro-batch in flight, the other stages "
                     "holding no extra-MSA block.")
        else:
            text += "."
        return text
    decides = max(terms, key=terms.get)
    return text + (f"**The term that decides is {decides}** ({terms[decides]:+.2f} s against 3F1B). Where one "
                   f"protein fits at tp {flat.config.tp} without a pipeline, a pipeline frees no memory that "
                   "pays for its bubble: 3F1B pays where the flat plan needs a wider tensor-parallel split than a "
                   "pipeline's stages do (the fine-tuning sizes below) or where the devices cannot all take "
                   "proteins of their own (the test `test_where_dp_cannot_fill_the_devices_and_tp_pays_for_its_"
                   "links_the_search_chooses_3f1b`: 2 proteins on 4 devices of gloo's links).")


def alphafold2(lines: list[str]) -> dict:
    from nnscaler_cst.plan.schedules import load_schedule
    table = load_schedule("3f1b")
    graph, trace_seconds = traced("dgx2_alphafold2.py")
    batch = graph.trace.batch_size               # AlphaFold2's global batch, 128
    blocks = auto._blocks(graph)
    rows = []
    for tp in (1, 2, 4, 8):
        dp = DEVICES // tp
        for recompute in (False, True):
            label = "DP" if tp == 1 else "TP (the search's own split: pair and MSA dims) + DP"
            rows.append(af2_row(graph, blocks, Config(tp=tp, dp=dp, micro_batches=batch // dp, recompute=recompute),
                                label + (" + recompute" if recompute else ""), table))
    for pp in (2, 4, 8):
        dp = DEVICES // pp
        for recompute in (False, True):
            rows.append(af2_row(graph, blocks, Config(tp=1, dp=dp, pp=pp, micro_batches=batch // dp,
                                                      recompute=recompute, schedule="3f1b"),
                                "3F1B" + (" + recompute" if recompute else ""), table))
    chosen, _ = af2_auto(graph)
    command = schedule_picture("dgx2_alphafold2.py", 4, 8, "3f1b", "dgx2_alphafold2_3f1b.svg")
    out = {"base": best([r for r in rows if r[0].startswith("TP")]), "dp": best([r for r in rows if r[0].startswith("DP")]),
           "paper": best([r for r in rows if r[0].startswith("3F1B")]), "svg": "dgx2_alphafold2_3f1b.svg"}
    lines += ["## AlphaFold2 (Evoformer, 3 recycles): 3F1B against TP + DP", "",
              f"`benchmarks/dgx2_alphafold2.py` (traced in {trace_seconds:.0f} s, {len(graph.nodes)} ops): 48 blocks, "
              "c_m 256, c_z 128, 128 sequences x 256 residues, triangle attention (4 heads of 32) in every block, and "
              "the extra-MSA stack (1024 extra sequences, c_e 64, 4 blocks with global column attention) before the "
              "blocks in every cycle; global batch 128 in micro-batches of 1. The pipelines cut the 48 Evoformer "
              "blocks (the longer list); the extra-MSA stack runs on the first stage in every pass. `--recompute` "
              "checkpoints the blocks of both lists (plan/recompute.py `other_lists`), as AlphaFold2 does. "
              "The sizes are AlphaFold2's initial training (Jumper et al. 2021, Suppl. 1.11, Table 4); nnScaler's "
              "own AlphaFold2 example lists the same (msrasys/nnscaler examples/alphafold2/alphafold2.py `test`: "
              "Evoformer s, r = 128, 256 and extra sequences 1024 x 256 for initial training, 512 x 256, 512 x 384 "
              "and 1024 x 384 for fine-tuning); the crop the OSDI '24 paper's evaluation used: not found. DAP (FastFold's "
              "dynamic axial parallelism) splits the MSA and pair representations along their rows; the nearest plan "
              "this tool expresses is its free tensor-parallel search over every op's dims (`--plan auto`'s split at a "
              "fixed tp), with DP over the rest. Times count the two no-gradient passes as forwards only (see "
              "the cost model's own no-grad pricing: plan/cost.py `node_time`).", "", *TABLE_HEAD]
    lines += [row(label, estimate, note) for label, estimate, note in [*rows, chosen]]
    lines += ["", af2_decides(out["paper"], out["dp"], rows), "", f"Picture: {command}", ""]
    out["fine"] = alphafold2_fine_tuning(lines, table)
    return out


def alphafold2_fine_tuning(lines: list[str], table) -> dict:
    """AlphaFold2's fine-tuning sizes, where one protein under DP no longer fits a device."""
    graph, trace_seconds = traced("dgx2_alphafold2_finetune.py")
    batch = graph.trace.batch_size
    blocks = auto._blocks(graph)
    rows = []
    for tp in (1, 2, 4, 8):
        dp = DEVICES // tp
        label = "DP + recompute" if tp == 1 else "TP (the search's own split: pair and MSA dims) + DP + recompute"
        rows.append(af2_row(graph, blocks, Config(tp=tp, dp=dp, micro_batches=batch // dp, recompute=True), label,
                            table))
    for tp, pp in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2)):
        dp = DEVICES // (tp * pp)
        rows.append(af2_row(graph, blocks, Config(tp=tp, dp=dp, pp=pp, micro_batches=batch // dp, recompute=True,
                                                  schedule="3f1b"), "3F1B + recompute" + (" + TP" if tp > 1 else ""),
                            table))
    chosen, flat = af2_auto(graph)
    rows.append(flat)
    out = {"base": best([r for r in rows if r[0].startswith(("TP", "DP"))]),
           "paper": best([r for r in rows if r[0].startswith("3F1B")])}
    # what one protein's recompute rebuilds at once: an extra-MSA block (the first stage) against an Evoformer block
    dp_row = rows[0][1]
    _, _, cost, _ = priced(graph, dp_row.config, None)
    fraction = 1.0 / (dp_row.config.dp * dp_row.config.micro_batches)
    extra_block = max(cost.checkpointed_most) * fraction / GIB
    trunk_block = auto._block_maxima(cost, blocks)[0] * fraction / GIB
    lines += ["### AlphaFold2 at its fine-tuning sizes", "",
              f"`benchmarks/dgx2_alphafold2_finetune.py` (traced in {trace_seconds:.0f} s): the same model at "
              "AlphaFold2's fine-tuning crop and MSA depth (Jumper et al. 2021, Suppl. 1.11, Table 4, fine-tuning: "
              "N_res 384, N_clust 512, N_extra_seq 5120; nnScaler's example lists 512 x 384 among its fine-tuning "
              "sizes), same batch (128), every plan with recompute (none fits without).", "", *TABLE_HEAD]
    lines += [row(label, estimate, note) for label, estimate, note in [*rows, chosen]]
    lines += ["", f"DP + recompute needs {dp_row.memory / GIB:.1f} GiB: recompute rebuilds one block at a time in "
              f"the backward, and one extra-MSA block of one protein saves {extra_block:.1f} GiB (its row attention's "
              f"5120 x 8 x 384 x 384 scores among them; an Evoformer block {trunk_block:.1f} GiB). A pipeline runs "
              "that stack whole on its first stage, so no plan fits without tensor parallelism. " + af2_decides(out["paper"], out["base"], rows), ""]
    return out


# ---------------------------------------------------------------------------------------------

PAPER = ("nnScaler (OSDI '24) abstract: \"up to 3.5x speedup compared to solutions such as DeepSpeed, Megatron-LM, "
         "and Alpa for popular DNN models like SwinTransformer and AlphaFold2\" (usenix.org/conference/osdi24/"
         "presentation/lin-zhiqi). Per-model figures of section 7 were not found in the sources this session could "
         "search; they are written \"not found\" below rather than guessed.")


FINDINGS = """## Findings: what crashed, what was refused, what the cost model lacks

1. **Planning T5-3B at its full batch was killed for memory** (fixed). `nnscaler-rewrite plan benchmarks/dgx2_t5_3b.py
   --tp 8 --dp 4 --cluster dgx2-v100x32 --precision fp16` was OOM-killed after 4 min 22 s: calls too large to probe
   at their traced shape had no derived split rule (transformers' cross-attention `sdpa_attention_forward`: "rule
   attention does not fit: expected 1 outputs, traced 2"), so the batch check fell back to replaying calls on real
   tensors of the traced shapes. Now such a call is probed at a small shape of itself (graph/derive.py
   `at_small_shape`: its large dims divided by one factor, same ranks and dtypes) and keeps those labels, and a
   result a call hands back unmodified (T5's `position_bias.contiguous()`) is split as the operand it is. All four
   entries are traced and planned at their global batch; no reduced trace batch. `/usr/bin/time nnscaler-rewrite
   plan benchmarks/dgx2_X.py --tp T --dp D --cluster dgx2-v100x32 --precision fp16` at 362bf09+this branch, load
   14-18 on 2 cores (CPU seconds, as wall clock was 4-10x that): Swin (tp 4, dp 8) 4.7 s, 0.35 GB; mBART (8, 4)
   7.7 s, 0.58 GB; T5-3B (8, 4) 13.4 s, 0.73 GB; AlphaFold2 (2, 16) 27.5 s, 0.52 GB, of which its fake-tensor trace
   of 14,592 ops is about 18 s and the split search 6 s. Under 4 GB everywhere; over 10 s for T5-3B and AlphaFold2,
   where the trace itself is most of it. Since (h-trace, 0633341 + 035dac0): the tracer records each op with torch
   functions off (its shape, stride and storage reads no longer pass through SmallConstants' mode) and looks each
   site's span up once per code position; and a repeated block (a ModuleList child beside siblings of its class) is
   traced once per signature and its records copied for each equal call (trace/replicate.py: same structure,
   input shapes/strides/storage sharing, plain arguments, grad state, calling line, and every attribute its forward
   read; anything else is traced). AlphaFold2's 144 block calls: 2 traced, 142 copied, the records identical to the
   full trace (tests/test_trace_replicate.py checks that op for op), its trace 26.2 -> 12.1 s CPU. Same command,
   same revision of everything else, load 6-11 on 2 cores, CPU s (user + sys) / peak RSS, before -> after:
   AlphaFold2 36.6 s, 0.55 GB -> 19.7 s, 0.52 GB; T5-3B 16.2 s, 0.68 GB -> 13.6 s, 0.75 GB (encoder blocks 2-23
   copied; block 1 and the decoder's blocks are traced: the decoder's take a cache object, see below);
   both plans print the same tables byte for byte. Still over 10 s for both.
   Since (h-speed, general changes, nothing the plan needs left out): the tracer's profile hook is off while
   a block's records are copied (trace/replicate.py: the copy's own Python calls were a hook call each, about
   half of the copying time); the split search derives each invocation's candidates once per graph (a line
   taken apart into per-instance groups reuses them; batch labels and read sizes once; the signature and the
   split check share the cached layouts; plan/search.py); a rule's dims are instantiated once per distinct call
   and copied with the call's tensor ids (graph/oprules.py `annotate`, tests/test_instantiate_once.py);
   SmallConstants walks a call's operands only when its result could be a constant; a frame's source position
   reads its code's `co_positions()` listed once (transformers' module constructors listed it per module).
   Measured with the base (298ba31) and this branch started together, so that both see the same load
   (load 10-14 on 2 cores, wall clock 8-12x the CPU time, so both columns are inflated against the numbers
   above), `/usr/bin/time nnscaler-rewrite plan benchmarks/dgx2_X.py --tp T --dp D --cluster dgx2-v100x32
   --precision fp16`, CPU s (user + sys) / peak RSS, before -> after: AlphaFold2 (2, 16) 31.1 s, 0.51 GB -> 24.5 s,
   0.59 GB (two earlier pairs: 23.0 -> 18.1 s, 23.8 -> 18.9 s: -20% each time; the extra 0.08 GB is the
   search's kept layouts); T5-3B (8, 4) 23.8 s, 0.68 GB -> 22.9 s, 0.68 GB (an earlier pair 17.5 -> 16.2 s:
   -4 to -7%); mBART (8, 4) 11.5 s, 0.56 GB -> 10.9 s, 0.57 GB; Swin (4, 8) 6.5 s, 0.36 GB -> 6.0 s, 0.36 GB
   (these two at c747fbf, before the last two small commits). The base alone at load ~3 the same morning:
   AlphaFold2 17.5 s, T5-3B 12.5 s, so at that rate about 14 s and 12 s now (an estimate from the ratios).
   Every plan printed is byte-identical to the base's. What is left of AlphaFold2's time (py-spy, share of
   the samples): building the model under fake tensors ~30% (FakeTensorMode's dispatch of the 3,514
   parameters' `empty`, `detach` in `nn.Parameter` and their random initialisation: torch's Python, not
   ours), the split candidates ~21% (a signature and a split check per invocation and label, 14,592
   invocations; now derived once), the forward ~14% (2 blocks traced, 142 copied: ~7%), the graph ~11%
   (kinds, binding, the probes), imports ~10% (leaving the random fills of fake parameters undrawn, by a dispatch mode over
   FakeTensorMode during build(), gained nothing measurable: the mode costs every other op of the build).
   T5-3B's (profiled before these changes) is mostly imports: transformers' T5 module with
   `torch._dynamo`, `torch.distributed.tensor` and triton, which transformers imports, about 40% of its
   samples, torch's own import another ~15%; its trace ~20% (the 24 decoder blocks traced one by one, see
   below), the graph's probes ~7%, the search ~8%. Under 4 GB everywhere; under 10 s CPU for Swin and mBART
   at a quiet machine's rate, not for T5-3B nor AlphaFold2.
   The block copies are on by default (h-copy): the test that had them off (a line calling a block's
   Sequential of same-kind conv subclasses came out as calling unlike layers, tests/test_layer_subclasses.py)
   failed because the attribute probe the template's call puts on each class for its length looked like an
   overridden method to `layer_type`; the probe is marked and skipped (tests/test_trace_replicate.py
   `test_a_traced_template_sees_its_layer_subclasses_as_their_torch_layers`). T5-3B's decoder blocks are never
   copied: each is called with transformers' `EncoderDecoderCache`, an object every block writes its keys and
   values into, which is no plain argument (correctly traced per block).
   Since (6d24865): the search derives an invocation's layouts and split signature once per structure (its
   operand names, dims' factors, reduced labels and ranks: a block's repeats share one; plan/search.py
   `_structure`, checked against each invocation's own in tests/test_instantiate_once.py). AlphaFold2
   (2, 16), three runs of base (35b66f5) and branch alternated beside a coverage sweep (load 2-3), fastest
   of each, CPU s / peak RSS: 18.5 s, 0.80 GB -> 16.6 s, 0.64 GB (the base alone on a quiet machine the same
   hour: 17.5 s); every plan printed byte-identical (AlphaFold2, mBART, Swin, and the fixtures at tp, pp and
   auto). A py-spy profile of what is left (of ~16 s): imports 17% (torch, sympy through fake tensors,
   torch.distributed.tensor), the fake-tensor build 15%, the 142 copied and 2 traced blocks 14%, the forward
   outside them 7%, the graph's rule instantiation and probes 13%, the split candidates 18% (now mostly
   `_split_problem`, per invocation: its size arguments, read sizes and parameters are the invocation's
   own), the rest of the search 12%. No one of them halves the time: planning AlphaFold2 under 10 s is
   still open.
   Since (7886959, from h-ptime): the objects made before a phase (the model through its forward, the
   forward's records, the trace through the graph, all of it through the search) are kept out of the
   garbage collector's full passes (lifetimes.py; each pass rescanned the whole trace: 23 passes and 4.6 s
   of AlphaFold2's 27.6 s at load 5), `python -m nnscaler_cst.cli plan` ends at once when done, and a
   constraint's weight matrices are kept per node. With the structures above, h-ptime's pairs (base c535e4a,
   load 5.5-6.5, CPU s / peak RSS): AlphaFold2 29.0 s, 0.80 GB -> 15.5 s, 0.63 GB; T5-3B 13.4 -> 12.6 s;
   mBART 9.7 -> 8.0 s; Swin 5.2 -> 4.3 s; the artifact's T5 (`--tp 8`) 16.0 -> 12.1 s; scaled to a quiet
   machine by the pairs' ratios (an estimate): AlphaFold2 9.0-10.4 s, T5-3B 10.4-11.3 s. On main after the
   merge, AlphaFold2 once at load ~4: 13.6 CPU s, 0.64 GB, its plan byte-identical.
   On a quiet machine (f41f212, load 0.2-0.5, nothing else running), the same command, wall / CPU s (user +
   sys) / peak RSS: AlphaFold2 (2, 16) 12.8 s / 12.9 s / 0.64 GB; T5-3B (8, 4) 8.7 / 8.9 s / 0.76 GB; mBART
   (8, 4) 6.0 / 6.2 s / 0.57 GB; Swin (4, 8) 3.3 / 3.4 s / 0.36 GB; the artifact's T5 (`--tp 8`) 8.9 / 9.5 s /
   0.95 GB. The estimate above was low for AlphaFold2; every other setting plans in under 10 s.
   Since (c2d4f9b): a `torch.nn.init` fill of a fake weight whose values are unknown is skipped inside
   SmallConstants' mode (no mode of its own: trace/fake_constants.py), and a parameter's constructor stack
   stops at the tool's frames. AlphaFold2's build() under fake tensors 3.4 -> 2.65 s, its forward 2.3 ->
   2.7 s (it now pays the fake dispatch's first-call imports), the whole 13.3-13.4 -> 12.9-13.0 s wall, base
   and branch alternated beside the bench (load ~1.5); quiet again at 78c1fca: 13.0 and 14.4 s wall, so no
   gain is visible against the base's quiet 12.8 s. Where the rest goes (phase timers around trace_model,
   build_graph and build_plan): torch's import 1.1 s, build 2.65 s, forward 2.7 s, the rest of the trace
   0.5 s, the graph 0.8 s, the split candidates 2.25 s, the rest of the search 2.2 s. Planning AlphaFold2
   under 10 s is still open: every phase is per invocation or per parameter (14,592 ops, 4,847 parameters).
   Since (310a79c): inside a phase the collector's full passes come after 1000 young-generation passes
   instead of 10 (lifetimes.py), and `plan`'s whole command is one phase, so the model's build is one too.
   gc callbacks over AlphaFold2's `plan`: 24 full passes, 1.56 s of 2.06 s collecting -> 3 passes, 0.55 s;
   RSS 0.63 GB either way. Quiet (load 0.3), three runs: 11.5, 11.6, 11.6 s wall (11.6-11.7 s CPU); T5-3B
   8.1 s. Still over 10 s for AlphaFold2: a py-spy profile now shows build 3.4 s and forward 3.1 s under
   load (fake dispatch, about 0.2 ms an op, 11,000 of them in the build), the split candidates 2.3 s (per
   invocation: `_split_problem` reads the invocation's own size arguments, read sizes and parameters, so a
   block's repeats cannot share it without proving those equal), the rest of the search 1.6 s.
   Since (96811d7): `torch.empty`'s values are no constant in SmallConstants' mode (every small bias and norm
   weight, 64 of an Evoformer block's 93 parameters, was made for real with the random state read twice, and
   its init fill then ran on the values in FakeTensorMode's uncached path); an Evoformer block's build under
   fake tensors 36.5 -> 22.6 ms. The candidate loop's table lookups make no dict per call. AlphaFold2's `plan`
   with nothing else running (load 0.8-1.7): 10.3, 10.5, 10.8 s wall (10.4-10.9 s CPU), 0.63 GB; just over
   10 s still. What is left is torch's (fake dispatch: 4,883 `empty` and 4,883 `detach` in the build, 0.13
   and 0.09 ms each, 5,888 ops in the forward; 1.7 s of imports) or per invocation (115,647 candidate splits).
   Since (b914ec3): an invocation's split checks look up once what does not depend on the label (its size
   reads, buffers, parameters, rule: plan/search.py `_split_problems`), candidates are tuples, constraints
   selecting alike share their answers, a copied block's records are cloned without `dataclasses.replace`,
   and a size read's enclosing call is found once per source span. Quiet (load 0.7), `/usr/bin/time
   nnscaler-rewrite plan benchmarks/dgx2_alphafold2.py --tp 2 --dp 16 --cluster dgx2-v100x32 --precision fp16`:
   9.48-9.95 s wall over five runs (9.1-9.6 s CPU), 0.61 GB; the fine-tune crop's entry 9.49-9.74 s; T5-3B
   (8, 4) 7.9 s, mBART 5.4 s, Swin 2.9 s. **Every DGX-2 setting now plans under 10 s**, each plan
   byte-identical to the base's; AlphaFold2's margin is thin (a busy machine takes it over).
   Since (6376698): invocations with equal structure and split context (plan/search.py `_split_context`: a
   block's repeats) share one candidate derivation, checked against each deriving its own
   (tests/test_instantiate_once.py), and a dim's factors are tuples: AlphaFold2 9.20-9.78 s wall over four
   runs (8.9-9.4 s CPU), 0.60 GB; its fine-tune crop 9.24 s; the artifact's T5 (8, 4) 8.38 s, 1.04 GB.
   `--plan auto --devices 32` searches far more than one plan and is still over 10 s where the fixed plan is
   near it. Since 9ae287c and fc19295 (session 36) an argument-agreement conflict is named among its group's
   facts only (plan/search.py `_agreement_groups`: z3 over one group of shared arguments, not all), co-shard
   is priced only where its split without co-shard beats the fastest fitting plan (a bound, tested to hold)
   and finds a source line's region once, not per block instance, and the cut the search checks is kept for
   the rewrite. `/usr/bin/time nnscaler-rewrite plan benchmarks/dgx2_<entry>.py --plan auto --devices 32
   --cluster dgx2-v100x32 --precision fp16`, one run each, quiet, before -> after (same choices): Swin 4.7 ->
   4.4 s, mBART 8.4 -> 6.3 s, T5-3B 18.2 -> 12.7 s, the artifact's T5 14.7 -> 12.2 s, AlphaFold2 24.7 -> 19.4
   s, its fine-tune crop 29.3 -> 22.8 s, each under 1 GB. What is left of AlphaFold2's fine-tune search: its
   18 tensor-parallel splits 5 s, pricing their regions 2.7 s, 3F1B's simulated orders 3 s (464 of them),
   checking the chosen cut with plan_stages 3 s, besides the trace and graph that `plan` at a fixed tp pays.
   Since session 37 a conflict z3 names in one split search is kept by site and option name and ruled out from
   the first elimination of the graph's other searches where z3 confirms it there (T5-3B: 132 eliminations -> 43),
   a group's facts are built once per set of steps and told only their own sites' choices; 3F1B's step is read
   off a timeline walked once per order (verify/simulate.py `Timeline`, exact against the simulator); an op's
   price is kept across the splits of one tp size; a site's alike instances are priced once; a co-shard region
   and a split op's size reads are found by line, not by a scan of every op; a module's ops are indexed once per
   graph for the trunk's search, and the ops running on every stage found once per stage plan (b04ad85: 0.9 s
   less of AlphaFold2's, in-process; runs of one command drift by 2 s here). Three runs each at 8f8c85e, before
   (65b3f12) -> after, same choices, each under 1.1 GB, on a machine whose one thread's fp32 matmul runs 92
   GFLOP/s (213 on the one of earlier sessions): Swin 4.3 -> 4.1-4.6 s, mBART 6.0 -> 5.4-5.8 s, **T5-3B 13.2 -> 9.0-10.0 s**,
   the artifact's T5 12.3 -> 10.3-10.9 s (2.0 s of it importing transformers' T5, 0.7 s the co-shard regions
   it then refuses), AlphaFold2 19.7 -> 17.1-18.1 s, its fine-tune crop 22.7 -> 18.8-19.6 s. AlphaFold2's floor
   is the 7.2 s a fixed `plan` also pays (importing torch 1.4 s, the trace of its 24,133 ops 3.9 s, building
   the model in fake tensors 1.4 s of it, the instance groups 1.3 s); its search is 18 splits 3.9 s, co-shard
   1.1 s, their regions 1.1 s, the stage check 0.9 s, 3F1B's z3 orders 0.9 s, its timelines 0.7 s, the blocks
   0.7 s, each a pass over every op of 48 identical blocks x 3 recycling passes that a per-block pass would not
   repeat. Since session 38 (579cf6b, f168a96) the cost tables of one size and batch slicing are kept per graph and
   shared by the variants solved there (the ops' own prices across fused collectives too), a constraint narrows a
   site once per group of alike instances (kept across sizes), `_regions` keeps an op's own times apart from its
   producers' splits and reads those at once, and a split's batch dims are found by group: `search_auto` alone
   (after the trace, in the CLI's collector phase, the process's schedule orders kept; min of 3) AlphaFold2 9.00 ->
   7.19 s, its fine-tune crop 10.85 -> 8.88 s, T5-3B 3.37 -> 2.68 s, the same choices on all six settings. End to end, three runs each alternating
   with ff59cab on a machine whose one thread's fp32 matmul runs 82 GFLOP/s: AlphaFold2 16.9-19.4 -> 15.9-17.4 s,
   its fine-tune crop 19.6-21.1 -> 17.3-18.3 s; T5-3B (9.9-10.9 -> 9.9-10.8 s), the artifact's T5 (10.8-11.9 ->
   10.6-12.3 s), mBART and Swin within the drift. A fixed `plan` of AlphaFold2 (tp 2, dp 16) takes 9.4-9.6 s here.
2. **Strided Conv2d was priced at 2 million times its FLOPs** (fixed in 211686f, before this run): plan/cost.py
   `node_flops` counts a conv's c·kh·kw from its weight; `Conv2d(3, 512, 4, stride=4)` on (256, 3, 1536, 1536)
   is 1.86e12 FLOPs. The Swin entry still embeds its patches with reshape + Linear (same FLOPs).
3. **Encoder-decoder pipelines cut the encoder only** (fixed): the encoder's and the decoder's layers are now
   cut as one chain (plan/pipeline.py `find_chain`), in the generated code and in `auto._blocks`, which these
   tables use. Before, the decoder's layers and the head were the epilogue, on the last stage, and T5-3B at
   TP 8 x PP 4 with recompute was priced at about 1.6x the step of stages cut over both stacks.
4. **No-gradient passes were priced with a backward** (fixed): plan/cost.py `node_time` now prices an op none
   of whose outputs needs a gradient as its forward alone, and `auto._regions` leaves such ops out of what
   recompute repeats, so the recycling passes 1 and 2 of AlphaFold2 cost their forwards and save nothing
   (this script's own correction, `one_gradient_pass`, is gone; it had also divided the gradient pass's
   saved activations by 3).
5. **Co-shard refuses TP 16 on Swin**: "cannot co-shard into 16x2 pieces: `attn` has 1 along dim 1 on each
   device": the first stage's 16 heads leave one per device and co-shard cuts heads only.
6. **What `plan` and `schedule` do not price**: `plan` has no --pp/--schedule (its co-shard estimate now adds
   the forward of every statement of the co-shard regions, the matmuls too, as this script does: plan/coshard.py
   `repeated_forward`); `schedule` times stages by FLOPs, without tensor parallelism or communication.
7. **The interlaced pipeline is now the paper's** (issue 29 item 1): the vocabulary modules split over all
   tp x pp = 32 devices, each call an SPMD step of every rank (the owner paused at its call, the others between
   two of their own steps; an embedding's backward step after its owner's B), the stages in lock step. Its
   estimate is the planner's (plan/interlaced.py `estimate`: the walk's orders on the simulator's timeline at
   2D, 3D ... micro-batches until the period is steady, extrapolated) and agrees with the simulator over all 256 micro-batches (the
   tables' second part). The old design, where the other ranks waited through the owner's whole step, was
   simulated at 2.2-2.3x 1F1B's step.
8. **3F1B's estimate missed the recycling wait** (fixed): auto's 1F1B formula over the stage times priced
   3F1B's order 20% short at 8 stages: pass c + 1 of a micro-batch starts on the first stage only after pass c
   has come round all 8 stages, a micro-batch after the diagonal the table gives it, so ranks idle where the
   formula has none. The planner now prices any order other than 1F1B by the simulator's timeline
   (plan/schedules.py `simulated_seconds`), the 3F1B rows' "simulated" column is over every micro-batch.
9. **An embedding lookup was priced as a matmul over its table** (fixed): plan/cost.py `node_flops` counted an
   nn.Embedding at 2 x output x vocabulary (the vocabulary is a summed label of its dims: a split gives partial
   sums), although `is_contraction` and `node_time` priced it memory-bound; auto's FLOP balance weighed the
   artifact T5's 2,048,000-row table like its LM head: 1F1B's cut at tp 8 x pp 4 was (0, 16), (16, 32), (32, 58),
   (58, 64), stages of 0.151, 0.153, 0.360 and 0.249 s per micro-batch; now (0, 17), (17, 42), (42, 63),
   (63, 64), 0.160, 0.281, 0.292, 0.181 s (balanced by FLOPs, not time: the blocks' memory-bound ops). A lookup (an integer operand, no summed label two floating operands share) now costs its output's
   elements. The 1F1B cuts of T5-3B and mBART above were measured before this change (c7ac356).
10. **Interlaced counted 1/pp of the vocabulary state per device** (fixed): plan/interlaced.py `price` took
   what 1F1B's split leaves on one device (the whole table: the vocabulary modules are whole on tp) times tp
   over tp x pp; every device holds 1/(tp x pp) of it. At 2M and tp 8 x pp 4 that was 47 GiB per device
   instead of 5.9.
11. **`--plan auto` priced interlaced otherwise than the runtime runs it** (fixed): the search's analytic form
   (plan/auto.py `_regions`' shared part) ran 1/pp of each vocabulary call on each pipeline rank, kept its
   state at 1/pp per device, left the fused head's cross entropy whole on the last stage and cut the stages
   with the table's ops on the end stages; the runtime splits every step over all tp x pp devices. Now each
   step (the calls and a fused loss) costs 1/(tp x pp) of the op on every device, its hidden state
   all-reduced over them, the stages cut without them: on a small tied-vocabulary model it agrees with
   plan/interlaced.py `estimate` (the walk this section uses) within 4%, where it was up to 1.63x its step
   and 1.84x its memory
   (tests/test_auto_paper_plans.py `test_the_searchs_interlaced_price_is_the_walks`).
12. **3F1B priced the later passes' extra-MSA stack on the last stage** (fixed): with code before the trunk
   in the recycling loop (`z = self.extra_stack(e0, z)`, then `m, z = self.trunk(m, z)`), plan/auto.py
   `_blocks` gave every op between two passes to the last block's region, so passes 2 and 3 of the stack
   (286 of its 430 TFLOP) and its activations of the pass with gradient (20.7 GiB a protein) were priced on
   the last stage, while the rewrite runs them on the first; plan/pipeline.py `between_passes` placed a
   module's op by its innermost frame (inside the block classes, so by the op before it), and `plan_stages`
   cut the stages by the first pass's prologue only. Now an op is placed by the innermost call around it in
   the recycling function (else the outermost, the helper's call), every pass's code before the trunk is
   priced on the first stage and the cut balances with it (4 stages: stage 0 holds blocks 0-6, was 0-9;
   tests/test_3f1b.py `test_3f1b_prices_the_code_before_the_trunk_of_every_pass_on_the_first_stage`).
   Before the fix 3F1B + recompute at 4 stages "fit" in 26.8 GiB (36.50 s); it needs 88.1 GiB.
13. **`--plan auto` tried no gradient accumulation without a pipeline** (fixed): plan/auto.py
   `_micro_batch_choices` returned [1] for pp = 1, so its tp x dp plans ran a device's whole share of the
   batch at once: on AlphaFold2 with the extra-MSA stack its best tp x dp (tp=1 dp=32 zero=3 recompute)
   needed 107.7 GiB with 4 proteins at once, and it chose a 3F1B plan; on Swin it chose a Chimera pipeline.
   `--micro-batches M` now runs without a pipeline (the generated step accumulates M slices of each rank's
   share, the gradients reduced after the last; docs/training.md) and the search offers it at pp = 1.
14. **Two lists of blocks**: `find_trunk` cuts the longer list (48 Evoformer blocks against 4 extra-MSA
   blocks). At equal lengths (2 and 2, tried on the small fixture) it took the list built first, the
   extra-MSA one, and the 3F1B rewrite cut that list, all Evoformer blocks on the last stage (fixed: of
   equally long lists it takes the one holding more weights, tests/test_3f1b.py
   `test_find_trunk_takes_the_list_with_more_weights_of_two_equally_long`). With the
   helper's call under an `if` in the recycling loop (`if e0 is not None: z = self.extra_stack(e0, z)`),
   3F1B was refused: "the blocks of extra_blocks run 3 times in one forward, and no `for` loop calls it"
   (plan/pipeline.py `find_recycle` looks at the statement nearest the call, the `if`); the fixture calls
   the helper in every cycle, over an empty list when the stack is off.
15. **3F1B's estimate fell below its busiest rank's work** (fixed): plan/schedules.py `simulated_seconds`
   measured the steady period between 2D and 3D micro-batches, but 3F1B's diagonals of N passes with a heavier
   first stage (the extra-MSA stack) fill for longer: at 2 stages (5.99 / 5.73 s) the step grew 11.10, 11.00,
   11.74, then 11.98 s per 2 micro-batches from 8 on, so the extrapolation priced tp=4 dp=4 pp=2 at 187.10 s
   against 32 x 5.99 = 191.55 s of work on its first rank and 192.62 s simulated over all 32 micro-batches. It
   now simulates 2D, 3D, 4D ... micro-batches until two successive periods agree (at most 12 D, else the whole
   timeline) and never prices a step below the busiest rank's work (tests/test_simulated_period.py).

## Why these estimates are below the paper's

- **Swin, co-shard**: each side at its own best fitting configuration (since 5b4ab34 the table sweeps tp 2 to
  16, each with and without ZeRO-1, and DeepSpeed's ZeRO-3): co-shard (C=8) + ZeRO-1 at tp 2 x dp 16, 33.41 s,
  against Megatron TP + recompute + distributed optimizer at tp 2 (36.76 s): **1.10x**; against DeepSpeed ZeRO-3
  + Megatron TP + recompute at tp 2 (36.35 s): 1.09x; against that with CPU offload, as the artifact ran
  DeepSpeed (parameters and optimizer on the host: each micro-batch's shards over PCIe, the optimizer step on the
  host's CPUs; `offloaded`, at datasheet peaks), 36.78 s at tp 2: 1.10x; the artifact's own TP 8, 53.31 s: 1.60x.
  Offload moves little here: 16 bytes a parameter of a 1/32 shard (0.65 GiB a device) leave the device, and the
  link adds 0.35 s (tp 2) to 1.41 s (tp 8) a step. `--plan auto` finds co-shard on its own (C=2 with ZeRO-3,
  33.02 s). Before, the table swept tp 4 to 16 without ZeRO and reported 1.14x (co-shard at tp 4, 36.69 s, against
  Megatron + recompute at tp 4, 41.71 s): Megatron fits at tp 2 once its optimizer state is sharded (31.1 -> 26.4
  GiB), and tp 2 pays fewer all-reduces. **The term that decides is recompute's second forward**: Megatron's
  recompute adds 10.70 s at tp 2 (36.76 against 26.06 s without, which needs 106.7 GiB), co-shard's repeated
  forward of the attention core 7.34 s; the gain is only the difference. The paper's up-to-3.5x is over DeepSpeed,
  Megatron-LM and Alpa as the artifact ran them (DeepSpeed TP 8 with CPU offload; Alpa at global batch 16, see
  cupilot/evaluation/swin_32gpus.sh); this model prices neither Alpa's plans nor allocator
  fragmentation and workspace (it lets Megatron + recompute fit at TP 2 with 26.4 GiB), nor lower matmul
  efficiency at the smaller per-device shapes of a larger TP (every matmul runs at 100 TFLOP/s).
- **T5-3B and mBART, interlaced**: the interlaced pipeline moves the vocabulary's work off the first and last
  stages and spreads it over all 32 devices; at 32k (T5-3B) and 250k (mBART) tokens that work is small next to
  the layers, and what decides the comparison is communication the vocabulary steps add on every rank: this
  tool's vocabulary steps broadcast each call's input along the pipeline lines and all-reduce the embedding's
  rows and the head's input gradient over all 32 devices. The head's logits are no longer gathered: where only
  a cross entropy takes them, the head and the loss run as one vocabulary-parallel step (plan/interlaced.py
  `fused_losses`, runtime `vocab_cross_entropy`: the row maxima, then the exp sums and target logits,
  all-reduced over all devices, as Megatron's 1F1B + TP does over its tp group). A call in
  the middle of a stage's step (the decoder's embedding, after encoder layers on the same stage) also holds
  every rank until the owner reaches it (the notes' "calls at").
- **T5 at the artifact's setting** (2,048,000 tokens, hidden 6144): as the paper says, Megatron-LM's 1F1B + TP
  does not fit: no pipeline of 2 to 32 stages, tp, micro-batch count, sequence parallelism, recompute or stage
  cut brings its table's stages under 32 GB (16 x 2 + recompute + SP, searched cut, 31.6 GiB at 101.82 s, is
  the nearest), because 1F1B keeps the whole table (12.6 billion parameters, 16 bytes of state each: fp32
  weights and gradients and AdamW's two moments, the same 16 bytes as Megatron-LM's fp16 weights and
  gradients plus fp32 masters and moments) on the first stage, the stage that calls the decoder's embedding
  and the last stage (Megatron-LM's T5 keeps it there too). The one Megatron-LM configuration that fits is TP 32
  without a pipeline + SP + recompute (29.8 GiB, 965.52 s: every layer's all-reduces over both nodes'
  InfiniBand), so interlaced is **20.06x** faster here. From 0199347 to f1e8ca8 it was priced just over the
  budget: the recompute rows of every model rose by 0.2-1.5 GiB, because find_trunk's new tie-break (equal
  lists broken by weights) made T5's decoder the representative list, and `block_activations` counted the
  encoder's output, which every decoder block reads, once per block (T5-3B's `estimate_config` at 8 x 4, 256
  micro-batches, recompute: 8.207 -> 8.425 GiB); a checkpoint holds a reference to it, one tensor for all
  blocks, and since f1e8ca8 it is counted once (8.222 GiB; T5-3B's 1F1B + TP + recompute row 1.9 -> 1.7 GiB).
  Since 180c766 auto keeps it only on the stages whose blocks read it and hands it across a cut only from where
  it is made to its last reader, not between the encoder's stages (T5-3B tp 8 x pp 4, 256 micro-batches,
  recompute: 11.587 -> 11.586 s, 1.665 -> 1.649 GiB: a small term; the tables here are from d9ec343).
  No 1F1B pipeline fits, as the paper reports. Interlaced fits at every tp x pp and is fastest
  at **1 x 32 with recompute (48.13 s, 27.2 GiB; the whole benchmark re-run at d9ec343)**: its vocabulary is split over all 32 devices whatever tp is,
  so its layers need no tensor parallelism (two layers a stage, no TP all-reduce), which 1F1B cannot do (at
  1 x 32 its last stage's head alone, a 2,048,000-wide matmul on one device, takes longer than the rest of a
  stage). `--plan auto --devices 32` finds this plan on its own since 19b7ba2 (45.04 s by its analytic price
  at 784d1c2; the walk's 48.13 s and 27.2 GiB). At 82f6361 it fit nothing: its analytic memory gave
  the plan 31.1 GiB (stage 0: 31.09 against the walk's 27.88 GiB, stage 1: 30.75 / 26.22, stage 31: 25.12 /
  25.14, `estimate_config` against plan/interlaced.py `price`). The two accountings differed in two terms:
  auto's `_stage_times` kept a stage's block activations for 1F1B's D - i micro-batches in flight, where the
  interlaced table's warm-up keeps 2 (D - 1 - i) + 1 (too low in auto); and auto's `_stages` spread the
  vocabulary steps' saved tensors over every stage (shared / pp) times that stage's micro-batches in flight,
  where they live while the step's owner holds its micro-batch (the head's: one, at the last stage; too high
  in auto). 19b7ba2 counts both as the schedule runs them; every stage now within 0.4% of the walk (the first
  stage 26.45 against 27.88 GiB: the walk prices the encoder's embedding in stage 0's region, whole on tp,
  where the step runs it split over all 32 devices). The column of the table below is this run's.
- **The vocabulary at which interlaced wins** (the sweep): at 1,024,000 tokens the best fitting 1F1B + TP is
  16 x 2 with SP (68.42 s) and interlaced 1 x 32 + recompute takes 44.70 s: **1.53x**, above the issue's
  1.5x and below the paper's 2.2x. Up to 512,000 tokens 1F1B fits at 4 x 8 and is faster (0.74x at 32,000,
  0.90x at 512,000). `--plan auto` chooses interlaced 1 x 32 + recompute at 1,024,000 (41.47 s by its
  analytic price). Since 784d1c2 it searches the stage cut of its 1F1B and 3F1B configurations (plan/auto.py
  `_search_cuts`: seeds fitting a rough per-stage memory and balancing the priced stage times, then one cut
  point at a time, each cut priced whole), and from 32,000 to 512,000 it chooses 1F1B + TP + SP at 4 x 8 with
  a cut of its own, as the table finds 1F1B faster there: 30.78 s at 32,000, 34.50 s at 128,000, 34.52 s at
  256,000, 38.69 s at 512,000. Its cuts (`stages=5,15,25,34,42,50,58` at 128,000: 5, 10, 10, 9, 8, 8, 8 and 6
  blocks a stage, the first holding the embedding and the last the head the lightest) were faster than the
  table's own search found at 128,000 and 256,000 (35.93 and 38.65 s, from FLOP, even and vocabulary-light
  seeds); since 5b4ab34 the table's search also starts from auto's seeds and finds the same cuts (the 1F1B
  column equals auto's choice from 32,000 to 512,000). At 1,024,000 and 2,048,000 neither search finds a
  fitting 4 x 8 cut. Before 784d1c2, auto priced 1F1B at the FLOP-balanced cut only and chose interlaced
  from 128,000 to 512,000. The "fits nothing" of the f41f212
  run was the 2,048,000 row (above), not 1,024,000; since 19b7ba2 auto chooses interlaced there too (45.04 s).
  The sweep prices pipelines only (tp x pp from 1 x 32 to 16 x 2): at 2,048,000 it finds no 1F1B, where the
  section above finds TP 32 without a pipeline (965.52 s). **The term that decides is memory**: 1F1B's step at 4 x 8 grows from 30.78 s to 38.69 s
  over those vocabularies; at 1,024,000 the table's stages (25 GB of state at tp 4 each, plus a block, plus
  the head's logits on the last) no longer fit at 4 x 8 under any cut the search tried, and the next
  fitting shape, 16 x 2, pays tp 16's all-reduces. Interlaced's step grows only from 41.38 s to 48.13 s
  from 32,000 to 2,048,000 tokens: its vocabulary steps (42.5 ms a micro-batch at 2,048,000, of which
  24.3 ms compute over 32 devices) and their collectives (sized by the hidden state and the tokens, not the
  vocabulary: each embedding's rows all-reduced, the head's input broadcast and its gradient all-reduced
  over all 32 devices, across InfiniBand). At 32,000 tokens those collectives and the lock-step walk's waits
  (the decoder's embedding, called in the middle of a stage's step, holds every rank until its owner
  reaches it; the warm-up keeps 2 (D - 1 - i) + 1 micro-batches in flight instead of D - i) are what
  interlaced pays over 1F1B. The state bytes are the
  tool's own (plan/zero.py), not changed for this comparison; the artifact trains with fairseq's Adam
  (examples/adam.py: fp16 weights and gradients, fp32 moments, 12 bytes a parameter), under which 1F1B
  would fit at larger vocabularies and the crossover move up.
- **AlphaFold2, 3F1B**: the fixture has triangle attention around the starting and the ending node in every
  block (N_res^3 scores per head) and the extra-MSA stack (4 blocks over 1024 extra sequences, c_e 64, global
  column attention) before the blocks in every cycle; it has no templates or structure module. The extra-MSA
  stack is heavy: 143 TFLOP a pass at the global batch, about 5.7 Evoformer blocks, and 20.7 GiB of saved
  activations per protein in the pass with gradient (its row attention's 1024 x 8 x 256 x 256 scores among
  them). `--recompute` now checkpoints its blocks too (every list of repeated blocks a loop calls, plan/
  recompute.py `other_lists`; before, only the 48 Evoformer blocks the pipeline cuts, and no 3F1B plan fit).
  Every 3F1B plan with recompute fits (9.1-9.7 GiB), and DP + recompute (10.0 GiB) stays faster: 3F1B's best,
  2 stages, takes 27.04 s against 25.60 s, its first stage loaded with the stack's passes and its bubble; `--plan
  auto` chooses DP with 2 micro-batches, ZeRO-3 and recompute (24.38 s). With recompute a pipeline keeps a
  block's inputs per micro-batch of one protein as DP does, and DP's gradient sync of 84 M parameters is small,
  so at these sizes 3F1B pays only where the devices cannot all take proteins of their own. `--plan auto`'s
  stage-cut search (plan/auto.py `_search_cuts`, since 784d1c2) does not change that: 3F1B's micro-batches of
  its stages' mean time already exceed the flat plan, 8 x (3.284 + 3.112) / 2 = 25.58 s against auto's
  DP + ZeRO-3 + recompute at 24.38 s, so no cut can help it.
  **At AlphaFold2's fine-tuning sizes `--plan auto` chooses 3F1B** (crop 384, 512 clusters, 5120 extra
  sequences): tp 2 x dp 4 x pp 4, ZeRO-1, recompute, its own cut `stages=1,17,33`, 174.61 s, 29.6 GiB, 1.06x
  over the fastest fitting plan without a pipeline (tp 2 x dp 16 with sequence parallelism and ZeRO-3,
  185.93 s) and 1.07x over TP + DP at tp 4 (186.78 s). One extra-MSA block of one protein rebuilds 36.9 GiB
  in the backward, so nothing fits without tensor parallelism; what pays is where the memory sits. Under
  recompute a device keeps the inputs of the blocks it runs, for the micro-batches in flight on it, beside the
  one block rebuilt in the backward: without a pipeline one protein's inputs of all 48 blocks sit beside the
  extra-MSA rebuild, and tp 2 needs 34.6 GiB (33.5 with ZeRO-3); a pipeline's first stage, cut after one
  block, holds the same rebuild beside its one block's inputs for the micro-batches in flight (29.6 GiB),
  the other stages no extra-MSA block, so tp 2 fits where the flat plan needs tp 4 or sequence parallelism.
  At the FLOP-balanced cut the same 3F1B needs 34.9 GiB: the search's cut is what makes it fit (BENCH rows
  for pipelines are priced at the searched cut since 4dc011b, the FLOP cut's figures in their notes). Below
  the paper's (3F1B vs DAP: not found; up to 3.5x across Swin and AlphaFold2 in the abstract), the terms that
  hold the estimate at 1.06x are the bubble (8.63 s, 12.9% at 4 stages; the simulator's timeline of the
  3F1B order gives the same 174.61 s) and the first stage's light load (3.78 s a micro-batch against 5.19 s:
  memory keeps blocks off it). The fit is thin: 29.6 of 29.8 GiB, inside the memory model's measured error
  (benchmarks/BENCH_MEMORY.md: measured / estimate 0.91-1.04 on CPU processes, 1.04 with recompute), so this
  estimate does not settle that it fits a V100; the next fitting 3F1B (tp 4 x dp 4 x pp 2, stages=19, 193.24 s,
  24.2 GiB) trails the flat plans. This model also prices AlphaFold2's many small ops at full matmul rate and
  memory bandwidth, without per-kernel launch overheads beyond matmul_overhead, and neither chunking
  (AlphaFold2's and FastFold's way to cut the scores' memory) nor DAP's all-to-alls. nnScaler's own
  AlphaFold2 benchmark (msrasys/nnscaler, examples/alphafold2/README.md: fp16, one device, which it does not
  name) measured the Evoformer stack's training at s, r = 128, 256 at a 4.4 GB peak with its larger recompute
  policy (8.1 GB with the smaller), and at 512, 384 at 17.8 GB; the extra-MSA stack at 5120 x 384 with
  chunking at 16.2 GB: one protein fits one 32 GB V100, so data parallelism needs no DAP at initial training,
  as this model finds. Chunking (not priced here) would shrink the fine-tuning rebuild too and favour the
  flat plans: 3F1B's win at fine-tuning holds for this unchunked model.
"""


T5_KEY = "T5 at the artifact's setting (vocabulary 2,048,000, hidden 6144): interlaced vs Megatron-LM"
T5_HALF_KEY = "T5 at half the artifact's vocabulary (1,024,000, hidden 6144): interlaced vs Megatron-LM"
T5_REPORTED = "2.2x (the issue's reading of the paper; the artifact's T5 setting)"


def summary_line(key: str, paper, base, reported: str) -> str:
    if paper is None or base is None:
        return (f"| {key} | {'none fits' if paper is None else paper[0] + ': ' + paper[1].config.describe()} | "
                f"{'' if paper is None else f'{paper[1].seconds:.2f}'} | "
                f"{'none fits' if base is None else base[0] + ': ' + base[1].config.describe()} | "
                f"{'' if base is None else f'{base[1].seconds:.2f}'} | "
                f"{'only the paper' + chr(39) + 's plan fits' if base is None and paper else ''} | {reported} |")
    return (f"| {key} | {paper[0]}: {paper[1].config.describe()} | {paper[1].seconds:.2f} | {base[0]}: "
            f"{base[1].config.describe()} | {base[1].seconds:.2f} | {base[1].seconds / paper[1].seconds:.2f}x | "
            f"{reported} |")


def t5_sections(body: list[str]) -> dict:
    """The two T5 sections; their summary rows: the artifact's vocabulary, and half of it (from the sweep)."""
    out = t5_artifact(body)
    half = next(r for r in t5_vocab_sweep(body) if r[0] == 1_024_000)
    return {T5_KEY: (out["paper"], out["base"], T5_REPORTED), T5_HALF_KEY: (half[2], half[1], T5_REPORTED)}


def only_t5(started: float, load_before: str) -> None:
    """`--only t5-artifact`: the T5 sections and their summary rows rewritten in the BENCH_DGX2.md there is,
    the other sections (and the findings, edited by hand since) left as they were measured."""
    path = ROOT / "benchmarks" / "BENCH_DGX2.md"
    text = path.read_text()
    body = [f"Measured at {revision()} by `python benchmarks/bench_dgx2.py --only t5-artifact` (this section and "
            f"its sweep only; load {load_before} at the start).", ""]
    summary = t5_sections(body)
    section = "\n".join(["## T5 at the artifact's setting: interlaced against the best fitting 1F1B + Megatron TP", "",
                         *body[:2], *body[4:]]) + "\n"
    start = text.find("## T5 at the artifact's setting")
    end = text.index("## AlphaFold2")
    text = text[:start if start >= 0 else end] + section + text[end:]
    lines = [l for l in text.split("\n") if not l.startswith("| T5 at ")]     # this run's rows replace them
    at = next(i for i, l in enumerate(lines) if l.startswith("| mBART-large")) + 1
    lines[at:at] = [summary_line(key, *row) for key, row in summary.items()]
    text = "\n".join(lines)     # the findings (edited by hand since) as they are; this run's time at the end
    text = "\n".join(l for l in text.rstrip("\n").split("\n") if not l.startswith("T5 sections:")) + "\n" + \
        f"T5 sections: {time.perf_counter() - started:.0f} s wall, load {load_before} at the start and {load()} at the end.\n"
    path.write_text(text)
    print("wrote benchmarks/BENCH_DGX2.md (T5 at the artifact's setting)")


def swin_results(rows) -> dict:
    """The summary rows of the Swin section: co-shard against Megatron TP, and against DeepSpeed's ZeRO-3
    without and with CPU offload (the artifact's DeepSpeed)."""
    coshard = best([r for r in rows if r[0].startswith("co-shard")])
    deepspeed = [r for r in rows if r[0].startswith("DeepSpeed")]
    return {
        "Swin-H-like: co-shard vs Megatron TP": (
            coshard, best([r for r in rows if r[0].startswith("Megatron")]),
            "up to 3.5x over DeepSpeed/Megatron-LM/Alpa across Swin and AlphaFold2 (abstract); Swin vs Megatron TP: "
            "not found"),
        "Swin-H-like: co-shard vs DeepSpeed ZeRO-3 (no offload)": (
            coshard, best([r for r in deepspeed if not r[0].endswith("CPU offload")]),
            "up to 3.5x (abstract); Swin vs DeepSpeed: not found"),
        SWIN_OFFLOAD_KEY: (
            coshard, best([r for r in deepspeed if r[0].endswith("CPU offload")]),
            "up to 3.5x (abstract); Swin vs DeepSpeed: not found")}


SWIN_OFFLOAD_KEY = "Swin-H-like: co-shard vs DeepSpeed ZeRO-3 + CPU offload (as the artifact ran DeepSpeed)"


def only_swin(started: float, load_before: str) -> None:
    """`--only swin`: the Swin section and its summary rows rewritten in the BENCH_DGX2.md there is."""
    body: list[str] = []
    results = swin_results(swin(body)["rows"])
    rewrite_section("swin", "## Swin-Transformer", "No picture: co-shard", "| Swin-H-like", body, results, started,
                    load_before, gap="\n\n")


def rewrite_section(option: str, heading: str, until: str, row_prefix: str, body: list[str], results: dict,
                    started: float, load_before: str, gap: str = "\n") -> None:
    """`--only OPTION`: one section (from `heading` to `until`) and its summary rows rewritten in the
    BENCH_DGX2.md there is, the other sections (and the findings, edited by hand since) left as they were."""
    path = ROOT / "benchmarks" / "BENCH_DGX2.md"
    text = path.read_text()
    body[2:2] = [f"Measured at {revision()} by `python benchmarks/bench_dgx2.py --only {option}` (this section "
                 f"only: {time.perf_counter() - started:.0f} s wall, load {load_before} at the start and {load()} "
                 "at the end).", ""]
    start, end = text.index(heading), text.index(until)
    lines = (text[:start] + "\n".join(body) + gap + text[end:]).split("\n")
    for key, (paper, base, reported) in results.items():
        at = next((i for i, l in enumerate(lines) if l.startswith(f"| {key} |")), None)
        if at is None:                  # a new row: after the section's last one
            at = max(i for i, l in enumerate(lines) if l.startswith(row_prefix)) + 1
            lines.insert(at, "")
        lines[at] = summary_line(key, paper, base, reported)
    path.write_text("\n".join(lines))
    print(f"wrote benchmarks/BENCH_DGX2.md ({option})")


def alphafold2_results(out: dict) -> dict:
    """The summary rows of the AlphaFold2 section."""
    return {"AlphaFold2: 3F1B vs TP + DP (DAP-like)": (out["paper"], out["base"],
                                                      "up to 3.5x (abstract, with Swin); 3F1B vs DAP: not found"),
            "AlphaFold2: 3F1B vs DP alone (not the paper's baseline)": (out["paper"], out["dp"], "-"),
            AF2_FINE_KEY: (out["fine"]["paper"], out["fine"]["base"], "3F1B vs DAP: not found")}


AF2_FINE_KEY = "AlphaFold2 at fine-tuning sizes (crop 384, 512 + 5120 extra sequences): 3F1B vs TP + DP"


def only_alphafold2(started: float, load_before: str) -> None:
    """`--only alphafold2`: the AlphaFold2 section and its summary rows rewritten in the BENCH_DGX2.md there is."""
    body: list[str] = []
    results = alphafold2_results(alphafold2(body))
    rewrite_section("alphafold2", "## AlphaFold2", "## Findings", "| AlphaFold2", body, results, started, load_before)


def main() -> None:
    started, load_before = time.perf_counter(), load()
    if sys.argv[1:] == ["--only", "t5-artifact"]:
        only_t5(started, load_before)
        return
    if sys.argv[1:] == ["--only", "alphafold2"]:
        only_alphafold2(started, load_before)
        return
    if sys.argv[1:] == ["--only", "swin"]:
        only_swin(started, load_before)
        return
    lines = ["# The nnScaler paper's comparison on its DGX-2 cluster, priced by this tool's cost model", "",
             f"Measured at {revision()} on this machine (2 cores shared with other sessions; load {load_before} at the "
             "start). `python benchmarks/bench_dgx2.py`. Cluster `rules/devices/dgx2-v100x32.toml` (32 V100: 16 per "
             "node on NVSwitch, 150 GB/s per direction, 12.5 GB/s InfiniBand between the 2 nodes; fp16 matmuls "
             "at 100 TFLOP/s, other ops at 600 GB/s: H100 efficiencies scaled, not measured on a V100), `--precision "
             "fp16`, 32 GB per device. Every figure is an estimate of this cost model; nothing ran on a GPU.", "",
             PAPER, ""]
    body: list[str] = []
    results = {}
    swin_rows = swin(body)["rows"]
    results.update(swin_results(swin_rows))
    body += ["", "No picture: co-shard runs no pipeline (`schedule` draws pipelines only).", ""]
    for entry, title in (("dgx2_t5_3b.py", "T5-3B"), ("dgx2_mbart.py", "mBART-large")):
        out = encoder_decoder(body, entry, title)
        results[f"{title}: interlaced vs 1F1B + TP"] = (out["paper"], out["base"], "not found")
    results.update(t5_sections(body))
    results.update(alphafold2_results(alphafold2(body)))
    lines += ["## Summary: the fastest plan that fits 32 GB on each side", "",
              "| model: comparison | paper's plan | est. step s | baseline | est. step s | est. speedup | paper's reported |",
              "|---|---|---|---|---|---|---|"]
    lines += [summary_line(key, paper, base, reported) for key, (paper, base, reported) in results.items()]
    lines += ["", *body, FINDINGS,
              f"Whole benchmark: {time.perf_counter() - started:.0f} s wall, load {load_before} at the start and {load()} "
              "at the end.", ""]
    (ROOT / "benchmarks" / "BENCH_DGX2.md").write_text("\n".join(lines) + "\n")
    print("wrote benchmarks/BENCH_DGX2.md")


if __name__ == "__main__":
    main()
