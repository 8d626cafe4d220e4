#!/usr/bin/env python
"""Bytes sent through collectives per training step by the generated TP=2 GPT, against the
analytic minimum of the Megatron plan.

    python benchmarks/bench_comm_bytes.py [--json out.json]

For two configs -- fixtures/gpt.py as it is, and the bigger copy bench_tp_step.py times --
it rewrites the model with ``nnscaler-rewrite MODEL --tp 2 -o DIR``, starts 2 gloo processes,
loads the generated package the way nnscaler_cst/verify/worker.py does, and on each rank:
``_comm.reset_counters()``, one ``train_step`` (the package's API), read ``_comm.COUNTERS``; twice (steps 0
and 1), to show the count is the same every step.

Three independent views of the same traffic:

* ``_comm.COUNTERS``: calls per kind and ``bytes``. Its convention (``_comm._record``): an
  all-reduce counts its whole buffer once per call; an all-gather counts this rank's input
  once per call; send counts the tensor, recv counts 0.
* a log of every ``torch.distributed`` call made in the step, taken by wrapping
  ``dist.all_reduce`` / ``all_gather`` / ``send`` / ``recv`` / ``broadcast`` /
  ``reduce_scatter*`` / ``all_to_all*`` / ``barrier`` in the rank process (so a call that does
  not go through ``_comm._record`` would show up here and not in COUNTERS), with the
  ``_comm`` function that made it (which tells forward from backward) and its shape.
* ``wchar`` of /proc/self/io around the step: bytes the process (gloo's threads included)
  handed to write-family syscalls, i.e. what gloo's TCP transport actually wrote to its
  sockets, with its own headers. A physical cross-check of the counter's convention.

The analytic minimum (bytes each rank sends, in the counter's convention; with 2 ranks this
is also what a ring all-reduce / all-gather puts on the wire per rank: 2(N-1)/N x buffer
and (N-1) x input, both = 1 x for N = 2). A = B*T*C*4 bytes, one fp32 activation:

  per block   forward : all-reduce after attn.c_proj and after mlp.c_proj (row-parallel) 2A
              backward: all-reduce of the input grads of c_attn and c_fc (the grads of
                        ln_1's and ln_2's outputs, Megatron's "f")                        2A
  embedding   vocab-parallel wte: forward all-reduce of the partial lookups              A
              wpe: replicated, nothing
  LM head     vocab-parallel (column) lm_head, tied to wte: backward all-reduce of
              the grad of ln_f's output                                                  A
  loss        vocab-parallel cross entropy: all-reduce of the row max, of sum(exp),
              of the target logit, B*T fp32 each (Megatron-LM does these 3 calls)        3*B*T*4
  grads       none: every replicated parameter (LayerNorms, row-parallel biases, wpe)
              gets the same gradient on both ranks from replicated activations
  loss.item() none: the vocab-parallel loss is already whole on every rank

  minimum = L*4A + 2A + 12*B*T bytes per rank per step.

Also printed: the blocks-only figure L*4A (what a plan that keeps embedding, LM head and
loss replicated would send) to show what vocabulary parallelism costs in bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tp_step import (BIG, FIXTURE, fixture_config, join_ranks, launch, load_file,  # noqa: E402
                           machine, rewrite, write_model_file)

DIST_FUNCS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
              "send", "recv", "isend", "irecv", "barrier", "reduce", "gather", "scatter"]


def _wchar() -> int:
    """Bytes this process handed to write-family syscalls so far (all threads)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return -1


def _nbytes(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _site(comm_file: str, model_prefix: str):
    """(the _comm function that made the call, the generated model line on the stack)."""
    caller, line = "?", None
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        name = getattr(code, "co_qualname", code.co_name)
        if code.co_filename == comm_file and caller == "?" and code.co_name not in (
                "_all_reduce", "_all_gather", "_send", "_recv", "_gather_slices", "_keep_slice"):
            caller = name
        if line is None and os.path.basename(code.co_filename).startswith(model_prefix):
            line = f"{os.path.basename(code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    if caller == "?":  # not made by _comm: name the function that called torch.distributed
        g = sys._getframe(2)
        caller = f"{os.path.basename(g.f_code.co_filename)}:{getattr(g.f_code, 'co_qualname', g.f_code.co_name)}"
    return caller, line


def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_file")
    p.add_argument("out_dir")
    p.add_argument("workdir")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args(argv)

    import inspect

    import torch
    import torch.distributed as dist

    rank, world, package, train, comm = join_ranks(Path(a.out_dir))
    module = package.rank_module(rank)
    torch.manual_seed(0)
    model = module.build()
    model.load_state_dict(package.shard_state_dict(torch.load(Path(a.workdir) / "init.pt"), rank))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Wrap torch.distributed's communication functions: an independent log of every call.
    log: list[dict] = []
    recording = [False]
    comm_file = inspect.getsourcefile(comm)

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if recording[0]:
                caller, line = _site(comm_file, "model")
                t = args[0] if args else None
                sent = args[1] if name.startswith("all_gather") and len(args) > 1 else t
                shape = list(sent.shape) if isinstance(sent, torch.Tensor) else None
                log.append({"fn": name, "caller": caller, "line": line, "shape": shape,
                            "input_bytes": _nbytes(sent),
                            "op": str(kwargs.get("op", "SUM")).split(".")[-1]})
            return fn(*args, **kwargs)
        return wrapper

    for name in DIST_FUNCS:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))

    steps = []
    for step in range(a.steps):
        batch = train.batch_for(module, step, 0, torch.device("cpu"))
        dist.barrier()
        comm.reset_counters()
        log.clear()
        w0 = _wchar()
        recording[0] = True
        loss = package.train_step(model, opt, batch)
        recording[0] = False
        w1 = _wchar()
        steps.append({"counters": dict(comm.COUNTERS), "log": list(log), "wchar": w1 - w0,
                      "loss": loss})
    (Path(a.workdir) / f"comm_rank{rank}.json").write_text(json.dumps(steps))
    dist.barrier()
    comm.teardown()


def analytic(cfg: dict) -> dict:
    B, T, C, L = cfg["batch"], cfg["seq"], cfg["n_embd"], cfg["n_layer"]
    A = B * T * C * 4
    parts = {"blocks fwd (2 all-reduce x L)": 2 * L * A,
             "blocks bwd (2 all-reduce x L)": 2 * L * A,
             "embedding fwd (wte all-reduce)": A,
             "LM head bwd (ln_f grad all-reduce)": A,
             "loss (max, sum-exp, target logit)": 3 * B * T * 4}
    return {"A": A, "parts": parts, "total": sum(parts.values()), "blocks_only": 4 * L * A}


def run_config(label: str, model_file: Path, cfg: dict, tmp: Path) -> dict:
    import torch
    out_dir = tmp / f"{label}_tp2"
    rewrite(model_file, out_dir, tp=2)
    entry = load_file(model_file, f"bench_entry_{label}")
    torch.manual_seed(0)
    torch.save(entry.build().state_dict(), tmp / "init.pt")
    launch(Path(__file__).resolve(), [str(model_file), str(out_dir), str(tmp)])
    ranks = [json.loads((tmp / f"comm_rank{r}.json").read_text()) for r in range(2)]
    return {"label": label, "cfg": cfg, "ranks": ranks, "analytic": analytic(cfg),
            "plan": json.loads((out_dir / "plan.json").read_text()) if (out_dir / "plan.json").exists() else None}


def kind_of(entry: dict) -> str:
    phase = {"forward": "fwd", "backward": "bwd"}.get(entry["caller"].split(".")[-1], "")
    return f"{entry['fn']}{'(' + entry['op'] + ')' if entry['fn'] == 'all_reduce' else ''} " \
           f"{entry['caller']}{' ' + phase if phase else ''}"


def report(res: dict) -> dict:
    cfg, an = res["cfg"], res["analytic"]
    print(f"== {res['label']}: B={cfg['batch']} T={cfg['seq']} C={cfg['n_embd']} L={cfg['n_layer']} "
          f"V={cfg['vocab_size']}  (A = B*T*C*4 = {an['A']:,} bytes)")
    out = {"config": cfg, "analytic": an, "ranks": []}
    for r, steps in enumerate(res["ranks"]):
        same = all(s["counters"] == steps[0]["counters"] for s in steps)
        s = steps[0]
        c = s["counters"]
        logged = sum(e["input_bytes"] for e in s["log"] if e["fn"] != "barrier")
        print(f"rank {r}: COUNTERS {c}  (identical in steps 0..{len(steps) - 1}: {same})")
        print(f"  torch.distributed calls seen by the wrapper: {len(s['log'])}, "
              f"{logged:,} bytes by the counter's convention; wchar (gloo's real socket writes): "
              f"{s['wchar']:,} bytes = {s['wchar'] / max(c['bytes'], 1):.3f} x COUNTERS bytes")
        out["ranks"].append({"counters": c, "same_every_step": same, "dist_calls": len(s["log"]),
                             "dist_bytes": logged, "wchar": s["wchar"]})
    c0 = res["ranks"][0][0]["counters"]
    log = res["ranks"][0][0]["log"]
    groups: dict[str, list] = {}
    for e in log:
        groups.setdefault((kind_of(e), str(e["shape"])), []).append(e)
    print(f"  {'collective (rank 0, step 0)':<66}{'shape':>16}{'calls':>7}{'bytes':>12}")
    for (kind, shape), es in groups.items():
        lines = sorted({e["line"] for e in es if e["line"]})
        where = f"  [{', '.join(lines)}]" if lines else ""
        print(f"  {kind:<66}{shape:>16}{len(es):>7}{sum(e['input_bytes'] for e in es):>12,}{where}")
    print("  analytic minimum (Megatron plan):")
    for k, v in an["parts"].items():
        print(f"    {k:<44}{v:>12,}")
    print(f"    {'total':<44}{an['total']:>12,}")
    ratio = c0["bytes"] / an["total"]
    print(f"  measured (COUNTERS bytes, rank 0) = {c0['bytes']:,}; measured / analytic = {ratio:.4f}; "
          f"excess {c0['bytes'] - an['total']:,} bytes")
    print(f"  measured / blocks-only ({an['blocks_only']:,}) = {c0['bytes'] / an['blocks_only']:.4f}\n")
    out.update({"measured_bytes": c0["bytes"], "measured_over_analytic": ratio,
                "measured_over_blocks_only": c0["bytes"] / an["blocks_only"],
                "collectives": [{"kind": k, "shape": s, "calls": len(es),
                                 "bytes": sum(e["input_bytes"] for e in es)}
                                for (k, s), es in groups.items()]})
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        return rank_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    m = machine()
    print(f"machine: {m['cores']} cores ({m['cpu']}), no GPU, torch {m['torch']}; gloo, 2 processes; "
          f"revision {m['revision']}\n")
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-comm-"))
    try:
        fixture_copy = tmp / "gpt.py"
        shutil.copy(FIXTURE, fixture_copy)  # fixtures/gpt.py as it is (copied: -o next to it)
        results.append(run_config("fixture", fixture_copy, fixture_config(), tmp))
        big = dict(BIG, seq=BIG["block_size"])
        results.append(run_config("big", write_model_file(tmp / "gpt_big.py", BIG), big, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = [report(r) for r in results]
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": m, "configs": out}, indent=1))


if __name__ == "__main__":
    main()
