#!/usr/bin/env python
"""What co-sharding the attention core costs and saves, against plain Megatron, same run.

    python benchmarks/bench_coshard.py [--steps 6] [--rounds 3] [--json out.json]

A benchmark-local copy of fixtures/gpt.py with a longer sequence (so the (B, heads, T, T)
attention matrices dominate activations: n_embd 128, n_head 8, block 256, batch 4 x 256
tokens) is rewritten twice at TP=2: `--plan megatron` and `--plan coshard` (the softmax of
each block split into 2·|tp| pieces, two per device, recomputed in backward). Two gloo
processes (one thread each) hold both variants and alternate, in rounds, on the same
batches from the same initial weights. Per variant, max over ranks:

* ``step``: median wall time of forward + backward + AdamW step (seconds).
* ``saved``: bytes autograd keeps for backward during one forward (saved_tensors_hooks,
  distinct storages): the activation memory of a step.

Printed as coshard / megatron ratios. The losses of the two variants are compared (they
compute the same function).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, join_ranks, launch_ranks, load_file, revision  # noqa: E402

LONG = {"n_embd": 128, "n_head": 8, "block_size": 256, "batch": 4}
VARIANTS = ("megatron", "coshard")


def write_model(dst: Path) -> Path:
    text = (ROOT / "fixtures" / "gpt.py").read_text()
    for key in ("n_embd", "n_head", "block_size"):
        text = text.replace(f"    {key}: int = ", f"    {key}: int = {LONG[key]}  # was ", 1)
    assert text.count("(8, 16))") == 2, "fixtures/gpt.py's example_inputs changed; update this benchmark"
    text = text.replace("(8, 16))", f"({LONG['batch']}, {LONG['block_size']}))")
    path = dst / "gpt_long.py"
    path.write_text(text)
    return path


def saved_bytes(fn) -> tuple[object, int]:
    import torch
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_file")
    p.add_argument("workdir")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    work = Path(a.workdir)
    entry = load_file(Path(a.model_file), "bench_entry")
    init = torch.load(work / "init.pt")
    runs = {}
    for name in VARIANTS:
        rank, world, package, _, comm = join_ranks(work / name)     # each output has its own _comm
        module = package.rank_module(rank)
        model = module.build()
        model.load_state_dict(package.shard_state_dict(init, rank))
        model.train()
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), package)
    times = {name: [] for name in VARIANTS}
    losses = {name: [] for name in VARIANTS}
    saved = {}
    for r in range(a.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            model, opt, package = runs[name]
            for step in range(a.steps + 1):
                torch.manual_seed(step)
                batch = entry.example_inputs()
                if name not in saved:
                    _, saved[name] = saved_bytes(lambda: model(*batch))
                dist.barrier()
                start = time.perf_counter()
                loss = package.train_step(model, opt, batch)
                if step:                                     # the first step of a round warms up
                    times[name].append(time.perf_counter() - start)
                if r == 0:
                    losses[name].append(loss)
    (work / f"rank{rank}.json").write_text(json.dumps(
        {"step": {n: statistics.median(t) for n, t in times.items()}, "saved": saved, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_file = write_model(work)
        for name in VARIANTS:
            subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "rewrite", str(model_file), "--plan", name,
                            "--tp", "2", "-o", str(work / name)], check=True, capture_output=True, cwd=work)
        entry = load_file(model_file, "bench_entry_main")
        torch.manual_seed(0)
        torch.save(entry.build().state_dict(), work / "init.pt")
        launch_ranks([sys.executable, __file__, "--rank", str(model_file), str(work), "--steps", str(a.steps),
                      "--rounds", str(a.rounds)], 2, timeout=1800, label="coshard ")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    step = {n: max(r["step"][n] for r in ranks) for n in VARIANTS}
    saved = {n: max(r["saved"][n] for r in ranks) for n in VARIANTS}
    loss_gap = max(abs(x - y) for x, y in zip(ranks[0]["losses"]["megatron"], ranks[0]["losses"]["coshard"]))
    result = {"revision": revision(), "config": LONG, "step_seconds": step, "saved_bytes": saved,
              "step_ratio": step["coshard"] / step["megatron"], "saved_ratio": saved["coshard"] / saved["megatron"],
              "max_loss_difference": loss_gap}
    print(f"TP=2, GPT {LONG}: step {step['megatron'] * 1e3:.1f} ms megatron, {step['coshard'] * 1e3:.1f} ms "
          f"coshard ({result['step_ratio']:.2f}x); saved for backward {saved['megatron'] / 2**20:.1f} MiB vs "
          f"{saved['coshard'] / 2**20:.1f} MiB ({result['saved_ratio']:.2f}x); max loss difference {loss_gap:.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    else:
        main()
