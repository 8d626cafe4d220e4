"""Measure this machine for the cpu-gloo device spec (rules/devices/cpu-gloo.toml).

    python benchmarks/calibrate_cpu.py            # prints the measured figures and the spec
    python benchmarks/calibrate_cpu.py --write    # and writes them into rules/devices/cpu-gloo.toml

A rank of the generated code is one process with one intra-op thread (verify and the launcher
set OMP_NUM_THREADS=1), so everything is measured so: one thread, and for the collectives two
such processes over gloo on loopback. Each figure is the median of several shapes, each shape
timed as the best of a few runs, the way the cost model uses it (plan/cost.py):

- matmul rate per dtype: 2·m·n·k / time over matmuls of 0.1 GFLOP and more;
- matmul overhead: what a small matmul takes beyond its FLOPs at that rate; and how skinny
  matmuls (few rows) fall below the rate;
- memory bandwidth: bytes read + written / time over memory-bound ops (add, gelu, softmax,
  layer_norm, masked_fill, cross_entropy, embedding) on tensors of 1-8 M elements;
- op overhead: the time of an op on a handful of elements under autograd, forward and backward
  (dispatch, allocation, the autograd graph), per forward op as the cost model counts it;
- optimizer: torch.optim.AdamW's step (what the generated train.py runs) per parameter;
- links: gloo all-reduce between two processes, fitted as latency + 2·(n-1)/n·bytes/bandwidth.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPEC = ROOT / "rules" / "devices" / "cpu-gloo.toml"


def best_seconds(fn, repeat: int = 5, min_time: float = 0.05) -> float:
    """The best of `repeat` timings, each running fn enough times to last min_time."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_time / once))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def matmul_rate(dtype: torch.dtype, shapes) -> float:
    rates = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        rates.append(2 * m * k * n / best_seconds(lambda: a @ b, repeat=3))
    return statistics.median(rates)


def matmul_overhead(rate: float) -> float:
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    return max(best_seconds(lambda: a @ b) - 2 * 32 ** 3 / rate, 0.0)


def matmul_half_rows(rate: float) -> float:
    """h in rate / (1 + h / rows): matmuls of 32-256 rows by 1024 x 1024 (the median fit)."""
    fits = []
    for rows in (32, 64, 128, 256):
        a, b = torch.randn(rows, 1024), torch.randn(1024, 1024)
        measured = 2 * rows * 1024 * 1024 / best_seconds(lambda: a @ b, repeat=3)
        fits.append(max(rows * (rate / measured - 1.0), 0.0))
    return statistics.median(fits)


def memory_bound_ops(elements: int):
    """(name, fn, bytes read + written) of memory-bound ops on about `elements` floats."""
    rows, cols = elements // 1024, 1024
    x, y = torch.randn(rows, cols), torch.randn(rows, cols)
    mask = torch.rand(rows, cols) < 0.5
    weight, bias = torch.ones(cols), torch.zeros(cols)
    labels = torch.randint(0, cols, (rows,))
    table, ids = torch.randn(rows, cols), torch.randint(0, rows, (rows,))
    f = torch.nn.functional
    size = 4 * rows * cols
    return [("add", lambda: x + y, 3 * size),
            ("gelu", lambda: f.gelu(x), 2 * size),
            ("softmax", lambda: x.softmax(-1), 2 * size),
            ("layer_norm", lambda: f.layer_norm(x, (cols,), weight, bias), 2 * size),
            ("masked_fill", lambda: x.masked_fill(mask, 0.0), 2 * size + size // 4),
            ("cross_entropy", lambda: f.cross_entropy(x, labels), size),
            ("embedding", lambda: f.embedding(ids, table), 2 * size)]


def memory_bandwidth() -> tuple[float, dict[str, float]]:
    per_op = {}
    for elements in (1 << 20, 1 << 23):
        for name, fn, nbytes in memory_bound_ops(elements):
            per_op.setdefault(name, []).append(nbytes / best_seconds(fn, repeat=3))
    medians = {name: statistics.median(v) for name, v in per_op.items()}
    return statistics.median([r for v in per_op.values() for r in v]), medians


def op_overhead(chain: int = 64) -> float:
    """Per forward op, as node_time counts it: a chain of elementwise ops on 8 elements, forward and
    backward under autograd (a training step's dispatch, graph building and backward nodes),
    over the chain's 1 + MEMORY_BOUND_BACKWARD forward-op units."""
    from nnscaler_cst.plan.cost import MEMORY_BOUND_BACKWARD
    x = torch.randn(8, requires_grad=True)

    def step():
        h = x
        for _ in range(chain):
            h = h * 1.01
        h.sum().backward()
    return best_seconds(step) / (chain * (1 + MEMORY_BOUND_BACKWARD))


def optimizer_seconds_per_param() -> float:
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return best_seconds(optimizer.step, repeat=3) / sum(p.numel() for p in params)


def _all_reduce_rank(rank: int, port: int, sizes, queue) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        runs = max(3, min(200, (1 << 26) // nbytes))     # the same count on both ranks: each call pairs up
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(runs):
                dist.all_reduce(x)
            best = min(best, (time.perf_counter() - start) / runs)
        times[nbytes] = best
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def all_reduce_link() -> tuple[float, float, dict[int, float]]:
    """(latency s, bandwidth bytes/s) of two gloo processes, least squares over the sizes."""
    import socket
    import torch.multiprocessing as mp
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get(timeout=600)
    for p in procs:
        p.join()
    # t = latency + bytes / bandwidth (for n = 2, 2·(n-1)/n = 1): least squares
    xs, ys = [float(b) for b in sizes], [times[b] for b in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = max(my - slope * mx, times[sizes[0]] / 2)
    return latency, 1.0 / slope, times


def measure() -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fp32 = matmul_rate(torch.float32, [(512, 512, 512), (1024, 1024, 1024), (2048, 512, 1024), (256, 2048, 2048)])
    bf16 = matmul_rate(torch.bfloat16, [(256, 256, 256), (512, 256, 512)])
    bandwidth, per_op = memory_bandwidth()
    latency, link, reduce_times = all_reduce_link()
    return {"fp32": fp32, "bf16": bf16, "matmul_overhead": matmul_overhead(fp32), "half_rows": matmul_half_rows(fp32), "memory_bandwidth": bandwidth,
            "per_op": per_op, "op_overhead": op_overhead(), "optimizer": optimizer_seconds_per_param(),
            "latency": latency, "link": link, "reduce_times": reduce_times}


def spec_text(m: dict) -> str:
    stamp = time.strftime("%Y-%m-%d")
    ops = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in m["per_op"].items())
    return f"""# This machine's kind: CPU processes talking gloo over loopback, one intra-op thread each
# (as verify and the launcher run the ranks). Measured by `python benchmarks/calibrate_cpu.py
# --write` on {stamp} ({os.cpu_count()} cores, torch {torch.__version__}); rerun it on another machine.
[device]
name = "cpu-gloo"
flops = {m['fp32']:.3g}          # FLOP/s for callers that price FLOPs without a dtype: the fp32 matmul rate
memory = 8e9          # bytes per process
memory_bandwidth = {m['memory_bandwidth']:.3g}   # bytes/s read + written, median over memory-bound ops of 1-8 M
                            # elements (GB/s: {ops})
matmul_overhead = {m['matmul_overhead']:.3g}   # seconds per matmul beyond its FLOPs (a 32^3 matmul)
matmul_half_rows = {m['half_rows']:.3g}   # skinny matmuls: 32-256 rows x 1024 x 1024 run at rate / (1 + this / rows)
op_overhead = {m['op_overhead']:.3g}       # seconds per other op beyond its bytes (ops on 8 elements under autograd)
optimizer_seconds_per_param = {m['optimizer']:.3g}   # torch.optim.AdamW's step, 16 M parameters
[device.matmul]       # FLOP/s, median over matmuls of 0.03-2 GFLOP
fp32 = {m['fp32']:.3g}
tf32 = {m['fp32']:.3g}           # no tf32 units on a CPU: fp32
bf16 = {m['bf16']:.3g}           # bf16 matmuls without bf16 units run far below fp32
[cluster]
devices_per_node = 64
intra_bandwidth = {m['link']:.3g}   # bytes/s: gloo all-reduce of 1 KB-64 MB between two processes,
inter_bandwidth = {m['link'] / 2:.3g}   # fitted as latency + bytes / bandwidth; loopback has no second tier: half
latency = {m['latency']:.3g}          # seconds per collective
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {SPEC.relative_to(ROOT)}")
    args = parser.parse_args()
    m = measure()
    print(f"matmul fp32 {m['fp32'] / 1e9:.1f} GFLOP/s, bf16 {m['bf16'] / 1e9:.2f} GFLOP/s, "
          f"overhead {m['matmul_overhead'] * 1e6:.1f} us, half rows {m['half_rows']:.0f}")
    print(f"memory-bound {m['memory_bandwidth'] / 1e9:.2f} GB/s "
          f"({', '.join(f'{k} {v / 1e9:.2f}' for k, v in m['per_op'].items())}); op overhead "
          f"{m['op_overhead'] * 1e6:.1f} us")
    print(f"AdamW {m['optimizer'] * 1e9:.2f} ns per parameter")
    print(f"gloo all-reduce: latency {m['latency'] * 1e6:.0f} us, {m['link'] / 1e9:.2f} GB/s "
          f"({', '.join(f'{b} B {t * 1e3:.2f} ms' for b, t in m['reduce_times'].items())})")
    text = spec_text(m)
    if args.write:
        SPEC.write_text(text)
        print(f"wrote {SPEC.relative_to(ROOT)}")
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
