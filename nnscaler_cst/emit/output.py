"""Write the output folder: rank files, _comm.py, __init__.py, train.py, plan.json, and its
hidden `.nnscaler/` (the pristine generation and the check cache).

Everything is rendered in memory first; emit/regenerate.py decides what each file becomes
(hand edits merged into the new generation); then the folder is written to a temporary folder
and swapped into place, so a failure leaves the old output untouched. Files the tool did not
write are never overwritten silently, and a folder that holds an input of the rewrite (which
the swap would replace) is refused. Generated files may sit in folders of the output
(`timm/layers/attention.py`); what the tool wrote is what `.nnscaler/pristine/` records.
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
from .pristine import CHECK_CACHE, HIDDEN_DIR, PRISTINE_DIR, read_pristine
from .regenerate import Regeneration, regenerate


def generated_json(data: dict) -> str:
    """plan.json as written: its content hash covers every other key, so edits show."""
    body = json.dumps(data, indent=1) + "\n"
    return json.dumps({**data, "content_hash": content_hash(body)}, indent=1) + "\n"


def write_output(out_dir: Path, files: dict[str, str], *, force: bool = False,
                 check_cache: str | None = None) -> Regeneration:
    """Write the new generation with the user's edits merged in; conflicts are written with
    markers and returned (the caller exits 1). `check_cache`: the text of .nnscaler/check.json.
    File names may hold folders (`timm/layers/attention.py`): written with their folders."""
    out_dir = Path(out_dir).resolve()           # `-o .` has no name of its own to swap by
    result = regenerate(out_dir, files, force=force)
    if result.foreign:
        raise UserError(f"-o {display_path(out_dir)} holds files nnscaler-rewrite did not write: "
                        + _summary(result.foreign), hint="choose another -o folder (a new or empty one, "
                        "e.g. -o parallel), or move those files")
    if result.blocked:
        raise UserError("cannot merge hand edits: " + "; ".join(f"{display_path(out_dir)}/{where} {why}"
                                                             for where, why in result.blocked),
                        hint="resolve the conflict markers, or pass --force to write the new generation "
                             "and keep the edited files as NAME.edited")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in result.files.items():
            _write_text(staging / name, text)
        for name in result.kept:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out_dir / name, staging / name, follow_symlinks=False)
        ours = {parent.as_posix() for name in read_pristine(out_dir) or {} for parent in Path(name).parents}
        for folder in _user_folders(out_dir):       # the user's own folders stay, empty ones too
            if folder not in ours:
                (staging / folder).mkdir(parents=True, exist_ok=True)
        for name, text in result.pristine.items():
            _write_text(staging / PRISTINE_DIR / name, text)
        if check_cache is not None:
            _write_text(staging / CHECK_CACHE, check_cache)
        # mkdtemp makes the folder 0700: give it the mode the old folder had, or the umask's
        os.chmod(staging, out_dir.stat().st_mode & 0o7777 if out_dir.is_dir() else 0o777 & ~_umask())
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


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _umask() -> int:
    mask = os.umask(0o022)      # reading the umask means setting it: set it straight back
    os.umask(mask)
    return mask


def _summary(names: list[str], most: int = 8) -> str:
    """Foreign files by their top-level entry (`src/` for a folder of them), at most `most`."""
    tops = sorted({name.split("/")[0] + ("/" if "/" in name else "") for name in names})
    return ", ".join(tops[:most]) + (f" and {len(tops) - most} more" if len(tops) > most else "")


def _user_folders(out_dir: Path) -> list[str]:
    """Every folder inside the output but the hidden record and bytecode, by its path there."""
    if not out_dir.is_dir():
        return []
    found = []
    for folder, dirs, _ in os.walk(out_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (Path(folder) == out_dir and d == HIDDEN_DIR)]
        found += [(Path(folder) / d).relative_to(out_dir).as_posix() for d in dirs]
    return found


def refuse_inputs_inside(out_dir: Path, inputs) -> None:
    """Refuse an output folder that holds an input of the rewrite (the model or entry file, or a
    file they import) or the working folder: writing the output replaces the whole folder."""
    out_dir = Path(out_dir).resolve()
    for path in inputs:
        path = Path(path).resolve()
        if out_dir == path or out_dir in path.parents:
            raise UserError(f"-o {display_path(out_dir)} holds {display_path(path)}, an input of the rewrite; "
                            "the output folder replaces what it holds",
                            hint="name a folder of its own for the output, e.g. -o parallel")
    cwd = Path.cwd().resolve()
    if out_dir == cwd or out_dir in cwd.parents:
        raise UserError(f"-o {display_path(out_dir)} is the working folder or holds it; "
                        "the output folder replaces what it holds",
                        hint="name a folder of its own for the output, e.g. -o parallel")


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
    found.problems += [f"{where}: error: {why}" for where, why in result.blocked]
    found.problems += [f"{name}: error: a file nnscaler-rewrite did not write" for name in result.foreign]
    found.problems += [f"{o.name}:{o.conflict_lines[0]}: error: hand edits conflict with the new generation"
                       if o.conflict_lines else f"{o.name}: error: hand edits conflict with the new generation"
                       for o in result.conflicts]
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

