"""The command line: `nnscaler-rewrite FILE [options]` rewrites; `inspect|verify|plan|schedule FILE`.

Wiring only: each command calls into the pipeline and prints; user errors exit 2 with
`path:line:col: error:` and no traceback unless --verbose.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Rewrite a single-device PyTorch model into explicit per-rank parallel source.")
console = Console()
err_console = Console(stderr=True)
SUBCOMMANDS = {"rewrite", "inspect", "verify", "plan", "schedule"}

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
PlanOpt = typer.Option(None, "--plan", help="dp | tp | megatron (default: what --tp/--dp imply)")
OutOpt = typer.Option(None, "--out", "-o", help="output folder")


def _options(model_file: Path, **given):
    """Command-line options over [tool.nnscaler-rewrite] defaults over built-in defaults."""
    from .config import project_defaults
    defaults = {"tp": 1, "dp": 1, "plan": None, "out": "parallel", "model": None}
    defaults.update(project_defaults(model_file))
    return {k: (v if v is not None else defaults.get(k)) for k, v in given.items()}


def _rewrite(model_file: Path, opts: dict):
    from .analysis import analyze
    from .rewrite import rewrite as do_rewrite
    analysis = analyze(model_file, model_class=opts["model"])
    return analysis, do_rewrite(analysis, plan_name=opts["plan"], tp=int(opts["tp"]), dp=int(opts["dp"]))


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
            out: Optional[Path] = OutOpt, model: Optional[str] = ModelOpt,
            diff: Optional[int] = typer.Option(None, "--diff", help="show the diff of the model file "
                                               "against this rank's file instead of writing"),
            check: bool = typer.Option(False, "--check", help="exit 1 with a diff when the output folder "
                                       "is stale (pre-commit)"),
            force: bool = typer.Option(False, "--force", help="overwrite hand-edited generated files "
                                       "(kept as NAME.edited)"),
            verbose: bool = VerboseOpt):
    """Rewrite MODEL_FILE into per-rank parallel source in the output folder."""
    _state["verbose"] = verbose
    from .emit.output import stale_files, write_output
    from .errors import display_path

    def body():
        opts = _options(model_file, tp=tp, dp=dp, plan=plan, out=out, model=model)
        analysis, result = _rewrite(model_file, opts)
        out_dir = Path(opts["out"])
        if diff is not None:
            name = f"model_rank{diff}.py"
            if name not in result.files:
                raise UserError(f"there is no rank {diff} in a world of {result.plan.world_size}")
            source = analysis.sources.get(analysis.entry.path).text
            _print_diff(_unified_diff(source, result.files[name], display_path(analysis.entry.path),
                                      str(out_dir / name)))
            return
        if check:
            stale = stale_files(out_dir, result.files)
            if stale:
                for name in stale:
                    path = out_dir / name
                    old = path.read_text() if path.is_file() else ""
                    _print_diff(_unified_diff(old, result.files[name], str(path), f"{path} (now)"))
                err_console.print(f"{display_path(out_dir)} is stale: {', '.join(stale)}; "
                                  f"rerun nnscaler-rewrite {display_path(model_file)}", markup=False)
                raise typer.Exit(1)
            console.print(f"{display_path(out_dir)} is up to date")
            return
        write_output(out_dir, result.files, force=force)
        console.print(f"wrote {display_path(out_dir)}/: {len(result.files)} files, plan "
                      f"{result.plan.describe()}, est. step {result.plan.estimated_step_seconds * 1e3:.2f} ms")

    _run(body)


@app.command()
def verify(model_file: Path = typer.Argument(..., help="model or entry file"),
           plan: Optional[str] = PlanOpt, tp: Optional[int] = TpOpt, dp: Optional[int] = DpOpt,
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
    from .emit.output import write_output
    from .verify.equivalence import VerifyError, run_verify
    from .report.verify_view import verify_table

    def body():
        opts = _options(model_file, tp=tp, dp=dp, plan=plan, out=out, model=model)
        out_dir = Path(opts["out"])
        if tp is not None or dp is not None or plan is not None or not out_dir.exists():
            _, result = _rewrite(model_file, opts)
            write_output(out_dir, result.files, force=force)
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `nnscaler-rewrite model.py ...` is the rewrite; the other commands are named first.
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        argv.insert(0, "rewrite")
    app(args=argv, prog_name="nnscaler-rewrite")


if __name__ == "__main__":
    main()
