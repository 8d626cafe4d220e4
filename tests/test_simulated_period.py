"""schedules.simulated_seconds: the extrapolated step of a pipeline table is never below the busiest
rank's work and agrees with the simulator's whole timeline (issue 29)."""
import pytest

from nnscaler_cst.plan.schedules import cached_schedule, load_schedule, placement, simulated_seconds
from nnscaler_cst.verify.simulate import simulate


def _whole(table, chunk, micro, passes):
    forward = [t / (passes + 2.0) for t in chunk]
    events = simulate(cached_schedule(table, len(chunk), micro, passes), len(chunk), forward_seconds=forward,
                      placement=placement(table, len(chunk)), passes=passes)
    return max(e.end for e in events)


@pytest.mark.parametrize("name,passes", [("3f1b", 3), ("3f1b", 2), ("1f1b", 1)])
@pytest.mark.parametrize("chunk,micro", [
    ([5.99, 5.5], 32),              # AlphaFold2 fine-tuning's tp4 x pp2: first stage heavier (was 180 s < 191.7 s)
    ([5.5, 5.99], 32),
    ([2.0, 1.0, 1.0, 1.0], 32),
    ([1.5, 1.0, 1.0, 1.0], 40),
    ([1.0, 1.0, 1.0, 2.0], 24),
    ([3.0, 1.0], 64),
])
def test_step_not_below_busiest_rank_and_matches_whole_timeline(name, passes, chunk, micro):
    table = load_schedule(name)
    estimate = simulated_seconds(table, chunk, micro, passes)
    assert estimate >= micro * max(chunk) - 1e-9
    whole = _whole(table, chunk, micro, passes)
    assert abs(estimate - whole) <= 0.1 * whole


@pytest.mark.parametrize("name,passes,ranks,micro", [("1f1b", 1, 4, 12), ("interleaved", 1, 2, 8),
                                                     ("chimera", 1, 2, 4), ("3f1b", 3, 2, 6)])
def test_a_timeline_walked_once_gives_the_simulators_span_for_any_stage_times(name, passes, ranks, micro):
    """verify/simulate.py Timeline (what the planner prices hundreds of stage times with): the
    order of the steps is walked once; each set of times (uneven, with a hand-off latency) then
    ends exactly where the simulator's own walk ends."""
    import random

    from nnscaler_cst.verify.simulate import Timeline
    table = load_schedule(name)
    orders = cached_schedule(table, ranks, micro, passes)
    place = placement(table, ranks)
    timeline = Timeline(orders, len(place.ranks), place, passes)
    rng = random.Random(0)
    for _ in range(25):
        forward = [rng.uniform(0.1, 3.0) for _ in place.ranks]
        latency = rng.choice([0.0, 0.05])
        events = simulate(orders, len(place.ranks), forward_seconds=forward, latency=latency, placement=place,
                          passes=passes)
        assert timeline.span(forward, latency) == max(e.end for e in events)
