"""The collective sequence that turns a producer's layout into the layout a consumer needs.

Steps are named after the output's _comm.py functions:
  reduce  (P -> R)  fwd all-reduce, bwd identity
  gather  (S -> R)  fwd all-gather, bwd keep own slice
  scatter (R -> S)  fwd keep own slice, bwd all-gather
  copy    (R -> R consumed by a split op) fwd identity, bwd all-reduce of the partial gradient
and, where a pair of them is one collective each way (Megatron's sequence parallelism):
  reduce_scatter  (P -> S)  fwd reduce-scatter, bwd all-gather    (reduce, then scatter)
  all_gather      (S -> R consumed by a split op) fwd all-gather, bwd reduce-scatter  (gather, then copy)
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from ..plan.cost import DeviceSpec, all_gather_time, all_reduce_time
from ..plan.layouts import Layout


# Whether the plan being solved and rewritten may fuse pairs (a table's `fused_collectives`):
# only plans asking for them get them, so every other plan stays as it was.
_FUSED = contextvars.ContextVar("fused_collectives", default=False)


@contextlib.contextmanager
def fused_collectives(enabled: bool):
    token = _FUSED.set(enabled)
    try:
        yield
    finally:
        _FUSED.reset(token)


def fusing() -> bool:
    """Whether the plan being solved may fuse pairs of collectives (what it is priced with)."""
    return _FUSED.get()


SPLIT_DIM_STEPS = ("gather", "scatter", "reduce_scatter", "all_gather")     # the steps that name a dim


@dataclass(frozen=True)
class Step:
    op: str                    # reduce | gather | scatter | copy | reduce_scatter | all_gather
    dim: int = -1
    groups: int = 1


def conversion(have: Layout, need: Layout, *, consumer_split: bool, requires_grad: bool) -> list[Step] | None:
    """Steps from `have` to `need`, or None when no sequence can produce `need` (a partial sum)."""
    if need.kind == "P":
        return None
    steps: list[Step] = []
    if have.kind == "P":
        steps.append(Step("reduce"))
        have = Layout("R")
    if have.kind == "S" and have != need:
        steps.append(Step("gather", have.dim, have.groups))
        have = Layout("R")
    if have.kind == "R" and need.kind == "S":
        steps.append(Step("scatter", need.dim, need.groups))
    elif need.kind == "R" and consumer_split and requires_grad:
        steps.append(Step("copy"))
    return _fused(steps) if _FUSED.get() else steps


def _fused(steps: list[Step]) -> list[Step]:
    """reduce + scatter is one reduce-scatter, gather + copy one all-gather (whose backward is the
    reduce-scatter of the partial gradient); fused blocks (groups > 1) keep the pair."""
    if [s.op for s in steps] == ["reduce", "scatter"] and steps[1].groups == 1:
        return [Step("reduce_scatter", steps[1].dim)]
    if [s.op for s in steps] == ["gather", "copy"] and steps[0].groups == 1:
        return [Step("all_gather", steps[0].dim)]
    return steps


def steps_from_end(steps: list[Step], ndim: int) -> list[Step]:
    """The same steps with their dims counted from the end of a value of `ndim` dims."""
    return [Step(step.op, step.dim - ndim, step.groups) if step.op in SPLIT_DIM_STEPS and step.dim >= 0
            else step for step in steps]


def common_prefix(lists: list[list[Step]]) -> list[Step]:
    """The steps every list starts with: where several uses of one value need the same
    conversion, it is written once, on the value's producer."""
    prefix: list[Step] = []
    for items in zip(*lists):
        if any(item != items[0] for item in items):
            break
        prefix.append(items[0])
    return prefix


def conversion_time(steps: list[Step], full_nbytes: float, n: int, device: DeviceSpec) -> float:
    total = 0.0
    for step in steps:
        if step.op in ("reduce_scatter", "all_gather"):
            # priced as the pair it fuses less the one call it saves: cheaper than the pair, so chosen
            # where the pair would be, and no plan that avoided the pair changes. Its bytes are fewer
            # too (one all-gather's worth); pricing that would move Megatron plans: the cost model's call
            total += all_reduce_time(full_nbytes, n, device) + all_gather_time(full_nbytes, n, device) \
                - device.latency
        elif step.op in ("reduce", "copy"):
            total += all_reduce_time(full_nbytes, n, device)
        else:
            total += all_gather_time(full_nbytes, n, device)
    return total
