"""ZeRO (Rajbhandari et al., SC'20): which data-parallel state a plan shards, and what it costs in
bytes per device.

The emitted code (emit/templates.py, runtime/_comm.py's ZeroShards) lays the trainable parameters
end to end, padded to a multiple of the data-parallel size, and gives each data-parallel rank one
contiguous 1/dp of them. Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3
the parameters too. This module checks a request can apply and counts the bytes; it emits nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

STAGES = (1, 2, 3)
PARAM_BYTES = 4          # fp32 weights
GRAD_BYTES = 4           # fp32 gradients
ADAMW_STATE_BYTES = 8    # exp_avg and exp_avg_sq, fp32 each


def check_zero(stage: int, dp: int, pp: int, *, searched: bool = False, pipelines: int = 1) -> None:
    """Refuse a ZeRO stage that cannot apply: an unknown stage, no data parallelism, replicated
    pipelines. `searched`: --plan auto chose the mesh, so the user did not ask for dp=1 themselves.
    With pipeline stages each rank shards the parameters of the stages it holds over its
    data-parallel peers, which hold the same stages; `pipelines` > 1 (Chimera) would also sum
    the gradients of a stage's replicas into the shards, which the step does not do."""
    if stage not in STAGES:
        raise UserError(f"--zero {stage}: ZeRO has stages 1, 2 and 3",
                        hint="--zero 1 shards optimizer state, 2 also gradients, 3 also parameters")
    if dp < 2 and searched:
        raise UserError(f"--zero {stage}: --plan auto chose a plan without data parallelism, so there is no "
                        "data-parallel state to shard",
                        hint="give the mesh yourself with --dp N (and --tp) and --zero, or drop --zero")
    if dp < 2:
        raise UserError(f"--zero {stage} shards data-parallel state, but the plan has no data parallelism",
                        hint="add --dp N (N > 1), e.g. --dp 2 --zero 1")
    if pp > 1 and pipelines > 1:
        raise UserError(f"--zero {stage} with a schedule of {pipelines} replicated pipelines: ZeRO is not "
                        "supported there yet (the replicas' gradients would have to be summed into the shards)",
                        hint="use --schedule 1f1b (or another single-pipeline schedule), or drop --zero")


@dataclass(frozen=True)
class StateBytes:
    """Bytes one device holds for training state once the optimizer has stepped."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes_per_device(param_count: int, stage: int, dp: int) -> StateBytes:
    """Parameters, gradients and AdamW state on one device at its peak, for `param_count`
    trainable fp32 parameters on that device's data-parallel group (after any tensor-parallel
    split) under ZeRO `stage` (0: none) over `dp` ranks, as runtime/_comm.py's ZeroShards holds
    them. The optimizer steps this rank's shard, a tensor of its own: from stage 1 on the state
    is a shard's. Stages 1 and 2 keep the whole parameters besides the shard; stage 1 holds the
    whole gradients until finish_backward reduce-scatters them, stage 2 reduce-scatters each unit
    as the backward leaves it and keeps the shard's gradient only, stage 3 holds shards only.
    What is whole for a moment (units gathered, a unit's gradients on their way) is
    `units_in_flight`. Each unit is padded to a multiple of dp; counted here as one buffer."""
    if stage == 0:
        held = (param_count, param_count, param_count)
    else:
        shard = -(-param_count // dp)
        whole = shard * dp
        held = {1: (whole + shard, whole, shard), 2: (whole + shard, shard, shard), 3: (shard, shard, shard)}[stage]
    return StateBytes(held[0] * PARAM_BYTES, held[1] * GRAD_BYTES, held[2] * ADAMW_STATE_BYTES)


def units_in_flight(stage: int, root_params: float, block_params: float) -> tuple[float, float]:
    """(parameter bytes, gradient bytes) whole for a moment beyond the shards, at the peak: from
    stage 2 on the gradients of the root unit (embedding, head: whole until the backward's end)
    and of two blocks (one being reduce-scattered, the next produced); at stage 3 the parameters
    of the same (the root unit, whole for the head where the backward starts and the activations
    peak, though freed while the blocks run; a block running and the next prefetched)."""
    units = root_params + 2 * block_params
    return (units * PARAM_BYTES if stage == 3 else 0.0), (units * GRAD_BYTES if stage >= 2 else 0.0)
