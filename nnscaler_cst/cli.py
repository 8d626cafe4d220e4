"""The command line: `nnscaler-rewrite FILE [options]` rewrites; `inspect|verify|plan|schedule FILE`.

Wiring only: each command calls into the pipeline and prints; user errors exit 2 with
`path:line:col: error:` and no traceback unless --verbose.
"""
from __future__ import annotations

import difflib
import functools
import inspect as pyinspect
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import UserError
from .options import DEFAULTS, OPTIONS

# Plain help (click's): flags show as flags, not `<bool>`, and it reads at any width.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None)
# Piped output (a file, a pager, CI logs) gets wide tables rather than rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err_console = Console(stderr=True)
SUBCOMMANDS = {"rewrite", "inspect", "verify", "plan", "explain", "schedule"}

_state = {"verbose": False, "json": False}

VerboseOpt = typer.Option(False, "--verbose", "-v", help="show tracebacks of errors")


def shared_options(*scopes: str, **own):
    """Declare the options of `scopes` (options.OPTIONS, in its order) on a command, in place of
    its `options` parameter, which receives them as one dict {key: value, None when not given}.
    `own`: a typer.Option for a key that this command declares otherwise (another default or help)."""
    chosen = [o for o in OPTIONS if o.scope in scopes]
    assert set(own) <= {o.key for o in chosen}, own

    def decorate(fn):
        signature = pyinspect.signature(fn, eval_str=True)
        shared = [pyinspect.Parameter(o.key, pyinspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[o.type],
                                      default=own[o.key] if o.key in own else typer.Option(None, *o.flags,
                                                                                         help=_help(o)))
                  for o in chosen]
        params = [q for p in signature.parameters.values() for q in (shared if p.name == "options" else [p])]

        @functools.wraps(fn)
        def command(**kwargs):
            options = {o.key: kwargs.pop(o.key) for o in chosen}
            return fn(options=options, **kwargs)

        command.__signature__ = signature.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command
    return decorate


def _help(option) -> str:
    """An option's help with its built-in default (the typer default is None: "not given")."""
    shown = option.default is not None and option.default is not False and "default" not in option.help
    return option.help + (f" [default: {option.default}]" if shown else "")


def _version(value: bool):
    if value:
        from . import __version__
        print(f"nnscaler-rewrite {__version__}")
        raise typer.Exit()


@app.callback()
def _commands(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="print the version and exit")):
    """Rewrite a single-device PyTorch model into explicit per-rank parallel source.

    \b
      nnscaler-rewrite model.py [options]
          rewrite model.py into the output folder (-o, default: parallel/)
      nnscaler-rewrite COMMAND model.py [options]
          COMMAND: inspect, plan, explain, verify or schedule
      nnscaler-rewrite COMMAND --help
          that command's options
    """


def _run(fn):
    """Run a command body, turning UserErrors into `path:line:col: error:` and exit 2."""
    try:
        return fn()
    except UserError as exc:
        if _state["verbose"]:
            traceback.print_exc()
        # soft_wrap: never break a message into lines; editors parse `path:line:col: error:`
        err_console.print(exc.format(), markup=False, highlight=False, soft_wrap=True)
        if _state["json"]:
            _print_json_error(exc.message, str(exc.location) if exc.location else None, exc.hint)
        raise typer.Exit(exc.exit_code)


def _print_json_error(message: str, location: str | None = None, hint: str | None = None) -> None:
    """--json's one object when the command refuses: the error in place of the result."""
    print(json.dumps({"error": message, "location": location, "hint": hint}, indent=1))


@app.command()
@shared_options("model")
def inspect(model_file: Path = typer.Argument(..., help="model or entry file"),
            json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
            options: dict = None,
            trace_mode: str = typer.Option("auto", "--trace-mode", help="auto | fake | real"),
            verbose: bool = VerboseOpt):
    """Show every call site: source position, module, callee, shapes, split annotation."""
    _state["verbose"], _state["json"] = verbose, json_out
    from .analysis import analyze
    from .report.inspect_view import inspect_json, inspect_table

    def body():
        from .config import project_defaults
        if trace_mode not in ("auto", "fake", "real"):
            raise UserError(f"--trace-mode {trace_mode}: unknown mode", hint="--trace-mode auto | fake | real")
        project_defaults(model_file)        # checked, and its rules folders read
        with _step(f"tracing {model_file}"):
            analysis = analyze(model_file, model_class=options["model"], trace_mode=trace_mode)
        if json_out:
            print(json.dumps(inspect_json(analysis.graph), indent=1))
            return
        table, line = inspect_table(analysis.graph)
        console.print(table)
        console.print(line)

    _run(body)


def _options(model_file: Path, **given):
    """Command-line options over [tool.nnscaler-rewrite] defaults over built-in defaults."""
    from .config import check_options, project_defaults
    defaults = {**DEFAULTS, **project_defaults(model_file)}
    opts = {k: (v if v is not None else defaults.get(k)) for k, v in given.items()}
    check_options(opts)
    return opts


def _request(opts: dict):
    from .config import parse_stages
    from .rewrite import PlanRequest
    cuts = parse_stages(opts.get("stages"))
    return PlanRequest(opts["plan"], opts["tp"], opts["dp"], opts["devices"], opts["cluster"],
                       _memory_budget(opts["memory_budget"]), int(opts.get("pp") or 1), opts.get("micro_batches"),
                       opts.get("schedule") or "1f1b", cuts, recompute=bool(opts.get("recompute")),
                       sequence_parallel=bool(opts.get("sequence_parallel")),
                       zero=int(opts.get("zero") or 0), precision=opts.get("precision"))


def _memory_budget(text) -> float | None:
    from .sizes import parse_bytes
    try:
        return parse_bytes(text) if text is not None else None
    except ValueError as exc:
        raise UserError(f"--memory-budget: {exc}", hint="bytes per device, or a number with a unit: "
                        "--memory-budget 24GiB (also MiB, GB, TB)") from None


def _step(text: str):
    from .report.progress import step
    return step(err_console, text)


def _rewrite(model_file: Path, opts: dict):
    """(analysis, rewrite, the files read while making it: what --check's cache depends on)."""
    from .analysis import analyze
    from .checkcache import recording
    from .rewrite import rewrite as do_rewrite
    with recording() as opened:
        with _step(f"tracing {model_file}"):
            analysis = analyze(model_file, model_class=opts["model"])
        with _step("searching the plan and rewriting"):
            result = do_rewrite(analysis, _request(opts))
    _print_warnings(result.plan.warnings)
    return analysis, result, opened


def _write(out_dir: Path, model_file: Path, given: dict, result, opened: set[str], force: bool) -> bool:
    """Write the output with the user's hand edits merged in and say what became of them;
    True when conflicts were left to resolve (the command exits 1)."""
    from .checkcache import effective_options, local_sources, record, recorded_options
    from .config import project_defaults
    from .emit.beside import beside_warning
    from .emit.output import refuse_inputs_inside, write_output
    from .errors import display_path
    from .report.regenerate_view import regenerate_command, regeneration_lines
    refuse_inputs_inside(out_dir, [model_file, *local_sources(opened)[0]])
    options = effective_options(given, project_defaults(model_file))
    before = recorded_options(out_dir)
    cache = record(model_file, options, opened, result.files, out_dir)
    with _step(f"writing {display_path(out_dir)}/"):
        written = write_output(out_dir, result.files, force=force, check_cache=cache)
    notes, conflicts = regeneration_lines(out_dir, written)
    if before is not None and before != options:
        notes.insert(0, f"{display_path(out_dir)}/ was written by `{regenerate_command(model_file, before, out_dir)}`; "
                        f"now by `{regenerate_command(model_file, options, out_dir)}`")
    said = err_console if _state["json"] else console      # --json: stdout holds the one object
    for line in notes:
        said.print(line, markup=False, highlight=False, soft_wrap=True)
    for line in conflicts:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    _print_warnings([w for w in [beside_warning(result.files, model_file, out_dir)] if w])
    said.print(f"wrote {display_path(out_dir)}/: {len(result.files)} files, plan {result.plan.describe()}, "
                  f"est. step {result.plan.estimated_step_seconds * 1e3:.2f} ms", markup=False, highlight=False,
                  soft_wrap=True)
    return bool(conflicts)


def _command(model_file: Path, given: dict, out_dir: Path) -> str:
    """The command that writes `out_dir` with the options given (over pyproject's)."""
    from .checkcache import effective_options
    from .config import project_defaults
    from .report.regenerate_view import regenerate_command
    return regenerate_command(model_file, effective_options(given, project_defaults(model_file)), out_dir)


def _refuse_stale(model_file: Path, out_dir: Path, given: dict) -> None:
    """`verify` of a folder as it is: refuse one that is stale against the model file, with the
    command that regenerates it (from the options .nnscaler/check.json recorded), rather than
    report the difference as a wrong rewrite. The cache answers when nothing changed; else the
    rewrite is made again with the recorded options and compared (hand edits that merge
    cleanly are not staleness). A folder without a record is verified as it is."""
    from .checkcache import is_current, recorded_options
    from .emit.output import staleness
    from .errors import display_path
    from .options import BY_KEY
    from .report.regenerate_view import regenerate_command
    recorded = recorded_options(out_dir)
    if recorded is None or is_current(model_file, recorded, out_dir):
        return
    typed = {key: (value == "True" if BY_KEY[key].type is bool else BY_KEY[key].type(value))
             for key, value in recorded.items() if key in BY_KEY}
    given = {**{key: None for key in given}, **{k: v for k, v in typed.items() if k in given}}
    opts = _options(model_file, **given)
    _, result, _ = _rewrite(model_file, opts)
    with _step(f"comparing {display_path(out_dir)}/ with a new generation"):
        stale = staleness(out_dir, result.files)
    if stale:
        names = ", ".join([name for name, _, _ in stale.files] + [p.split(":")[0] for p in stale.problems])
        command = regenerate_command(model_file, recorded, out_dir)
        raise UserError(f"{display_path(out_dir)} is stale: {names} differ from what {display_path(model_file)} "
                        f"gives now, so verify would compare an old rewrite with a new model",
                        hint=f"regenerate it with `{command}`, or give verify the plan options to rewrite first")


def _refuse_inputs_early(out_dir: Path, model_file: Path) -> None:
    """Before tracing: an -o that holds the model file or the working folder (the files the
    model imports are known after the trace, and checked again before writing)."""
    from .emit.output import refuse_inputs_inside
    refuse_inputs_inside(out_dir, [model_file])


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        err_console.print(warning, markup=False, highlight=False, soft_wrap=True)


def _unified_diff(old: str, new: str, old_name: str, new_name: str) -> str:
    import difflib
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        old_name, new_name))


def _print_diff(text: str) -> None:
    if console.is_terminal:
        from rich.syntax import Syntax
        console.print(Syntax(text, "diff", theme="ansi_dark", background_color="default"))
    else:
        sys.stdout.write(text)


@app.command()
@shared_options("plan", "pipeline", "output", "model")
def rewrite(model_file: Path = typer.Argument(..., help="model or entry file"),
            options: dict = None,
            diff: Optional[int] = typer.Option(None, "--diff", help="show the diff of the model file "
                                               "against the program file this rank runs, instead of writing"),
            check: bool = typer.Option(False, "--check", help="exit 1 with a diff when the output folder "
                                       "is stale (pre-commit)"),
            force: bool = typer.Option(False, "--force", help="write the new generation without merging "
                                       "hand edits (edited files are kept as NAME.edited)"),
            verbose: bool = VerboseOpt):
    """Rewrite MODEL_FILE into per-rank parallel source in the output folder."""
    _state["verbose"] = verbose
    from .emit.output import staleness
    from .emit.programs import program_of
    from .errors import display_path

    def body():
        if diff is not None and check:
            raise UserError("--diff and --check do not go together",
                            hint="--diff RANK shows the diff of the program that rank runs; "
                                 "--check compares the whole output folder")
        if diff is not None and diff < 0:
            raise UserError(f"--diff {diff}: ranks start at 0", hint="e.g. --diff 0")
        opts = _options(model_file, **options)
        out_dir = Path(opts["out"])
        if check and not out_dir.is_dir():      # nothing to compare: one line, not a diff of every file
            err_console.print(f"{display_path(out_dir)} does not exist: write it with "
                              f"`{_command(model_file, options, out_dir)}`", markup=False, soft_wrap=True)
            raise typer.Exit(1)
        if diff is None and not check:
            _refuse_inputs_early(out_dir, model_file)
        analysis, result, opened = _rewrite(model_file, opts)
        if diff is not None:
            if diff >= result.plan.world_size:
                raise UserError(f"there is no rank {diff} in a world of {result.plan.world_size}",
                                hint=f"--diff takes a rank from 0 to {result.plan.world_size - 1}")
            name = program_of(result.plan, result.stages, diff).file
            source = analysis.sources.get(analysis.entry.path).text
            _print_diff(_unified_diff(source, result.files[name], display_path(analysis.entry.path),
                                      str(out_dir / name)))
            for mirrored, (original, base) in sorted(result.mirror_bases.items()):   # a model in several files
                _print_diff(_unified_diff(base, result.files[mirrored], original, str(out_dir / mirrored)))
            return
        if check:       # clean hand edits are not staleness: compared after merging them
            stale = staleness(out_dir, result.files)
            if stale:
                for name, now, then in stale.files:
                    path = out_dir / name
                    _print_diff(_unified_diff(now, then, str(path), f"{path} (now)"))
                for problem in stale.problems:
                    err_console.print(f"{display_path(out_dir)}/{problem}", markup=False, soft_wrap=True)
                command = _command(model_file, options, out_dir)
                if stale.files:
                    names = ", ".join(name for name, _, _ in stale.files)
                    err_console.print(f"{display_path(out_dir)} is stale: {names}; regenerate it with `{command}`",
                                      markup=False, soft_wrap=True)
                else:
                    err_console.print(f"{display_path(out_dir)}: resolve the conflicts above, then run `{command}`",
                                      markup=False, soft_wrap=True)
                raise typer.Exit(1)
            console.print(f"{display_path(out_dir)} is up to date")
            return
        if _write(out_dir, model_file, options, result, opened, force):
            raise typer.Exit(1)

    _run(body)


@app.command()
@shared_options("plan", "pipeline", "output", "model",
                out=typer.Option(None, "--out", "-o", help="output folder: rewritten first "
                                 "when --tp/--dp/--plan is given, else verified as it is [default: parallel]"))
def verify(model_file: Path = typer.Argument(..., help="model or entry file"),
           options: dict = None,
           steps: int = typer.Option(3, "--steps", help="AdamW steps"),
           lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
           timeout: float = typer.Option(300.0, "--timeout", help="seconds before a hung run is ended"),
           max_grad_norm: Optional[float] = typer.Option(None, "--max-grad-norm", help="clip the gradients' "
                                                         "global norm to this in both runs"),
           json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
           force: bool = typer.Option(False, "--force", help="as the rewrite's --force, when verify rewrites "
                                      "first"),
           verbose: bool = VerboseOpt):
    """Run the output on N gloo processes against the single-device model; exit 1 if they differ."""
    _state["verbose"], _state["json"] = verbose, json_out
    from .errors import display_path
    from .verify import forkserver

    def body():
        if steps < 1 or lr <= 0 or timeout <= 0:
            flag, value = next((f, v) for f, v, bad in (("--steps", steps, steps < 1), ("--lr", lr, lr <= 0),
                                                        ("--timeout", timeout, timeout <= 0)) if bad)
            raise UserError(f"{flag} {value:g}: must be {'at least 1' if flag == '--steps' else 'positive'}",
                            hint="e.g. --steps 3 --lr 1e-3 --timeout 300 (the defaults)")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise UserError(f"--max-grad-norm {max_grad_norm:g}: must be positive", hint="e.g. --max-grad-norm 1.0")
        opts = _options(model_file, **options)
        out_dir = Path(opts["out"])
        rewriting = any(options[o.key] is not None for o in OPTIONS if o.scope in ("plan", "pipeline")
                        and not o.cost_only) or not out_dir.exists()
        if rewriting:
            _refuse_inputs_early(out_dir, model_file)
        # the fork server imports torch for verify's processes while this process imports it and rewrites
        with forkserver.started(forkserver.installed_imports(model_file)) as forks:
            from .verify.equivalence import VerifyError, run_verify
            from .report.verify_view import verify_table
            if rewriting:
                _, result, opened = _rewrite(model_file, opts)
                if _write(out_dir, model_file, options, result, opened, force):
                    raise typer.Exit(1)         # conflict markers: nothing to verify until resolved
            else:
                _refuse_stale(model_file, out_dir, options)
            try:
                with _step(f"verifying {display_path(out_dir)}/: the single-device run and the ranks' "
                           f"gloo run, {steps} steps each"):
                    outcome = run_verify(model_file, out_dir, steps=steps, lr=lr, timeout=timeout, forks=forks,
                                         max_grad_norm=max_grad_norm)
            except VerifyError as exc:
                err_console.print(f"verify failed: {exc}", markup=False)
                if json_out:
                    _print_json_error(f"verify failed: {exc}")
                raise typer.Exit(1)
        if json_out:
            print(json.dumps({**outcome.to_json(), "output": display_path(out_dir)}, indent=1))
        else:
            console.print(verify_table(outcome))
            console.print(f"verified {display_path(out_dir)}/ against {display_path(model_file)}",
                          markup=False, highlight=False, soft_wrap=True)
        if not outcome.passed:
            raise typer.Exit(1)

    _run(body)


def _plan_command(model_file: Path, options: dict, json_out: bool, explain: bool, verbose: bool):
    _state["verbose"], _state["json"] = verbose, json_out
    from .analysis import analyze
    from .lifetimes import objects_so_far_kept
    from .plan.cost import load_cluster
    from .plan.explain import binding_constraints
    from .plan.tables import load_table, source_annotations
    from .report.plan_view import plan_json, plan_table
    from .rewrite import _table_names, build_plan

    def body():
        opts = _options(model_file, **options)
        request = _request(opts)
        with _step(f"tracing {model_file}"):
            analysis = analyze(model_file, model_class=opts["model"])
        with _step("searching the plan"):
            solved, tp_plan = build_plan(analysis, request)
        _print_warnings(solved.warnings)
        binding = None
        if explain and tp_plan is not None:
            graph = analysis.graph
            names = _table_names(request, solved.mesh["tp"], solved.mesh["dp"]) if request.plan != "auto" else []
            constraints = [c for n in names for c in load_table(n).for_axis("tp")] + \
                [c for c in source_annotations(graph) if c.axis == "tp"]
            device = load_cluster(request.cluster).with_precision(request.precision).axis(1, solved.mesh["tp"])
            binding = binding_constraints(graph, tp_plan, constraints, device, memory_budget=request.memory_budget,
                                          data_parallel=solved.mesh["dp"])
        if json_out:
            print(json.dumps(plan_json(analysis.graph, solved, tp_plan, binding), indent=1))
        else:
            console.print(plan_table(analysis.graph, solved, tp_plan, binding))

    # the model, its trace and graph, the search's tables live until the command ends: kept out of
    # the garbage collector's full passes, which would rescan their millions of objects
    with objects_so_far_kept():
        _run(body)


@app.command()
@shared_options("plan", "model")
def plan(model_file: Path = typer.Argument(..., help="model or entry file"),
         options: dict = None,
         json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
         explain: bool = typer.Option(False, "--explain", help="also show which constraints bind"),
         verbose: bool = VerboseOpt):
    """Show the chosen plan: per op its split, n and devices; per device time and memory."""
    _plan_command(model_file, options, json_out, explain, verbose)


@app.command()
@shared_options("plan", "model")
def explain(model_file: Path = typer.Argument(..., help="model or entry file"),
            options: dict = None,
            json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
            verbose: bool = VerboseOpt):
    """`plan --explain`: the plan and the constraints that bind it."""
    _plan_command(model_file, options, json_out, True, verbose)


@app.command()
@shared_options("pipeline", "model", pp=typer.Option(2, "--pp", help="pipeline stages (ranks)"),
                schedule=typer.Option("1f1b", "--schedule"))
def schedule(model_file: Path = typer.Argument(..., help="model or entry file"),
             options: dict = None,
             picture: Optional[Path] = typer.Option(None, "--picture", help="write the timeline as SVG"),
             csv: bool = typer.Option(False, "--csv", help="print the schedule in "
                                      "torch.distributed.pipelining's action grammar"),
             verbose: bool = VerboseOpt):
    """Show each rank's pipeline order, simulated with the cost model's times (no processes run)."""
    _state["verbose"] = verbose
    from .analysis import analyze
    from .plan.pipeline import plan_stages
    from .plan.schedules import load_schedule, placement, schedule as make_schedule, to_csv
    from .report.timeline import timeline_svg
    from .verify.simulate import bubble_fraction, simulate

    def body():
        from .config import check_options, project_defaults
        project_defaults(model_file)        # checked, and its rules folders read
        check_options(options)
        pp, micro_batches, stages, name = (options[k] for k in ("pp", "micro_batches", "stages", "schedule"))
        table = load_schedule(name)
        with _step(f"tracing {model_file}"):
            analysis = analyze(model_file, model_class=options["model"])
        cuts = [int(x) for x in stages.split(",")] if stages else None
        place = placement(table, pp)
        plan = plan_stages(analysis.graph, pp, table.virtual_stages, cuts, place, recycling=table.recycling)
        passes = plan.trunk.recycle.passes if plan.trunk.recycle is not None else 1
        micro = micro_batches or pp * table.virtual_stages
        if table.vocab:         # interlaced: the vocabulary calls' steps, every rank's, too
            from .plan import interlaced
            interlaced.apply(analysis.graph, plan, table)
            orders = interlaced.orders(table, pp, micro, place, plan.vocab_steps, plan.stage_seconds)
        else:
            orders = make_schedule(table, pp, micro, passes)
        events = simulate(orders, plan.stages, forward_seconds=plan.stage_seconds, placement=place,
                          passes=passes, vocab=plan.vocab_steps)
        if csv:
            sys.stdout.write(to_csv(orders))
        else:
            for rank, order in enumerate(orders):
                console.print(f"rank {rank}: {' '.join(map(str, order))}", highlight=False)
            blocks = ", ".join(f"stage {s}: blocks {a}-{b - 1}" for s, (a, b) in enumerate(plan.block_ranges))
            own = table.formula(pp, micro)      # the table's own bubble formula, if it states one
            console.print(f"{' + '.join(t.container for t in plan.trunks)}: {blocks}; bubble {100 * bubble_fraction(events, pp):.1f}% "
                          f"(cost model), 1F1B formula (D-1)/(D-1+M) = {100 * (pp - 1) / (pp - 1 + micro):.1f}%"
                          + (f", {table.name} formula {own[0]} = {100 * own[1]:.1f}%" if own else ""))
        if picture:
            picture.write_text(timeline_svg(events, pp, f"{name}: {pp} ranks x {micro} micro-batches"))
            console.print(f"wrote {picture}")

    _run(body)


def _refuse_mistyped_command(word: str) -> None:
    """`nnscaler-rewrite verfy model.py`: a word that is no file but close to a command's name
    is a mistyped command, not a model file."""
    if word.startswith("-") or Path(word).exists():
        return
    close = difflib.get_close_matches(word, sorted(SUBCOMMANDS), n=1, cutoff=0.6)
    if close:
        err_console.print(f"error: unknown command `{word}`; did you mean `{close[0]}`?\n"
                          f"  hint: nnscaler-rewrite {close[0]} MODEL_FILE [options], or "
                          "nnscaler-rewrite MODEL_FILE [options] to rewrite", markup=False, soft_wrap=True)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    # typer raises click's exceptions (or those of the copy of click it carries)
    click_errors = {c.__name__: c for c in typer.BadParameter.__mro__}
    usage_error, click_error = click_errors["UsageError"], click_errors["ClickException"]
    argv = list(sys.argv[1:] if argv is None else argv)
    # `nnscaler-rewrite model.py ...` (or `nnscaler-rewrite --tp 2 model.py`) is the rewrite;
    # the other commands are named first.
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("--help", "-h", "--version"):
        _refuse_mistyped_command(argv[0])
        argv.insert(0, "rewrite")
    try:
        code = app(args=argv, prog_name="nnscaler-rewrite", standalone_mode=False)
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":     # the help, once, as --help prints it
            print(exc.ctx.get_help() if exc.ctx else exc.format_message())
            raise SystemExit(2) from None
        # a bad option: an `error:` line and a hint, like every other error
        command = exc.ctx.command_path if exc.ctx else "nnscaler-rewrite"
        err_console.print(f"error: {exc.format_message()}\n  hint: see `{command} --help`",
                          markup=False, highlight=False, soft_wrap=True)
        if "--json" in argv:
            _print_json_error(exc.format_message(), hint=f"see `{command} --help`")
        code = exc.exit_code
    except click_error as exc:
        err_console.print(f"error: {exc.format_message()}", markup=False, highlight=False, soft_wrap=True)
        code = exc.exit_code
    except typer.Abort:
        err_console.print("aborted", markup=False)
        code = 1
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    # `python -m nnscaler_cst.cli plan ...` is a whole process, as the console script's is: it
    # ends at once when done (see __main__.py's IMMEDIATE_EXIT)
    from nnscaler_cst.__main__ import IMMEDIATE_EXIT, run_and_exit
    if sys.argv[1:2] and sys.argv[1] in IMMEDIATE_EXIT:
        run_and_exit(main, sys.argv[1:])
    main()
