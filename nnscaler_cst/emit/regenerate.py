"""Regenerating over an existing output folder: what each file becomes.

The user's edits since the last generation (pristine copy -> file on disk) are merged into the
new generation, file by file (emit/merge.py). The cases around that merge, none of which
drops text the user wrote:

- a generated file the user deleted is written again (reported as restored);
- a file the new generation no longer has is removed when unedited; edited, it is set aside
  as NAME.edited and listed with the conflicts (its edits apply nowhere any more);
- a file still holding the conflict markers of the last merge blocks the rewrite: merging it
  again would nest markers;
- a folder written before pristine copies were kept: a file whose @generated hash still
  matches is its own base; an edited one cannot be merged and blocks the rewrite;
- in a folder with pristine copies, files the user added stay as they are; without them, a
  file the tool did not write means the folder is not ours, and nothing is written.

`force` takes the new generation as it is and sets every hand-edited file aside as
NAME.edited (what --force always did), for when the user wants no merge.
Decides only; emit/output.py writes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .assemble import content_hash, read_header
from .merge import conflict_marker_lines, has_unresolved_conflict, merge3
from .pristine import HIDDEN_DIR, is_kept_aside, read_pristine

GENERATED_JSON_KEY = "generated_by"


@dataclass
class Outcome:
    name: str
    action: str            # new | same | updated | merged | conflict | restored | removed | orphaned | set-aside
    kept_edits: int = 0
    conflict_lines: list[int] = field(default_factory=list)
    set_aside_as: str | None = None


@dataclass
class Regeneration:
    files: dict[str, str]                  # the generated files after this run (merged) and those set aside
    pristine: dict[str, str]               # the new generation, recorded as the next merge's base
    outcomes: list[Outcome]
    kept: list[str] = field(default_factory=list)                  # copied as they are, byte for byte
    blocked: list[tuple[str, str]] = field(default_factory=list)   # (file or file:line, why it cannot be merged)
    foreign: list[str] = field(default_factory=list)               # files the tool did not write

    @property
    def conflicts(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.action in ("conflict", "orphaned")]


def regenerate(out_dir: Path, generated: dict[str, str], *, force: bool = False) -> Regeneration:
    out_dir = Path(out_dir)
    on_disk = _plain_files(out_dir)
    pristine = read_pristine(out_dir)
    recorded = _recorded_hashes(_read(out_dir, "plan.json") if "plan.json" in on_disk else "")
    result = Regeneration({}, dict(generated), [])
    for name, new in generated.items():
        yours = _read(out_dir, name) if name in on_disk else None
        if yours is None:
            restored = pristine is not None and name in pristine
            result.files[name] = new
            result.outcomes.append(Outcome(name, "restored" if restored else "new"))
            continue
        base = pristine.get(name) if pristine is not None else _own_base(name, yours, recorded)
        if pristine is None and not _is_generated(name, yours):     # not ours: never merged, never forced
            result.foreign.append(name)
        elif yours == new:
            result.files[name] = new
            result.outcomes.append(Outcome(name, "same"))
        elif base is None and pristine is not None and not force:   # a user file the new generation now claims
            result.blocked.append((name, "a file the tool did not write has this generated file's name"))
        elif force and yours != base:
            _set_aside(result, on_disk, name, yours, new)
        elif base is None:
            result.blocked.append((name, "edited by hand in a folder written before pristine copies were kept, "
                                         "so there is no base to merge against"))
        elif has_unresolved_conflict(yours, base):
            lines = [n for n in conflict_marker_lines(yours) if n not in set(conflict_marker_lines(base))]
            result.blocked.append((f"{name}:{lines[0]}" if lines else name,
                                   "still holds the conflict markers of the last merge (lines "
                                   + ", ".join(map(str, lines[:6])) + (", ..." if len(lines) > 6 else "") + ")"))
        else:
            merged = merge3(base, yours, new)
            result.files[name] = merged.text
            action = "conflict" if merged.conflicts else "merged" if merged.kept_edits or yours != base else "updated"
            result.outcomes.append(Outcome(name, action, merged.kept_edits, merged.conflict_lines))
    for name in sorted(on_disk):
        if name in generated:
            continue
        if pristine is not None and name not in pristine or is_kept_aside(name):
            result.kept.append(name)         # the user's own files, and edits set aside before
            continue
        yours = _read(out_dir, name)
        base = pristine.get(name) if pristine is not None else _own_base(name, yours, recorded)
        if pristine is None and not _is_generated(name, yours):
            result.foreign.append(name)
        elif yours == base:
            result.outcomes.append(Outcome(name, "removed"))
        else:
            aside = _free_name(f"{name}.edited", result.files, on_disk)
            result.files[aside] = yours
            result.outcomes.append(Outcome(name, "orphaned", set_aside_as=aside))
    return result


def _set_aside(result: Regeneration, on_disk: set[str], name: str, yours: str, new: str) -> None:
    aside = _free_name(f"{name}.edited", result.files, on_disk)
    result.files[aside] = yours
    result.files[name] = new
    result.outcomes.append(Outcome(name, "set-aside", set_aside_as=aside))


def _plain_files(out_dir: Path) -> set[str]:
    """The folder's plain files, at any depth, by their path inside it (`timm/layers/x.py`):
    the generated ones are matched by that path. The hidden record and bytecode are not files
    of the output."""
    if not out_dir.is_dir():
        return set()
    found = set()
    for folder, dirs, names in os.walk(out_dir):
        here = Path(folder)
        if here == out_dir:
            dirs[:] = [d for d in dirs if d != HIDDEN_DIR]
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found.update((here / n).relative_to(out_dir).as_posix() for n in names if (here / n).is_file())
    return found


def _read(out_dir: Path, name: str) -> str:
    return (out_dir / name).read_text(encoding="utf-8", errors="replace")


def _own_base(name: str, text: str, recorded: dict[str, str]) -> str | None:
    """Without pristine copies: the file itself when it is an unedited generation, else None."""
    if name in recorded:
        return text if recorded[name] == content_hash(text) else None
    if name.endswith(".json"):
        return text if json_state(text) == "generated" else None
    header = read_header(text)
    return text if header is not None and header[0] == header[1] else None


def _is_generated(name: str, text: str) -> bool:
    """Written by the tool, edited since or not (no pristine copies to ask)."""
    if name.endswith(".json"):
        return json_state(text) is not None
    return read_header(text) is not None


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


def _recorded_hashes(plan_json: str) -> dict[str, str]:
    """Hashes plan.json keeps for generated files that cannot carry a header (schedule.csv)."""
    try:
        data = json.loads(plan_json)
    except ValueError:
        return {}
    return data.get("file_hashes", {}) if isinstance(data, dict) and GENERATED_JSON_KEY in data else {}


def _free_name(name: str, *taken) -> str:
    """NAME.edited, or NAME.edited.2, .3, ... when earlier edits are kept already."""
    candidate, number = name, 1
    while any(candidate in names for names in taken):
        number += 1
        candidate = f"{name}.{number}"
    return candidate
