#!/usr/bin/env python
"""One pipeline hand-off against one plain isend of the same tensor, on gloo (2 processes).

    python benchmarks/bench_handoff.py [--old-rev REV] [--shape 2,64,256] [--rounds 10]
        [--pings 60] [--json out.json]

Rank 0 and rank 1 ping-pong one micro-batch's activation (default 2 x 64 x 256 fp32, the
activation of benchmarks/bench_pipeline.py at M = 8). The one-way latency is half the round
trip. Variants, taking turns in rounds with a rotating order, so that a drift in machine load
hits them alike:

* ``isend``: ``dist.isend(x).wait()`` on one side, ``dist.recv(y)`` on the other (baseline);
* ``handoff``: this checkout's ``_comm.send_values`` / ``recv_values``, the P2POps that the
  generated train.py posts with ``batch_isend_irecv``.  The header goes with the first ping
  only, as with a pipeline's first micro-batch: one message per hand-off after that;
* ``handoff_old``: ``send_values`` / ``recv_values`` of ``_comm.py`` at ``--old-rev``
  (default 3fabb37, before the hand-off rework): an int64 size, the pickled header and the
  tensor, three messages per hand-off.  Skipped with ``--old-rev ''``.

Per round and variant, the figure is the median over the pings after the first fifth.  The
ratio to ``isend`` is taken per round (paired) and its median over rounds is reported.
Every process runs one intra-op thread.
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
from _common import launch_ranks, load_file  # noqa: E402


def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--old", default="")
    p.add_argument("--shape", default="2,64,256")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pings", type=int, default=60)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    new = load_file(ROOT / "nnscaler_cst" / "runtime" / "_comm.py", "_comm_new")
    old = load_file(Path(a.old), "_comm_old") if a.old else None
    x = torch.randn(*(int(s) for s in a.shape.split(",")))
    y = torch.empty_like(x)
    peer = 1 - rank

    def isend(i):
        if rank == 0:
            dist.isend(x, peer, tag=7).wait()
            dist.recv(y, peer, tag=7)
        else:
            dist.recv(y, peer, tag=7)
            dist.isend(x, peer, tag=7).wait()

    def via(comm, stage):
        def ping(i):
            if rank == 0:
                for request in comm.send_values((x,), peer, stage, i):
                    request.wait()
                comm.recv_values(peer, stage, i)
            else:
                comm.recv_values(peer, stage, i)
                for request in comm.send_values((x,), peer, stage, i):
                    request.wait()
        return ping

    variants = {"isend": isend, "handoff": via(new, 1)}
    if old is not None:
        variants["handoff_old"] = via(old, 2)
    names = list(variants)
    per_round = {n: [] for n in names}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            new._clear_handoff_cache()      # every round's first hand-off sends the header again
            dist.barrier()
            rtts = []
            for i in range(a.pings):
                t0 = time.perf_counter()
                variants[name](i)
                rtts.append(time.perf_counter() - t0)
            per_round[name].append(statistics.median(rtts[a.pings // 5:]) / 2)
    if rank == 0:
        (Path(a.workdir) / "handoff.json").write_text(json.dumps({"one_way_s": per_round}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        return rank_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-rev", default="3fabb37", help="revision for handoff_old ('' to skip)")
    p.add_argument("--shape", default="2,64,256")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pings", type=int, default=60)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        old = ""
        if a.old_rev:
            old = str(Path(tmp) / "_comm_old.py")
            Path(old).write_bytes(subprocess.run(
                ["git", "show", f"{a.old_rev}:nnscaler_cst/runtime/_comm.py"], cwd=ROOT,
                capture_output=True, check=True).stdout)
        load = os.getloadavg()[0]
        launch_ranks([sys.executable, str(Path(__file__).resolve()), "_rank", tmp, "--old", old,
                      "--shape", a.shape, "--rounds", str(a.rounds), "--pings", str(a.pings)], 2, 1800.0)
        per_round = json.loads((Path(tmp) / "handoff.json").read_text())["one_way_s"]
    med = statistics.median
    print(f"one-way latency of a {a.shape} fp32 tensor, gloo, 2 processes; {a.rounds} rounds x "
          f"{a.pings} pings per variant; 1-min loadavg {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| variant | one-way ms (median over rounds) | min / max over rounds | / isend (paired per round) |")
    print("|---|---|---|---|")
    result = {"shape": a.shape, "rounds": a.rounds, "pings": a.pings, "old_rev": a.old_rev, "variants": {}}
    for name, values in per_round.items():
        ratio = med([v / b for v, b in zip(values, per_round["isend"])])
        result["variants"][name] = {"one_way_s": values, "median_s": med(values), "ratio_to_isend": ratio}
        print(f"| {name} | {med(values) * 1e3:.3f} | {min(values) * 1e3:.3f} / {max(values) * 1e3:.3f} "
              f"| {ratio:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
