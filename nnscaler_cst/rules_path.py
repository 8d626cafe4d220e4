"""Where the rules live: the built-in folder, and the user's own folders searched before it.

The built-in rules are the repository's top-level `rules/` folder. An installed wheel carries it
as the data package `nnscaler_cst/rules/` (see pyproject.toml); a checkout or an editable install
reads it next to the package. Users add their own folders, each laid out like the built-in one
(`ops/*.toml`, `plans/*.toml`, `devices/*.toml`, any of them optional):

- the environment variable `NNSCALER_RULES_PATH`, folders separated by `os.pathsep` (`:`);
- `rules = ["my_rules"]` under `[tool.nnscaler-rewrite]` in the project's pyproject.toml,
  relative to that file.

A plan, schedule or cluster is looked up by name in the user's folders first (the environment
variable's, then pyproject's), then in the built-in one; op rules of the user's folders are
loaded after the built-in ones, so a user's rule for a callee replaces the built-in rule.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "NNSCALER_RULES_PATH"

_project_dirs: list[Path] = []


def builtin_rules_dir() -> Path:
    """The tool's own rules: inside the package when installed, else the checkout's rules/."""
    package = Path(__file__).resolve().parent
    installed = package / "rules"
    if (installed / "plans").is_dir():
        return installed
    return package.parent / "rules"


def set_project_rules_dirs(dirs: list[Path]) -> None:
    """The folders named by `[tool.nnscaler-rewrite] rules` (absolute), for this run."""
    _project_dirs[:] = [Path(d) for d in dirs]


def user_rules_dirs() -> list[Path]:
    from_env = [Path(p).expanduser().resolve() for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip()]
    return [*from_env, *_project_dirs]


def rules_dirs() -> list[Path]:
    """Every rules folder, searched in this order (the user's, then the built-in one)."""
    return [*user_rules_dirs(), builtin_rules_dir()]


def find_rules_file(kind: str, name: str) -> Path | None:
    """`<folder>/<kind>/<name>.toml` in the first rules folder that has it."""
    for folder in rules_dirs():
        path = folder / kind / f"{name}.toml"
        if path.is_file():
            return path
    return None


def rules_files(kind: str) -> list[Path]:
    """Every `<kind>/*.toml`, one per name, a user's file hiding a built-in one of that name."""
    found: dict[str, Path] = {}
    for folder in rules_dirs():
        for path in sorted((folder / kind).glob("*.toml")):
            found.setdefault(path.stem, path)
    return [found[name] for name in sorted(found)]


def check_user_rules_dirs() -> None:
    """A folder named in NNSCALER_RULES_PATH that does not exist is an error, not a silent no-op
    (config.py checks those of pyproject.toml, at their line)."""
    from .errors import UserError
    for folder in user_rules_dirs():
        if not folder.is_dir() and folder not in _project_dirs:
            raise UserError(f"rules folder {str(folder)!r} (from ${ENV_VAR}) does not exist",
                            hint=f"{ENV_VAR} lists folders laid out like the built-in rules/ (ops/, plans/, "
                            "devices/), separated by ':'")
