"""Simulate every rank's pipeline order before any process runs: sends do not wait (isend),
receives do. Each forward of stage s > 0 waits for stage s-1's forward of the same micro-batch;
each backward waits for its own forward and for stage s+1's backward. If some rank waits for
something no rank will ever send, the run would hang: say which step, on which ranks.

The same walk, with times per action from the cost model, gives the timeline picture.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..plan.schedules import Action, Placement


@dataclass
class Event:
    rank: int
    action: Action
    start: float
    end: float


def _needs(action: Action, place: Placement, passes: int = 1) -> list[tuple[Action, int | None]]:
    """(the action this one waits for, the rank it comes from; None when it is this rank's own).
    Recycling (`passes` N > 1): pass c > 0 of a micro-batch starts on the first stage with what
    the last stage of its pipeline handed back from pass c - 1."""
    s, m = action.stage, action.micro
    if action.kind == "F":
        if not place.first(s):
            return [(Action("F", s - 1, m, action.cycle), place.ranks[s - 1])]
        cycle = action.cycle if action.cycle is not None else passes - 1
        if cycle == 0:
            return []
        last = s + place.length - 1
        return [(Action("F", last, m, cycle - 1), place.ranks[last])]
    needs = [(Action("F", s, m), None)]
    if not place.last(s):
        needs.append((Action("B", s + 1, m), place.ranks[s + 1]))
    return needs


def _collective(action: Action, shared) -> tuple[str, int, int] | None:
    """The step of an owner's stage that every rank takes part in (interlaced: the vocabulary-split
    modules): the owner's F or B of a `shared` stage, another rank's share E or G of it."""
    if action.kind in "EG":
        return ("F" if action.kind == "E" else "B", action.stage, action.micro)
    if action.stage in shared:
        return (action.kind, action.stage, action.micro)
    return None


def simulate(orders: list[list[Action]], stages: int, *, forward_seconds: list[float] | None = None,
             latency: float = 0.0, placement: Placement | None = None, passes: int = 1,
             shared=()) -> list[Event]:
    """`placement`: which rank runs each stage, and how many stages one pipeline has (default:
    stage s on rank s % ranks, one pipeline of all `stages`). `passes`: forwards per micro-batch
    (recycling); a no-grad pass takes a forward's time and has no backward. `shared`: stages
    whose steps are collective over all ranks (interlaced): each other rank runs its share (sEk,
    sGk), and none of them goes on before all have reached it."""
    shared = set(shared)
    ranks = len(orders)
    place = placement or Placement(tuple(s % ranks for s in range(stages)), stages)
    expected = {action for order in orders for action in order}
    for rank, order in enumerate(orders):
        for step, action in enumerate(order):
            if action.kind in "EG":
                if action.stage not in shared or place.ranks[action.stage] == rank:
                    raise UserError(f"rank {rank} step {step} runs {action}, a share of stage {action.stage}, "
                                    "which " + ("is its own" if action.stage in shared else
                                               "calls no vocabulary-split module"))
                continue
            if not 0 <= action.stage < len(place.ranks) or place.ranks[action.stage] != rank:
                owner = place.ranks[action.stage] if 0 <= action.stage < len(place.ranks) else "no rank"
                raise UserError(f"rank {rank} step {step} runs {action}, a stage of rank {owner}")
        seen = set()
        for step, action in enumerate(order):
            if action in seen:
                raise UserError(f"rank {rank} runs {action} twice (step {step})")
            seen.add(action)
    done: dict[Action, float] = {}
    position = [0] * ranks
    clock = [0.0] * ranks
    events: list[Event] = []
    cost = forward_seconds or [1.0] * stages
    def head(rank):
        return orders[rank][position[rank]] if position[rank] < len(orders[rank]) else None

    def members(key) -> dict[int, Action]:
        kind, stage, m = key
        owner = place.ranks[stage]
        return {r: Action(kind, stage, m) if r == owner else Action("E" if kind == "F" else "G", stage, m)
                for r in range(ranks)}

    def ready_at(rank, action) -> float | None:
        needs = [] if action.kind in "EG" else _needs(action, place, passes)
        if any(need not in done for need, _ in needs):
            return None
        return max([clock[rank]] + [done[n] + (latency if src is not None else 0.0) for n, src in needs])

    while True:
        progressed = False
        for rank in range(ranks):
            while position[rank] < len(orders[rank]):
                action = orders[rank][position[rank]]
                key = _collective(action, shared)
                group = members(key) if key else {rank: action}
                if any(head(r) != a for r, a in group.items()):
                    break          # a collective step: every rank must be at it
                starts = [ready_at(r, a) for r, a in group.items()]
                if any(s is None for s in starts):
                    break
                ready = max(starts)
                for r, a in group.items():
                    stage = a.stage
                    length = cost[stage] * (1.0 if a.kind == "F" else 2.0) if a.kind in "FB" else 0.0
                    events.append(Event(r, a, ready, ready + length))
                    done[a] = clock[r] = ready + length
                    position[r] += 1
                progressed = True
        if all(position[r] == len(orders[r]) for r in range(ranks)):
            return events
        if not progressed:
            waits = []
            for rank in range(ranks):
                if position[rank] == len(orders[rank]):
                    continue
                action = orders[rank][position[rank]]
                key = _collective(action, shared)
                if key:
                    for r, a in members(key).items():
                        if head(r) != a:
                            where = f"at step {position[r]} ({head(r)})" if head(r) else "at its end"
                            later = "runs it only later" if a in orders[r] else "never runs it"
                            waits.append(f"rank {rank} at step {position[rank]} ({action}) waits for rank {r} "
                                         f"to join {a} (collective over all ranks); rank {r} is {where} and "
                                         f"{later}")
                for need, src in ([] if action.kind in "EG" else _needs(action, place, passes)):
                    if need not in done:
                        who = "itself" if src is None else f"rank {src}"
                        later = "never runs it" if need not in expected else "runs it only later"
                        waits.append(f"rank {rank} at step {position[rank]} ({action}) waits for {need} "
                                     f"from {who}, which {later}")
            raise UserError("the pipeline schedule deadlocks: " + "; ".join(waits),
                            hint="every receive needs its send earlier in the other rank's order")


def bubble_fraction(events: list[Event], ranks: int) -> float:
    """Idle time over total time, across ranks, from the first start to the last end."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (span * ranks)
