"""The `nnscaler-rewrite` console script (and `python -m nnscaler_cst`).

Before loading the command line (typer, rich) or anything heavier, `--check` is answered from
the output folder's cache when nothing the output depends on changed (checkcache.py): a
pre-commit hook then costs about a Python start-up. Every other command line, and every
check the cache cannot settle, goes to cli.py unchanged.

`nnscaler-rewrite --check` with no model file takes it from `model-file` in
`[tool.nnscaler-rewrite]` (relative to that pyproject.toml), as the pre-commit hook runs it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .options import DEFAULTS, VALUE_FLAGS     # the options as cli.py declares them

CHECK_FLAGS = {"--check", "--verbose", "-v"}


# Commands that start no process: when one is the whole process (the console script), it ends
# at once when done. Freeing the heap of a traced model at interpreter exit (transformers'
# modules, the trace's records) took 0.8 s of a 7 s `plan`, and there is nothing left to clean.
IMMEDIATE_EXIT = {"rewrite", "inspect", "plan", "explain", "schedule"}


def main(argv: list[str] | None = None) -> None:
    whole_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = _with_project_model_file(argv)
    request = _check_request(argv)
    if request is not None and _answer_from_cache(*request):
        return
    from .verify.launch import OMP_WAIT
    os.environ.setdefault(*OMP_WAIT)        # before torch loads (why: verify/launch.py)
    from .cli import SUBCOMMANDS, main as cli_main
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "rewrite"
    if not (whole_process and command in IMMEDIATE_EXIT):
        cli_main(argv)
        return
    run_and_exit(cli_main, argv)


def run_and_exit(cli_main, argv: list[str]) -> None:
    """cli_main(argv) as the whole process, which ends at once when done (IMMEDIATE_EXIT)."""
    code = None
    try:
        cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):      # as Python itself: a message, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _split(args: list[str]) -> tuple[dict[str, str], list[str], list[str]] | None:
    """(options with values, flags, positional arguments), or None when a value is missing."""
    given, flags, positional = {}, [], []
    tokens = iter(args)
    for arg in tokens:
        name, eq, value = arg.partition("=")
        if name in VALUE_FLAGS:
            if not eq:
                value = next(tokens, None)
                if value is None:
                    return None
            given[VALUE_FLAGS[name]] = value
        elif arg.startswith("-") and arg != "-":
            flags.append(arg)
        else:
            positional.append(arg)
    return given, flags, positional


def _with_project_model_file(argv: list[str]) -> list[str]:
    """`nnscaler-rewrite [rewrite] --check ...` with no model file: pyproject's `model-file`."""
    args = argv[1:] if argv[:1] == ["rewrite"] else argv
    parts = _split(args)
    if not args or parts is None or parts[2] or {"--help", "-h"} & set(parts[1]):
        return argv
    found = _project_model_file()
    return ["rewrite", found, *args] if found else argv


def _project_model_file() -> str | None:
    start = Path.cwd()
    folder = next((f for f in (start, *start.parents) if (f / "pyproject.toml").is_file()), None)
    if folder is None:
        return None
    from .config import project_defaults
    from .errors import UserError
    try:
        model_file = project_defaults(folder / "pyproject.toml").get("model_file")
    except UserError:
        return None                 # the command line reports it
    return str(folder / model_file) if model_file else None


def _check_request(argv: list[str]) -> tuple[Path, dict[str, str]] | None:
    """(model file, options given) of a plain `--check` the cache may answer, else None."""
    args = argv[1:] if argv[:1] == ["rewrite"] else argv
    parts = _split(args)
    if parts is None or "--check" not in parts[1]:
        return None
    given, flags, positional = parts
    if len(positional) != 1 or not set(flags) <= CHECK_FLAGS:
        return None
    return Path(positional[0]), given


def _answer_from_cache(model_file: Path, given: dict[str, str]) -> bool:
    """True when the cache proves the output current (and says so); False: run the full check."""
    try:
        from .checkcache import effective_options, is_current
        from .config import project_defaults
        from .errors import display_path
        project = project_defaults(model_file)
        out_dir = Path(given.get("out") or project.get("out") or DEFAULTS["out"])
        if not is_current(model_file, effective_options(given, project), out_dir):
            return False
    except Exception:   # noqa: BLE001 -- anything unexpected: the full check decides, and reports
        return False
    print(f"{display_path(out_dir)} is up to date")
    return True


if __name__ == "__main__":
    main()
