"""Progress on a terminal: a transient spinner on stderr naming the step under way (trace,
search, write, each run of verify), for commands whose steps take seconds. Nothing at all when
stderr is not a terminal (a pipe, a file, CI logs), so piped output stays what the command
prints. `say` renames the step under way from deeper code (verify's runs); without a spinner
it does nothing. Imports rich only when a spinner shows."""
from __future__ import annotations

from contextlib import contextmanager

_shown: list = []       # the spinner on screen, if any


@contextmanager
def step(console, text: str):
    if not console.is_terminal:
        yield
        return
    with console.status(text, spinner="dots") as status:
        _shown.append(status)
        try:
            yield
        finally:
            _shown.remove(status)


def say(text: str) -> None:
    if _shown:
        _shown[-1].update(text)
