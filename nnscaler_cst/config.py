"""Defaults from `[tool.nnscaler-rewrite]` in the nearest pyproject.toml, as ruff and black do.

Keys are option names with dashes or underscores (`tp = 2`, `out = "parallel"`). Command-line
options win over the file.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from .errors import Location, UserError, display_path


def project_defaults(model_file: str | Path) -> dict[str, Any]:
    start = Path(model_file).resolve().parent
    for folder in [start, *start.parents]:
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            try:
                data = tomllib.loads(pyproject.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise UserError(f"invalid TOML: {exc}", Location(display_path(pyproject))) from None
            table = data.get("tool", {}).get("nnscaler-rewrite", {})
            return {key.replace("-", "_"): value for key, value in table.items()}
    return {}
