"""Verification ladder step 2: before anything is written, the emitted programs are built and
run under fake tensors (DESIGN.md).

The rendered files go to a temporary package (never the output folder), which is imported in
this process. For one rank of every pipeline stage (tp 0, dp 0) the check builds the rank's
model, loads its share of the single-device state dict (`shard_state_dict`, strict: every key
and every shape), and runs the forward on the entry's example inputs as the training API slices them
(data-parallel share, first micro-batch), then the backward; pipeline stages run one after
another, each fed what the previous one hands over. The last tensor-parallel rank of each
stage is built and loaded as well (a split that does not come out even differs there).

Collectives get shape-only stand-ins in the imported `_comm` (the generated text is not
changed): an all-reduce is the identity, an all-gather repeats this rank's piece, and each
simulated rank sees its own tp/dp/pp coordinates. Fake tensors make the compute free; when the
trace itself needed real tensors, the check runs on real ones.

A mismatch is a bug of the rewrite: a UserError `internal error` at the user's source line the
failing generated line came from (or the generated file and line), so the CLI exits 2 with
nothing written. What the dry run itself cannot run (an op fake tensors do not support) is a
warning, never a refusal.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import linecache
import pickle
import re
import shutil
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import Location, UserError, display_path
from ..report.progress import say
from ..trace.tracer import quiet_fake_mode

HINT = "a bug of nnscaler-rewrite, not of your model: nothing was written; please report it with the model file"


@dataclass
class DryRun:
    """What the dry run checked: (rank, what was run), and the warnings it leaves."""

    checked: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class _CannotRun(Exception):
    """The dry run itself cannot run this construct (not a bug of the rewrite)."""


def _unsupported_types() -> tuple[type, ...]:
    """Exceptions meaning fake tensors cannot run an op, not that the rewrite is wrong."""
    found: list[type] = []
    from torch._subclasses import fake_tensor
    for name in ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
                 "UnsupportedFakeTensorException", "MetadataMismatchError"):
        if hasattr(fake_tensor, name):
            found.append(getattr(fake_tensor, name))
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
        found.append(GuardOnDataDependentSymNode)
    except ImportError:     # pragma: no cover - older torch
        pass
    return tuple(found)


def _tensor_mode(mode: str):
    return quiet_fake_mode() if mode == "fake" else contextlib.nullcontext()


@contextlib.contextmanager
def _package(files: dict[str, str]):
    """The rendered files as an importable package in a temporary folder; removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="nnscaler-dry-run-"))
    name = f"_nnscaler_dry_run_{uuid.uuid4().hex[:12]}"
    (folder / name).mkdir()
    for file, text in files.items():
        if file.endswith(".py"):
            (folder / name / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / name / file).write_text(text, encoding="utf-8")
    sys.path.insert(0, str(folder))
    try:
        yield name, folder / name
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        shutil.rmtree(folder, ignore_errors=True)


def _shape_only_collectives(comm) -> None:
    """Stand-ins in this imported copy of _comm: right shapes, no process group."""
    comm._all_reduce = lambda t, axis, op=None: t
    comm._all_gather = lambda t, axis: [t.clone() for _ in range(axis.size)]
    comm._reduce_scatter = lambda t, axis, dim: t.chunk(axis.size, dim)[axis.rank].clone()
    comm._broadcast = lambda t, src, axis: t
    comm._gather = lambda t, dst, axis: [t.clone() for _ in range(axis.size)]
    comm._scatter = lambda pieces, src, axis, like=None: (pieces[axis.rank] if pieces is not None else like).clone()


def _place(comm, package, rank: int) -> dict[str, int]:
    """Set every mesh axis of the imported _comm as `rank` would see it after setup()."""
    tp, dp, pp = package.TP_SIZE, package.DP_SIZE, package.PP_SIZE
    coords = package.coords(rank)

    def global_rank(p, d, t):
        return (p * dp + d) * tp + t

    p, d, t = coords["pp"], coords["dp"], coords["tp"]
    lines = {comm.TP: [global_rank(p, d, i) for i in range(tp)],
             comm.DP: [global_rank(p, i, t) for i in range(dp)],
             comm.PP: [global_rank(i, d, t) for i in range(pp)],
             comm.PP_TP: [global_rank(i, d, j) for i in range(pp) for j in range(tp)]}
    pipeline = lines[comm.PP]
    tied = [pipeline[i] for i in getattr(package.rank_module(rank), "TIED_RANKS", None) or (0, pp - 1)] \
        if pp > 1 else [rank]
    lines[comm.PP_ENDS] = tied if rank in tied else [rank]
    comm.GLOBAL_RANK = rank
    for axis, ranks in lines.items():
        axis._reset()
        if len(ranks) > 1:
            axis.size, axis.rank, axis.ranks = len(ranks), ranks.index(rank), ranks
    return coords


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


class _Checker:
    def __init__(self, analysis, files: dict[str, str], name: str, folder: Path):
        self.analysis = analysis
        self.files = files
        self.folder = folder
        self.package = importlib.import_module(name)
        self.comm = importlib.import_module(f"{name}._comm")
        _shape_only_collectives(self.comm)
        self.unsupported = _unsupported_types()
        self.result = DryRun()
        self.mode = "fake"

    # ---- what runs ----------------------------------------------------------------------
    def run(self, mode: str) -> DryRun:
        self.mode = mode
        package = self.package
        tp, dp, pp = package.TP_SIZE, package.DP_SIZE, package.PP_SIZE
        firsts = [p * dp * tp for p in range(pp)]        # tp 0, dp 0 of each pipeline rank
        lasts = [r + tp - 1 for r in firsts] if tp > 1 else []
        for rank in firsts + lasts:
            self._import(rank)                           # module-level code runs outside fake mode
        with torch.random.fork_rng(devices=[]), _tensor_mode(mode):
            torch.manual_seed(0)
            full = self._guard(lambda: self.analysis.entry.build_fn().state_dict(), None,
                               "building the single-device model", own=False)
            models = {rank: self._build_and_load(rank, full) for rank in firsts}
            for first, last in zip(firsts, lasts):
                if self._body(last) == self._body(first):    # the same code: only its share can differ
                    self._place(last)
                    shard = self._guard(lambda: package.shard_state_dict(full, last), last, "shard_state_dict()")
                    self._compare(last, models[first], shard)
                    self.result.checked.append((last, "shard shapes"))
                else:
                    self._build_and_load(last, full)
            step = (lambda: self._forward_backward(firsts[0], models[firsts[0]])) if pp == 1 else \
                (lambda: self._pipeline(firsts, models))
            self._steps(step, {rank: models[rank] for rank in firsts})
        return self.result

    def _steps(self, step, models: dict) -> None:
        """One training step; a second one where the first left the models' state (a buffer, a
        tensor attribute) at other shapes than it was built with: a value stored on the model in
        the forward (`self.pe = self.pe.to(x.dtype)`) is what the next step reads, and the ranks
        run several steps. With the same batch, the state must not change shape again."""
        built = _state_shapes(models)
        step()
        after = _state_shapes(models)
        changed = {key: (built[key], shape) for key, shape in after.items() if key in built and built[key] != shape}
        if not changed:
            return
        try:
            step()
        except UserError as error:
            error.related.extend(self._state_notes(changed))
            error.message += " (at the second step: the first changed the model's state)"
            raise
        again = _state_shapes(models)
        drift = {key: (after[key], shape) for key, shape in again.items() if key in after and after[key] != shape}
        if drift:
            (rank, key), (first, second) = next(iter(drift.items()))
            notes = self._state_notes(drift)
            error = self._internal(rank, f"{key} changes shape at every step: {list(first)} after the first, "
                                         f"{list(second)} after the second", notes[0][0] if notes else None)
            error.related.extend(notes)
            raise error
        self.result.checked.append((next(iter(models)), "second step"))

    def _state_notes(self, changed: dict) -> list[tuple[Location, str]]:
        """Per changed state tensor, where the rank's code stores it (`self.<attr> = ...`), at the
        user's line it came from."""
        notes = []
        for (rank, key), (before, after) in changed.items():
            attr = key.rpartition(".")[2]
            file = self._file(rank)
            lines = self.files.get(file, "").splitlines()
            store = re.compile(rf"^\s*self\.{re.escape(attr)}\s*(?::[^=]*)?=(?!=)")
            index = next((i for i, line in enumerate(lines) if store.match(line) and not _in_init(lines, i)), None)
            text = f"{key} was {list(before)} when built and is {list(after)} after a step"
            if index is None:
                notes.append((Location(file, 1, 0), text))
                continue
            location = _user_location(self.analysis, file, lines, index, None) or \
                Location(file, index + 1, len(lines[index]) - len(lines[index].lstrip()))
            notes.append((location, f"{text}: stored here ({_normal(lines[index])})"))
        return notes

    def _import(self, rank: int) -> None:
        try:
            self.package.rank_module(rank)
        except ImportError as exc:
            if not (exc.name or "").startswith(self.package.__name__):
                # one of the user's modules, not found from here (a search path the rank processes have)
                raise _CannotRun(f"{self._file(rank)} does not import here: {exc}") from exc
            raise self._failure(exc, rank, f"importing {self._file(rank)}") from exc
        except Exception as exc:     # noqa: BLE001 - judged by _failure
            raise self._failure(exc, rank, f"importing {self._file(rank)}") from exc

    def _file(self, rank: int) -> str:
        """The program file `rank` runs."""
        return f"{self.package.program(rank)}.py"

    def _body(self, rank: int) -> str:
        return self.files[self._file(rank)].partition("\n")[2]

    def _build_and_load(self, rank: int, full: dict):
        package = self.package
        self._place(rank)
        model = self._guard(lambda: package.build(rank), rank, "build()")
        self._rewritten_classes(rank, model)
        shard = self._guard(lambda: package.shard_state_dict(full, rank), rank, "shard_state_dict()")
        self._compare(rank, model, shard)
        self._guard(lambda: model.load_state_dict(shard, strict=True), rank, "load_state_dict()")
        self.result.checked.append((rank, "build, load"))
        return model

    def _batch(self, rank: int):
        module = self.package.rank_module(rank)
        torch.manual_seed(0)
        batch = self._guard(module.example_inputs, rank, "example_inputs()", own=False)
        return module, self._guard(lambda: self.package.batch_share(batch), rank, "the data-parallel split")

    def _forward_backward(self, rank: int, model) -> None:
        self._place(rank)
        module, inputs = self._batch(rank)
        if getattr(self.package, "MICRO_BATCHES", 1) > 1:     # gradient accumulation: its first micro-batch
            share = inputs
            inputs = self._guard(lambda: self.package.micro_batches(share)[0], rank, "the micro-batch split")
        model.train()
        output = self._guard(lambda: _call(model, inputs), rank, "the forward")
        loss = self._guard(lambda: self.package.loss_of(module, output), rank, "loss()")
        self._check_loss(rank, loss)
        if loss.requires_grad:
            self._guard(loss.backward, rank, "the backward")
        self.result.checked.append((rank, "forward, backward"))

    def _pipeline(self, firsts: list[int], models: dict) -> None:
        """Every stage in order on the rank that runs it: stage s gets what stage s - 1 handed over."""
        comm, package = self.comm, self.package
        modules = {rank: self.package.rank_module(rank) for rank in firsts}
        count = modules[firsts[0]].PIPELINE_LENGTH     # one pipeline: replicas (Chimera) run the same code
        owner = {stage: rank for rank in firsts for stage in modules[rank].PIPELINE_STAGES}
        for model in models.values():
            model.train()
        inbox: tuple = ()
        held: list[tuple[list, list]] = []
        for stage in range(count):
            rank = owner.get(stage)
            if rank is None:
                raise self._internal(None, f"no rank runs pipeline stage {stage}")
            module = modules[rank]
            self._place(rank)
            _, inputs = self._batch(rank)
            micro = self._guard(lambda: package.micro_batches(inputs)[0], rank, "the micro-batch split")
            comm.PIPE.stages, comm.PIPE.stage = count, stage
            model = models[rank][module.PIPELINE_STAGES.index(stage)]
            comm.PIPE.model = model
            comm.PIPE.inbox = comm._received(*inbox) if inbox else ()    # modules handed over: this stage's
            what = f"stage {stage}'s forward"
            try:
                output = _call(model, micro)
            except comm.StageBoundary as boundary:
                if stage == count - 1:
                    raise self._internal(rank, f"the last stage ({stage}) handed values on") from None
                sent = comm.flat_tensors(boundary.values)
                inbox, received = self._hand_over(rank, stage, boundary.values)
                held.append((sent, received))
            except Exception as exc:        # noqa: BLE001 - judged by _failure
                raise self._failure(exc, rank, what) from exc
            else:
                if stage < count - 1:
                    raise self._internal(rank, f"stage {stage}'s forward ran to the end without handing "
                                               "anything to the next stage")
                loss = self._guard(lambda: package.loss_of(module, output) / package.MICRO_BATCHES, rank, "loss()")
                self._check_loss(rank, loss)
                if loss.requires_grad:
                    self._guard(loss.backward, rank, f"stage {stage}'s backward")
            finally:
                comm.PIPE.inbox = ()
            self.result.checked.append((rank, f"stage {stage} forward"))
        for stage in reversed(range(count - 1)):         # backward, last stage first
            sent, received = held[stage]
            outputs = [t for t in sent if t.requires_grad]
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in received if t.requires_grad]
            if outputs:
                self._guard(lambda: torch.autograd.backward(outputs, grads), owner[stage], f"stage {stage}'s backward")

    def _hand_over(self, rank: int, stage: int, values) -> tuple[tuple, list]:
        """What recv_values would hand the next stage: the structure pickled as send_values pickles
        it and fresh copies of its tensors (needing gradients where the sent ones did), to be filled
        in (comm._received) when the next stage's model runs: a module handed over is its own."""
        comm = self.comm
        tensors: list = []
        structure = comm._slots(values, tensors)
        try:
            structure = pickle.loads(pickle.dumps(structure))
        except Exception as exc:     # noqa: BLE001
            if self.mode == "real":  # an object holding fake tensors (a cache) does not pickle: as it is
                raise self._internal(rank, f"stage {stage} hands the next stage a value that cannot be "
                                           f"sent ({type(exc).__name__}: {exc})") from exc
        received = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]   # values kept: ids
        return (structure, received), received

    # ---- checks ------------------------------------------------------------------------
    def _place(self, rank: int) -> None:
        _place(self.comm, self.package, rank)

    def _check_loss(self, rank: int, loss) -> None:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise self._internal(rank, f"the loss is not a scalar tensor: {shape}")

    def _compare(self, rank: int, model, shard: dict) -> None:
        """Every key and shape of the rank's state dict against its share of the single-device one."""
        own = model.state_dict()
        problems = []
        for key, tensor in own.items():
            if key not in shard:
                problems.append((key, f"{key} is missing from the sharded state dict"))
            elif tuple(shard[key].shape) != tuple(tensor.shape):
                problems.append((key, f"{key} has shape {list(tensor.shape)} in the rank's model but "
                                      f"{list(shard[key].shape)} in its share of the state dict"))
        problems += [(key, f"{key} of the sharded state dict is not in the rank's model")
                     for key in shard if key not in own]
        if problems:
            key, text = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            error = self._internal(rank, f"state dict mismatch: {text}{more}", self._param_location(rank, key))
            # parameters built at another size than their plan says (library code at construction
            # ties or pads them to a dim the plan keeps whole): rewrite.py plans again, them whole
            shaped = {self._param(rank, key) for key, text in problems if "has shape" in text}
            error.misshapen_params = sorted(name for name in shaped if name is not None)
            raise error

    def _rewritten_classes(self, rank: int, model) -> None:
        """Every module of the rank's model whose class the output writes anew is of the rewritten
        class: a build() that reaches the installed one (library code calling it) runs the single-
        device layer on every rank, whatever the plan says."""
        package = self.package.__name__
        program = self.package.rank_module(rank)
        mirrored = any("/" in name for name in self.files)    # else the model's file is in the program
        own = {str(Path(p).resolve()) for p in self.analysis.trace.own_files}
        for path, module in model.named_modules():
            cls = type(module)
            home = sys.modules.get(f"{package}.{cls.__module__}") if mirrored else program
            anew = getattr(home, cls.__name__, None) if home is not None else None
            file = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if not (isinstance(anew, type) and anew is not cls and anew.__module__ == home.__name__
                    and file is not None and str(Path(file).resolve()) in own):
                continue
            built = self.analysis.entry.constructions.get(_single_device_name(path, self.package, program))
            location = Location(display_path(built.file), built.line, built.col) \
                if built is not None and built.file is not None else None
            raise self._internal(rank, f"build() made {path or 'the model'} of the installed "
                                       f"{cls.__module__}.{cls.__qualname__}, not of the rewritten class", location)

    def _param(self, rank: int, key: str) -> str | None:
        """The parameter (its canonical name) a rank's state-dict key names."""
        name = _single_device_name(key, self.package, self.package.rank_module(rank))
        return next((canonical for canonical, info in self.analysis.trace.params.items() if name in info.aliases),
                    None)

    def _param_location(self, rank: int, key: str) -> Location | None:
        """Where the user's code constructs the parameter a rank's state-dict key names."""
        info = self.analysis.trace.params.get(self._param(rank, key) or "")
        return info.ctor_span.start if info is not None and info.ctor_span is not None else None

    # ---- failures ----------------------------------------------------------------------
    def _guard(self, fn, rank, what: str, *, own: bool = True):
        try:
            return fn()
        except UserError:
            raise
        except Exception as exc:     # noqa: BLE001 - judged by _failure
            if not own and not isinstance(exc, self.unsupported):
                raise _CannotRun(f"{what} raised {type(exc).__name__}: {exc}") from exc
            raise self._failure(exc, rank, what) from exc

    def _failure(self, exc: Exception, rank, what: str) -> Exception:
        if isinstance(exc, self.unsupported):
            return _CannotRun(f"{what} of rank {rank}: {type(exc).__name__}: {_first_line(exc)}")
        location, generated = self._site(exc)
        if isinstance(exc, self.comm.HandoffUnsendable):     # the model's values, not the tool's code
            names = _handed_names(generated[2]) if generated is not None else []
            if generated is not None:       # at the loop over the blocks, the line before the hand-off
                lines = self.files.get(generated[0], "").splitlines()
                loop = next((k for k in range(generated[1] - 1, -1, -1) if lines[k].lstrip().startswith("for ")
                             and "# pipeline: " in lines[k]), None)
                if loop is not None:
                    location = _user_location(self.analysis, generated[0], lines, loop, None) or location
            what = f"`{names[exc.index]}`" if exc.index < len(names) else "a value"
            return UserError(f"the pipeline stages hand {what} on from stage to stage (it is set before or in the "
                             f"loop over the blocks and read after the cut): {exc}", location,
                             hint="carry tensors (or dataclasses, lists, dicts of them) across the loop, or use "
                                  "--tp or --dp for this model")
        message = f"{what} raised {type(exc).__name__}: {_first_line(exc)}"
        error = self._internal(rank, message, location, generated)
        if what == "build()":
            error.misshapen_params = self._written_at_construction(exc)
            error.in_build = True
        return error

    def _written_at_construction(self, exc: Exception) -> list[str]:
        """The parameters the failing line of a model's construction names (`init.copy_(self.dt_proj.bias,
        inv_dt)`: initialization code computing a value at the whole size): every instance's,
        by the class of the module the line reaches them through and the attribute path."""
        frame = None
        tb = exc.__traceback__
        while tb is not None:
            if self.folder in Path(tb.tb_frame.f_code.co_filename).parents:
                frame = tb.tb_frame
            tb = tb.tb_next
        if frame is None:
            return []
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        found = set()
        for name, chain in re.findall(r"\b(\w+)((?:\.\w+)+)", line):    # self.x.bias, module.dt_bias
            owner = frame.f_locals.get(name)
            if not isinstance(owner, torch.nn.Module):
                continue
            value, walked = owner, []
            for attr in chain.lstrip(".").split("."):       # up to a parameter: `self.up.bias.copy_`
                value = getattr(value, attr, None)
                walked.append(attr)
                if value is None or isinstance(value, torch.nn.Parameter):
                    break
            if not isinstance(value, torch.nn.Parameter):
                continue
            attrs = ".".join(walked)
            for canonical, info in self.analysis.trace.params.items():
                for alias in info.aliases:
                    path = alias[:-len(attrs) - 1]
                    if alias.endswith("." + attrs) and \
                            self.analysis.trace.module_types.get(path, "").rsplit(".", 1)[-1] == type(owner).__name__:
                        found.add(canonical)
        return sorted(found)

    def _internal(self, rank, message: str, location: Location | None = None,
                  generated: tuple[str, int, str] | None = None) -> UserError:
        who = ""
        if rank is not None:
            coords = self.package.coords(rank)
            who = f"rank {rank} ({', '.join(f'{a} {i}' for a, i in coords.items())}): "
        related = []
        if generated is not None:
            file, line, text = generated
            where = Location(file, line, len(text) - len(text.lstrip()))
            if location is None:
                location = where
            else:
                related.append((where, f"the generated line: {text.strip()}"))
        return UserError(f"internal error: the dry run of the emitted code failed: {who}{message}", location,
                         hint=HINT, related=related)

    def _site(self, exc: Exception) -> tuple[Location | None, tuple[str, int, str] | None]:
        """(the user's source line the innermost generated model line on the traceback came from,
        (generated file, line, text)); a failure inside __init__.py or train.py names only the
        generated line, _comm.py's frames are skipped for the line that called them."""
        frames = []
        for frame in traceback.extract_tb(exc.__traceback__):
            path = Path(frame.filename)
            if self.folder in path.parents and path.name != "_comm.py":
                frames.append((path.relative_to(self.folder).as_posix(), frame))
        if not frames:
            return None, None
        name, frame = frames[-1]
        lines = self.files.get(name, "").splitlines()
        text = lines[frame.lineno - 1] if frame.lineno and 0 < frame.lineno <= len(lines) else ""
        location = None
        if name not in ("__init__.py", "train.py") and text:
            location = _user_location(self.analysis, name, lines, frame.lineno - 1, getattr(frame, "colno", None))
        return location, (name, frame.lineno or 1, text)


def _handed_names(text: str) -> list[str]:
    """The names a generated `pp_handoff(a, b)` / `pp_hand_on(self, a, b)` line hands on."""
    call = text.strip().split("  #")[0]
    if not call.startswith(("pp_handoff(", "pp_hand_on(")) or not call.endswith(")"):
        return []
    names = [n.strip() for n in call[call.index("(") + 1:-1].split(",")]
    return names[1:] if call.startswith("pp_hand_on(") else names


def _single_device_name(name: str, package, module) -> str:
    """A state-dict key or module path of a rank's model as the single-device model names it
    (pipeline stages: `0.blocks.1.mlp` -> `blocks.<first block of stage 0 + 1>.mlp`)."""
    if package.PP_SIZE == 1:
        return name
    local, _, rest = name.partition(".")
    with contextlib.suppress(ValueError, IndexError, KeyError):
        return package.global_key(rest, module.PIPELINE_STAGES[int(local)], module)
    return name


def _state_shapes(models: dict) -> dict[tuple[int, str], tuple]:
    """(rank, dotted name) -> shape of every buffer and plain tensor attribute of the ranks' models
    (parameters are loaded, never stored to by a forward)."""
    shapes = {}
    for rank, model in models.items():
        roots = list(model) if isinstance(model, (list, tuple)) else [model]
        for k, root in enumerate(roots):
            prefix = f"{k}." if len(roots) > 1 else ""
            for name, module in root.named_modules(remove_duplicate=False):
                for attr, value in list(vars(module).items()) + list(module._buffers.items()):
                    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                        shapes[(rank, f"{prefix}{name + '.' if name else ''}{attr}")] = tuple(value.shape)
    return shapes


def _in_init(lines: list[str], index: int) -> bool:
    """Whether line `index` lies in an `__init__` method (the store a forward makes is elsewhere)."""
    indent = len(lines[index]) - len(lines[index].lstrip())
    for line in reversed(lines[:index]):
        stripped = line.lstrip()
        if stripped.startswith("def ") and len(line) - len(stripped) < indent:
            return stripped.startswith("def __init__")
    return False


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


_COMMENT = re.compile(r"\s+#.*$")


def _normal(line: str) -> str:
    return _COMMENT.sub("", line).strip()


def _user_location(analysis, name: str, generated: list[str], index: int, colno: int | None) -> Location | None:
    """Map line `index` (0-based) of the generated file `name` to the user's source line it rewrites:
    the generated file keeps the user's line structure, so align the two line by line (comments
    and indentation aside) and read the pair. A mirror of a model file (`timm/models/dla.py`) is
    aligned with that file only: another file's rewritten line may align as well as its own (DLA's
    dry run failure was put in timm's adaptive_avgmax_pool.py). None when no source lines up."""
    paths = [str(p) for p in analysis.trace.own_files] + [str(analysis.entry.path)]
    name = re.sub(r"_stage\d+\.py$", ".py", name)      # a pipeline stage's program of model.py
    paths = [p for p in paths if Path(p).resolve().as_posix().endswith("/" + name)] or (
        [p for p in paths if "site-packages" not in Path(p).parts] if name == "model.py" else []) or paths
    seen, best = set(), None
    target = [_normal(line) for line in generated]
    for path in paths:
        key = str(Path(path).resolve())
        if key in seen:
            continue
        seen.add(key)
        try:
            source = analysis.sources.get(key)
        except Exception:       # noqa: BLE001 - a file that cannot be read maps nothing
            continue
        user = source.text.splitlines()
        matcher = difflib.SequenceMatcher(None, [_normal(line) for line in user], target, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if not j1 <= index < j2 or tag == "delete":
                continue
            rank = {"equal": 0, "replace": 1, "insert": 2}[tag]
            line = i1 + min(index - j1, max(i2 - i1 - 1, 0)) if tag != "insert" else i1
            if line >= len(user):
                break
            if best is None or rank < best[0]:
                best = (rank, source.path, line, tag, user[line])
            break
    if best is None:
        return None
    _, path, line, tag, text = best
    indent = len(text) - len(text.lstrip())
    col = indent
    if tag == "equal" and colno is not None:
        gen = generated[index]
        col = max(indent, colno - (len(gen) - len(gen.lstrip())) + indent)
    return Location(display_path(path), line + 1, col)


def dry_run(analysis, files: dict[str, str]) -> DryRun:
    """Build, load and run the emitted rank modules before anything is written (see the module
    docstring). Raises UserError `internal error` on a mismatch; warns when it cannot run."""
    mode = "fake" if analysis.trace.mode == "fake" else "real"
    say("a dry run of the output before it is written")
    with _package(files) as (name, folder):
        try:
            checker = _Checker(analysis, files, name, folder)
        except Exception as exc:        # noqa: BLE001 - the generated package itself does not import
            location = None
            raise UserError(f"internal error: the emitted package does not import: {type(exc).__name__}: "
                            f"{_first_line(exc)}", location, hint=HINT) from exc
        try:
            return checker.run(mode)
        except _CannotRun as exc:
            entry = display_path(analysis.entry.path)
            return DryRun(checker.result.checked, [f"{entry}: warning: could not dry-run the emitted code ({exc}); "
                                                   "it is written unchecked"])
