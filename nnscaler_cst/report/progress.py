"""Progress on a terminal: a transient spinner on stderr naming the step under way (trace,
search, write, verify), for commands whose steps take seconds. Nothing at all when stderr is
not a terminal (a pipe, a file, CI logs), so piped output stays what the command prints."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console


@contextmanager
def step(console: Console, text: str):
    if not console.is_terminal:
        yield
        return
    with console.status(text, spinner="dots"):
        yield
