"""Phases whose earlier objects all live on through them, kept out of the garbage collector's
full passes.

A trace, its graph and the search's tables are millions of objects that live until the end of
the command; every full pass of Python's cyclic collector rescans all of them, and a pass comes
each time the heap grows by a quarter (AlphaFold2's trace: about a tenth of the CPU time). In a
phase, the objects made before it are frozen (gc.freeze), and full passes come only after
PHASE_FULL_PASS_EVERY young-generation passes instead of 10: what a phase makes lives on too, and
rescanning it a pass per quarter of growth cost `plan` of AlphaFold2 1.4 of its 2 s of collection.
Young cycles are still collected by the young passes. Leaving the outermost phase unfreezes the
objects and restores the thresholds, so garbage among them is collected as before.
"""
from __future__ import annotations

import contextlib
import gc

PHASE_FULL_PASS_EVERY = 1000      # gc's third threshold inside a phase (Python's default: 10)

_depth = 0
_thresholds = gc.get_threshold()        # outside the phases


@contextlib.contextmanager
def objects_so_far_kept():
    global _depth, _thresholds
    gc.freeze()          # (again inside a phase: what the outer phase made so far is kept too)
    if not _depth:
        _thresholds = gc.get_threshold()
        gc.set_threshold(_thresholds[0], _thresholds[1], PHASE_FULL_PASS_EVERY)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            gc.set_threshold(*_thresholds)
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
