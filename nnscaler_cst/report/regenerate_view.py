"""What a rewrite over an existing output says about the user's hand edits: per file what was
kept, restored or set aside (notes), and the conflicts left to resolve (errors, exit 1)."""
from __future__ import annotations

import shlex
from pathlib import Path

from ..emit.regenerate import Regeneration
from ..errors import display_path


def regeneration_lines(out_dir: Path, result: Regeneration) -> tuple[list[str], list[str]]:
    """(notes, conflicts), one line each."""
    notes, conflicts = [], []
    for outcome in result.outcomes:
        path = display_path(Path(out_dir) / outcome.name)
        if outcome.action == "merged" and outcome.kept_edits:
            plural = "s" if outcome.kept_edits > 1 else ""
            notes.append(f"kept {outcome.kept_edits} hand edit{plural} in {path}")
        elif outcome.action == "restored":
            notes.append(f"restored {path} (deleted by hand)")
        elif outcome.action == "set-aside":
            notes.append(f"{path}: hand edits set aside as {outcome.set_aside_as} (--force)")
        elif outcome.action == "conflict":
            lines = ", ".join(map(str, outcome.conflict_lines))
            conflicts.append(f"{path}:{outcome.conflict_lines[0]}:1: error: hand edits conflict with the new "
                             f"generation (line{'s' if len(outcome.conflict_lines) > 1 else ''} {lines}); "
                             "resolve the <<<<<<< yours / >>>>>>> generated blocks")
        elif outcome.action == "orphaned":
            conflicts.append(f"{path}: error: no longer generated; your edited copy is kept as "
                             f"{outcome.set_aside_as}: carry its edits over by hand")
    return notes, conflicts


def regenerate_command(model_file: Path, options: dict[str, str], out_dir: Path) -> str:
    """The command line that writes `out_dir` from `model_file` with `options` (as check.json
    records them: text, the command line's over pyproject's), in the options' --help order."""
    from ..options import OPTIONS
    words = ["nnscaler-rewrite", display_path(model_file)]
    for option in OPTIONS:
        value = options.get(option.key)
        if value is None or option.key == "out":
            continue
        if option.type is bool:
            words += [option.flags[0]] if value == "True" else []
        else:
            words += [option.flags[0], value]
    words += ["-o", display_path(out_dir)]
    return " ".join(shlex.quote(w) for w in words)
