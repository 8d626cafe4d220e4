"""Defaults from `[tool.nnscaler-rewrite]` in the nearest pyproject.toml, as ruff and black do,
and the checks every option gets before the model is traced.

Keys are the long option names without their dashes (`tp = 2`, `micro-batches = 4`,
`out = "parallel"`); another spelling is an unknown key, with the one meant. Command-line
options win over the file. `rules = ["my_rules"]` adds rules folders (relative to the
pyproject.toml), searched before the built-in one (see rules_path.py).
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from .errors import Location, UserError, display_path, toml_error
from .options import OPTIONS

# key -> what its value must be: the command line's options (options.py), and two of the file's own
KEYS = {**{option.key: option.kind for option in OPTIONS},
        "rules": "paths",
        "model_file": "name"}   # the model file `nnscaler-rewrite --check` (the pre-commit hook) checks
_SECTION = "tool.nnscaler-rewrite"


def project_defaults(model_file: str | Path) -> dict[str, Any]:
    """The checked `[tool.nnscaler-rewrite]` values of the nearest pyproject.toml; also makes its
    `rules` folders (if any) the project's rules folders for this run."""
    from .rules_path import check_user_rules_dirs, set_project_rules_dirs
    set_project_rules_dirs([])
    check_user_rules_dirs()
    start = Path(model_file).resolve().parent
    for folder in [start, *start.parents]:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            text = pyproject.read_text()
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise toml_error(exc, pyproject, text) from None
            table = data.get("tool", {}).get("nnscaler-rewrite", {})
            if not isinstance(table, dict):
                raise UserError("`tool.nnscaler-rewrite` must be a table", Location(display_path(pyproject)),
                                hint="write the options under a [tool.nnscaler-rewrite] header")
            values = {key.replace("-", "_"): value for key, value in table.items()}
            for key, value in table.items():
                _check_value(key, value, pyproject, text)
            if "rules" in values:
                paths = [values["rules"]] if isinstance(values["rules"], str) else values["rules"]
                dirs = [(pyproject.parent / p).resolve() for p in paths]
                for path, folder in zip(paths, dirs):
                    if not folder.is_dir():
                        raise UserError(f"rules folder {path!r} does not exist (next to {pyproject.name})",
                                        _key_location(pyproject, text, "rules"),
                                        hint="name folders laid out like the built-in rules/: ops/, plans/, "
                                        "devices/, relative to pyproject.toml")
                set_project_rules_dirs(dirs)
            return values
    return {}


def _key_location(pyproject: Path, text: str, key: str) -> Location:
    """Where `key = ...` sits in the [tool.nnscaler-rewrite] table (its line and column)."""
    section = None
    spellings = {key}
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[\s*([^\]]+?)\s*\]", line)
        if header and not line.strip().startswith("[["):
            section = header.group(1).replace('"', "").replace("'", "")
            continue
        found = re.match(r"(\s*)[\"']?([\w-]+)[\"']?\s*=", line)
        if section == _SECTION and found and found.group(2) in spellings:
            return Location(display_path(pyproject), number, len(found.group(1)))
    return Location(display_path(pyproject))


def _check_value(key: str, value: Any, pyproject: Path, text: str) -> None:
    name = key.replace("-", "_")
    kind = KEYS.get(name) if "_" not in key else None
    where = _key_location(pyproject, text, key)
    if kind is None:
        import difflib
        spelled = [k.replace("_", "-") for k in KEYS]
        close = difflib.get_close_matches(key.replace("_", "-"), spelled, n=1, cutoff=0.6)
        raise UserError(f"unknown key `{key}` in [{_SECTION}]" + (f"; did you mean `{close[0]}`?" if close else ""),
                        where, hint="keys: " + ", ".join(spelled))
    problem = _problem(kind, value)
    if problem:
        raise UserError(f"`{key} = {_toml(value)}` in [{_SECTION}]: {problem}", where,
                        hint=f"the same value as the command line's --{name.replace('_', '-')}")


def _toml(value: Any) -> str:
    return repr(value).replace("True", "true").replace("False", "false").replace("'", '"')


def _problem(kind: str, value: Any) -> str | None:
    """What is wrong with a value of this kind, or None."""
    if kind == "size":
        if isinstance(value, bool) or not isinstance(value, int):
            return "expected a whole number"
        return "must be at least 1" if value < 1 else None
    if kind == "name":
        return None if isinstance(value, str) and value.strip() else "expected a non-empty string"
    if kind == "bytes":
        from .sizes import parse_bytes
        try:
            parse_bytes(value)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None
    if kind == "stages":
        return stages_problem(value)
    if kind == "flag":
        return None if isinstance(value, bool) else "expected true or false"
    if kind == "zero_stage":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3
        return None if ok else "expected a ZeRO stage: 0 (none), 1, 2 or 3"
    if kind == "paths":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(p, str) for p in value))
        return None if ok else "expected a folder or a list of folders"
    raise AssertionError(kind)


def stages_problem(value: Any) -> str | None:
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        cuts = [int(str(x).strip()) for x in items if not isinstance(x, bool)]
    except ValueError:
        cuts = []
    if len(cuts) != len(items) or not cuts:
        return "expected block indices separated by commas, e.g. 6,12,18"
    if any(c < 1 for c in cuts) or cuts != sorted(set(cuts)):
        return "the block indices where stages 1.. begin must be increasing and at least 1"
    return None


def parse_stages(value: Any) -> list[int] | None:
    if value is None or value == "":
        return None
    problem = stages_problem(value)
    if problem:
        raise UserError(f"--stages {value}: {problem}", hint="one index per stage after the first: "
                        "--pp 3 --stages 4,8 starts stage 1 at block 4 and stage 2 at block 8")
    items = value if isinstance(value, list) else str(value).split(",")
    return [int(str(x).strip()) for x in items]


def check_options(opts: dict[str, Any]) -> None:
    """What can be checked about the options before the model is traced: sizes, names, the
    output folder, combinations. Later checks (divisibility by the model's sizes) need the trace."""
    for name in ("tp", "dp", "pp", "devices", "micro_batches"):
        value = opts.get(name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} {value}: must be at least 1",
                            hint=f"{flag} N with N >= 1 ({flag} 1, the default, does not split)")
    plan = opts.get("plan")
    if opts.get("sequence_parallel") and (opts.get("tp") or 1) < 2 and plan != "auto":
        raise UserError("--sequence-parallel needs --tp N with N > 1",
                        hint="sequence parallelism splits the norms between tensor-parallel regions: e.g. --tp 2 "
                        "--sequence-parallel")
    if opts.get("zero") and plan != "auto":     # --plan auto chooses dp itself: checked once solved
        from .plan.zero import check_zero
        check_zero(opts["zero"], opts.get("dp") or 1, opts.get("pp") or 1)
    if opts.get("devices") is not None and plan not in ("auto", None):
        raise UserError(f"--devices is for --plan auto, not --plan {plan}",
                        hint="give --tp/--dp for a fixed plan, or --plan auto --devices N to search")
    if opts.get("devices") is not None and plan is None and (opts.get("tp") or opts.get("dp")):
        raise UserError("--devices is for --plan auto; with --tp/--dp the plan is fixed",
                        hint="drop --devices, or use --plan auto --devices N")
    if plan == "auto" and not opts.get("devices") and (opts.get("tp") or 1) * (opts.get("dp") or 1) < 2:
        raise UserError("--plan auto needs --devices N (N > 1)", hint="e.g. --plan auto --devices 4")
    if plan == "dp" and (opts.get("tp") or 1) > 1:
        raise UserError("--plan dp splits no op over --tp", hint="drop --tp or use --plan megatron")
    if plan is not None:
        from .plan.tables import load_table
        load_table("megatron" if plan == "tp" else plan)
    if opts.get("cluster"):
        from .plan.cost import load_cluster
        load_cluster(opts["cluster"])
    if (opts.get("pp") or 1) > 1 or opts.get("schedule") not in (None, "1f1b"):
        from .plan.schedules import load_schedule
        load_schedule(opts.get("schedule") or "1f1b")
    if opts.get("stages") is not None:
        parse_stages(opts["stages"])
        if (opts.get("pp") or 1) < 2:
            raise UserError("--stages needs --pp N with N > 1", hint="e.g. --pp 2 --stages 6")
    out = opts.get("out")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"-o {out}: is a file, not a folder",
                        hint="name a folder to write (it is created when missing), e.g. -o parallel")
