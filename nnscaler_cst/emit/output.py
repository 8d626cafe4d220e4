"""Write the output folder: rank files, _comm.py, __init__.py, train.py, plan.json.

Everything is rendered in memory first; then written to a temporary folder and swapped into
place, so a failure leaves the old output untouched. Files someone edited by hand (their
content no longer matches the hash in their @generated line) and files the tool did not
write are never overwritten silently.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError, display_path
from .assemble import content_hash, read_header

GENERATED_JSON_KEY = "generated_by"


def edited_or_foreign(out_dir: Path, new_files: dict[str, str]) -> tuple[list[str], list[str]]:
    """(generated files changed by hand since, files the tool did not write) in out_dir."""
    edited, foreign = [], []
    if not out_dir.exists():
        return edited, foreign
    recorded = _recorded_hashes(out_dir)
    for path in sorted(out_dir.iterdir()):
        if path.name == "__pycache__" or ".edited" in path.name:
            continue
        if path.is_dir():
            foreign.append(path.name)
            continue
        text = path.read_text(errors="replace")
        if path.name in recorded:
            if recorded[path.name] != content_hash(text):
                edited.append(path.name)
            continue
        if path.suffix == ".json":
            state = json_state(text)
            if state is None:
                foreign.append(path.name)
            elif state == "edited":
                edited.append(path.name)
            continue
        header = read_header(text)
        if header is None:
            foreign.append(path.name)
        elif header[0] != header[1]:
            edited.append(path.name)
    return edited, foreign


def generated_json(data: dict) -> str:
    """plan.json as written: its content hash covers every other key, so edits show."""
    body = json.dumps(data, indent=1) + "\n"
    return json.dumps({**data, "content_hash": content_hash(body)}, indent=1) + "\n"


def json_state(text: str) -> str | None:
    """"generated", "edited" (hash no longer matches), or None when the tool did not write it."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or GENERATED_JSON_KEY not in data:
        return None
    recorded = data.pop("content_hash", None)
    return "generated" if recorded == content_hash(json.dumps(data, indent=1) + "\n") else "edited"


def _recorded_hashes(out_dir: Path) -> dict[str, str]:
    """Hashes plan.json keeps for generated files that cannot carry a header (schedule.csv)."""
    try:
        data = json.loads((out_dir / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    return data.get("file_hashes", {}) if GENERATED_JSON_KEY in data else {}


def write_output(out_dir: Path, files: dict[str, str], *, force: bool = False) -> None:
    out_dir = Path(out_dir)
    edited, foreign = edited_or_foreign(out_dir, files)
    if foreign:
        raise UserError(f"{display_path(out_dir)} holds files nnscaler-rewrite did not write: "
                        + ", ".join(foreign), hint="choose another -o folder, or move those files")
    if edited and not force:
        raise UserError("generated files were edited by hand since they were written: "
                        + ", ".join(display_path(out_dir / f) for f in edited),
                        hint="commit or move your edits, or pass --force (edited files are kept as "
                             "NAME.edited, NAME.edited.2, ...)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        kept = [p for p in out_dir.glob("*.edited*")] if out_dir.exists() else []
        for path in kept:
            shutil.copy2(path, staging / path.name)
        for name in edited:
            shutil.copy2(out_dir / name, staging / _free_name(staging, f"{name}.edited"))
        if out_dir.exists():
            retired = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            os.rename(out_dir, retired)
            os.rename(staging, out_dir)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _free_name(folder: Path, name: str) -> str:
    """NAME.edited, or NAME.edited.2, .3, ... when earlier edits are kept already."""
    candidate, number = name, 1
    while (folder / candidate).exists():
        number += 1
        candidate = f"{name}.{number}"
    return candidate


def stale_files(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Names whose content on disk differs from what would be written now."""
    stale = []
    for name, text in sorted(files.items()):
        path = Path(out_dir) / name
        if not path.is_file() or path.read_text(errors="replace") != text:
            stale.append(name)
    return stale
