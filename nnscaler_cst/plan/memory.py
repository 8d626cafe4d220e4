"""The memory model per device: training state by ZeRO stage, and the activations the schedule
keeps in flight.

Activations (`saved_bytes`): what autograd keeps for backward, as the trace saw it save
(trace/tracer.py, a saved_tensors_hooks pair around the forward): each storage once, counted at
the node that made it. A matmul keeps its inputs, a softmax its output, a masked_fill its mask,
a residual add nothing; a view shares its base's storage. Parameters are training state, not
activations. The figure is the node's on one device before any split; the planner divides it
by the ways the node is split.

A device's peak (`device_memory`): its parameters, gradients and AdamW state (plan/zero.py,
per ZeRO stage), plus one micro-batch's activations times the micro-batches its stage holds at
once under the schedule (1F1B: stage s of D holds min(D - s, M); GPipe: all M), plus what
recompute rebuilds at once in backward (one block's activations) and, under ZeRO-2 and 3, the
units whole for a moment (plan/zero.py's units_in_flight).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..trace.records import Node, Trace
from .zero import state_bytes_per_device, units_in_flight


def saved_bytes(node: Node, trace: Trace) -> float:
    """Bytes of the storages `node` made that autograd keeps for backward."""
    return float(trace.saved.get(node.index, 0))


def micro_batches_in_flight(stage: int, stages: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """How many micro-batches' activations pipeline stage `stage` of `stages` holds at its peak:
    1F1B runs stages - stage - 1 warm-up forwards, then one forward per backward; GPipe runs every
    forward before any backward."""
    if schedule == "gpipe":
        return micro_batches
    return min(stages - stage, micro_batches)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds at its peak, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float       # micro-batches in flight x one micro-batch's saved activations
    rebuilt: float = 0.0     # recompute: one block's activations, rebuilt in backward
    gathered: float = 0.0    # ZeRO-2, 3: units whole for a moment (gradients; ZeRO-3 parameters too)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.rebuilt + self.gathered


def device_memory(param_count: int, zero: int, dp: int, activations_per_micro_batch: float, in_flight: int, *,
                  rebuilt: float = 0.0, block_params: int = 0, root_params: int = 0) -> DeviceMemory:
    """The peak of one device holding `param_count` trainable fp32 parameters (its stage's, after
    any tensor-parallel split) under ZeRO `zero` over `dp` ranks, `in_flight` micro-batches of
    `activations_per_micro_batch` bytes each; `rebuilt`: what recompute holds at once;
    `block_params`: parameters of the largest block, `root_params`: of the rest (ZeRO's units)."""
    state = state_bytes_per_device(param_count, zero, dp)
    gathered = sum(units_in_flight(zero, root_params, block_params)) if zero >= 2 else 0.0
    return DeviceMemory(state.params, state.grads, state.optimizer, activations_per_micro_batch * in_flight,
                        rebuilt, gathered)
