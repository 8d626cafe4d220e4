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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `nnscaler-rewrite model.py ...` is the rewrite; the other commands are named first.
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        argv.insert(0, "rewrite")
    app(args=argv, prog_name="nnscaler-rewrite")


if __name__ == "__main__":
    main()
