"""The command line: `nnscaler-rewrite FILE [options]` rewrites; `inspect|verify|plan|schedule FILE`.

Wiring only: each command calls into the pipeline and prints; user errors exit 2 with
`path:line:col: error:` and no traceback unless --verbose.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Rewrite a single-device PyTorch model into explicit per-rank parallel source.")
# Piped output (a file, a pager, CI logs) gets wide tables rather than rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err_console = Console(stderr=True)
SUBCOMMANDS = {"rewrite", "inspect", "verify", "plan", "explain", "schedule"}

_state = {"verbose": False}

VerboseOpt = typer.Option(False, "--verbose", "-v", help="show tracebacks of errors")
ModelOpt = typer.Option(None, "--model", help="nn.Module class in the file to build when it has no build()")


@app.callback()
def _commands():
    """Rewrite a single-device PyTorch model into explicit per-rank parallel source."""


def _run(fn):
    """Run a command body, turning UserErrors into `path:line:col: error:` and exit 2."""
    try:
        return fn()
    except UserError as exc:
        if _state["verbose"]:
            traceback.print_exc()
        # soft_wrap: never break a message into lines; editors parse `path:line:col: error:`
        err_console.print(exc.format(), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code)


@app.command()
def inspect(model_file: Path = typer.Argument(..., help="model or entry file"),
            json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
            model: Optional[str] = ModelOpt,
            trace_mode: str = typer.Option("auto", "--trace-mode", help="auto | fake | real"),
            verbose: bool = VerboseOpt):
    """Show every call site: source position, module, callee, shapes, split annotation."""
    _state["verbose"] = verbose
    from .analysis import analyze
    from .report.inspect_view import inspect_json, inspect_table

    def body():
        from .config import project_defaults
        if trace_mode not in ("auto", "fake", "real"):
            raise UserError(f"--trace-mode {trace_mode}: unknown mode", hint="--trace-mode auto | fake | real")
        project_defaults(model_file)        # checked, and its rules folders read
        analysis = analyze(model_file, model_class=model, trace_mode=trace_mode)
        if json_out:
            print(json.dumps(inspect_json(analysis.graph), indent=1))
            return
        table, line = inspect_table(analysis.graph)
        console.print(table)
        console.print(line)

    _run(body)


TpOpt = typer.Option(None, "--tp", help="tensor-parallel size")
DpOpt = typer.Option(None, "--dp", help="data-parallel size")
ZeroOpt = typer.Option(None, "--zero", help="ZeRO stage over the data-parallel ranks: 1 shards optimizer state, "
                       "2 also gradients, 3 also parameters")
PlanOpt = typer.Option(None, "--plan", help="a table in rules/plans (dp, megatron, auto, ...); "
                       "default: what --tp/--dp imply")
DevicesOpt = typer.Option(None, "--devices", help="devices for --plan auto")
ClusterOpt = typer.Option(None, "--cluster", help="device/cluster spec in rules/devices (default cpu-gloo)")
PrecisionOpt = typer.Option(None, "--precision", help="compute dtype the cost model prices matmuls in: fp32 | tf32 | "
                            "bf16 | fp16 (autocast); default the traced tensors' dtype")
BudgetOpt = typer.Option(None, "--memory-budget", help="memory per device the plan may use: bytes, or 24GiB, 80GB, 512MiB")
PpOpt = typer.Option(None, "--pp", help="pipeline stages (ranks)")
MicroOpt = typer.Option(None, "--micro-batches", help="micro-batches per step (default: pp x virtual stages)")
ScheduleOpt = typer.Option(None, "--schedule", help="gpipe | 1f1b | interleaved, or any schedule table in rules/plans")
StagesOpt = typer.Option(None, "--stages", help="block indices where stages 1.. begin, e.g. 6,12,18")
OutOpt = typer.Option(None, "--out", "-o", help="output folder")
RecomputeOpt = typer.Option(None, "--recompute", help="run every repeated block under torch.utils.checkpoint: "
                            "forward keeps its inputs only, backward reruns it")
SequenceParallelOpt = typer.Option(None, "--sequence-parallel", help="with --tp: Megatron's sequence "
                                   "parallelism (norms on sequence slices; reduce-scatter / all-gather)")


def _options(model_file: Path, **given):
    """Command-line options over [tool.nnscaler-rewrite] defaults over built-in defaults."""
    from .config import check_options, project_defaults
    defaults = {"tp": None, "dp": None, "plan": None, "out": "parallel", "model": None, "devices": None,
                "cluster": "cpu-gloo", "precision": None, "memory_budget": None, "pp": 1, "micro_batches": None, "schedule": "1f1b",
                "stages": None, "recompute": False, "sequence_parallel": False, "zero": 0}
    defaults.update(project_defaults(model_file))
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


def _rewrite(model_file: Path, opts: dict):
    """(analysis, rewrite, the files read while making it: what --check's cache depends on)."""
    from .analysis import analyze
    from .checkcache import recording
    from .rewrite import rewrite as do_rewrite
    with recording() as opened:
        analysis = analyze(model_file, model_class=opts["model"])
        result = do_rewrite(analysis, _request(opts))
    _print_warnings(result.plan.warnings)
    return analysis, result, opened


def _write(out_dir: Path, model_file: Path, given: dict, result, opened: set[str], force: bool) -> bool:
    """Write the output with the user's hand edits merged in and say what became of them;
    True when conflicts were left to resolve (the command exits 1)."""
    from .checkcache import effective_options, record
    from .config import project_defaults
    from .emit.output import write_output
    from .report.regenerate_view import regeneration_lines
    options = effective_options(given, project_defaults(model_file))
    cache = record(model_file, options, opened, result.files, out_dir)
    notes, conflicts = regeneration_lines(out_dir, write_output(out_dir, result.files, force=force,
                                                                check_cache=cache))
    for line in notes:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for line in conflicts:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    return bool(conflicts)


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
def rewrite(model_file: Path = typer.Argument(..., help="model or entry file"),
            plan: Optional[str] = PlanOpt, tp: Optional[int] = TpOpt, dp: Optional[int] = DpOpt,
            devices: Optional[int] = DevicesOpt, cluster: Optional[str] = ClusterOpt,
            precision: Optional[str] = PrecisionOpt,
            memory_budget: Optional[str] = BudgetOpt, pp: Optional[int] = PpOpt,
            micro_batches: Optional[int] = MicroOpt, schedule: Optional[str] = ScheduleOpt,
            stages: Optional[str] = StagesOpt, recompute: Optional[bool] = RecomputeOpt,
            sequence_parallel: Optional[bool] = SequenceParallelOpt, zero: Optional[int] = ZeroOpt,
            out: Optional[Path] = OutOpt, model: Optional[str] = ModelOpt,
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
        given = dict(tp=tp, dp=dp, plan=plan, out=out, model=model, devices=devices, cluster=cluster,
                     precision=precision,
                     memory_budget=memory_budget, pp=pp, micro_batches=micro_batches, schedule=schedule,
                     stages=stages, recompute=recompute, sequence_parallel=sequence_parallel, zero=zero)
        if diff is not None and check:
            raise UserError("--diff and --check do not go together",
                            hint="--diff RANK shows the diff of the program that rank runs; "
                                 "--check compares the whole output folder")
        if diff is not None and diff < 0:
            raise UserError(f"--diff {diff}: ranks start at 0", hint="e.g. --diff 0")
        opts = _options(model_file, **given)
        analysis, result, opened = _rewrite(model_file, opts)
        out_dir = Path(opts["out"])
        if diff is not None:
            if diff >= result.plan.world_size:
                raise UserError(f"there is no rank {diff} in a world of {result.plan.world_size}",
                                hint=f"--diff takes a rank from 0 to {result.plan.world_size - 1}")
            name = program_of(result.plan, result.stages, diff).file
            source = analysis.sources.get(analysis.entry.path).text
            _print_diff(_unified_diff(source, result.files[name], display_path(analysis.entry.path),
                                      str(out_dir / name)))
            return
        if check:       # clean hand edits are not staleness: compared after merging them
            stale = staleness(out_dir, result.files)
            if stale:
                for name, now, then in stale.files:
                    path = out_dir / name
                    _print_diff(_unified_diff(now, then, str(path), f"{path} (now)"))
                for problem in stale.problems:
                    err_console.print(f"{display_path(out_dir)}/{problem}", markup=False, soft_wrap=True)
                names = ", ".join(name for name, _, _ in stale.files) or "conflicts"
                err_console.print(f"{display_path(out_dir)} is stale: {names}; "
                                  f"rerun nnscaler-rewrite {display_path(model_file)}", markup=False, soft_wrap=True)
                raise typer.Exit(1)
            console.print(f"{display_path(out_dir)} is up to date")
            return
        conflicted = _write(out_dir, model_file, given, result, opened, force)
        console.print(f"wrote {display_path(out_dir)}/: {len(result.files)} files, plan "
                      f"{result.plan.describe()}, est. step {result.plan.estimated_step_seconds * 1e3:.2f} ms")
        if conflicted:
            raise typer.Exit(1)

    _run(body)


@app.command()
def verify(model_file: Path = typer.Argument(..., help="model or entry file"),
           plan: Optional[str] = PlanOpt, tp: Optional[int] = TpOpt, dp: Optional[int] = DpOpt,
           devices: Optional[int] = DevicesOpt, cluster: Optional[str] = ClusterOpt,
           precision: Optional[str] = PrecisionOpt,
           memory_budget: Optional[str] = BudgetOpt, pp: Optional[int] = PpOpt,
           micro_batches: Optional[int] = MicroOpt, schedule: Optional[str] = ScheduleOpt,
           stages: Optional[str] = StagesOpt, recompute: Optional[bool] = RecomputeOpt,
            sequence_parallel: Optional[bool] = SequenceParallelOpt, zero: Optional[int] = ZeroOpt,
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder: rewritten first "
                                              "when --tp/--dp/--plan is given, else verified as it is"),
           model: Optional[str] = ModelOpt,
           steps: int = typer.Option(3, "--steps", help="AdamW steps"),
           lr: float = typer.Option(1e-3, "--lr"),
           timeout: float = typer.Option(300.0, "--timeout", help="seconds before a hung run is ended"),
           json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
           force: bool = typer.Option(False, "--force"),
           verbose: bool = VerboseOpt):
    """Run the output on N gloo processes against the single-device model; exit 1 if they differ."""
    _state["verbose"] = verbose
    from .verify.equivalence import VerifyError, run_verify
    from .report.verify_view import verify_table

    def body():
        given = dict(tp=tp, dp=dp, plan=plan, out=out, model=model, devices=devices, cluster=cluster,
                     precision=precision,
                     memory_budget=memory_budget, pp=pp, micro_batches=micro_batches, schedule=schedule,
                     stages=stages, recompute=recompute, sequence_parallel=sequence_parallel, zero=zero)
        if steps < 1 or lr <= 0 or timeout <= 0:
            flag, value = next((f, v) for f, v, bad in (("--steps", steps, steps < 1), ("--lr", lr, lr <= 0),
                                                        ("--timeout", timeout, timeout <= 0)) if bad)
            raise UserError(f"{flag} {value:g}: must be {'at least 1' if flag == '--steps' else 'positive'}",
                            hint="e.g. --steps 3 --lr 1e-3 --timeout 300 (the defaults)")
        opts = _options(model_file, **given)
        out_dir = Path(opts["out"])
        if any(v is not None for v in (tp, dp, plan, devices, pp, micro_batches, schedule, stages, recompute, sequence_parallel, zero)) \
                or not out_dir.exists():
            _, result, opened = _rewrite(model_file, opts)
            if _write(out_dir, model_file, given, result, opened, force):
                raise typer.Exit(1)         # conflict markers: nothing to verify until resolved
        try:
            outcome = run_verify(model_file, out_dir, steps=steps, lr=lr, timeout=timeout)
        except VerifyError as exc:
            err_console.print(f"verify failed: {exc}", markup=False)
            raise typer.Exit(1)
        if json_out:
            print(json.dumps(outcome.to_json(), indent=1))
        else:
            console.print(verify_table(outcome))
        if not outcome.passed:
            raise typer.Exit(1)

    _run(body)


def _plan_command(model_file, plan, tp, dp, devices, cluster, memory_budget, model, json_out, explain, verbose,
                  recompute=None, zero=None, precision=None, sequence_parallel=None):
    _state["verbose"] = verbose
    from .analysis import analyze
    from .plan.cost import load_cluster
    from .plan.explain import binding_constraints
    from .plan.tables import load_table, source_annotations
    from .report.plan_view import plan_json, plan_table
    from .rewrite import _table_names, build_plan

    def body():
        opts = _options(model_file, tp=tp, dp=dp, plan=plan, model=model, devices=devices, cluster=cluster,
                        memory_budget=memory_budget, recompute=recompute, sequence_parallel=sequence_parallel, zero=zero, precision=precision)
        request = _request(opts)
        analysis = analyze(model_file, model_class=opts["model"])
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

    _run(body)


@app.command()
def plan(model_file: Path = typer.Argument(..., help="model or entry file"),
         plan: Optional[str] = PlanOpt, tp: Optional[int] = TpOpt, dp: Optional[int] = DpOpt,
         devices: Optional[int] = DevicesOpt, cluster: Optional[str] = ClusterOpt,
         memory_budget: Optional[str] = BudgetOpt, model: Optional[str] = ModelOpt,
         recompute: Optional[bool] = RecomputeOpt,
            sequence_parallel: Optional[bool] = SequenceParallelOpt, zero: Optional[int] = ZeroOpt,
         precision: Optional[str] = PrecisionOpt,
         json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
         explain: bool = typer.Option(False, "--explain", help="also show which constraints bind"),
         verbose: bool = VerboseOpt):
    """Show the chosen plan: per op its split, n and devices; per device time and memory."""
    _plan_command(model_file, plan, tp, dp, devices, cluster, memory_budget, model, json_out, explain, verbose,
                  recompute, zero, precision, sequence_parallel=sequence_parallel)


@app.command()
def explain(model_file: Path = typer.Argument(..., help="model or entry file"),
            plan: Optional[str] = PlanOpt, tp: Optional[int] = TpOpt, dp: Optional[int] = DpOpt,
            devices: Optional[int] = DevicesOpt, cluster: Optional[str] = ClusterOpt,
            memory_budget: Optional[str] = BudgetOpt, model: Optional[str] = ModelOpt,
            recompute: Optional[bool] = RecomputeOpt,
            sequence_parallel: Optional[bool] = SequenceParallelOpt, zero: Optional[int] = ZeroOpt,
            precision: Optional[str] = PrecisionOpt,
            json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
            verbose: bool = VerboseOpt):
    """`plan --explain`: the plan and the constraints that bind it."""
    _plan_command(model_file, plan, tp, dp, devices, cluster, memory_budget, model, json_out, True, verbose,
                  recompute, zero, precision, sequence_parallel=sequence_parallel)


@app.command()
def schedule(model_file: Path = typer.Argument(..., help="model or entry file"),
             pp: int = typer.Option(2, "--pp", help="pipeline stages (ranks)"),
             micro_batches: Optional[int] = MicroOpt, schedule: str = typer.Option("1f1b", "--schedule"),
             stages: Optional[str] = StagesOpt, model: Optional[str] = ModelOpt,
             picture: Optional[Path] = typer.Option(None, "--picture", help="write the timeline as SVG"),
             csv: bool = typer.Option(False, "--csv", help="print the schedule in "
                                      "torch.distributed.pipelining's action grammar"),
             verbose: bool = VerboseOpt):
    """Show each rank's pipeline order, simulated with the cost model's times (no processes run)."""
    _state["verbose"] = verbose
    from .analysis import analyze
    from .plan.pipeline import plan_stages
    from .plan.schedules import load_schedule, schedule as make_schedule, to_csv
    from .report.timeline import timeline_svg
    from .verify.simulate import bubble_fraction, simulate

    def body():
        from .config import check_options, project_defaults
        project_defaults(model_file)        # checked, and its rules folders read
        check_options({"pp": pp, "micro_batches": micro_batches, "stages": stages, "schedule": schedule})
        table = load_schedule(schedule)
        analysis = analyze(model_file, model_class=model)
        cuts = [int(x) for x in stages.split(",")] if stages else None
        plan = plan_stages(analysis.graph, pp, table.virtual_stages, cuts)
        micro = micro_batches or pp * table.virtual_stages
        orders = make_schedule(table, pp, micro)
        events = simulate(orders, plan.stages, forward_seconds=plan.stage_seconds)
        if csv:
            sys.stdout.write(to_csv(orders))
        else:
            for rank, order in enumerate(orders):
                console.print(f"rank {rank}: {' '.join(map(str, order))}", highlight=False)
            blocks = ", ".join(f"stage {s}: blocks {a}-{b - 1}" for s, (a, b) in enumerate(plan.block_ranges))
            console.print(f"{plan.trunk.container}: {blocks}; bubble {100 * bubble_fraction(events, pp):.1f}% "
                          f"(cost model), 1F1B formula (D-1)/(D-1+M) = {100 * (pp - 1) / (pp - 1 + micro):.1f}%")
        if picture:
            picture.write_text(timeline_svg(events, pp, f"{schedule}: {pp} ranks x {micro} micro-batches"))
            console.print(f"wrote {picture}")

    _run(body)


def main(argv: list[str] | None = None) -> None:
    # typer raises click's exceptions (or those of the copy of click it carries)
    click_errors = {c.__name__: c for c in typer.BadParameter.__mro__}
    usage_error, click_error = click_errors["UsageError"], click_errors["ClickException"]
    argv = list(sys.argv[1:] if argv is None else argv)
    # `nnscaler-rewrite model.py ...` (or `nnscaler-rewrite --tp 2 model.py`) is the rewrite;
    # the other commands are named first.
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("--help", "-h"):
        argv.insert(0, "rewrite")
    try:
        code = app(args=argv, prog_name="nnscaler-rewrite", standalone_mode=False)
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(exc.ctx.get_help() if exc.ctx else exc.format_message())
            raise SystemExit(2) from None
        # a bad option: an `error:` line and a hint, like every other error
        command = exc.ctx.command_path if exc.ctx else "nnscaler-rewrite"
        err_console.print(f"error: {exc.format_message()}\n  hint: see `{command} --help`",
                          markup=False, highlight=False, soft_wrap=True)
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
    main()
