"""The generated code on CUDA, in fp32 and bf16, against the single-GPU original.

    python benchmarks/bench_gpu.py prepare /tmp/gpu          # here: rewrite the fixtures per plan
    python benchmarks/bench_gpu.py run /tmp/gpu --out R.md   # on a machine with CUDA

`prepare` needs the tool; `run` needs only torch and CUDA (the outputs are self-contained).
Each case trains the original on one GPU (torch.autocast in bf16, float32 master weights, as the
output's training API does) and the output's ranks as processes, for STEPS AdamW steps from the
same initial weights and batches, and compares the losses and the parameters after the last step.

With fewer GPUs than ranks (the one GPU a session is lent), every rank runs on cuda:0 and the
collectives go through gloo: NCCL refuses two ranks on one GPU, and gloo takes CUDA tensors for few
collectives, so this script stages them through host memory (`host_staged`, around
torch.distributed in the rank processes only). The generated code is run unchanged. With a GPU per
rank it runs on NCCL, one GPU each.

The yardstick for bf16 is bf16 itself: the single-GPU bf16 run's distance from its fp32 run. A
parallel bf16 run passes when it is within that distance of the single-GPU bf16 run (plus 1e-3 of
the loss); fp32 runs (TF32 off) pass within verify's tolerances (1e-4 abs + 1e-4 rel on losses).
"""
import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, LR, SEED = 5, 1e-3, 0
DEVICE = os.environ.get("BENCH_GPU_DEVICE", "cuda")  # "cpu": the same checks on gloo, to try the script here
CASES = {  # name: (fixture, rewrite options)
    "gpt-tp2": ("gpt.py", ["--tp", "2"]),
    "gpt-tp2-sp": ("gpt.py", ["--tp", "2", "--sequence-parallel"]),
    "gpt-dp2": ("gpt.py", ["--dp", "2"]),
    "gpt-dp2-zero3": ("gpt.py", ["--dp", "2", "--zero", "3"]),
    "gpt-pp2": ("gpt.py", ["--pp", "2"]),
    "gpt-dp2-tp2": ("gpt.py", ["--dp", "2", "--tp", "2"]),
    "vit-tp2": ("vit.py", ["--tp", "2"]),
    "convnet-dp2": ("convnet.py", ["--dp", "2"]),
    "convnet-tp2": ("convnet.py", ["--tp", "2"]),
    "evoformer-tp2": ("evoformer.py", ["--tp", "2"]),
}
PRECISIONS = ("fp32", "bf16")


def prepare(folder, names):
    os.makedirs(folder, exist_ok=True)
    for name in names:
        fixture, options = CASES[name]
        out = os.path.join(folder, name.replace("-", "_"))
        subprocess.run([sys.executable, "-m", "nnscaler_cst", os.path.join(REPO, "fixtures", fixture), *options,
                        "-o", out, "--force"], check=True)
        subprocess.run(["cp", os.path.join(REPO, "fixtures", fixture), os.path.join(out, "entry_original.py")],
                       check=True)


# ---------------------------------------------------------------------------------------------
# on the GPU machine
# ---------------------------------------------------------------------------------------------

def load_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def no_dropout(model):
    import torch
    for layer in model.modules():
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0


def batch_for(entry, step, device):
    import torch
    torch.manual_seed(SEED + step)
    batch = entry.example_inputs()
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x
    return {k: move(v) for k, v in batch.items()} if isinstance(batch, dict) else tuple(map(move, batch))


def loss_of(entry, output):
    if hasattr(entry, "loss"):
        return entry.loss(output)
    return output if hasattr(output, "backward") else output.loss


def reference(case_dir, precision):
    """The original on one device; returns (losses, state dict on CPU); saves the initial weights."""
    import torch
    entry = load_file(os.path.join(case_dir, "entry_original.py"), "gpu_entry")
    torch.manual_seed(SEED)
    model = entry.build()
    torch.save(model.state_dict(), os.path.join(case_dir, "init.pt"))
    model = model.to(DEVICE).train()
    no_dropout(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    losses = []
    for step in range(STEPS):
        batch = batch_for(entry, step, DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16"):
            output = model(**batch) if isinstance(batch, dict) else model(*batch)
            loss = loss_of(entry, output)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


class Done:
    """A finished collective's handle: the staged call below is synchronous."""
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def host_staged(collective, output_arg):
    """`collective` on CUDA tensors through gloo: CPU copies in, the results (positional argument
    `output_arg`, in place) copied back; inputs are left untouched (autograd checks versions)."""
    import torch

    def call(*args, **kwargs):
        async_op = kwargs.pop("async_op", False)
        pairs = []

        def to_host(value, output):
            if isinstance(value, torch.Tensor) and value.is_cuda:
                copy = value.detach().cpu()
                if output:
                    pairs.append((copy, value))
                return copy
            if isinstance(value, list):
                return [to_host(v, output) for v in value]
            return value
        work = collective(*[to_host(a, k == output_arg) for k, a in enumerate(args)],
                          **{k: to_host(v, False) for k, v in kwargs.items()})
        with torch.no_grad():
            for copy, value in pairs:
                value.copy_(copy)
        return Done() if async_op else work
    return call


def rank_main(case_dir, precision):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared_gpu = torch.cuda.device_count() < world
    device = torch.device("cuda", 0 if shared_gpu else rank) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    if shared_gpu and DEVICE == "cuda":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "gather", "scatter",
                     "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            setattr(dist, name, host_staged(getattr(dist, name), output_arg=1 if name == "gather" else 0))
    sys.path.insert(0, os.path.dirname(case_dir))
    package = importlib.import_module(os.path.basename(case_dir))
    package.setup("nccl" if DEVICE == "cuda" and not shared_gpu else "gloo")
    comm = importlib.import_module(f"{package.__name__}._comm")
    module = package.rank_module(rank)
    if precision == "bf16":
        package.use_precision("bf16")
    torch.manual_seed(SEED)
    model = package.build(rank)
    model.load_state_dict(package.shard_state_dict(torch.load(os.path.join(case_dir, "init.pt")), rank))
    model.to(device).train()
    no_dropout(model)
    optimizer = torch.optim.AdamW(package.optimizer_params(model), lr=LR, eps=1e-6)
    losses = []
    for step in range(STEPS):
        loss = package.train_step(model, optimizer, batch_for(module, step, device))
        losses.append(float(loss))
    shards = getattr(model, "zero_shards", None)
    if shards is not None and shards.stage == 3:  # ZeRO-3 holds shards between steps: whole for the check
        comm.all_gather_params(shards, comm.DP)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    torch.save({"losses": losses, "state": state}, os.path.join(case_dir, f"rank{rank}_{precision}.pt"))
    comm.teardown()


def run_ranks(case_dir, precision, world, port):
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, __file__, "rank", case_dir, precision],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    failed = [(r, out) for r, (p, out) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    return "\n".join(f"rank {r}: {out[-3000:]}" for r, out in failed) or None


def compare(case_dir, world, ref_losses, ref_state, precision):
    import torch
    sys.path.insert(0, os.path.dirname(case_dir))
    package = importlib.import_module(os.path.basename(case_dir))
    ranks = [torch.load(os.path.join(case_dir, f"rank{r}_{precision}.pt")) for r in range(world)]
    merged = package.merge_state_dicts([r["state"] for r in ranks])
    scale = max(v.abs().max().item() for v in ref_state.values() if v.numel())
    param_diff = max((merged[k].float() - v).abs().max().item() for k, v in ref_state.items() if v.numel())
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref_losses))
    return ranks[0]["losses"], loss_diff, param_diff / scale


def run(folder, out, names):
    import torch
    device_name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    gpus = torch.cuda.device_count()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows, port = [], 29600
    for name in names:
        case_dir = os.path.join(os.path.abspath(folder), name.replace("-", "_"))
        world = json.load(open(os.path.join(case_dir, "plan.json"))).get("world_size") or 2
        row = {"case": name, "world": world}
        try:
            refs = {p: reference(case_dir, p) for p in PRECISIONS}
        except Exception as exc:  # the original itself does not run here: nothing to compare with
            print(f"{name}: the single-device original failed: {exc!r}", flush=True)
            continue
        for precision in PRECISIONS:
            port += 1
            started = time.time()
            error = run_ranks(case_dir, precision, world, port)
            if error:
                row[precision] = {"error": error}
                continue
            losses, loss_diff, param_rel = compare(case_dir, world, *refs[precision], precision)
            row[precision] = {"losses": losses, "ref_losses": refs[precision][0], "loss_diff": loss_diff,
                              "param_rel_diff": param_rel, "seconds": round(time.time() - started, 1)}
        drift = max(abs(a - b) for a, b in zip(refs["bf16"][0], refs["fp32"][0]))
        row["bf16_drift"] = drift
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
    with open(out + ".json", "w") as f:
        json.dump({"device": device_name, "gpus": gpus,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    with open(out, "w") as f:
        f.write(render(rows, device_name, gpus, torch.__version__))


def verdict(row, precision):
    result = row[precision]
    if "error" in result:
        return "crash"
    if precision == "fp32":
        ok = all(abs(a - b) <= 1e-4 + 1e-4 * abs(b) for a, b in zip(result["losses"], result["ref_losses"]))
    else:
        ok = all(abs(a - b) <= row["bf16_drift"] + 1e-3 * abs(b)
                 for a, b in zip(result["losses"], result["ref_losses"]))
    return "pass" if ok else "differs"


def render(rows, device, gpus, torch_version):
    lines = [f"device: {device} x{gpus}, torch {torch_version}; {STEPS} AdamW steps, lr {LR}", "",
             "| case | ranks | fp32 | max loss diff | params (rel) | bf16 | max loss diff | params (rel) "
             "| bf16 vs fp32 single-GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["case"], str(row["world"])]
        for precision in PRECISIONS:
            result = row[precision]
            cells += [verdict(row, precision), f"{result.get('loss_diff', float('nan')):.2e}",
                      f"{result.get('param_rel_diff', float('nan')):.2e}"]
        cells.append(f"{row['bf16_drift']:.2e}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["prepare", "run", "rank"])
    parser.add_argument("folder")
    parser.add_argument("precision", nargs="?")
    parser.add_argument("--out", default="gpu_check.md")
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    if args.command == "prepare":
        prepare(args.folder, names)
    elif args.command == "run":
        run(args.folder, args.out, names)
    else:
        rank_main(os.path.abspath(args.folder), args.precision)


if __name__ == "__main__":
    main()
