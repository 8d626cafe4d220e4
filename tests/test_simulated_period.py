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
