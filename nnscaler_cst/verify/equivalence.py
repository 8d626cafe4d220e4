"""Numerical equivalence: the generated code on N gloo processes against the original on one.

Same initial weights (the single-device state dict, sharded by the output's own
shard_state_dict), same batches, K AdamW steps; per-step losses and the merged parameters
after the last step are compared. An output rewritten with --precision bf16 or fp16 runs its
forward under autocast, and so does the reference; a model built in bf16 or fp16 holds and
steps its parameters in it. derived_tolerance picks the tolerances of the dtypes the reference
computes in; half_precision_tolerance says what a half precision takes and why. With
--max-grad-norm both runs clip the gradients' global norm before each step, and the first
gradients are compared after clipping.

Every process runs under a deadline: a rank that dies or hangs ends the run with an error,
never a hang. verify writes only into a temporary folder,
removed however the run ends; the output folder is read, never written (no bytecode caches).
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..plan.schedules import Placement, VocabSteps, parse_action
from ..report.progress import say
from . import forkserver
from .launch import LaunchError, fixed_port, process_env, run_all, run_world, terminated_as_exit
from .simulate import simulate

WORKER = Path(forkserver.WORKER)
NOT_FLOAT64 = "nnscaler-verify: does not run in float64: "   # worker.py's words (it cannot import us)
READ_ONLY = {"PYTHONDONTWRITEBYTECODE": 1}   # the processes leave no __pycache__ beside the files they run


class VerifyError(Exception):
    """A process failed or timed out; the run proves nothing."""


@dataclass
class VerifyResult:
    world_size: int
    steps: int
    reference_losses: list[float]
    parallel_losses: list[float]
    max_abs_error: float
    max_rel_error: float
    worst_param: str
    max_grad_error: float            # first step, relative to each parameter's largest gradient
    worst_grad: str
    tolerance: dict[str, float]
    seconds: float
    counters: list[dict] = field(default_factory=list)
    twin: dict | None = None         # the sensitivity twin's drift from the reference, when one ran
    noise_driven: list[str] = field(default_factory=list)   # first gradient is rounding: values not compared
    exact_first_loss: float | None = None    # the first loss in float64, where the model runs in it
    float64: VerifyResult | None = None      # the same check with both runs in float64, when float32 failed
    precision: str = "fp32"          # the dtype the tolerances are for (derived_tolerance)
    max_buffer_error: float = 0.0    # buffers after the first forward (running statistics), as gradients
    worst_buffer: str = ""

    @property
    def loss_errors(self) -> list[float]:
        return [abs(a - b) for a, b in zip(self.reference_losses, self.parallel_losses)]

    def loss_tolerances(self) -> list[float]:
        tol = self.tolerance
        drift = self.twin["loss_errors"] if self.twin else [0.0] * len(self.reference_losses)
        drift = [0.0, *drift[1:]]          # the first loss comes before any step: never widened by it
        tolerances = [max(tol["loss_atol"] + tol["rtol"] * abs(r), TWIN_MARGIN * d)
                      for r, d in zip(self.reference_losses, drift)]
        if tolerances and self.exact_first_loss is not None:    # ... but by the reference's own rounding
            rounding = abs(self.reference_losses[0] - self.exact_first_loss)
            tolerances[0] = max(tolerances[0], ROUNDING_MARGIN * rounding)
        return tolerances

    def param_tolerance(self) -> float:
        return max(self.tolerance["param_atol"], TWIN_MARGIN * self.twin["max_abs_error"] if self.twin else 0.0)

    @property
    def first_step_passed(self) -> bool:
        """The first step is free of chaos: its gradients, loss and buffers (what its forward made
        of BatchNorm's running statistics) follow from the same weights. Later steps may be judged
        against the twin's drift, which in an unstable model dwarfs a wrong running statistic."""
        return self.max_grad_error <= self.tolerance["grad_rtol"] and \
            self.max_buffer_error <= self.tolerance["grad_rtol"] and \
            all(e <= t for e, t in zip(self.loss_errors[:1], self.loss_tolerances()[:1]))

    @property
    def passed_as_run(self) -> bool:
        """Within tolerance in this run's own dtype."""
        losses_ok = all(e <= t for e, t in zip(self.loss_errors, self.loss_tolerances()))
        return losses_ok and self.first_step_passed and self.max_abs_error <= self.param_tolerance()

    @property
    def passed(self) -> bool:
        """In float32, or, where float32 rounding is amplified past its tolerances (an
        ill-conditioned model), with both runs in float64 under tolerances 1000x tighter: a
        rewrite that computes something else differs there as much as in float32."""
        return self.passed_as_run or (self.float64 is not None and self.float64.passed_as_run)

    def to_json(self) -> dict:
        return {"passed": self.passed, "world_size": self.world_size, "steps": self.steps,
                "reference_losses": self.reference_losses, "parallel_losses": self.parallel_losses,
                "loss_errors": self.loss_errors, "max_abs_error": self.max_abs_error,
                "max_rel_error": self.max_rel_error, "worst_param": self.worst_param,
                "max_grad_error": self.max_grad_error, "worst_grad": self.worst_grad,
                "max_buffer_error": self.max_buffer_error, "worst_buffer": self.worst_buffer,
                "precision": self.precision, "tolerance": self.tolerance, "loss_tolerances": self.loss_tolerances(),
                "param_tolerance": self.param_tolerance(), "twin": self.twin, "seconds": round(self.seconds, 2),
                "noise_driven": self.noise_driven,
                "collectives": self.counters,     # per rank: calls (and bytes) over the steps
                "float64": self.float64.to_json() if self.float64 is not None else None,
                "dropout": "off in both runs (its masks differ between a tensor and its shards)"}


def check_schedules(package) -> None:
    """Simulate the pipeline order written in the rank files (hand edits included) first: a
    schedule that would hang is refused before any process starts."""
    if getattr(package, "PP_SIZE", 1) == 1:
        return
    stride = package.TP_SIZE * package.DP_SIZE
    modules = [package.rank_module(p * stride) for p in range(package.PP_SIZE)]
    orders = []
    for module in modules:
        orders.append([parse_action(text) for text in module.SCHEDULE.split()])
    placement = Placement(tuple(modules[0].STAGE_RANKS), modules[0].PIPELINE_LENGTH)
    calls = getattr(modules[0], "VOCAB_CALLS", {})     # interlaced: each call a step of every rank
    later = getattr(modules[0], "VOCAB_DEFERRED", {})  # backward calls whose steps run after the B
    simulate(orders, modules[0].PIPELINE_STAGE_COUNT, placement=placement,
             passes=getattr(modules[0], "PIPELINE_PASSES", 1),
             vocab={stage: VocabSteps((0.0,) * n, deferred=tuple(n - 1 - c in later.get(stage, ()) for c in range(n)))
                    for stage, n in calls.items()})


HALF_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}   # half a unit in the last place: 8 and 11 significant bits


def half_precision_tolerance(precision: str, steps: int, lr: float, stored: bool = False) -> dict[str, float]:
    """Tolerances for an output rewritten with --precision bf16 or fp16, against the reference
    under the same autocast, or for a model whose parameters are `stored` in `precision` (built
    in bfloat16: its whole forward and backward run in it). Both runs round every matmul's
    output to `precision` (relative error up to u: 2**-8 for bf16's 8 significant bits, 2**-11
    for fp16's 11), but at other
    points: a contraction split over tensor-parallel ranks rounds each rank's partial sum, then
    their sum, where one device rounds the whole sum once. So:

    - losses (every step): rtol 2u. One forward's roundings differ by about u relative; the
      loss, a mean over the batch, averages them. Measured: 0.6u at the first step of the GPT
      fixture at TP=2, less later (where the losses move together).
    - first gradients: grad_rtol 8u of each parameter's largest gradient. The backward adds
      its own roundings to the forward's, a chain of some tens per gradient whose independent
      errors add up as their square root.
    - parameters after K steps: 2·lr·K. AdamW moves an element by about lr per step whatever
      the gradient's size (its update m/sqrt(v) is near ±1); an element whose gradient is
      below the precision's resolution of the terms summed into it moves by lr either way
      in either run, so two correct runs end up to 2·lr apart per step. Stored in `precision`,
      an element's step is rounded to its dtype: none below half a unit in the last place, up
      to twice the step above it, so 4·lr·K. This check only catches a run that diverges; the
      losses and the first gradients carry the proof.

    Where the reference's own rounding (its distance from float64, rounding_of) is larger,
    gradients and the first loss are judged against ten times that, as in float32. fp16 scales
    its loss dynamically; both runs start from worker.py's VERIFY_LOSS_SCALE, so that both take
    (or skip) the same steps."""
    u = UNIT_ROUNDOFF[precision]
    return {"param_atol": (4 if stored else 2) * lr * steps, "loss_atol": 1e-4, "rtol": 2 * u, "grad_rtol": 8 * u}


def stored_precision(params: dict) -> str | None:
    """The half precision ("bf16", "fp16") the reference's parameters (or their gradients, of the
    same dtypes) are held in, the coarser where it holds both; None where every one is float32 or
    wider. Buffers are not asked: a bf16 mask beside float32 weights rounds nothing trained."""
    dtypes = {t.dtype for t in params.values() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    found = [HALF_PRECISIONS[d] for d in dtypes if d in HALF_PRECISIONS]
    return max(found, key=UNIT_ROUNDOFF.get) if found else None


def derived_tolerance(given: dict[str, float], autocast: str | None, params: dict, steps: int,
                      lr: float) -> tuple[str, dict[str, float]]:
    """(precision, tolerances) for the dtypes the reference computes in: the float32 ones given,
    unless it runs under autocast in a half precision or holds its parameters in one (a model
    built in bfloat16); then half_precision_tolerance's for the coarser of the two. A float32
    tolerance on a bfloat16 model calls its rounding (2**-8 relative) a wrong result."""
    stored = stored_precision(params)
    precision = max(filter(None, (autocast, stored)), key=UNIT_ROUNDOFF.get, default=None)
    if precision is None:
        return "fp32", given
    return precision, half_precision_tolerance(precision, steps, lr, stored=stored is not None)


GRAD_SCALE_FLOOR = 1e-3   # share of the largest gradient below which a gradient's own scale is noise
TWIN_MARGIN = 10.0        # how far past the twin's own drift the parallel run may land
TWIN_LEAST_NUDGE = 1e-6   # the twin's first gradients differ by at least this share
ROUNDING_MARGIN = 10.0    # how far past the float32 reference's own rounding a gradient may land
FLOAT64_TIGHTENING = 1e-3  # float64's tolerances against float32's (its rounding is 1e-9 of float32's)


def run_verify(entry_file: Path, out_dir: Path, *, steps: int = 3, lr: float = 1e-3, seed: int = 0,
               timeout: float = 300.0, param_atol: float = 5e-4, loss_atol: float = 1e-4,
               rtol: float = 1e-4, grad_rtol: float = 1e-3, forks=None,
               max_grad_norm: float | None = None) -> VerifyResult:
    """`forks`: a fork server (forkserver.started()) that a caller started early, so that its
    torch import overlaps the caller's own work; else run_verify starts one. `max_grad_norm`:
    both runs clip their gradients' global norm to it. An output rewritten with --precision
    bf16 or fp16 is compared with the reference under the same autocast, within the
    tolerances half_precision_tolerance derives (they replace the float32 ones given), as is one
    whose reference holds its parameters in bf16 or fp16 (derived_tolerance)."""
    out_dir = Path(out_dir).resolve()
    started = time.monotonic()
    sys.path.insert(0, str(out_dir.parent))
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        package = importlib.import_module(out_dir.name)
        package = importlib.reload(package)
    finally:
        sys.path.remove(str(out_dir.parent))
        sys.dont_write_bytecode = writes_bytecode
    check_schedules(package)
    fixed_port()                    # a bad $NNSCALER_VERIFY_PORT is refused before any process starts
    tolerance = {"param_atol": param_atol, "loss_atol": loss_atol, "rtol": rtol, "grad_rtol": grad_rtol}
    precision = HALF_PRECISIONS.get(getattr(package, "PRECISION", None))
    common = ["--steps", str(steps), "--lr", str(lr), "--seed", str(seed)]
    common += ["--max-grad-norm", repr(max_grad_norm)] if max_grad_norm is not None else []
    common += ["--precision", precision] if precision is not None else []
    if getattr(package, "BATCH_STATISTICS_PER_MICRO_BATCH", False):    # the reference accumulates alike
        common += ["--micro-batches", str(package.MICRO_BATCHES), "--dp-shares", str(package.DP_SIZE)]
        common += [] if package.AVERAGE_SHARES else ["--summed-shares"]
    server = nullcontext(forks) if forks is not None else forkserver.started(forkserver.installed_imports(entry_file))
    with terminated_as_exit(), tempfile.TemporaryDirectory(prefix="nnscaler-verify-") as workdir, server as forks:
        run = _Run(entry_file, out_dir, package, workdir, common, timeout, forks, precision, lr)
        result, ref = run.compare(tolerance)
        run.judge_later_steps(result, ref)
        if not result.passed and ref.get("exact_grads") is not None:     # the model runs in float64
            tighter = {name: value * FLOAT64_TIGHTENING for name, value in result.tolerance.items()}
            wide, wide_ref = run.compare(tighter, float64=True)
            if wide is not None:
                run.judge_later_steps(wide, wide_ref, float64=True)
            result.float64 = wide
    result.seconds = time.monotonic() - started
    return result


@dataclass
class _Run:
    """One verify's processes: the reference and the ranks, in float32 or float64."""
    entry_file: Path
    out_dir: Path
    package: object
    workdir: str
    common: list[str]
    timeout: float
    forks: object
    autocast: str | None = None      # the forward's half precision (--precision), if any
    lr: float = 1e-3

    def _folder(self, float64: bool) -> Path:
        workdir = Path(self.workdir) / "float64" if float64 else Path(self.workdir)
        workdir.mkdir(exist_ok=True)
        return workdir

    def _args(self, float64: bool) -> list[str]:
        return [*self.common, *(["--float64"] if float64 else [])]

    def compare(self, tolerance: dict[str, float], float64: bool = False) -> tuple[VerifyResult | None, dict]:
        """Run both sides and compare them; (None, {}) for a float64 run of a model that names
        float32 itself. In float32, `tolerance` is for the dtypes the reference computes in
        (derived_tolerance); a float64 run's is as given."""
        workdir, args = self._folder(float64), self._args(float64)
        world = self.package.WORLD_SIZE
        precision = "float64" if float64 else "float32"
        try:
            say(f"verify: the single-device run ({precision})")
            run_all([([sys.executable, str(WORKER), "reference", str(self.entry_file), str(workdir), *args],
                      process_env(**READ_ONLY))], self.timeout, self.forks)
            # the model's folder on the ranks' path, as the reference has it: helper modules the
            # programs import from beside the model (emit/beside.py)
            path = os.pathsep.join([str(Path(self.entry_file).resolve().parent),
                                    *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
            say(f"verify: {world} ranks on gloo ({precision})")
            run_world([sys.executable, str(WORKER), "rank", str(self.out_dir), str(workdir), *args], world,
                      self.timeout, self.forks, PYTHONPATH=path, **READ_ONLY)
        except LaunchError as err:
            if float64 and NOT_FLOAT64 in str(err):
                return None, {}
            raise VerifyError(str(err)) from None
        ref = torch.load(workdir / "reference.pt")
        if nothing_to_compare(ref["grads"]):
            raise VerifyError("every first gradient of the single-device run is zero: the loss is flat at the "
                              "initial weights (an output layer initialized to zero under a loss of the output's "
                              "square?), so no step moves a weight and the check would compare nothing; give the "
                              "entry's loss a gradient there (e.g. the square of output - 1)")
        dtype = "fp64"
        if not float64:
            dtype, tolerance = derived_tolerance(tolerance, self.autocast, ref["grads"], len(ref["losses"]),
                                                 self.lr)
        ranks = [torch.load(workdir / f"rank{r}.pt") for r in range(world)]
        merged = self.package.merge_state_dicts([r["state"] for r in ranks])
        max_abs, max_rel, worst = 0.0, 0.0, ""
        # a float64 run is its own exact reference: its rounding is how far another order moves it
        exact = ref["grads"] if float64 else ref.get("exact_grads")
        rounding = rounding_of(ref["grads"], exact, ref.get("reordered_grads"))
        unmeasured = set(noise_driven(ref["grads"], exact, rounding))
        for name, expected in ref["state"].items():
            diff = _difference(name, merged, expected)
            if name in unmeasured:
                continue
            err = diff.max().item() if diff.numel() else 0.0
            rel = (diff / expected.double().abs().clamp_min(1e-6)).max().item() if diff.numel() else 0.0
            if err > max_abs or not worst:     # an exact match still names what it compared
                max_abs, worst = err, name
            max_rel = max(max_rel, rel)
        grads = self.package.merge_state_dicts([r["grads"] for r in ranks])
        max_grad, worst_grad = gradient_error(ref["grads"], grads, rounding, tolerance["grad_rtol"])
        # buffers after the first forward are judged as its gradients are (relative to each one's
        # largest entry, widened by the reference's own rounding): before any step adds chaos
        buffers = self.package.merge_state_dicts([r["buffers"] for r in ranks])
        exact_buffers = ref["buffers"] if float64 else ref.get("exact_buffers")
        max_buffer, worst_buffer = gradient_error(
            ref["buffers"], buffers, rounding_of(ref["buffers"], exact_buffers, ref.get("reordered_buffers")),
            tolerance["grad_rtol"])
        result = VerifyResult(world, len(ref["losses"]), ref["losses"], ranks[0]["losses"], max_abs, max_rel,
                              worst, max_grad, worst_grad, tolerance, 0.0, [r["counters"] for r in ranks],
                              noise_driven=sorted(unmeasured), exact_first_loss=ref.get("exact_loss"),
                              precision=dtype, max_buffer_error=max_buffer, worst_buffer=worst_buffer)
        return result, ref

    def judge_later_steps(self, result: VerifyResult, ref: dict, float64: bool = False) -> None:
        """Later steps can amplify rounding: an unstable run (a loss that jumps at verify's lr)
        carries the last bits of its first gradients into visible differences. A second
        single-device run whose first gradients differ from the reference's by as much as the
        parallel run's did shows how far the reference itself drifts; where the first step
        passed and a later one did not, later steps are judged against that drift."""
        if result.passed_as_run or not result.first_step_passed or result.steps < 2:
            return
        # the least nudge is some units in the last place of the run's own dtype
        least = TWIN_LEAST_NUDGE * (torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps if float64 else 1)
        nudge = max(result.max_grad_error, least)
        workdir = self._folder(float64)
        say("verify: a single-device twin with nudged gradients (later steps differ)")
        try:
            run_all([([sys.executable, str(WORKER), "reference", str(self.entry_file), str(workdir),
                       *self._args(float64), "--nudge", repr(nudge)], process_env(**READ_ONLY))],
                    self.timeout, self.forks)
        except LaunchError as err:
            raise VerifyError(str(err)) from None
        twin = torch.load(workdir / "twin.pt")
        drift = max((_difference(name, twin["state"], expected).max().item()
                     for name, expected in ref["state"].items() if expected.numel()), default=0.0)
        result.twin = {"nudge": nudge, "loss_errors": [abs(a - b) for a, b in zip(ref["losses"], twin["losses"])],
                       "max_abs_error": drift}


def nothing_to_compare(first_grads: dict) -> bool:
    """Whether the reference's first gradients are all zero (none at all counts too): both runs
    then step nothing and agree whatever the rewrite does, a check that cannot fail."""
    return not any(g.numel() and bool(g.any()) for g in first_grads.values())


def gradient_error(expected_grads: dict, merged: dict, rounding: dict[str, float] | None = None,
                   grad_rtol: float = 1e-3) -> tuple[float, str]:
    """(largest relative error, its parameter) of the parallel run's first gradients.

    Each gradient is judged relative to its own scale, but never to less than a small share of
    the largest gradient anywhere: a true gradient of zero (a key bias before softmax) arrives
    as rounding noise in both runs, and noise over noise is no error. With the reference's own
    `rounding` per parameter (rounding_of), a difference within ROUNDING_MARGIN times it is
    rounding too (a sum of terms that cancel, larger than the gradients around it)."""
    overall = max((g.float().abs().max().item() for g in expected_grads.values() if g.numel()), default=0.0)
    floor = max(GRAD_SCALE_FLOOR * overall, 1e-8)
    worst, worst_name = 0.0, ""
    for name, expected in expected_grads.items():
        if not expected.numel():
            continue
        scale = max(expected.float().abs().max().item(), floor)
        scale = max(scale, ROUNDING_MARGIN * (rounding or {}).get(name, 0.0) / grad_rtol)
        err = _difference(name, merged, expected).max().item() / scale
        if err > worst or not worst_name:
            worst, worst_name = err, name
    return worst, worst_name


def rounding_of(expected_grads: dict, exact_grads: dict | None, reordered: dict | None = None) -> dict[str, float]:
    """Per parameter, how far the float32 reference's first gradient is from rounding-free: its
    distance from the float64 gradient (`exact_grads`), or from the same float32 step summed in
    another order (`reordered`), whichever is larger. Without float64 gradients, the distance
    from `reordered` alone (a half precision model's, its weights nudged: worker.py); empty
    without either."""
    rounding = {}
    if exact_grads is None and reordered is None:
        return rounding
    for name, expected in expected_grads.items():
        exact = (exact_grads or {}).get(name)
        if exact_grads is not None and (exact is None or exact.shape != expected.shape) or not expected.numel():
            continue
        rounding[name] = (expected.double() - exact).abs().max().item() if exact is not None else 0.0
        again = (reordered or {}).get(name)
        if again is not None and again.shape == expected.shape:
            rounding[name] = max(rounding[name], (expected.double() - again.double()).abs().max().item())
    return rounding


def noise_driven(expected_grads: dict, exact_grads: dict | None, rounding: dict[str, float]) -> list[str]:
    """Parameters whose first float32 gradient is rounding: its exact (float64) value is within
    ROUNDING_MARGIN times the float32 reference's rounding (rounding_of). AdamW turns such a
    gradient into full steps in a direction rounding chose, so their values after later steps
    are no measure of the rewrite (their gradients are judged, by gradient_error)."""
    if not exact_grads:
        return []
    return [name for name, expected in expected_grads.items() if expected.numel() and name in exact_grads
            and exact_grads[name].abs().max().item() < ROUNDING_MARGIN * rounding.get(name, 0.0)]


def _difference(name: str, merged: dict, expected: torch.Tensor) -> torch.Tensor:
    if name not in merged:
        raise VerifyError(f"the parallel run has no {name}")
    got = merged[name]
    if got.shape != expected.shape:
        raise VerifyError(f"merged {name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    return (got.double() - expected.double()).abs()
