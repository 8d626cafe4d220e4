"""Line-based three-way merge (diff3) of a generated file: the last generation as written
(base), the user's file (yours), and the new generation (generated).

A region only the user changed keeps the user's lines; a region only the generator changed
takes the new lines; a region both changed differently is a conflict, written between
standard markers with all three versions, so nothing the user wrote is dropped unseen.
Standard library only: the fast `--check` path imports this module without torch or LibCST.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher

YOURS_MARKER = "<<<<<<< yours"
BASE_MARKER = "||||||| last generation"
SEPARATOR = "======="
GENERATED_MARKER = ">>>>>>> generated"
_MARKER_PREFIXES = ("<<<<<<< ", "||||||| ", ">>>>>>> ")


@dataclass
class Merged:
    text: str
    kept_edits: int = 0           # regions where the user's lines won over the generator's
    conflicts: int = 0
    conflict_lines: list[int] = field(default_factory=list)   # 1-based lines of each `<<<<<<<`


def merge3(base: str, yours: str, generated: str) -> Merged:
    """Merge the user's changes (base -> yours) into the new generation (base -> generated)."""
    if yours == base:
        return Merged(generated)
    if generated == base or yours == generated:
        return Merged(yours, kept_edits=0 if yours == generated else _count_changes(base, yours))
    o, a, b = (text.splitlines(keepends=True) for text in (base, yours, generated))
    out: list[str] = []
    result = Merged("")
    for o_part, a_part, b_part in _chunks(o, a, b):
        if a_part == o_part or a_part == b_part:
            out += b_part
        elif b_part == o_part:
            out += a_part
            result.kept_edits += 1
        else:
            result.conflicts += 1
            result.conflict_lines.append(len(out) + 1)
            out += [YOURS_MARKER + "\n", *_closed(a_part), BASE_MARKER + "\n", *_closed(o_part),
                    SEPARATOR + "\n", *_closed(b_part), GENERATED_MARKER + "\n"]
    result.text = "".join(out)
    return result


def conflict_marker_lines(text: str) -> list[int]:
    """1-based lines that look like merge-conflict markers (left unresolved by the user)."""
    return [number for number, line in enumerate(text.splitlines(), 1)
            if line.startswith(_MARKER_PREFIXES) or line == SEPARATOR]


def has_unresolved_conflict(yours: str, base: str) -> bool:
    """The user's file holds markers the last generation did not (a conflict not yet resolved)."""
    return "<<<<<<< " in yours and len(conflict_marker_lines(yours)) > len(conflict_marker_lines(base))


def _chunks(o: list[str], a: list[str], b: list[str]):
    """(base, yours, generated) line runs, alternating stable (all equal) and changed runs."""
    oa, ob = _matches(o, a), _matches(o, b)
    i = j = k = 0
    while True:
        run = 0
        while i + run < len(o) and oa.get(i + run) == j + run and ob.get(i + run) == k + run:
            run += 1
        if run:
            yield o[i:i + run], a[j:j + run], b[k:k + run]
            i, j, k = i + run, j + run, k + run
        sync = next((n for n in range(i, len(o)) if n in oa and n in ob), None)
        if sync is None:
            if i < len(o) or j < len(a) or k < len(b):
                yield o[i:], a[j:], b[k:]
            return
        yield o[i:sync], a[j:oa[sync]], b[k:ob[sync]]
        i, j, k = sync, oa[sync], ob[sync]


def _matches(old: list[str], new: list[str]) -> dict[int, int]:
    """Line of `new` each line of `old` is kept as (autojunk off: blank lines are real lines)."""
    pairs = {}
    for block in SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        pairs.update((block.a + n, block.b + n) for n in range(block.size))
    return pairs


def _count_changes(old: str, new: str) -> int:
    opcodes = SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False).get_opcodes()
    return sum(1 for tag, *_ in opcodes if tag != "equal")


def _closed(lines: list[str]) -> list[str]:
    """A run put before a marker line must end with a newline."""
    if lines and not lines[-1].endswith("\n"):
        return [*lines[:-1], lines[-1] + "\n"]
    return lines
