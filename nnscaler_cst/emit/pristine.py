"""The output folder's hidden part, `.nnscaler/`, committed with the generated files.

`pristine/` holds the last generation exactly as the tool produced it (before any hand edit
was merged in): the base of the next three-way merge. `check.json` is the cache `--check`
answers from without tracing (nnscaler_cst/checkcache.py). Standard library only: the fast
check path reads this module.
"""
from __future__ import annotations

from pathlib import Path

HIDDEN_DIR = ".nnscaler"
PRISTINE_DIR = f"{HIDDEN_DIR}/pristine"
CHECK_CACHE = f"{HIDDEN_DIR}/check.json"


def read_pristine(out_dir: Path) -> dict[str, str] | None:
    """The last generation by each file's path inside the output (`model.py`,
    `timm/layers/attention.py`), or None for a folder written before copies were kept: what
    the tool wrote there, whatever else the folder holds."""
    folder = Path(out_dir) / PRISTINE_DIR
    if not folder.is_dir():
        return None
    return {p.relative_to(folder).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(folder.rglob("*")) if p.is_file()}


def is_kept_aside(name: str) -> bool:
    """NAME.edited, NAME.edited.2: hand-edited files the tool set aside; never touched again."""
    return ".edited" in name
