"""User-facing errors: `path:line:col: error: message` plus a hint, exit code 2.

Internal bugs are not UserErrors; they surface as tracebacks.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Location:
    """A point in a source or rules file: 1-based line, 0-based character column."""

    path: str
    line: int = 1
    col: int = 0

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col + 1}"


class UserError(Exception):
    """A problem with the user's input (model file, options, rules, plan); exits 2."""

    exit_code = 2

    def __init__(self, message: str, location: Location | None = None, hint: str | None = None,
                 related: list[tuple[Location, str]] | None = None):
        super().__init__(message)
        self.message = message
        self.location = location
        self.hint = hint
        self.related = related or []

    def format(self) -> str:
        where = f"{self.location}: " if self.location else ""
        lines = [f"{where}error: {self.message}"]
        lines += [f"{loc}: note: {text}" for loc, text in self.related]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def display_path(path: str | Path) -> str:
    """A path relative to the working directory when it is below it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def package_path(path: str | Path) -> str:
    """display_path, but a file of an installed package (below site-packages or a PYTHONPATH
    folder) by its path inside that folder (`transformers/models/llama/modeling_llama.py`):
    what a table at 80 columns can show."""
    shown = display_path(path)
    if not Path(shown).is_absolute():
        return shown
    below = [root for root in _package_roots() if root in Path(shown).parents]
    return str(Path(shown).relative_to(max(below, key=lambda r: len(r.parts)))) if below else shown


@functools.cache
def _package_roots() -> tuple[Path, ...]:
    import os
    import site
    import sysconfig
    paths = sysconfig.get_paths()
    roots = [*site.getsitepackages(), site.getusersitepackages(), paths["purelib"], paths["platlib"],
             *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return tuple({Path(r).resolve() for r in roots if r})


def toml_error(exc: Exception, path: str | Path, text: str) -> UserError:
    """A TOMLDecodeError as a UserError at the line and column tomllib names (Python 3.11's
    tomllib puts them in the message only: `... (at line 6, column 3)`)."""
    message = str(exc)
    line, col = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    found = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if found:
        line, col = line or int(found.group(1)), col or int(found.group(2))
    elif message.endswith("(at end of document)"):
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
    message = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)$", "", message)
    return UserError(f"invalid TOML: {message}", Location(display_path(path), line or 1, max((col or 1) - 1, 0)),
                     hint="fix the TOML syntax at that place (https://toml.io)")
