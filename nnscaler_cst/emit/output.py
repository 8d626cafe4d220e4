"""Write the output folder: rank files, _comm.py, __init__.py, train.py, plan.json, and its
hidden `.nnscaler/` (the pristine generation and the check cache).

Everything is rendered in memory first; emit/regenerate.py decides what each file becomes
(hand edits merged into the new generation); then the folder is written to a temporary folder
and swapped into place, so a failure leaves the old output untouched. Files the tool did not
write are never overwritten silently.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, display_path
from .assemble import content_hash
from .pristine import CHECK_CACHE, HIDDEN_DIR, PRISTINE_DIR
from .regenerate import Regeneration, regenerate


def generated_json(data: dict) -> str:
    """plan.json as written: its content hash covers every other key, so edits show."""
    body = json.dumps(data, indent=1) + "\n"
    return json.dumps({**data, "content_hash": content_hash(body)}, indent=1) + "\n"


def write_output(out_dir: Path, files: dict[str, str], *, force: bool = False,
                 check_cache: str | None = None) -> Regeneration:
    """Write the new generation with the user's edits merged in; conflicts are written with
    markers and returned (the caller exits 1). `check_cache`: the text of .nnscaler/check.json."""
    out_dir = Path(out_dir)
    result = regenerate(out_dir, files, force=force)
    folders = _user_folders(out_dir)
    pristine_kept = (out_dir / PRISTINE_DIR).is_dir()
    foreign = result.foreign + ([] if pristine_kept else [f"{p.name}/" for p in folders])
    if foreign:
        raise UserError(f"{display_path(out_dir)} holds files nnscaler-rewrite did not write: "
                        + ", ".join(foreign), hint="choose another -o folder, or move those files")
    if result.blocked:
        raise UserError("cannot merge hand edits: " + "; ".join(f"{display_path(out_dir / name)} {why}"
                                                             for name, why in result.blocked),
                        hint="resolve the conflict markers, or pass --force to write the new generation "
                             "and keep the edited files as NAME.edited")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in result.files.items():
            _write(staging / name, text)
        for name in result.kept:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out_dir / name, staging / name)
        for folder in folders:               # the user's own (empty) folders inside ours stay
            (staging / folder.relative_to(out_dir)).mkdir(parents=True, exist_ok=True)
        (staging / PRISTINE_DIR).mkdir(parents=True)
        for name, text in result.pristine.items():
            _write(staging / PRISTINE_DIR / name, text)
        if check_cache is not None:
            (staging / CHECK_CACHE).write_text(check_cache, encoding="utf-8")
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
    return result


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _user_folders(out_dir: Path) -> list[Path]:
    """Folders below the output folder (their files are handled one by one, as the top's)."""
    if not out_dir.is_dir():
        return []
    return [p for p in sorted(out_dir.rglob("*")) if p.is_dir() and p.relative_to(out_dir).parts[0] != HIDDEN_DIR
            and "__pycache__" not in p.relative_to(out_dir).parts]


@dataclass
class Staleness:
    """What --check finds: files whose committed text differs from what a rewrite would write
    (name, text now, text then), and problems no rewrite settles by itself."""

    files: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.files or self.problems)


def staleness(out_dir: Path, files: dict[str, str]) -> Staleness:
    """Compare the folder with the new generation, the user's clean edits merged in: hand edits
    that merge cleanly are not staleness; conflicts, and markers left unresolved, are."""
    out_dir = Path(out_dir)
    result = regenerate(out_dir, files)
    found = Staleness()
    found.problems += [f"{name}: {why}" for name, why in result.blocked]
    found.problems += [f"{name}: files nnscaler-rewrite did not write" for name in result.foreign]
    found.problems += [f"{o.name}: hand edits conflict with the new generation" for o in result.conflicts]
    for name, text in sorted(result.files.items()):
        path = out_dir / name
        now = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        if now != text or not path.is_file():
            found.files.append((name, now, text))
    for name in sorted(o.name for o in result.outcomes if o.action == "removed"):   # no longer generated
        found.files.append((name, (out_dir / name).read_text(encoding="utf-8", errors="replace"), ""))
    pristine_dir, shown = out_dir / PRISTINE_DIR, {name for name, _, _ in found.files}
    for name, text in sorted(result.pristine.items()):
        path = pristine_dir / name
        now = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        if (now != text or not path.is_file()) and name not in shown:     # else implied: less noise
            found.files.append((f"{PRISTINE_DIR}/{name}", now, text))
    return found

