"""Phases whose earlier objects all live on through them, kept out of the garbage collector's
full passes.

A trace, its graph and the search's tables are millions of objects that live until the end of
the command; every full pass of Python's cyclic collector rescans all of them, and a pass comes
each time the heap grows by a quarter (AlphaFold2's trace: about a tenth of the CPU time). In a
phase, the objects made before it are frozen (gc.freeze): passes scan only what the phase makes.
Leaving the outermost phase unfreezes them, so garbage among them is collected as before.
"""
from __future__ import annotations

import contextlib
import gc

_depth = 0


@contextlib.contextmanager
def objects_so_far_kept():
    global _depth
    gc.freeze()          # (again inside a phase: what the outer phase made so far is kept too)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            gc.unfreeze()


@contextlib.contextmanager
def every_object_visible():
    """gc.get_referrers finds no frozen object: the frozen ones are let back for the call, and
    frozen again after it (with what the phase has made since, which lives on as well)."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()
