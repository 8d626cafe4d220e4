"""Simulate every rank's pipeline order before any process runs: sends do not wait (isend),
receives do. Each forward of stage s > 0 waits for stage s-1's forward of the same micro-batch;
each backward waits for its own forward and for stage s+1's backward. If some rank waits for
something no rank will ever send, the run would hang: say which step, on which ranks.

The same walk, with times per action from the cost model, gives the timeline picture.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..plan.schedules import Action, Placement, VocabSteps


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


def _check_owner(orders, rank: int, vocab) -> None:
    """Interlaced: an owner's F / B of a stage calling vocabulary-split modules pauses at each
    call: its order names that step's calls (sEk, sEkc1, ...) in order before its next own step;
    the vocabulary steps of other stages between them are those it takes part in while paused."""
    order = orders[rank]
    for step, action in enumerate(order):
        if action.kind in "FB" and action.stage in vocab:
            pausing = vocab[action.stage].pausing(action.kind)
            kind = "E" if action.kind == "F" else "G"
            following = []
            for later in order[step + 1:]:
                if later.kind in "FB":
                    break
                if (later.kind, later.stage, later.micro) == (kind, action.stage, action.micro) and \
                        later.call in pausing:
                    following.append(later.call)
            if following != pausing:
                want = " ".join(str(Action(kind, action.stage, action.micro, call=c)) for c in pausing)
                raise UserError(f"rank {rank} step {step} runs {action}, which pauses at {len(pausing)} "
                                f"vocabulary call(s): its order must name {want} before its next own step")
        if action.kind == "G" and action.stage in vocab and vocab[action.stage].deferred_call(action.call) and \
                Action("B", action.stage, action.micro) in order[step:]:
            raise UserError(f"rank {rank} step {step} runs {action}, the step of an embedding's backward, "
                            f"before {Action('B', action.stage, action.micro)}, whose gradient it takes")


def simulate(orders: list[list[Action]], stages: int, *, forward_seconds: list[float] | None = None,
             latency: float = 0.0, placement: Placement | None = None, passes: int = 1,
             vocab: dict[int, VocabSteps] | None = None) -> list[Event]:
    """`placement`: which rank runs each stage, and how many stages one pipeline has (default:
    stage s on rank s % ranks, one pipeline of all `stages`). `passes`: forwards per micro-batch
    (recycling); a no-grad pass takes a forward's time and has no backward. `vocab` (interlaced):
    the stages whose steps call vocabulary-split modules, and where and how long: each call is an
    SPMD step (sEk, sGk) of every rank; the owner's step pauses at the call, each other rank runs
    it between two of its own steps, and none goes on before all have reached it."""
    vocab = vocab or {}
    ranks = len(orders)
    place = placement or Placement(tuple(s % ranks for s in range(stages)), stages)
    expected = {action for order in orders for action in order}
    for rank, order in enumerate(orders):
        for step, action in enumerate(order):
            if action.kind in "EG":
                if action.stage not in vocab or action.call >= vocab[action.stage].calls:
                    raise UserError(f"rank {rank} step {step} runs {action}, a vocabulary step of stage "
                                    f"{action.stage}, which makes " + (f"{vocab[action.stage].calls} such call(s)"
                                                                       if action.stage in vocab else "none"))
                continue
            if not 0 <= action.stage < len(place.ranks) or place.ranks[action.stage] != rank:
                owner = place.ranks[action.stage] if 0 <= action.stage < len(place.ranks) else "no rank"
                raise UserError(f"rank {rank} step {step} runs {action}, a stage of rank {owner}")
        seen = set()
        for step, action in enumerate(order):
            if action in seen:
                raise UserError(f"rank {rank} runs {action} twice (step {step})")
            seen.add(action)
        _check_owner(orders, rank, vocab)
    done: dict[Action, float] = {}
    position = [0] * ranks
    clock = [0.0] * ranks
    events: list[Event] = []
    cost = forward_seconds or [1.0] * stages

    def head(rank):
        return orders[rank][position[rank]] if position[rank] < len(orders[rank]) else None

    def length(action: Action) -> float:
        return cost[action.stage] * (1.0 if action.kind == "F" else 2.0)

    needs_of: dict[Action, list] = {}        # a blocked step is asked again each round: its needs once

    def ready_at(rank, action) -> float | None:
        needs = needs_of.get(action)
        if needs is None:
            needs = needs_of[action] = _needs(action, place, passes)
        arrivals = [clock[rank]]               # (each need looked up once: a step is asked many times)
        for need, src in needs:
            at = done.get(need)
            if at is None:
                return None
            arrivals.append(at + (latency if src is not None else 0.0))
        return max(arrivals)

    while True:
        progressed = False
        for rank in range(ranks):
            while position[rank] < len(orders[rank]):
                action = orders[rank][position[rank]]
                if action.kind in "EG":        # collective: every rank must be at it
                    if any(head(r) != action for r in range(ranks)):
                        break
                    steps = vocab[action.stage]
                    begin = max(clock)
                    end = begin + steps.seconds(action.kind, action.call)
                    for r in range(ranks):
                        events.append(Event(r, action, begin, end))
                        clock[r] = end
                        position[r] += 1
                    owner = place.ranks[action.stage]
                    step = Action("F" if action.kind == "E" else "B", action.stage, action.micro)
                    pausing = steps.pausing(step.kind)
                    if action.call in pausing:        # the owner's step goes on to its next call or its end
                        index = pausing.index(action.call)
                        piece = steps.pieces(step.kind)[index + 1] * length(step)
                        events.append(Event(owner, step, end, end + piece))
                        clock[owner] = end + piece
                        if index == len(pausing) - 1:
                            done[step] = clock[owner]
                    progressed = True
                    continue
                ready = ready_at(rank, action)
                if ready is None:
                    break
                whole = length(action) if action.kind in "FB" else 0.0
                if action.stage in vocab and action.kind in "FB" and action.cycle is None and \
                        vocab[action.stage].pausing(action.kind):
                    first = vocab[action.stage].pieces(action.kind)[0] * whole
                    events.append(Event(rank, action, ready, ready + first))
                    clock[rank] = ready + first           # the step pauses at its first vocabulary call
                else:
                    events.append(Event(rank, action, ready, ready + whole))
                    done[action] = clock[rank] = ready + whole
                position[rank] += 1
                progressed = True
        if all(position[r] == len(orders[r]) for r in range(ranks)):
            return events
        if not progressed:
            waits = []
            for rank in range(ranks):
                if position[rank] == len(orders[rank]):
                    continue
                action = orders[rank][position[rank]]
                if action.kind in "EG":
                    for r in range(ranks):
                        if head(r) != action:
                            where = f"at step {position[r]} ({head(r)})" if head(r) else "at its end"
                            later = "runs it only later" if action in orders[r] else "never runs it"
                            waits.append(f"rank {rank} at step {position[rank]} ({action}) waits for rank {r} "
                                         f"to join it (collective over all ranks); rank {r} is {where} and "
                                         f"{later}")
                    continue
                for need, src in _needs(action, place, passes):
                    if need not in done:
                        who = "itself" if src is None else f"rank {src}"
                        later = "never runs it" if need not in expected else "runs it only later"
                        waits.append(f"rank {rank} at step {position[rank]} ({action}) waits for {need} "
                                     f"from {who}, which {later}")
            raise UserError("the pipeline schedule deadlocks: " + "; ".join(waits),
                            hint="every receive needs its send earlier in the other rank's order")


class Timeline:
    """One set of orders' timeline as a function of the stages' times alone: which step runs
    when depends on the orders, never on the times (a step waits for steps, not for a clock), so
    the walk is done once (`simulate`, which also checks the orders) and each step's start is
    then the latest of its rank's clock and its needs' ends. The planner prices hundreds of stage
    times over a few sets of orders. Without vocabulary steps (their collectives join all ranks)."""

    def __init__(self, orders: list[list[Action]], stages: int, placement: Placement | None = None,
                 passes: int = 1):
        self.ranks = len(orders)
        events = simulate(orders, stages, placement=placement, passes=passes)
        place = placement or Placement(tuple(s % self.ranks for s in range(stages)), stages)
        position = {event.action: k for k, event in enumerate(events)}
        # per step, in the walk's order: (rank, stage, forwards it takes, the steps it waits for
        # with whether each comes from another rank)
        self.steps = [(event.rank, event.action.stage, 1.0 if event.action.kind == "F" else 2.0,
                       tuple((position[need], src is not None) for need, src in _needs(event.action, place, passes)))
                      for event in events]

    def span(self, forward_seconds: list[float], latency: float = 0.0) -> float:
        """max(e.end for e in simulate(...)) for these forward times, without the walk."""
        clock = [0.0] * self.ranks
        end = [0.0] * len(self.steps)
        for k, (rank, stage, forwards, needs) in enumerate(self.steps):
            start = clock[rank]
            for need, remote in needs:
                arrival = end[need] + latency if remote else end[need]
                if arrival > start:
                    start = arrival
            end[k] = clock[rank] = start + forward_seconds[stage] * forwards
        return max(end, default=0.0)


def bubble_fraction(events: list[Event], ranks: int) -> float:
    """Idle time over total time, across ranks, from the first start to the last end."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (span * ranks)
