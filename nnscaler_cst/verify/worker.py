"""One process of a verify run, started as a plain script (`python worker.py ...`).

It imports only torch and the files under test, and makes `import nnscaler_cst` fail, so a
passing run also proves the generated code is self-contained.

    worker.py reference ENTRY_FILE WORKDIR --steps K --lr LR --seed S [--float64] [--precision P]
              [--max-grad-norm N] [--micro-batches M --dp-shares D]
    worker.py rank OUTPUT_DIR WORKDIR --steps K --lr LR --seed S [--float64] [--max-grad-norm N]
              (RANK, WORLD_SIZE, MASTER_* set)

The reference runs its forward and loss under torch.autocast in --precision (bf16, fp16) as the
output's training API does in the precision it was rewritten for (fp16: with torch.amp.GradScaler,
whose dynamic loss scaling the API's follows), and clips the gradients'
norm (torch.nn.utils.clip_grad_norm_) with --max-grad-norm, as the ranks do with the API's
clip_grad_norm. With --micro-batches M it runs each step as gradient accumulation over the M
micro-batches a pipeline runs (with --dp-shares D: micro-batch m joins the m-th slice of each of
the D data-parallel shares), for an output whose BatchNorm normalises each micro-batch by its own
statistics.

Fault injection, to see what verify does when a rank fails (tests/test_faults.py):
NNSCALER_VERIFY_FAULT=die:R:K kills rank R (SIGKILL) just before its first collective of step K;
NNSCALER_VERIFY_FAULT=hang:R:K makes it sleep there forever instead.
"""
import argparse
import faulthandler
import importlib
import importlib.util
import os
import signal
import sys
import time

sys.modules["nnscaler_cst"] = None  # the code under test must not need the tool
PHASE_MARK = "nnscaler-verify phase: "   # verify/launch.py reads these lines to say when a process failed
NOT_FLOAT64 = "nnscaler-verify: does not run in float64: "   # verify/equivalence.py reads it
current_step = None


def enter(phase, step=None):
    global current_step
    current_step = step
    print(f"{PHASE_MARK}{phase if step is None else f'step {step}'}", flush=True)


def die_with_the_launcher():
    """A launcher that is itself killed (SIGKILL, a CI job's time limit) cannot stop its ranks:
    on Linux the kernel sends them SIGKILL when it goes. Asked first thing, before torch's slow import."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # gone before we asked (the launcher names itself: our parent then is no longer it)
        if os.getppid() != int(os.environ.get("NNSCALER_VERIFY_LAUNCHER", os.getppid())):
            os._exit(1)


die_with_the_launcher()
enter("start-up (importing torch)")
if hasattr(signal, "SIGUSR1"):
    # a run past its deadline asks each stuck process where it waits (verify/launch.py)
    faulthandler.register(signal.SIGUSR1, all_threads=False)

import torch  # noqa: E402

FAULT_VARIABLE = "NNSCALER_VERIFY_FAULT"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")


def inject_fault(rank):
    """$NNSCALER_VERIFY_FAULT (KIND:RANK:STEP): this rank dies or hangs before its first collective
    of that step, while the other ranks wait in it."""
    spec = os.environ.get(FAULT_VARIABLE)
    if not spec:
        return
    try:
        kind, fault_rank, fault_step = spec.split(":")
        fault_rank, fault_step = int(fault_rank), int(fault_step)
        assert kind in ("die", "hang")
    except (ValueError, AssertionError):
        sys.exit(f"{FAULT_VARIABLE}={spec}: expected die:RANK:STEP or hang:RANK:STEP")
    if fault_rank != rank:
        return

    def faulty(collective):
        def hang_before_collective(*args, **kwargs):
            if current_step == fault_step:
                if kind == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                while True:
                    time.sleep(60)
            return collective(*args, **kwargs)
        return hang_before_collective

    for name in COLLECTIVES:
        if hasattr(torch.distributed, name):
            setattr(torch.distributed, name, faulty(getattr(torch.distributed, name)))


def switch_off_dropout():
    """Dropout draws one mask for a whole tensor on one device and other masks for its shards, so
    no two runs could agree step for step; both runs of a verify train with it switched off.
    So does stochastic depth (timm's DropPath, torchvision's StochasticDepth): its per-sample keep
    mask is a Bernoulli draw, and a data-parallel share draws the first samples' masks for its
    own; every sample is kept (the kept branch scaled as the layer scales it) in both runs."""
    def keep_all(input, *args, **kwargs):
        return torch.ones_like(input)

    torch.bernoulli = keep_all
    torch.Tensor.bernoulli = keep_all
    torch.Tensor.bernoulli_ = lambda self, *args, **kwargs: self.fill_(1)
    functional = torch.nn.functional

    def identity(input, *args, **kwargs):
        return input

    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        setattr(functional, name, identity)
    attention = functional.scaled_dot_product_attention

    def attention_without_dropout(*args, **kwargs):
        if len(args) > 4:                      # (query, key, value, attn_mask, dropout_p, ...)
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        return attention(*args, **kwargs)

    functional.scaled_dot_product_attention = attention_without_dropout
    keep_uniform_draws()


def keep_uniform_draws():
    """A uniform draw in a forward decides what to drop as dropout does (diffusers' label dropout
    drops a sample's class where `torch.rand(batch) < p`; stochastic depth keeps it where `keep +
    torch.rand(...)` floors to 1), and a batch split over ranks draws other numbers for its
    samples. Inside a module's forward both runs draw the largest float below 1, which keeps
    everything in either form; outside (batches, initial weights) draws are left alone."""
    depth = [0]

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave)

    def kept(draw):
        def uniform(*args, **kwargs):
            out = draw(*args, **kwargs)
            if depth[0] > 0 and isinstance(out, torch.Tensor) and out.is_floating_point():
                out.fill_(1.0 - torch.finfo(out.dtype).eps / 2)
            return out
        return uniform

    torch.rand = kept(torch.rand)
    torch.rand_like = kept(torch.rand_like)


def adamw(params, lr):
    """AdamW with eps 1e-6 in both runs: a parameter whose true gradient is zero (a key bias before
    softmax) gets rounding noise as its gradient, which Adam's default eps 1e-8 would turn into
    full-size steps of opposite sign in the two runs; 1e-6 leaves every real gradient's step alone."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-6)


def load_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def loss_of(module, output):
    if hasattr(module, "loss"):
        return module.loss(output)
    if isinstance(output, torch.Tensor):
        return output
    return output["loss"] if isinstance(output, dict) else output.loss


def widened(value):
    """Floating tensors in a batch (nested in dicts, tuples and lists) in float64."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, dict):
        return {k: widened(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(widened(v) for v in value)
    return value


def batch_for(module, step, seed):
    torch.manual_seed(seed + step)
    batch = module.example_inputs()
    return widened(batch) if torch.get_default_dtype() == torch.float64 else batch


def require_float64(model):
    """A float64 run (verify's second opinion, --float64) of a model that names float32 itself
    proves nothing more than the float32 one: refused, and verify keeps the float32 verdict."""
    narrow = [name for name, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float64]
    if narrow:
        sys.exit(f"{NOT_FLOAT64}{narrow[0]} is {model.get_parameter(narrow[0]).dtype}")


def capture_first_gradients(model, optimizer, nudge=0.0):
    """Keep every parameter's gradient as the optimizer first sees it (after any all-reduce).
    `nudge`: then add noise of `nudge` times each tensor's largest entry to its first gradient, to measure
    how far the run itself carries so small a difference (verify's sensitivity twin)."""
    captured = {}
    step = optimizer.step

    def step_and_capture(*a, **k):
        if not captured:
            for name, param in model.named_parameters(remove_duplicate=False):
                if param.grad is not None:
                    captured[name] = param.grad.detach().clone()
            noise = torch.Generator().manual_seed(1234)
            for param in model.parameters() if nudge else ():
                if param.grad is not None and param.grad.numel():
                    # noise on the scale verify measures gradient errors in: each tensor's largest entry
                    scale = param.grad.abs().max()
                    param.grad.add_(nudge * scale * torch.randn(param.grad.shape, generator=noise))
        return step(*a, **k)

    optimizer.step = step_and_capture
    return captured


def persistent_buffers(model):
    """The buffers a state dict holds (running statistics, counters), as they stand now."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer.detach().clone()
    return found


def capture_first_buffers(model, optimizer):
    """The buffers as the first optimizer step finds them: what the first forward made of them
    (BatchNorm's running statistics), judged before any step can carry rounding into chaos."""
    captured = {}
    step = optimizer.step

    def step_and_capture(*a, **k):
        if not captured:
            captured.update(persistent_buffers(model))
        return step(*a, **k)

    optimizer.step = step_and_capture
    return captured


def capture_zero_gradients(model, shards, optimizer, comm):
    """capture_first_gradients under ZeRO: each rank's optimizer sees its shard of the mean gradient
    only, so the shards are gathered (by this harness, outside the counted collectives) and cut
    back into parameters."""
    captured = {}
    step = optimizer.step

    def step_and_capture(*a, **k):
        if not captured:
            flat = comm.gather_whole(shards, shards.grad(), record=False)
            by_param = {id(p): g for p, g in zip(shards.params, shards.views(flat))}
            for name, param in model.named_parameters(remove_duplicate=False):
                if id(param) in by_param:
                    captured[name] = by_param[id(param)].clone()
        return step(*a, **k)

    optimizer.step = step_and_capture
    return captured


def exact_first_step(entry, model, seed, max_grad_norm=None):
    """The first step's loss, gradients and buffers in float64, from the same weights and batch:
    how far the float32 reference itself lands from the exact values (a gradient that is zero in
    exact arithmetic, a bias before a norm over its own dim, is pure rounding in float32; a loss
    through BatchNorm over four values per channel carries 1e-4 of it). (None, None, None) when
    the model does not run in float64 (code that names float32)."""
    import copy
    try:
        exact = copy.deepcopy(model).double()
        exact.train()
        loss = step_loss(entry, exact, widened(batch_for(entry, 0, seed)))
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(exact.parameters(), max_grad_norm)
    except Exception:       # noqa: BLE001 -- no yardstick; verify judges as before
        return None, None, None
    return loss.item(), {name: param.grad.detach().clone()
                         for name, param in exact.named_parameters(remove_duplicate=False) if param.grad is not None}, \
        persistent_buffers(exact)


def reordered_first_gradients(entry, model, seed, precision=None, max_grad_norm=None, nudge_weights=False):
    """The first step's float32 gradients and buffers again, summed in another order (twice the
    intra-op threads: the kernels split their reductions differently): the same arithmetic, so how
    far they land from the reference's is rounding too. A reference whose one order happens to land
    next to float64 (a grouped conv through BatchNorm: 1e-4 there, 0.6% with two threads) would
    otherwise make the parallel run's own order look like an error. (None, None) when it cannot run.

    `nudge_weights` (a model held in bf16 or fp16 that does not run in float64): also every half
    precision weight moved by one unit in its last place, in a seeded random direction -- the
    size of the rounding that storing it, and a parallel run's other order of each sum, make.
    How far that carries is this model's own reach of rounding: another order of a sum moves
    scores near a tie, and a top-k routing picks another expert for a token (gpt_oss: 35% of a
    router's bias gradient, the wrong gradient of a tp_copy too many: 100% of a bias's)."""
    import copy
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 * threads)
        again = copy.deepcopy(model)
        if nudge_weights:
            nudge_half_weights(again)
        again.train()
        scaler = loss_scaler(precision)
        step_loss(entry, again, batch_for(entry, 0, seed), precision, scaler)
        for param in again.parameters():
            if param.grad is not None:
                param.grad.div_(scaler.get_scale() if scaler.is_enabled() else 1.0)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(again.parameters(), max_grad_norm)
    except Exception:       # noqa: BLE001 -- no second order; verify judges by float64 alone
        return None, None
    finally:
        torch.set_num_threads(threads)
    return {name: param.grad.detach().clone()
            for name, param in again.named_parameters(remove_duplicate=False) if param.grad is not None}, \
        persistent_buffers(again)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def held_in_half(model) -> bool:
    return any(p.dtype in AUTOCAST.values() for p in model.parameters())


def nudge_half_weights(model):
    """Move each bf16 / fp16 parameter element by one unit in its last place, up or down."""
    signs = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype in AUTOCAST.values() and param.numel():
                up = torch.rand(param.shape, generator=signs) < 0.5
                target = torch.where(up, float("inf"), float("-inf")).to(param.dtype)
                param.copy_(torch.nextafter(param, target))


# (M, D, average) with --micro-batches M --dp-shares D [--summed-shares]: each step accumulates
# gradients over the micro-batches, the shares of a mean loss averaged (of a sum: added up)
MICRO_BATCHES = None


def map_tensors(fn, batch):
    """`fn` on every tensor of a batch, through nested dicts, lists and tuples (runtime/_comm.py's
    map_tensors, which this process may not import: the tool is blocked here)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [map_tensors(fn, v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def micro_batches(batch):
    """The batch as the pipeline's micro-batches: micro-batch m is the m-th of MICRO_BATCHES slices
    of each data-parallel share, joined (the data-parallel ranks sum BatchNorm's statistics over
    their m-th micro-batches); the whole batch without --micro-batches."""
    if MICRO_BATCHES is None:
        return [batch]
    micro, shares, _ = MICRO_BATCHES

    def piece(x, m):
        if x.dim() == 0:
            return x
        return torch.cat([share.chunk(micro)[m] for share in x.chunk(shares)])
    return [map_tensors(lambda x: piece(x, m), batch) for m in range(micro)]


def step_loss(entry, model, batch, precision=None, scaler=None):
    """One step's forward, loss and backward on `batch` (micro-batch after micro-batch, gradients
    accumulated, shares of a mean loss averaged as the output's training API averages them);
    returns the step's loss."""
    pieces = micro_batches(batch)
    total = 0.0
    for piece in pieces:
        with autocast(precision):
            output = model(**piece) if isinstance(piece, dict) else model(*piece)
            loss = loss_of(entry, output)
            if len(pieces) > 1 and MICRO_BATCHES[2]:
                loss = loss / len(pieces)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = total + loss.detach()
    return total




def autocast(precision):
    """The forward's and the loss's compute dtype, as the output's training API sets it."""
    return torch.autocast("cpu", dtype=AUTOCAST.get(precision), enabled=precision in AUTOCAST)


# fp16's first loss scale in both runs. The output starts at GradScaler's 2**16, where the first
# backward may overflow fp16 on one plan and not on another (a sum over ranks rounds where one
# device's does not): a step skipped on one side only would leave nothing to compare.
VERIFY_LOSS_SCALE = 2.0 ** 8


def loss_scaler(precision):
    """fp16's dynamic loss scaling as the output's (its GROWTH_INTERVAL, VERIFY_LOSS_SCALE to
    begin with); disabled for other precisions."""
    return torch.amp.GradScaler("cpu", init_scale=VERIFY_LOSS_SCALE, growth_interval=2000,
                                enabled=precision == "fp16")


def reference(args):
    target = os.path.abspath(args.target)
    sys.path.insert(0, os.path.dirname(target))     # the entry's own imports (a sibling model file)
    entry = load_file(target, "verify_entry")
    torch.manual_seed(args.seed)
    model = entry.build()
    if args.float64:
        require_float64(model)
    torch.save(model.state_dict(), os.path.join(args.workdir, "init.pt"))
    yardsticks = not args.nudge and not args.float64
    exact_loss, exact, exact_buffers = exact_first_step(entry, model, args.seed, args.max_grad_norm) \
        if yardsticks else (None, None, None)
    # float64's own rounding: the yardstick for gradients that are rounding there too
    reordered, reordered_buffers = reordered_first_gradients(entry, model, args.seed, args.precision,
                                                             args.max_grad_norm) \
        if exact is not None or args.float64 else (None, None)
    if yardsticks and exact is None:     # no float64 (code that names float32 or a half dtype): rounding's
        # reach, measured by another order (torchvision's RAFT: its feature encoder's weight gradients move
        # 1.4% between one and two threads, and a tensor-parallel run's order as far); a half model's weights
        # nudged too
        reordered, reordered_buffers = reordered_first_gradients(entry, model, args.seed, args.precision,
                                                                 args.max_grad_norm, nudge_weights=held_in_half(model))
    model.train()
    optimizer = adamw(model.parameters(), args.lr)
    grads = capture_first_gradients(model, optimizer, args.nudge)
    buffers = capture_first_buffers(model, optimizer)
    scaler = loss_scaler(args.precision)
    losses = []
    for step in range(args.steps):
        enter("step", step)
        loss = step_loss(entry, model, batch_for(entry, step, args.seed), args.precision, scaler)
        scaler.unscale_(optimizer)
        if args.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)          # optimizer.step(), unless fp16's gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    enter("saving")
    torch.save({"losses": losses, "state": model.state_dict(), "grads": grads, "exact_grads": exact,
                "exact_loss": exact_loss, "reordered_grads": reordered, "buffers": buffers,
                "exact_buffers": exact_buffers, "reordered_buffers": reordered_buffers},
               os.path.join(args.workdir, "twin.pt" if args.nudge else "reference.pt"))


def rank(args):
    folder = os.path.abspath(args.target)
    sys.path.insert(0, os.path.dirname(folder))
    package = importlib.import_module(os.path.basename(folder))
    comm = importlib.import_module(f"{package.__name__}._comm")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inject_fault(rank)
    comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo",
               pp_replicas=package.rank_module(rank).PIPELINE_REPLICAS if package.PP_SIZE > 1 else None,
               pp_tied=getattr(package.rank_module(rank), "TIED_RANKS", None))
    module = package.rank_module(rank)
    package.LOSS_SCALE["scale"] = VERIFY_LOSS_SCALE     # used under fp16 only
    torch.manual_seed(args.seed)
    model = package.build(rank)
    if args.float64:
        require_float64(model)
    init = torch.load(os.path.join(args.workdir, "init.pt"))
    model.load_state_dict(package.shard_state_dict(init, rank))
    model.train()
    # the output says what its optimizer steps: every parameter, or (ZeRO) this rank's shard
    params = package.optimizer_params(model)
    optimizer = adamw(params, args.lr)
    shards = getattr(model, "zero_shards", None)
    grads = capture_zero_gradients(model, shards, optimizer, comm) if shards is not None \
        else capture_first_gradients(model, optimizer)
    buffers = capture_first_buffers(model, optimizer)
    comm.reset_counters()
    losses = []
    for k in range(args.steps):
        enter("step", k)
        losses.append(package.train_step(model, optimizer, batch_for(module, k, args.seed), args.max_grad_norm))
    if shards is not None and shards.stage == 3:   # ZeRO-3 holds shards between steps: whole for the check
        comm.all_gather_params(shards, comm.DP)
    enter("saving")
    torch.save({"losses": losses, "state": model.state_dict(), "grads": grads, "buffers": buffers,
                "counters": dict(comm.COUNTERS)},
               os.path.join(args.workdir, f"rank{rank}.pt"))
    comm.teardown()


def preload():
    """What every process imports before its work: a fork server (verify/forkserver.py) imports
    it once. torch.use_deterministic_algorithms imports inductor's config, seconds of imports."""
    import torch._inductor.config  # noqa: F401


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["reference", "rank"])
    parser.add_argument("target")
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nudge", type=float, default=0.0)
    parser.add_argument("--float64", action="store_true", help="build, batches and steps in float64")
    parser.add_argument("--precision", help="the reference's forward under autocast in bf16 or fp16")
    parser.add_argument("--max-grad-norm", type=float, help="clip the gradients' global norm to this")
    parser.add_argument("--micro-batches", type=int, help="each step accumulates over this many micro-batches")
    parser.add_argument("--dp-shares", type=int, default=1, help="data-parallel shares the micro-batches join")
    parser.add_argument("--summed-shares", action="store_true", help="the loss sums its micro-batches' losses")
    args = parser.parse_args()
    global MICRO_BATCHES
    MICRO_BATCHES = (args.micro_batches, args.dp_shares, not args.summed_shares) if args.micro_batches else None
    if args.float64:
        torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    switch_off_dropout()
    enter("setup")
    (reference if args.role == "reference" else rank)(args)


if __name__ == "__main__":
    main()
