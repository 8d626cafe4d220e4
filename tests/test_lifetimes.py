"""Phases keeping earlier objects out of the collector's full passes (lifetimes.py): a function
made before a phase is still found by its code inside it (trace/replay.py `function_of` reads
gc.get_referrers, which sees no frozen object), full passes are held back inside a phase, and
leaving the phase unfreezes everything and restores the collector's thresholds."""
from __future__ import annotations

import gc

from nnscaler_cst.lifetimes import PHASE_FULL_PASS_EVERY, objects_so_far_kept
from nnscaler_cst.trace.replay import function_of


def _closure(k):
    def scaled(x):
        return x * k
    return scaled


def test_a_closure_made_before_a_phase_is_found_inside_it():
    scaled = _closure(3)
    with objects_so_far_kept():
        assert gc.get_freeze_count() > 0
        with objects_so_far_kept():
            assert function_of(scaled.__code__) is scaled
        assert gc.get_freeze_count() > 0        # the outer phase still keeps its objects
    assert gc.get_freeze_count() == 0


def test_a_phase_holds_full_passes_back_and_leaving_it_restores_the_thresholds():
    before = gc.get_threshold()
    with objects_so_far_kept():
        with objects_so_far_kept():
            assert gc.get_threshold() == (before[0], before[1], PHASE_FULL_PASS_EVERY)
        assert gc.get_threshold()[2] == PHASE_FULL_PASS_EVERY
        passes = gc.get_stats()[2]["collections"]
        kept = [[] for _ in range(300_000)]       # what a trace makes, and keeps
        assert gc.get_stats()[2]["collections"] == passes
    assert gc.get_threshold() == before
