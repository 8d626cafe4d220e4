"""Phases keeping earlier objects out of the collector's full passes (lifetimes.py): a function
made before a phase is still found by its code inside it (trace/replay.py `function_of` reads
gc.get_referrers, which sees no frozen object), and leaving the phase unfreezes everything."""
from __future__ import annotations

import gc

from nnscaler_cst.lifetimes import objects_so_far_kept
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
