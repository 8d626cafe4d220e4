"""Named collectives for generated per-rank model code, and process-group setup.

This file is copied verbatim next to the generated per-rank model files, so it
imports nothing but the Python standard library and torch.

What it does
------------
* ``setup`` / ``teardown`` initialise torch.distributed and cut the world into a
  3-D device mesh (tp fastest-varying, then dp, then pp).  The mesh axes are the
  module-level ``Axis`` objects ``TP``, ``DP`` and ``PP``; ``setup`` fills them in
  place, so ``from _comm import TP`` taken before ``setup`` stays valid.
* Every collective is a small ``torch.autograd.Function`` whose name states what
  it does in both directions, in the Megatron-LM vocabulary:

  =====================  ==========================  ==========================
  function               forward                     backward
  =====================  ==========================  ==========================
  ``tp_copy``            identity                    all-reduce(sum)
  ``tp_reduce``          all-reduce(sum)             identity
  ``tp_scatter``         keep this rank's slice      all-gather
  ``tp_gather``          all-gather                  keep this rank's slice
  =====================  ==========================  ==========================

  plus a vocabulary-parallel embedding and cross entropy, ``coshard`` (pieces
  of one op run one after another, recomputed in backward), bucketed gradient
  synchronisation for data parallelism, ZeRO's sharded data-parallel state
  (``reduce_scatter_grads``, ``all_gather_params``), and p2p for pipeline stages (hand-offs:
  metadata once, then one message per tensor, batched with ``batch_isend_irecv``).
* ``CheckpointChunks``: the pieces of a single-device tensor one rank holds, as
  torch.distributed.checkpoint saves and loads them (by offsets in the whole tensor).
* On an axis of size 1 every collective is the identity and no
  torch.distributed function is called, so generated code also runs in one
  plain process without ``setup``.
* ``COUNTERS`` counts calls and bytes put on the wire, for benchmarks.

What it must not do
-------------------
* Import anything but the standard library and torch (never ``nnscaler_cst``).
* Hide communication: every byte this module moves goes through one of the
  named functions below, is visible at the call site in the generated source,
  and is counted by ``_record``.  The only hooks are the ones a named call
  installs and says so (``overlap_grads``: gradient buckets all-reduced as the
  backward fills them; ``zero_shards``: ZeRO's per-unit gathers, frees and
  reduce-scatters); no implicit global syncs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import struct
from typing import Iterable

import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn.functional as F

__all__ = [
    "Axis", "TP", "DP", "PP",
    "setup", "teardown", "axis_ranks",
    "tp_copy", "tp_reduce", "tp_scatter", "tp_gather",
    "vocab_parallel_embedding", "vocab_parallel_cross_entropy", "tp_multi_head_attention_forward", "tp_recurrent",
    "split_after_build", "instance_classes",
    "dp_batch_norm", "dp_functional_batch_norm", "dp_layers",
    "sync_grads", "GradBuckets", "overlap_grads", "wait_grad_buckets",
    "ZeroShards", "ZeroUnit", "zero_shards", "reduce_scatter_grads", "all_gather_params", "free_params",
    "state_dict_keys",
    "keep_params", "gather_whole", "shard_of",
    "CheckpointChunks",
    "send_forward", "recv_forward", "send_backward", "recv_backward",
    "activation_sends", "activation_recvs", "grad_sends", "grad_recvs", "post_p2p",
    "wait_activations", "wait_grads", "shape_key", "HandoffMismatch",
    "COUNTERS", "reset_counters",
    "vocab_split", "vocab_begin", "vocab_end", "vocab_share", "vocab_deferred", "vocab_cross_entropy",
]


# --------------------------------------------------------------------------
# Device mesh
# --------------------------------------------------------------------------

class Axis:
    """One axis of the device mesh.

    name:  "tp", "dp" or "pp".
    size:  number of ranks along the axis (1 = axis not used).
    rank:  index of this process along the axis, in [0, size).
    group: the torch.distributed ProcessGroup of this rank's line along the
           axis, or None when size == 1.
    ranks: global ranks in that group, ordered by their index along the axis.
    """

    def __init__(self, name: str, size: int = 1, rank: int = 0, group=None):
        self.name = name
        self.size = size
        self.rank = rank
        self.group = group
        self.ranks: list[int] = [rank]

    def _reset(self) -> None:
        self.size, self.rank, self.group, self.ranks = 1, 0, None, [GLOBAL_RANK]

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, size={self.size}, rank={self.rank}, ranks={self.ranks})"


TP = Axis("tp")
DP = Axis("dp")
PP = Axis("pp")
PP_ENDS = Axis("pp_ends")  # the stages of this rank's pipeline holding tied embeddings (first and last)
PP_REPLICA = Axis("pp_replica")  # pipeline ranks holding replicas of the same stages (Chimera)
PP_TP = Axis("pp_tp")  # the tp x pp devices of one data-parallel replica, by (pp, tp) index (interlaced)
GLOBAL_RANK = 0  # rebound by setup: read it as _comm.GLOBAL_RANK, not via `from _comm import`


def map_tensors(fn, batch):
    """`fn` on every tensor of a batch, through nested dicts, lists and tuples; the rest kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [map_tensors(fn, v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)   # a namedtuple
    return batch


def setup(rank: int, world_size: int, *, tp: int = 1, dp: int = 1, pp: int = 1,
          backend: str | None = None, pp_replicas: list | None = None, pp_tied: list | None = None) -> None:
    """Initialise torch.distributed (if needed) and build the tp x dp x pp mesh.

    ``pp_replicas``: groups of pipeline indices whose ranks hold replicas of the same
    stages (Chimera: [[0, 3], [1, 2]]); their gradients are summed over ``PP_REPLICA``.
    ``pp_tied``: the pipeline indices holding tied parameters (default: the first and the
    last), whose gradients are summed over ``PP_ENDS``.

    Global rank = ((pp_index * dp) + dp_index) * tp + tp_index.
    MASTER_ADDR / MASTER_PORT come from the environment (as torchrun sets them).
    Must be called by every rank with the same mesh sizes.
    """
    global GLOBAL_RANK
    assert tp * dp * pp == world_size, (
        f"mesh tp={tp} x dp={dp} x pp={pp} = {tp * dp * pp} ranks, "
        f"but world_size is {world_size}")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    assert dist.get_rank() == rank and dist.get_world_size() == world_size, (
        f"torch.distributed is already initialised as rank {dist.get_rank()} of "
        f"{dist.get_world_size()}, but setup was called with rank {rank} of {world_size}")
    GLOBAL_RANK = rank

    def global_rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    # Every line of ranks along each axis, in one fixed order.  new_group is
    # collective over the whole world, so every rank creates every group (in
    # the same order) and keeps the one it belongs to.
    lines = {
        TP: [[global_rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        DP: [[global_rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        PP: [[global_rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    lines[PP_TP] = [[global_rank(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)]
    lines[PP_ENDS] = [[line[p] for p in (pp_tied or (0, pp - 1))] for line in lines[PP]] if pp > 1 else [[rank]]
    lines[PP_REPLICA] = [[line[p] for p in group] for line in lines[PP] for group in pp_replicas] \
        if pp_replicas else [[rank]]
    _clear_handoff_cache()  # hand-off headers are cached per mesh: a new one starts afresh
    for axis, axis_lines in lines.items():
        axis._reset()
        for ranks in axis_lines:
            if len(ranks) == 1:
                continue  # size-1 line: no group, every collective is the identity
            group = dist.new_group(ranks)
            if rank in ranks:
                axis.size, axis.rank = len(ranks), ranks.index(rank)
                axis.group, axis.ranks = group, ranks


def teardown() -> None:
    """Destroy the default process group (if any) and reset the mesh axes."""
    global GLOBAL_RANK
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    GLOBAL_RANK = 0
    for axis in (TP, DP, PP, PP_TP, PP_ENDS, PP_REPLICA):
        axis._reset()
    _clear_handoff_cache()


def axis_ranks(axis: Axis) -> list[int]:
    """Global ranks of this rank's group along ``axis``, ordered by axis index."""
    return list(axis.ranks)


# --------------------------------------------------------------------------
# Communication counter: every transfer goes through _record
# --------------------------------------------------------------------------

COUNTERS = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "send": 0, "recv": 0, "bytes": 0,
            "handoff_headers": 0, "broadcast": 0, "gather": 0, "scatter": 0}  # pipeline hand-off metadata headers sent


def reset_counters() -> None:
    for key in COUNTERS:
        COUNTERS[key] = 0


def _record(kind: str, sent: torch.Tensor | None) -> None:
    """Count one call of ``kind`` and the bytes this rank puts on the wire."""
    COUNTERS[kind] += 1
    if sent is not None:
        COUNTERS["bytes"] += sent.numel() * sent.element_size()


def _all_reduce(t: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a contiguous tensor over ``axis``."""
    _record("all_reduce", t)
    dist.all_reduce(t, op=op, group=axis.group)
    return t


def _all_gather(t: torch.Tensor, axis: Axis) -> list[torch.Tensor]:
    """All-gather ``t`` over ``axis``; returns one tensor per axis index."""
    t = t.contiguous()
    _record("all_gather", t)
    parts = [torch.empty_like(t) for _ in range(axis.size)]
    dist.all_gather(parts, t, group=axis.group)
    return parts


# --------------------------------------------------------------------------
# Tensor-parallel mappings
# --------------------------------------------------------------------------

class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity.  Backward: all-reduce(sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.axis), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce(sum).  Backward: identity."""

    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _check_split(size: int, axis: Axis, groups: int, what: str) -> int:
    """Length of one rank's slice of one group block along a split dim."""
    parts = axis.size * groups
    if size % parts != 0:
        raise ValueError(
            f"{what}: dim of size {size} cannot be split into {groups} group(s) "
            f"x {axis.size} {axis.name} ranks")
    return size // parts


def _keep_slice(x: torch.Tensor, axis: Axis, dim: int, groups: int) -> torch.Tensor:
    """This rank's slice of ``dim`` of ``x``, viewed as (groups, size/groups)."""
    dim = dim % x.dim()
    chunk = _check_split(x.shape[dim], axis, groups, "tp_scatter")
    blocks = x.unflatten(dim, (groups, axis.size, chunk))   # [..., groups, size, chunk, ...]
    # a copy, never a view: the user's code may write into it in place (`h[..., :k] = 0`)
    return blocks.select(dim + 1, axis.rank).flatten(dim, dim + 1).clone(memory_format=torch.contiguous_format)


def _gather_slices(x: torch.Tensor, axis: Axis, dim: int, groups: int) -> torch.Tensor:
    """Inverse of _keep_slice: all-gather the slices of every rank along ``dim``."""
    dim = dim % x.dim()
    if x.shape[dim] % groups != 0:
        raise ValueError(f"tp_gather: dim of size {x.shape[dim]} is not divisible "
                         f"into {groups} group(s)")
    chunk = x.shape[dim] // groups
    parts = _all_gather(x, axis)
    # group-major: [g0 of rank 0, g0 of rank 1, ..., g1 of rank 0, ...]; cat makes a fresh tensor
    # (not a view), so the user's code may write into it in place
    return torch.cat([p.narrow(dim, g * chunk, chunk) for g in range(groups) for p in parts], dim=dim)


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's slice of ``dim``.  Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, axis, dim, groups):
        ctx.axis, ctx.dim, ctx.groups = axis, dim, groups
        return _keep_slice(x, axis, dim, groups)

    @staticmethod
    def backward(ctx, grad):
        return _gather_slices(grad, ctx.axis, ctx.dim, ctx.groups), None, None, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather along ``dim``.  Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, axis, dim, groups):
        ctx.axis, ctx.dim, ctx.groups = axis, dim, groups
        return _gather_slices(x, axis, dim, groups)

    @staticmethod
    def backward(ctx, grad):
        return _keep_slice(grad, ctx.axis, ctx.dim, ctx.groups), None, None, None


def tp_copy(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Copy to the tensor-parallel region: fwd identity, bwd all-reduce(sum)."""
    if axis.size == 1:
        return x
    return _CopyToTensorParallel.apply(x, axis)


def tp_reduce(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Reduce from the tensor-parallel region: fwd all-reduce(sum), bwd identity."""
    if axis.size == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, axis)


def tp_scatter(x: torch.Tensor, axis: Axis, dim: int, groups: int = 1) -> torch.Tensor:
    """Scatter to the tensor-parallel region: fwd keep this rank's slice of
    ``dim``, bwd all-gather.

    ``groups`` > 1 is for fused projections: ``dim`` is viewed as ``groups``
    equal blocks and every block is split, e.g. groups=3 on a fused q|k|v dim
    keeps [q_r | k_r | v_r].
    """
    if axis.size == 1:
        return x
    return _ScatterToTensorParallel.apply(x, axis, dim, groups)


def tp_gather(x: torch.Tensor, axis: Axis, dim: int, groups: int = 1) -> torch.Tensor:
    """Gather from the tensor-parallel region: fwd all-gather along ``dim``
    (respecting ``groups``, the exact inverse of ``tp_scatter``), bwd keep this
    rank's slice of the gradient."""
    if axis.size == 1:
        return x
    return _GatherFromTensorParallel.apply(x, axis, dim, groups)


def _reduce_scatter(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's slice of ``dim``: one reduce-scatter."""
    dim = dim % x.dim()
    _check_split(x.shape[dim], axis, 1, "tp_reduce_scatter")
    parts = [p.contiguous() for p in x.chunk(axis.size, dim)]
    out = torch.empty_like(parts[axis.rank])
    _record("reduce_scatter", x)
    dist.reduce_scatter(out, parts, group=axis.group)
    return out


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``.  Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_slices(grad, ctx.axis, ctx.dim, 1), None, None


class _AllGatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather along ``dim``.  Backward: reduce-scatter (the consumer's gradient is a
    partial sum on each rank: each rank keeps the sum of its slice)."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _gather_slices(x, axis, dim, 1)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.axis, ctx.dim), None, None


def tp_reduce_scatter(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Leave the tensor-parallel region split along ``dim`` (Megatron's sequence parallelism):
    fwd reduce-scatter of the partial sums, bwd all-gather.  Half the bytes of tp_reduce's
    all-reduce, and what follows runs on 1/n of ``dim``."""
    if axis.size == 1:
        return x
    return _ReduceScatterToSequenceParallel.apply(x, axis, dim)


def tp_all_gather(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Enter the tensor-parallel region from slices of ``dim``: fwd all-gather, bwd
    reduce-scatter (tp_gather + tp_copy in one collective each way)."""
    if axis.size == 1:
        return x
    return _AllGatherFromSequenceParallel.apply(x, axis, dim)


# --------------------------------------------------------------------------
# Layers built whole, then cut to this rank's share
# --------------------------------------------------------------------------

def split_after_build(build, shares: dict, axis: Axis):
    """``build`` as the entry file wrote it, then each parameter or buffer in ``shares`` cut to this
    rank's slice on ``axis``: name -> (dim, fused blocks, the layer's attributes holding that
    size). For layers one constructor call builds for instances split unalike, or sized from a
    config object: they are built whole, and the rank then holds only its share, the layer's
    size attributes (``out_features``) set to the local size as a divided constructor argument
    would have. Local work only: no communication."""

    def build_split(*args, **kwargs):
        model = build(*args, **kwargs)
        cut: dict[int, tuple] = {}     # id of a whole parameter -> (it, its share): tied ones cut once
        for name, (dim, groups, attributes) in shares.items():
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            whole = getattr(owner, attr)
            if id(whole) not in cut:
                with torch.no_grad():
                    local = _keep_slice(whole.detach(), axis, dim, groups)
                if isinstance(whole, torch.nn.Parameter):
                    local = torch.nn.Parameter(local, requires_grad=whole.requires_grad)
                cut[id(whole)] = whole, local       # a buffer (running statistics) stays one
            local = cut[id(whole)][1]
            setattr(owner, attr, local)
            for size in attributes:
                if getattr(owner, size, None) == whole.shape[dim]:
                    setattr(owner, size, local.shape[dim])
        return model

    build_split.__wrapped__ = build
    return build_split


def instance_classes(build, classes: dict):
    """``build`` as the entry file wrote it, then each module in ``classes`` (its path -> a
    variant of its class) given that class: a block class whose instances split unalike runs
    each kind's own rewrite of its forward. A module this rank's build() dropped (another
    pipeline stage's) is skipped. Local work only."""

    def build_variants(*args, **kwargs):
        model = build(*args, **kwargs)
        for path, cls in classes.items():
            try:
                module = model.get_submodule(path)
            except AttributeError:
                continue
            module.__class__ = cls
        return model

    build_variants.__wrapped__ = build
    return build_variants


# --------------------------------------------------------------------------
# Vocabulary parallelism
# --------------------------------------------------------------------------

class _AllReduceBothWays(torch.autograd.Function):
    """Forward: all-reduce(sum).  Backward: all-reduce(sum): every rank's result depends on every
    rank's input."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.axis), None


def dp_batch_norm(x: torch.Tensor, bn: torch.nn.Module, axis: Axis) -> torch.Tensor:
    """A BatchNorm layer run on this rank's slice of the batch, normalised with the statistics of
    the whole batch (as torch's SyncBatchNorm, which needs a GPU): the layer's own forward, its
    running statistics' momentum and count included, around dp_functional_batch_norm. A line that
    calls a BatchNorm in one instance of its class and another layer (nn.Identity) in another runs
    that layer as it is."""
    if axis.size == 1 or not isinstance(bn, torch.nn.modules.batchnorm._BatchNorm) \
            or not (bn.training or bn.running_mean is None):
        return bn(x)
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    keep = not bn.training or bn.track_running_stats
    return dp_functional_batch_norm(x, axis, bn.running_mean if keep else None, bn.running_var if keep else None,
                                    bn.weight, bn.bias, True, momentum, bn.eps)


def dp_layers(module: torch.nn.Module, x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """A module run on this rank's slice of the batch with every BatchNorm of it that an
    nn.Sequential calls (nested ones too) normalised by the whole batch's statistics
    (dp_batch_norm); any other layer runs as it is. For a line that calls an nn.Sequential holding
    a BatchNorm in some instances of its class and other modules (nn.Identity) in others. An
    nn.Sequential with a forward of its own (pooling, then upsampling back) runs that forward: its
    lines are the model's own, rewritten where they call a BatchNorm."""
    if isinstance(module, torch.nn.Sequential) and type(module).forward is torch.nn.Sequential.forward:
        for layer in module:
            x = dp_layers(layer, x, axis)
        return x
    return dp_batch_norm(x, module, axis)


def dp_functional_batch_norm(input: torch.Tensor, axis: Axis, running_mean: torch.Tensor | None,
                             running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
                             bias: torch.Tensor | None = None, training: bool = False, momentum: float = 0.1,
                             eps: float = 1e-5) -> torch.Tensor:
    """torch.nn.functional.batch_norm on this rank's slice of the batch, in training normalised
    with the statistics of the whole batch (sums over every rank's slice), so it computes what the
    single-device call computes on the whole batch; the running statistics given are updated alike
    on every rank. Every rank holds an equal share of the batch."""
    if axis.size == 1 or not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    dims = [0, *range(2, input.dim())]
    shape = [1, -1] + [1] * (input.dim() - 2)
    count = input.numel() // input.shape[1] * axis.size
    # normalised in the dtype torch's own kernel accumulates in (on CPU float64 for float32): a
    # channel whose variance is below eps over a few values (4 per channel, ShuffleNet at 32x32)
    # turns float32's rounding into 19% of a gradient, where torch's kernel lands at 4e-4
    x = input.to(_batch_norm_accumulation(input))
    mean = _AllReduceBothWays.apply(x.sum(dims), axis) / count
    centered = x - mean.reshape(shape)
    var = _AllReduceBothWays.apply(centered.pow(2).sum(dims), axis) / count
    y = (centered * torch.rsqrt(var + eps).reshape(shape)).to(input.dtype)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.detach() * count / max(count - 1, 1), alpha=momentum)
    return y


def _batch_norm_accumulation(input: torch.Tensor) -> torch.dtype:
    """The dtype torch's batch_norm kernels accumulate `input`'s statistics in: float32 for half
    precisions, float64 for float32 on CPU (its acc_type), the input's own otherwise."""
    if input.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return torch.float64 if input.dtype == torch.float32 and input.device.type == "cpu" else input.dtype


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, axis: Axis,
                             padding_idx: int | None = None, max_norm: float | None = None,
                             norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                             sparse: bool = False) -> torch.Tensor:
    """Partial embedding lookup in a vocabulary-split table; the arguments after ``axis`` are
    ``F.embedding``'s.

    ``weight`` holds rows [axis.rank * V_local, (axis.rank + 1) * V_local) of the
    full table.  Rows for ids outside that range are zero; the caller sums the
    partial results with ``tp_reduce``.  ``padding_idx`` is a global index.
    Differentiable w.r.t. ``weight`` through ordinary autograd.
    """
    if axis.size == 1:
        return F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if max_norm is not None or scale_grad_by_freq:
        # the ids of other ranks' rows are looked up as row 0 here: they would renormalize it,
        # or count towards its frequency
        raise ValueError("vocab_parallel_embedding: max_norm and scale_grad_by_freq need the whole table")
    v_local = weight.shape[0]
    start = axis.rank * v_local
    outside = (ids < start) | (ids >= start + v_local)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = None
    if padding_idx is not None and start <= padding_idx < start + v_local:
        local_pad = padding_idx - start
    out = F.embedding(local_ids, weight, local_pad, sparse=sparse)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: masked out) as the float mask added to the scores."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def tp_multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                                    in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
                                    out_proj_bias, training=True, key_padding_mask=None, need_weights=True,
                                    attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None,
                                    k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
                                    average_attn_weights=True, is_causal=False, *, axis: Axis):
    """``F.multi_head_attention_forward`` on this rank's heads (Megatron's attention layout).

    Takes F's arguments, (L, N, E) inputs, with the projections' local rows: ``in_proj_weight``
    holds this rank's rows of each of q, k and v ([q_r | k_r | v_r], as ``tp_scatter`` with
    groups=3 keeps them; or the separate ``q/k/v_proj_weight``), ``bias_k`` / ``bias_v`` their
    heads' columns, ``out_proj_weight`` its columns of these heads. The inputs arrive whole
    (the caller's ``tp_copy`` sums their gradients); the output projection's partial sums are
    all-reduced here and the bias added once, so the result is whole on every rank. Averaged
    attention weights are summed over the ranks' heads (all-reduce); per-head ones are this
    rank's heads' (N, local heads, L, S).
    ``is_causal`` is a hint that ``attn_mask`` is causal; the mask itself is applied.
    """
    if static_k is not None or static_v is not None:
        raise ValueError("tp_multi_head_attention_forward: static_k / static_v are not split by heads")
    head_dim = embed_dim_to_check // num_heads
    if use_separate_proj_weight:
        w_q, w_k, w_v = q_proj_weight, k_proj_weight, v_proj_weight
    else:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    tgt_len, bsz, embed_dim = query.shape
    q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
    heads = q.shape[-1] // head_dim                # this rank's heads
    mask = _additive_mask(attn_mask, q.dtype)
    padding = _additive_mask(key_padding_mask, q.dtype)
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        padding = F.pad(padding, (0, 1)) if padding is not None else None
    q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(bsz * heads, 1, head_dim)], dim=1)
        v = torch.cat([v, v.new_zeros(bsz * heads, 1, head_dim)], dim=1)
        mask = F.pad(mask, (0, 1)) if mask is not None else None
        padding = F.pad(padding, (0, 1)) if padding is not None else None
    src_len = k.shape[1]
    mask = mask.unsqueeze(0) if mask is not None else None                      # (1, L, S)
    if padding is not None:
        padding = padding.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
        mask = padding if mask is None else mask + padding
    dropout_p = dropout_p if training else 0.0
    scores = torch.bmm(q * head_dim ** -0.5, k.transpose(-2, -1))
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    attn = torch.bmm(F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights, v)
    attn = attn.transpose(0, 1).contiguous().view(tgt_len * bsz, heads * head_dim)
    out = tp_reduce(F.linear(attn, out_proj_weight), axis)       # the heads' partial sums
    if out_proj_bias is not None:
        out = out + out_proj_bias
    out = out.view(tgt_len, bsz, embed_dim)
    if not need_weights:
        return out, None
    weights = weights.view(bsz, heads, tgt_len, src_len)
    if average_attn_weights:
        return out, tp_reduce(weights.sum(dim=1) / num_heads, axis)
    return out, weights                                         # this rank's heads


def _recurrent_step(mode: str, gx: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None):
    """One time step of one layer on this rank's units: gx, gh the input's and the hidden state's
    gate pre-activations (this rank's rows of each gate), h and c its units' state."""
    if mode == "LSTM":
        i, f, g, o = (gx + gh).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        (r_x, z_x, n_x), (r_h, z_h, n_h) = gx.chunk(3, dim=-1), gh.chunk(3, dim=-1)
        r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
        n = torch.tanh(n_x + r * n_h)
        return (1 - z) * n + z * h, None
    return (torch.tanh(gx + gh) if mode == "RNN_TANH" else torch.relu(gx + gh)), None


def _recurrent_direction(rnn, suffix: str, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None,
                         reverse: bool, from_caller: bool, axis: Axis):
    """One layer and direction over the sequence x (T, B, features), whole; h0 / c0 (B, H) whole.
    Returns the whole output (T, B, H), and the last h and c, whole."""
    units = rnn.hidden_size // axis.size
    mine = slice(axis.rank * units, (axis.rank + 1) * units)
    w_ih, w_hh = getattr(rnn, f"weight_ih{suffix}"), getattr(rnn, f"weight_hh{suffix}")
    b_ih = getattr(rnn, f"bias_ih{suffix}") if rnn.bias else None
    b_hh = getattr(rnn, f"bias_hh{suffix}") if rnn.bias else None
    # the input projection of every step at once: this rank's rows. An input gathered here (a
    # lower layer's output) gets this rank's partial gradient summed by tp_copy; the caller's own
    # input, and h0, arrive with the caller's tp_copy, which sums it
    gates_x = F.linear(x if from_caller else tp_copy(x, axis), w_ih, b_ih)
    h_whole, h, c = h0, h0[..., mine], (c0[..., mine] if c0 is not None else None)
    outputs: list = [None] * x.shape[0]
    for step, t in enumerate(range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
        gh = F.linear(h_whole if step == 0 else tp_copy(h_whole, axis), w_hh, b_hh)
        h, c = _recurrent_step(rnn.mode, gates_x[t], gh, h, c)
        h_whole = outputs[t] = tp_gather(h, axis, dim=-1)   # the next step reads every unit
    return torch.stack(outputs), h_whole, (tp_gather(c, axis, dim=-1) if c is not None else None)


def tp_recurrent(rnn: torch.nn.Module, input: torch.Tensor, hx=None, *, axis: Axis):
    """``rnn(input, hx)`` for an nn.RNN, nn.LSTM or nn.GRU holding this rank's hidden units: its
    ``weight_ih_l{k}``, ``weight_hh_l{k}`` and biases hold this rank's rows of every gate block
    ([i_r | f_r | g_r | o_r], as ``tp_scatter`` with groups=4 keeps them), the hidden size whole.

    The input and ``hx`` arrive whole (the caller's ``tp_copy`` sums their gradients); the input
    projection of all steps is one local matmul; every step all-gathers the new hidden units
    (``tp_gather``: bwd keeps this rank's slice) because the next step's gates read all of them,
    and the gathered states are the layer's output, whole, as are h_n and c_n. In backward each
    step's gathered state all-reduces its partial gradient (``tp_copy``). Dropout between layers
    draws on the whole output (the same seed on every tp rank). Not for a projected LSTM
    (proj_size) or a packed sequence."""
    if rnn.proj_size or not isinstance(input, torch.Tensor):
        raise ValueError("tp_recurrent: a projected LSTM or a packed sequence is not split by hidden units")
    batched = input.dim() == 3
    lstm = rnn.mode == "LSTM"
    x = input.transpose(0, 1) if batched and rnn.batch_first else input if batched else input.unsqueeze(1)
    directions = 2 if rnn.bidirectional else 1
    if hx is None:
        zeros = x.new_zeros(rnn.num_layers * directions, x.shape[1], rnn.hidden_size)
        hx = (zeros, zeros) if lstm else zeros
    h0, c0 = hx if lstm else (hx, None)
    if not batched:
        h0, c0 = h0.unsqueeze(1), (c0.unsqueeze(1) if c0 is not None else None)
    hs, cs = [], []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(directions):
            k = layer * directions + d
            out, h, c = _recurrent_direction(rnn, f"_l{layer}{'_reverse' if d else ''}", x, h0[k],
                                             c0[k] if c0 is not None else None, d == 1, layer == 0, axis)
            outs.append(out)
            hs.append(h)
            cs.append(c)
        x = outs[0] if directions == 1 else torch.cat(outs, dim=-1)
        if rnn.dropout and rnn.training and layer < rnn.num_layers - 1:
            x = F.dropout(x, rnn.dropout, True)
    h_n = torch.stack(hs)
    c_n = torch.stack(cs) if lstm else None
    if not batched:
        x, h_n, c_n = x.squeeze(1), h_n.squeeze(1), (c_n.squeeze(1) if lstm else None)
    elif rnn.batch_first:
        x = x.transpose(0, 1)
    return x, ((h_n, c_n) if lstm else h_n)


def _cross_entropy_pieces(x: torch.Tensor, t: torch.Tensor, start: int, vocab: int, axis: Axis,
                          ignore_index: int, label_smoothing: float):
    """Per-token cross entropy of logits whose columns [start, start + x.shape[-1]) of `vocab`
    this rank holds (x: (tokens, local) in fp32, t: (tokens,) global ids). Communication: one
    all-reduce(max) of the row maxima, one all-reduce(sum) of [sum exp, target logit, (sum
    logits)] stacked, over ``axis``. Returns (loss per token, ignored rows, what the gradient
    needs: softmax, rows holding their target here, their local column)."""
    def reduce(t, op=dist.ReduceOp.SUM):
        return _all_reduce(t.contiguous(), axis, op) if axis.size > 1 else t

    row_max = reduce(x.max(dim=-1).values, dist.ReduceOp.MAX)
    x = x - row_max.unsqueeze(-1)        # numerically stable: the global row maximum
    v_local = x.shape[-1]
    ignored = t == ignore_index
    local = (t >= start) & (t < start + v_local) & ~ignored
    local_t = (t - start).masked_fill(~local, 0)
    target_logit = x.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~local, 0.0)
    exp = x.exp()
    stats = [exp.sum(dim=-1), target_logit]
    if label_smoothing > 0:
        stats.append(x.sum(dim=-1))
    stats = reduce(torch.stack(stats))
    log_z = stats[0].log()
    loss = (1.0 - label_smoothing) * (log_z - stats[1])
    if label_smoothing > 0:
        loss = loss + label_smoothing * (log_z - stats[2] / vocab)
    softmax = exp.div_(stats[0].unsqueeze(-1))
    return loss.masked_fill(ignored, 0.0), ignored, (softmax, local, local_t)


def _reduced(loss: torch.Tensor, ignored: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    if reduction == "none":
        return loss.view(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (~ignored).sum()    # mean over non-ignored targets (0/0 = nan when all are, as torch)


def _cross_entropy_grad(saved, ignored: torch.Tensor, grad_out: torch.Tensor, reduction: str,
                        label_smoothing: float, vocab: int) -> torch.Tensor:
    """The local logits' gradient: (softmax - (1 - eps) * onehot - eps / V) * d loss, local only."""
    softmax, local, local_t = saved
    grad = softmax
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local_t] -= (1.0 - label_smoothing) * local.to(grad.dtype)
    if label_smoothing > 0:
        grad -= label_smoothing / vocab
    grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
    g = grad_out.to(grad.dtype)
    if reduction == "none":
        return grad.mul_(g.reshape(-1, 1))
    return grad.mul_(g if reduction == "sum" else g / (~ignored).sum())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split on the vocabulary (last) dim (_cross_entropy_pieces);
    backward is local."""

    @staticmethod
    def forward(ctx, logits, target, axis, ignore_index, reduction, label_smoothing):
        v_local = logits.shape[-1]
        vocab = v_local * axis.size
        x = logits.reshape(-1, v_local).float()
        loss, ignored, saved = _cross_entropy_pieces(x, target.reshape(-1), axis.rank * v_local, vocab, axis,
                                                     ignore_index, label_smoothing)
        ctx.save_for_backward(ignored, *saved)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        ctx.reduction, ctx.label_smoothing, ctx.vocab = reduction, label_smoothing, vocab
        return _reduced(loss, ignored, reduction, target.shape).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        ignored, *saved = ctx.saved_tensors
        grad = _cross_entropy_grad(saved, ignored, grad_out, ctx.reduction, ctx.label_smoothing, ctx.vocab)
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axis: Axis,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross entropy of logits split over the vocabulary (last dim) across ``axis``.

    Rank r holds columns [r * V_local, (r + 1) * V_local); ``target`` holds
    global class indices with shape ``logits.shape[:-1]``.  Computes what
    ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ...)`` computes
    on the full logits (for reduction "none" the result has ``target``'s shape).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must be logits shape "
                         f"{tuple(logits.shape)} without the last (vocabulary) dim")
    if torch.is_autocast_enabled(logits.device.type):
        logits = logits.float()  # autocast runs cross_entropy in float32: its vocabulary pieces too
    if axis.size == 1:
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
        return loss.view(target.shape) if reduction == "none" else loss
    return _VocabParallelCrossEntropy.apply(logits, target, axis, ignore_index, reduction,
                                            float(label_smoothing))


# --------------------------------------------------------------------------
# Co-shard: several pieces of one op on a device, one after another
# --------------------------------------------------------------------------

def coshard(fn, chunks: int, in_dims: tuple, out_dims: int):
    """``fn`` as ``chunks`` pieces run one after another (no communication).

    The arguments at the positions ``in_dims`` names are cut into ``chunks``
    pieces along that dim (``None``: passed whole to every piece); the pieces'
    tensor results are concatenated along ``out_dims``.  Each piece is
    recomputed in backward (activation checkpointing), so only one piece's
    intermediates are alive at a time: less activation memory for one more
    forward of ``fn``.  The co-shard plan of nnScaler: n = C·|D| pieces, C
    consecutive ones on each device.
    """
    def run(*args, **kwargs):
        dims = tuple(in_dims) + (None,) * (len(args) - len(in_dims))
        cut = [arg.chunk(chunks, dim) if dim is not None else (arg,) * chunks for arg, dim in zip(args, dims)]
        results = [torch.utils.checkpoint.checkpoint(fn, *(pieces[c] for pieces in cut), use_reentrant=False,
                                                     **kwargs) for c in range(chunks)]
        return _joined(results, out_dims)
    return run


def buffers_kept_through_recompute(block: torch.nn.Module, names: tuple):
    """``context_fn`` for ``torch.utils.checkpoint`` of a block whose forward writes the buffers
    ``names`` (spectral norm's power iteration, a step counter, BatchNorm's running statistics).
    Backward's second forward starts from the values the first one started from, and the values
    the first one left are put back after it: the buffers change once a forward, as without
    recompute, and the recomputed activations are the forward's own. (The blocks of one call may
    differ: each keeps those of ``names`` it has.)"""
    def kept() -> dict:         # looked up each time: a forward may assign a buffer anew
        buffers = dict(block.named_buffers())
        return {name: buffers[name] for name in names if name in buffers}

    def contexts():
        started = {}

        @contextlib.contextmanager
        def forward():
            started.update((name, buffer.detach().clone()) for name, buffer in kept().items())
            yield

        @contextlib.contextmanager
        def recompute():
            left = {name: buffer.detach().clone() for name, buffer in kept().items()}
            with torch.no_grad():
                for name, buffer in kept().items():
                    buffer.copy_(started[name])
            try:
                yield
            finally:
                with torch.no_grad():
                    for name, buffer in kept().items():
                        buffer.copy_(left[name])
        return forward(), recompute()
    return contexts


def _joined(results: list, dim: int):
    first = results[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(results, dim)
    if isinstance(first, (tuple, list)):     # (output, None) from attention helpers
        return type(first)(_joined([r[k] for r in results], dim) for k in range(len(first)))
    return first


# --------------------------------------------------------------------------
# Data parallelism
# --------------------------------------------------------------------------

def sync_grads(params: Iterable[torch.nn.Parameter], axis: Axis, *, average: bool,
               bucket_bytes: int = 25 * 2**20, reduce_dtype: torch.dtype | None = None) -> None:
    """All-reduce ``.grad`` of every parameter over ``axis``, in buckets.

    Grads of the same dtype and device are flattened into buckets of at most
    ``bucket_bytes`` (a single larger grad gets a bucket of its own), one
    all-reduce per bucket, in the order the params are given.  Params whose
    grad is None are skipped.  With ``average`` the result is divided by
    ``axis.size``.  ``reduce_dtype`` (e.g. bfloat16): the buckets go over the
    wire in it, half the bytes, and come back into the gradients' own dtype.
    """
    if axis.size == 1:
        return
    open_buckets: dict[tuple, list[torch.Tensor]] = {}
    open_bytes: dict[tuple, int] = {}

    def flush(key):
        grads = open_buckets.pop(key)
        open_bytes.pop(key)
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = _all_reduce(flat.to(reduce_dtype) if reduce_dtype is not None else flat, axis)
        if average:
            flat.div_(axis.size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            raise NotImplementedError("sync_grads does not handle sparse gradients")
        key = (g.dtype, g.device)
        nbytes = g.numel() * g.element_size()
        if key in open_buckets and open_bytes[key] + nbytes > bucket_bytes:
            flush(key)
        open_buckets.setdefault(key, []).append(g)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes
    for key in list(open_buckets):  # dicts keep first-seen order: same on every rank
        flush(key)


# --------------------------------------------------------------------------
# Data parallelism overlapped with the backward (DDP's reducer)
# --------------------------------------------------------------------------
#
# ``overlap_grads`` puts the parameters into buckets in reverse order (the order the backward
# produces their gradients) and hooks each parameter's gradient accumulation: when the last
# gradient of a bucket is in, the bucket is flattened, its all-reduce is issued asynchronously and
# the parameters' .grad become views of the flat bucket (the separate gradients are freed), while
# the backward goes on. ``wait_grad_buckets`` (finish_backward) issues what never filled (unused
# parameters), waits for every bucket in issue order and averages. Every rank runs the same
# backward, so the buckets are issued in the same order on every rank.

def fill_missing_grads(params: list[torch.nn.Parameter], axis: Axis) -> None:
    """Give a zero ``.grad`` to each parameter that has none on this rank but has one on another
    rank of ``axis`` (a pipeline stage holds a parameter of the model's root that only another
    stage computes with), so that sync_grads reduces the same buckets on every rank; one that
    no rank computed a gradient for keeps None, as on one device."""
    if axis.size == 1 or not params:
        return
    held = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    _all_reduce(held, axis)
    for p, anywhere in zip(params, held.tolist()):
        if p.grad is None and anywhere:
            p.grad = torch.zeros_like(p)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class GradBuckets:
    """Buckets of one axis's gradients, all-reduced as the backward fills them."""

    def __init__(self, params: Iterable[torch.nn.Parameter], axis: Axis, *, average: bool,
                 bucket_bytes: int = 25 * 2**20, partial=(), partial_axis: Axis | None = None):
        seen: set[int] = set()
        params = [p for p in params if p.requires_grad and id(p) not in seen and not seen.add(id(p))]
        self.axis, self.average, self.reduce_dtype = axis, average, None
        self.buckets: list[list[torch.nn.Parameter]] = []
        size, kind = 0, None
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or kind != (p.dtype, p.device) or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size, kind = 0, (p.dtype, p.device)
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.partial = {id(p) for p in partial}    # tensor parallel: summed over partial_axis first
        self.partial_axis = partial_axis
        self.ready = [0] * len(self.buckets)
        self.in_flight: list[tuple] = []           # (bucket, handle, flat, wire dtype), issue order
        self.issued: set[int] = set()
        self.summed: set[int] = set()              # partial gradients summed in this backward
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if self.axis.size == 1 and not self.partial:
            return
        if id(p) in self.partial and self.partial_axis is not None and self.partial_axis.size > 1:
            _all_reduce(p.grad, self.partial_axis)
            self.summed.add(id(p))
        b = self.bucket_of[id(p)]
        if b in self.issued:
            raise RuntimeError("a second backward before finish_backward: the data-parallel reduction of "
                               "the first is in flight (call finish_backward after each backward)")
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self._issue(b)

    def _issue(self, b: int) -> None:
        self.issued.add(b)
        if self.axis.size == 1:
            return
        params = [p for p in self.buckets[b] if p.grad is not None]
        if not params:
            return
        wire = self.reduce_dtype or params[0].grad.dtype
        flat = torch.cat([p.grad.reshape(-1).to(wire) for p in params])
        if wire == params[0].grad.dtype:           # the gradients live on in the bucket
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        _record("all_reduce", flat)
        self.in_flight.append((params, dist.all_reduce(flat, group=self.axis.group, async_op=True), flat))

    def wait(self) -> None:
        for b in range(len(self.buckets)):         # buckets that never filled: unused parameters
            if b in self.issued:
                continue
            if self.partial_axis is not None and self.partial_axis.size > 1:
                for p in self.buckets[b]:
                    if id(p) in self.partial and id(p) not in self.summed and p.grad is not None:
                        _all_reduce(p.grad, self.partial_axis)
            self._issue(b)
        for params, handle, flat in self.in_flight:
            handle.wait()
            if self.average:
                flat.div_(self.axis.size)
            if flat.dtype != params[0].grad.dtype:
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.in_flight, self.issued, self.summed, self.ready = [], set(), set(), [0] * len(self.buckets)


def overlap_grads(model: torch.nn.Module, axis: Axis, *, average: bool, partial=(),
                  partial_axis: Axis | None = None) -> GradBuckets:
    """Hook ``model``'s gradients so that each bucket is all-reduced over ``axis`` as soon as the
    backward has filled it (``partial``: parameters whose gradient is summed over ``partial_axis``
    first, when it is ready). Once per model; ``wait_grad_buckets`` after each backward."""
    if getattr(model, "grad_buckets", None) is None:
        model.grad_buckets = GradBuckets(model.parameters(), axis, average=average, partial=partial,
                                         partial_axis=partial_axis)
    return model.grad_buckets


def wait_grad_buckets(buckets: GradBuckets, *, reduce_dtype: torch.dtype | None = None) -> None:
    """The end of the data-parallel reduction ``overlap_grads`` started in the backward: every
    gradient averaged (or summed) over the axis. ``reduce_dtype``: the wire dtype from the next
    backward on (this one's buckets are on the wire already)."""
    buckets.wait()
    buckets.reduce_dtype = reduce_dtype


# --------------------------------------------------------------------------
# ZeRO: data-parallel state in shards (Rajbhandari et al., SC'20), per unit as FSDP does it
# --------------------------------------------------------------------------
#
# The trainable parameters are cut into units: each block of a ``nn.ModuleList`` (a model's
# repeated layers) is one, and the root unit holds the rest (embeddings, head, final norm; and a
# parameter that several units use). A unit's parameters lie end to end in one flat buffer,
# padded to a multiple of the data-parallel size; data-parallel rank r owns the r-th 1/dp of each
# unit ("its chunk"), and this rank's chunks laid end to end are its shard (``ZeroShards.shard``);
# the optimizer steps the chunks (``ZeroShards.chunks``, one parameter per unit, views of the
# shard), so its state (AdamW: exp_avg, exp_avg_sq) is 1/dp of the whole. AdamW is elementwise, so stepping each shard is stepping the whole. Per stage:
#   1: the parameters stay whole; after the backward each unit's gradient is reduce-scattered
#      into its chunk's gradient and dropped; after the step every unit is all-gathered.
#   2: as 1, but each unit's gradient is reduce-scattered as soon as the backward has produced it
#      (a hook on its last gradient), and freed: a rank never holds more than a unit of full
#      gradients at once beyond what plain data parallelism holds.
#   3: as 2, and the parameters are whole only while they are used: a block is all-gathered just
#      before its forward (the next block's gather issued ahead, asynchronously), freed after it,
#      gathered again when the backward reaches it (the block before it prefetched), and freed
#      once its gradients are reduce-scattered. The root unit is gathered at the step's start
#      (before the embedding), freed while the blocks run forward, gathered again (issued as the
#      last block starts) for what follows them (final norm, head), freed when the backward enters
#      the blocks, and gathered when a backward op unpacks what autograd saved of it (the
#      embedding's, a norm's before the blocks). That needs no block to read it: the first
#      step's forward watches (``_RootReads``) and, if a block or code between blocks reads it (a
#      parameter the blocks share, a weight handed to every block), it stays whole for the step.
#      Freeing empties the flat buffer's storage, so the parameters (views of it) and what autograd
#      saved of them come back when the storage is refilled.
# With a pipeline (several backwards a step), the reduce-scatters wait for finish_backward.

class ZeroUnit:
    """One unit's parameters in one flat buffer, and where this rank's chunk of it lies."""

    def __init__(self, name: str, params: list, axis: Axis, offset: int):
        self.name, self.params, self.axis = name, params, axis
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.chunk = -(-sum(self.numels) // axis.size)     # ceil: the last chunk is padded
        self.offset = offset                               # of this unit's chunk in the shard
        self.dtype, self.device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.chunk * axis.size, dtype=self.dtype, device=self.device)
        for p, piece in zip(params, self.views(self.flat)):
            piece.copy_(p.detach())
            p.data = piece
        self.whole = True
        self.gathering = None           # (handle, this rank's chunk sent) while an all-gather is in flight
        self.ready = 0                  # gradients accumulated in this backward
        self.trained = sum(1 for p in params if p.requires_grad)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape, n in zip(self.shapes, self.numels):
            out.append(flat[offset:offset + n].view(shape))
            offset += n
        return out

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        start = self.axis.rank * self.chunk
        return flat[start:start + self.chunk]


class ZeroShards:
    """The units of a model, this rank's shard of them, and the hooks that gather, free and reduce
    them. ``stage`` 1, 2 or 3; ``overlap``: reduce-scatter in the backward (one backward a step)."""

    def __init__(self, model: torch.nn.Module, axis: Axis, stage: int, *, average: bool, overlap: bool = True,
                 partial=(), partial_axis: Axis | None = None):
        self.axis, self.stage, self.overlap = axis, stage, overlap and stage >= 2
        self.reduce_dtype, self.average = None, average
        self.partial, self.partial_axis = {id(p) for p in partial}, partial_axis
        owners: dict[int, set] = {}
        params: dict[int, torch.nn.Parameter] = {}
        blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        block_names = [f"{name}.{child}" if name else child for name, ml in blocks for child, _ in ml.named_children()]
        for name, p in model.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            unit = max((b for b in block_names if name.startswith(b + ".")), key=len, default="")
            owners.setdefault(id(p), set()).add(unit)
            params.setdefault(id(p), p)
        by_unit: dict[str, list] = {}
        for key, p in params.items():       # a parameter several units use stays in the root unit
            unit = next(iter(owners[key])) if len(owners[key]) == 1 else ""
            by_unit.setdefault(unit, []).append(p)
        if not by_unit:
            raise ValueError("ZeRO: the model has no trainable parameters")
        kinds = {(p.dtype, p.device) for p in params.values()}
        if len(kinds) > 1:
            raise ValueError(f"ZeRO: the shard needs one dtype and device, the parameters have {sorted(map(str, kinds))}")
        order = [""] + [b for b in block_names if b in by_unit]
        self.units: list[ZeroUnit] = []
        offset = 0
        for name in order:
            if name in by_unit:
                self.units.append(ZeroUnit(name or "(root)", by_unit[name], axis, offset))
                offset += self.units[-1].chunk
        self.params = [p for u in self.units for p in u.params]
        self.shard_numel = offset
        self.dtype, self.device = self.units[0].dtype, self.units[0].device
        self.shard = torch.empty(offset, dtype=self.dtype, device=self.device)
        for u in self.units:
            self.chunk_of(u, self.shard).copy_(u.mine(u.flat))
        # what the optimizer steps: a parameter per unit, each a view of the shard (one tensor for
        # all would make the optimizer's temporaries as large as the shard)
        self.chunks = [torch.nn.Parameter(self.chunk_of(u, self.shard)) for u in self.units]
        self.root = self.units[0] if self.units[0].name == "(root)" else None
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.forward_order: list[ZeroUnit] = []
        self.reducing: list[tuple] = []     # (unit, handle, chunk received, flat sent), issue order
        modules = dict(model.named_modules())
        # stage 3, one backward a step, blocks around the root unit: the root freed between its uses
        # once the first forward has shown that nothing between the first block and the last reads it
        self.root_between: bool | None = None if stage == 3 and self.overlap and self.root is not None \
            and len(self.units) > 2 else False
        self._reads: _RootReads | None = None
        self._saving = None             # saved_tensors_hooks of the forward: what autograd keeps of the root
        if stage == 3 and self.root is not None:
            model.register_forward_pre_hook(lambda m, a: self._model_pre_forward())
            model.register_forward_hook(lambda m, a, out: self._model_post_forward())
        if stage == 3:
            model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self._whole_for(m, "state_dict"))
            model.register_state_dict_post_hook(lambda m, state, prefix, meta: self._copied_out(state))
            model.register_load_state_dict_pre_hook(lambda m, *args: self._whole_for(m, "load_state_dict"))
            model.register_load_state_dict_post_hook(lambda m, keys: self._kept_in())
        self._gathered_for_state = False
        self.as_stored = 0              # >0: state_dict hands back the parameters as they are (keys only)
        for u in self.units:
            if u is not self.root and stage == 3:
                module = modules[u.name]
                module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
                module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))
            for p in u.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: self._accumulated(p))
        if stage == 3:
            for u in self.units:
                if u is not self.root:
                    self.free(u)

    # -- layout --------------------------------------------------------------------------------

    def chunk_of(self, u: ZeroUnit, shard: torch.Tensor) -> torch.Tensor:
        return shard[u.offset:u.offset + u.chunk]

    def views(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter (``self.params`` order) of ``whole``, a tensor laid out as the
        units' flat buffers end to end (``gather_whole``'s result)."""
        out, start = [], 0
        for u in self.units:
            out += u.views(whole[start:start + u.chunk * self.axis.size])
            start += u.chunk * self.axis.size
        return out

    def pieces(self, per_unit: list[torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, the part of ``per_unit`` (a tensor shaped as each unit's chunk, e.g. the
        chunks' gradients) that holds this rank's elements of it), for every parameter with
        elements in this rank's chunks."""
        out = []
        for u, chunk in zip(self.units, per_unit):
            start, offset = self.axis.rank * u.chunk, 0
            for p, n in zip(u.params, u.numels):
                low, high = max(offset, start), min(offset + n, start + u.chunk)
                if low < high:
                    out.append((p, chunk[low - start:high - start]))
                offset += n
        return out

    def grad(self) -> torch.Tensor:
        """This rank's shard of the gradients, one tensor (zeros where a unit has none)."""
        return torch.cat([c.grad if c.grad is not None else torch.zeros_like(c) for c in self.chunks])

    # -- gathering and freeing the parameters (stage 3) -----------------------------------------

    def free(self, u: ZeroUnit) -> None:
        self._settle(u)
        u.flat.untyped_storage().resize_(0)
        u.whole = False

    def prefetch(self, u: ZeroUnit) -> None:
        """Issue ``u``'s all-gather without waiting for it."""
        if u.whole or u.gathering is not None:
            return
        u.flat.untyped_storage().resize_(u.flat.numel() * u.flat.element_size())
        sent = self.chunk_of(u, self.shard).clone()
        if self.axis.size == 1:
            u.flat.copy_(sent)
            u.whole = True
            return
        _record("all_gather", sent)
        u.gathering = (dist.all_gather(list(u.flat.chunk(self.axis.size)), sent, group=self.axis.group,
                                       async_op=True), sent)

    def gather(self, u: ZeroUnit) -> None:
        """``u`` whole: its prefetched all-gather waited for, or one issued and waited for now."""
        self.prefetch(u)
        self._settle(u)

    def _settle(self, u: ZeroUnit) -> None:
        if u.gathering is not None:
            u.gathering[0].wait()
            u.gathering, u.whole = None, True

    def _pre_forward(self, u: ZeroUnit) -> None:
        self.gather(u)
        if _in_backward():              # recompute: the backward gathered it already
            return
        if u not in self.forward_order:
            if not self.forward_order and self.root_between is None:    # the first step: watch the root
                self._reads = _RootReads(self.root)
                self._reads.__enter__()
            self.forward_order.append(u)
        else:
            at = self.forward_order.index(u)
            if at + 1 < len(self.forward_order):
                self.prefetch(self.forward_order[at + 1])
            if self.root_between:
                if at == 0:
                    self.free(self.root)
                if at == len(self.forward_order) - 1:
                    self.prefetch(self.root)    # for the final norm and head, during the last block

    def _post_forward(self, u: ZeroUnit, output):
        if _in_backward():
            return output
        self.free(u)
        if self._reads is not None:
            self._reads.left += 1
        if self.root_between and u is self.forward_order[-1]:
            self.gather(self.root)
        flat, spec = torch.utils._pytree.tree_flatten(output)
        at = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return output
        entered = _BeforeUnitBackward.apply(self, u, *(flat[k] for k in at))
        for k, t in zip(at, entered):
            flat[k] = t
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def _pre_backward(self, u: ZeroUnit) -> None:
        # this backward's gradients counted afresh: a parameter the forward left unused gets none,
        # and its missing count must not carry over into the next micro-batch's backward, where
        # the unit would be freed before its own backward had run
        u.ready = 0
        self.gather(u)
        if u in self.forward_order:
            at = self.forward_order.index(u)
            if at > 0:
                self.prefetch(self.forward_order[at - 1])
            if self.root_between and at == len(self.forward_order) - 1:
                self.free(self.root)    # the head's backward is done; unpacking a saved view regathers it

    # -- the root unit between its uses (stage 3) -----------------------------------------------

    def _model_pre_forward(self) -> None:
        if _in_backward():
            return
        self.gather(self.root)          # a forward outside forward_backward (evaluation) too
        if not self.root_between or self._saving is not None:
            return
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saving.__enter__()

    def _model_post_forward(self) -> None:
        if self._saving is not None and not _in_backward():
            self._saving.__exit__(None, None, None)
            self._saving = None
        if self._reads is not None:     # the first forward: free the root from now on if no block read it
            self._reads.__exit__(None, None, None)
            blocks = len(self.forward_order)
            self.root_between = blocks >= 2 and all(left == blocks for left in self._reads.seen)
            self._reads = None

    def _pack(self, t: torch.Tensor):
        # a view of the root unit's buffer (its weight, saved by the embedding or the head): marked,
        # so that the backward gathers the root before handing it back; anything else as it is
        # (detached: a saved output that held its own grad_fn would be a reference cycle)
        if self.root.whole and t.layout is torch.strided and t.untyped_storage().data_ptr() == \
                self.root.flat.untyped_storage().data_ptr():
            return _RootView(t.detach())
        return t.detach()

    def _unpack(self, packed):
        if isinstance(packed, _RootView):
            self.gather(self.root)
            return packed.tensor
        return packed

    # -- state dicts (stage 3): the whole parameters, as without ZeRO --------------------------------

    def _whole_for(self, model, what: str) -> None:
        if self.as_stored or all(u.whole for u in self.units):
            return                      # inside whole_parameters (or keys only): as they are
        if self.axis.size > 1 and not dist.is_initialized():
            raise RuntimeError(f"ZeRO-3: {what}() gathers the whole parameters over the data-parallel ranks, "
                               "which needs the process groups (setup())")
        all_gather_params(self, self.axis)
        self._gathered_for_state = True

    def _copied_out(self, state: dict) -> None:
        if not self._gathered_for_state:
            return
        flats = {u.flat.untyped_storage().data_ptr() for u in self.units}
        for key, t in state.items():
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in flats:
                state[key] = t.detach().clone()     # the buffers are emptied again below
        free_params(self)
        self._gathered_for_state = False

    def _kept_in(self) -> None:
        if self._gathered_for_state:
            keep_params(self)
            free_params(self)
            self._gathered_for_state = False

    # -- reducing the gradients ----------------------------------------------------------------

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if self.overlap and id(p) in self.partial and self.partial_axis is not None and self.partial_axis.size > 1:
            _all_reduce(p.grad, self.partial_axis)      # tensor parallel: the partial gradient summed first
        u = self.unit_of[id(p)]
        u.ready += 1
        if u.ready < u.trained:
            return
        u.ready = 0
        if self.overlap:
            self.reduce(u)
        if self.stage == 3 and u is not self.root:
            self.free(u)

    def reduce(self, u: ZeroUnit) -> None:
        """Issue the reduce-scatter of ``u``'s gradients (their full copies dropped); the previous
        one is waited for first, so one unit's full gradients are in flight at a time."""
        self._wait_reduced()
        grads = [p.grad for p in u.params]
        if all(g is None for g in grads):
            return
        wire = self.reduce_dtype or self.dtype
        flat = torch.zeros(u.chunk * self.axis.size, dtype=wire, device=self.device)
        for g, piece in zip(grads, u.views(flat)):
            if g is not None:
                piece.copy_(g)
        for p in u.params:
            p.grad = None
        if self.axis.size == 1:
            self.reducing.append((u, None, flat, flat))
            return
        received = torch.empty(u.chunk, dtype=wire, device=self.device)
        _record("reduce_scatter", flat)
        handle = dist.reduce_scatter(received, list(flat.chunk(self.axis.size)), group=self.axis.group,
                                     async_op=True)
        self.reducing.append((u, handle, received, flat))

    def _wait_reduced(self) -> None:
        for u, handle, received, _ in self.reducing:
            if handle is not None:
                handle.wait()
            else:
                received = u.mine(received)
            stepped = self.chunks[self.units.index(u)]
            if stepped.grad is None:
                stepped.grad = torch.zeros_like(stepped)
            chunk = stepped.grad
            chunk.add_(received.to(self.dtype).div_(self.axis.size) if self.average else received.to(self.dtype))
        self.reducing = []


class _RootView:
    """What autograd saved of the root unit's parameters, marked for ZeroShards._unpack."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _RootReads(torch.overrides.TorchFunctionMode):
    """The first ZeRO-3 forward, from the first block on: for each torch call that reads the root
    unit's buffer (a parameter, a view of one), how many blocks had finished (``left``) by then."""

    def __init__(self, root: ZeroUnit):
        super().__init__()
        self.storage = root.flat.untyped_storage().data_ptr()
        self.left = 0
        self.seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and \
                    t.untyped_storage().data_ptr() == self.storage:
                self.seen.add(self.left)
        return func(*args, **kwargs)


class _BeforeUnitBackward(torch.autograd.Function):
    """Identity on a unit's outputs; in backward, before the unit's own backward runs, the unit is
    gathered again (and the unit before it prefetched)."""

    @staticmethod
    def forward(ctx, shards, unit, *outputs):
        ctx.shards, ctx.unit = shards, unit
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.shards._pre_backward(ctx.unit)
        return (None, None, *grads)


def zero_shards(model: torch.nn.Module, axis: Axis, *, stage: int, average: bool, overlap: bool = True,
                partial=(), partial_axis: Axis | None = None) -> ZeroShards:
    """Cut ``model``'s parameters into units for ZeRO ``stage`` over ``axis`` and hook them; the
    optimizer then steps ``.shard`` only. No communication: every rank starts from the same
    parameters. ``average``: the gradients' mean over the axis, else their sum. ``overlap``:
    reduce-scatter each unit in the backward (False with pipelines, whose several backwards a
    step accumulate first); then ``partial`` parameters' gradients are summed over
    ``partial_axis`` (tensor parallel) in the backward too."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage}")
    return ZeroShards(model, axis, stage, average=average, overlap=overlap, partial=partial,
                      partial_axis=partial_axis)


def reduce_scatter_grads(shards: ZeroShards, axis: Axis, *, average: bool = True,
                         reduce_dtype: torch.dtype | None = None) -> None:
    """This rank's shard of the data-parallel gradients (their mean with ``average``, else their
    sum) as the gradients of ``shards.chunks``: the units the backward has not reduce-scattered yet are now
    (all of them at stage 1 and with pipelines), and every reduce-scatter in flight is waited for.
    From stage 2 on the full gradients are dropped. ``reduce_dtype``: the dtype on the wire (for
    the reduce-scatters issued in the backward: from the next one on)."""
    shards.average = average
    shards.reduce_dtype = reduce_dtype
    for u in shards.units:
        if any(p.grad is not None for p in u.params):
            shards.reduce(u)
        u.ready = 0
    shards._wait_reduced()
    for stepped in shards.chunks:
        if stepped.grad is None:
            stepped.grad = torch.zeros_like(stepped)


def all_gather_params(shards: ZeroShards, axis: Axis, units: str = "all") -> None:
    """All-gather this rank's chunks into the units' flat buffers, which the parameters view:
    ``units`` "all" (stages 1 and 2 after the step; a checkpoint), or "root" (stage 3, before the
    forward: the unit outside the blocks, whole for the step; each block's hooks gather it)."""
    chosen = shards.units if units == "all" else [u for u in shards.units if u is shards.root]
    for u in chosen:
        shards._settle(u)
        u.whole = False             # the shard is what is current: gathered anew even where whole
        shards.prefetch(u)
    for u in chosen:
        shards._settle(u)


def free_params(shards: ZeroShards) -> None:
    """Stage 3: drop every unit's whole parameters, keeping only this rank's shard."""
    for u in shards.units:
        shards.free(u)


def state_dict_keys(model: torch.nn.Module) -> list[str]:
    """The keys of ``model.state_dict()``, without ZeRO-3 gathering anything for them."""
    shards = getattr(model, "zero_shards", None)
    if shards is not None:
        shards.as_stored += 1
    try:
        return list(model.state_dict(keep_vars=True))
    finally:
        if shards is not None:
            shards.as_stored -= 1


def keep_params(shards: ZeroShards) -> None:
    """The whole parameters (written into, a checkpoint loaded) back into this rank's shard."""
    for u in shards.units:
        shards.chunk_of(u, shards.shard).copy_(u.mine(u.flat))


def gather_whole(shards: ZeroShards, shard: torch.Tensor, *, record: bool = True) -> torch.Tensor:
    """Every rank's ``shard``-shaped tensor (optimizer state, gradient) made whole, laid out as
    the units' flat buffers end to end (``shards.views`` cuts it into parameters)."""
    dp = shards.axis.size
    gathered = torch.empty(shards.shard_numel * dp, dtype=shard.dtype, device=shard.device)
    pieces = list(gathered.chunk(dp))
    if dp == 1:
        pieces[0].copy_(shard)
    else:
        if record:
            _record("all_gather", shard)
        dist.all_gather(pieces, shard.contiguous(), group=shards.axis.group)
    whole = torch.empty_like(gathered)
    start = 0
    for u in shards.units:
        for r in range(dp):
            whole[start + r * u.chunk:start + (r + 1) * u.chunk] = pieces[r][u.offset:u.offset + u.chunk]
        start += u.chunk * dp
    return whole


def shard_of(shards: ZeroShards, whole: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``whole`` (laid out as gather_whole's result)."""
    out, start = [], 0
    for u in shards.units:
        out.append(u.mine(whole[start:start + u.chunk * shards.axis.size]))
        start += u.chunk * shards.axis.size
    return torch.cat(out)


# --------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint's view of a rank's pieces
# --------------------------------------------------------------------------

class CheckpointChunks(torch.Tensor):
    """A single-device tensor of ``shape`` of which this rank holds ``pieces``, [(offsets, tensor)]:
    rectangular blocks at those offsets (a tensor-parallel shard of fused q|k|v is one block per
    q, k and v).  torch.distributed.checkpoint saves each piece under the tensor's name and its
    offsets, and loads into the pieces in place whatever blocks the checkpoint was written in.
    Holds no storage of its own: computing with it raises."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, pieces):
        first = pieces[0][1]
        chunks = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)
        chunks.pieces = [(torch.Size(offsets), piece) for offsets, piece in pieces]
        return chunks

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a checkpoint's pieces: use the tensors they are views of")

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets, piece.shape) for offsets, piece in self.pieces]

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, piece.shape),
                                                      properties=TensorProperties.create_from_tensor(piece),
                                                      size=self.shape))
                for offsets, piece in self.pieces]

    def __get_tensor_shard__(self, index):
        return next(piece for offsets, piece in self.pieces if offsets == index.offset)

# --------------------------------------------------------------------------
# Pipeline point-to-point (blocking, global ranks, no autograd)
# --------------------------------------------------------------------------

def _p2p_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send(x: torch.Tensor, dst: int) -> None:
    x = x.contiguous()
    _record("send", x)
    dist.send(x, dst)


def _recv(shape, dtype: torch.dtype, src: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=_p2p_device())
    _record("recv", None)  # bytes are counted once, on the sending side
    dist.recv(buf, src)
    return buf


def send_forward(x: torch.Tensor, dst: int) -> None:
    """Send an activation to the next pipeline stage (global rank ``dst``)."""
    _send(x.detach(), dst)


def recv_forward(shape, dtype: torch.dtype, src: int) -> torch.Tensor:
    """Receive an activation from the previous pipeline stage (global rank ``src``)."""
    return _recv(shape, dtype, src)


def send_backward(grad: torch.Tensor, dst: int) -> None:
    """Send a gradient to the previous pipeline stage (global rank ``dst``)."""
    _send(grad.detach(), dst)


def recv_backward(shape, dtype: torch.dtype, src: int) -> torch.Tensor:
    """Receive a gradient from the next pipeline stage (global rank ``src``)."""
    return _recv(shape, dtype, src)


# --------------------------------------------------------------------------
# Pipeline stages: which stage runs now, and what crosses a stage boundary
# --------------------------------------------------------------------------

class PipelineState:
    """The stage this process is running (set by train.py's schedule loop before each step)."""

    def __init__(self) -> None:
        self.stage = 0
        self.stages = 1
        self.inbox: tuple = ()
        # recycling (3F1B): the pass of the recycling loop this action runs (None: no schedule
        # runs passes, as in the dry run: the last pass only), how many there are, and what the
        # last stage handed back for it (the first stage's input to a later pass)
        self.cycle: int | None = None
        self.passes = 1
        self.recycled: tuple | None = None
        self.first_blocks: dict[int, int] = {}     # stage -> index of its first block (build() notes it)
        # a loop whose iterations run blocks that are lists of modules (pp_iterations): stage ->
        # (first, stop) of its blocks, and the iterations the loop runs in all (build() notes them)
        self.iterations: dict[int, tuple[int, int]] = {}
        self.iteration_count: int | None = None
        # the model of the stage running now: a module handed over stands for the module at the
        # same path in the receiving stage's model (set by train.py's schedule loop per action)
        self.model: torch.nn.Module | None = None


PIPE = PipelineState()


class StageBoundary(Exception):
    """Raised by pp_handoff on every stage but the last: this stage's forward ends there."""

    def __init__(self, values: tuple):
        super().__init__("pipeline stage boundary")
        self.values = values


def pp_first_stage() -> bool:
    return PIPE.stage == 0


def pp_stage() -> int:
    """The model stage this forward runs (a function cut between its statements runs its part)."""
    return PIPE.stage


def pp_first_block(stage_blocks: dict | None = None) -> int:
    """The index in the whole model of this stage's first block (STAGE_BLOCKS: per stage of this
    file, its range of blocks; a mirrored file, shared by the stages, reads what build() noted),
    where the model counts its blocks (`enumerate(self.layers)`)."""
    if stage_blocks is None:
        return PIPE.first_blocks.get(PIPE.stage, 0)
    blocks = stage_blocks.get(PIPE.stage)
    return blocks[0] if blocks else 0


def pp_iterations(iterable, owner=None):
    """The iterations of a loop over blocks that are lists of modules (`for norm, block, residual in
    self.layers`, zipped with per-layer lists) that this stage runs: iteration k runs block k, and
    this stage holds blocks first..stop-1 (the others are hollow here). Every iteration is counted,
    so the loop's own index and the sequences zipped with the blocks stay the whole model's; a loop
    that runs another number of iterations than there are blocks is refused. `owner`: the module
    whose method this is, when it is not the only one running the loop: its part in a chain of
    trunks (pp_trunk), or, when the stages cut another module's call, every iteration."""
    part = getattr(owner, "pp_trunk", None)
    if part is not None:
        (first, stop), total = part[1:3], getattr(owner, "pp_iteration_count", None)
    elif owner is not None and not pp_cuts(owner):
        (first, stop), total = (0, None), None
    else:
        (first, stop), total = PIPE.iterations.get(PIPE.stage, (0, None)), PIPE.iteration_count
    count = 0
    for count, item in enumerate(iterable, 1):
        if first < count and (stop is None or count <= stop):
            yield item
    if total is not None and count != total:
        raise RuntimeError(f"the loop over the blocks ran {count} iterations; the pipeline stages were cut for "
                           f"{total}, one block each")


def pp_cuts(module) -> bool:
    """Whether this call of a function that loops over blocks is the one the stages cut (one stack
    class can run the encoder's blocks and the decoder's: build() marks the trunk's owner)."""
    return getattr(module, "pp_cut_here", False)


def pp_receive() -> tuple:
    """The values the previous stage handed over (train.py received them before the forward)."""
    return PIPE.inbox


class HandoffUnsendable(TypeError):
    """A stage would hand over an object holding tensors that need gradients which the hand-off
    cannot carry as tensors: pickled, they would reach the next stage without their gradients.
    `index`: the value's position among those handed over."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def _unsendable(value) -> str | None:
    """The type of an object inside handed-over values that holds tensors needing gradients and is
    none of what a hand-off carries as such (tensors, tuples, lists, dicts and dataclasses of them,
    the model's modules, plain values), or None."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return None
    if isinstance(value, (tuple, list, dict)):
        return next(filter(None, map(_unsendable, value.values() if isinstance(value, dict) else value)), None)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return next(filter(None, map(_unsendable, _attributes(value).values())), None)
    if isinstance(value, torch.nn.Module) and _module_path(value) is not None:
        return None
    needs_grad = []

    class Tensors(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                needs_grad.append(obj.requires_grad)
                return len(needs_grad)
            return None
    try:
        Tensors(io.BytesIO()).dump(value)
    except Exception:       # noqa: BLE001 - what cannot be pickled fails where it is sent, as before
        return None
    return type(value).__name__ if any(needs_grad) else None


def _check_sendable(values: tuple) -> None:
    for k, value in enumerate(values):
        kind = _unsendable(value)
        if kind is not None:
            raise HandoffUnsendable(f"hand-off value {k + 1} is or holds a {kind} object with tensors that need "
                                    "gradients, which a pipeline hand-off cannot carry (it carries tensors, tuples, "
                                    "lists, dicts and dataclasses of them, the model's modules and plain values)", k)


def pp_handoff(*values):
    """End this stage's forward with `values` for the next stage; a no-op on the last stage."""
    if PIPE.stage < PIPE.stages - 1:
        raise StageBoundary(values)


def _replayed_calls(owner) -> list:
    """The calls that changed module state which this stage ran or replayed on `owner`, in order
    (kept on the module itself, outside its attributes, parameters and state dict)."""
    return owner.__dict__.setdefault("_pp_replayed_calls", [])


def pp_replayed(owner, method: str, *args, **kwargs):
    """Run `owner.<method>(*args, **kwargs)`, a call that changes the state of modules later
    stages hold (BigBird's prologue switching its layers' attention type), and note it: every
    later stage runs it too, once, before its blocks (pp_replay). The same call again is noted once."""
    calls = _replayed_calls(owner)
    call = (method, args, kwargs)
    if not calls or calls[-1] != call:
        calls.append(call)
    target = owner
    for name in method.split("."):
        target = getattr(target, name)
    return target(*args, **kwargs)


def pp_replays(owner) -> list:
    """Every state-changing call noted on this stage so far, handed on with the activations (a
    list that only grows, so its hand-off metadata stays the same once the call has run)."""
    return list(_replayed_calls(owner))


def pp_replay(owner, calls) -> None:
    """Run the calls the previous stage handed over that this stage has not run yet, in order."""
    done = _replayed_calls(owner)
    for method, args, kwargs in calls[len(done):]:
        done.append((method, tuple(args), dict(kwargs)))
        target = owner
        for name in method.split("."):
            target = getattr(target, name)
        target(*args, **kwargs)


# Chained trunks: the stages cut several block lists run one after the other (an encoder's,
# then a decoder's) as one chain. build() gives each list's owner (the module whose method loops
# over it) this stage's part in it, `pp_trunk` = (role, first, stop, hands_on): "enter" (run the
# code before its blocks), "receive" (start there from the hand-off) or "skip" (start after it).
# A call of a module without one (a call the stages do not cut) runs whole.

def pp_skips(owner) -> bool:
    """Whether this stage starts after these blocks: it does not run them, and the function returns
    what it returned on the stage that did (pp_passed)."""
    part = getattr(owner, "pp_trunk", None)
    return part is not None and part[0] == "skip"


def pp_passed(owner):
    """What the trunk's function returned on an earlier stage, handed on with the activations."""
    return PIPE.inbox[-1][owner.pp_owner]


def pp_enters(owner) -> bool:
    """Whether this stage runs the code before these blocks (it reached them first)."""
    part = getattr(owner, "pp_trunk", None)
    return part is None or part[0] == "enter"


def pp_received(owner) -> tuple:
    """The values the previous stage handed over, before the blocks of this stage."""
    return PIPE.inbox[:-1]


def pp_first_block_of(owner) -> int:
    """The index in its list of this stage's first block of the list (`enumerate(self.layers)`)."""
    part = getattr(owner, "pp_trunk", None)
    return part[1] if part is not None else 0


def pp_hand_on(owner, *values):
    """End this stage's forward after its last block, in this list: hand `values` on, with what the
    trunks this stage or earlier ones finished returned (later stages skip those trunks)."""
    part = getattr(owner, "pp_trunk", None)
    if part is not None and part[3]:
        returned = {**(PIPE.inbox[-1] if PIPE.inbox else {}), **owner.pp_returned}
        _check_sendable(values)
        raise StageBoundary((*values, returned))


def pp_returns(owner, value):
    """Note what a trunk's function returns on this stage: later stages skipping it return the same."""
    if getattr(owner, "pp_trunk", None) is not None:
        owner.pp_returned[owner.pp_owner] = value
    return value


class RecycleBoundary(Exception):
    """Raised by pp_recycle on the last stage after every pass of the recycling loop but the last:
    this forward ends, and the values go back to the first stage for the next pass."""

    def __init__(self, values: tuple):
        super().__init__("recycling: end of a pass")
        self.values = values


def pp_passes(passes, after: int = 0):
    """Recycling (3F1B): of the loop's passes, the one this pipeline action runs. `after`: passes
    the forward runs after the loop (the last one, with gradient); their actions run no pass of it."""
    passes = list(passes)
    if PIPE.cycle is None:          # the last pass only
        return [] if after else passes[-1:]
    if len(passes) + after != PIPE.passes:
        runs = f"the recycling loop runs {len(passes)} passes" + (f" and {after} follows it" if after else "")
        raise RuntimeError(f"{runs}; the schedule was made for {PIPE.passes}")
    return passes[PIPE.cycle:PIPE.cycle + 1]


def pp_recycled(*values):
    """The values a pass starts from: on the first stage, from the second pass on, what the last
    stage handed back at the end of the pass before; elsewhere the values themselves (the later
    stages receive their inputs at the cut instead)."""
    if PIPE.stage == 0 and PIPE.recycled is not None:
        values = PIPE.recycled
    return values[0] if len(values) == 1 else values


def pp_recycle(*values):
    """End a pass: the last stage hands `values` back to the first (every pass but the last)."""
    if PIPE.stage == PIPE.stages - 1 and PIPE.cycle is not None and PIPE.cycle < PIPE.passes - 1:
        raise RecycleBoundary(values)


class _ModuleRef:
    """Stands for a module of the sending stage's model inside handed-over values (a tuple of the
    layers a loop zips): the receiving stage reads its own module at the same path."""

    def __init__(self, path: str):
        self.path = path

    def __eq__(self, other):
        return isinstance(other, _ModuleRef) and other.path == self.path

    def __hash__(self):
        return hash(self.path)


class _Fields:
    """Stands for a dataclass instance inside handed-over values (an attention's intermediates):
    its fields walked as a container's items, so that the tensors in it are sent as tensors."""

    def __init__(self, cls: type, fields: dict):
        self.cls, self.fields = cls, fields

    def __eq__(self, other):
        return isinstance(other, _Fields) and (other.cls, other.fields) == (self.cls, self.fields)

    def rebuilt(self, fields: dict):
        value = self.cls.__new__(self.cls)
        for name, item in fields.items():
            object.__setattr__(value, name, item)
        return value


def _attributes(value) -> dict:
    """A dataclass instance's fields, and the attributes set on it besides (`inter.layer_type = "a"`)."""
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    return {**fields, **getattr(value, "__dict__", {})}


def _module_path(module: torch.nn.Module) -> str | None:
    """The path of `module` in the model of the stage running now, or None."""
    model = PIPE.model
    if model is None:
        return None
    paths = model.__dict__.get("_pp_module_paths")
    if paths is None:
        paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        model.__dict__["_pp_module_paths"] = paths
    return paths.get(id(module))


class _TensorSlot:
    """Stands for a tensor inside a pickled structure of handed-over values."""

    def __init__(self, index: int, tensor: torch.Tensor):
        self.index = index
        self.shape, self.dtype, self.requires_grad = tuple(tensor.shape), tensor.dtype, tensor.requires_grad
        self.device_type = tensor.device.type


def _landed(buffer: torch.Tensor, slot: _TensorSlot) -> torch.Tensor:
    """A received buffer on the kind of device its slot's tensor lives on: gloo receives into
    host memory, but a stage on a GPU computes with (and takes gradients for) CUDA tensors."""
    if buffer.device.type == slot.device_type:
        return buffer
    index = torch.cuda.current_device() if slot.device_type == "cuda" else None
    return buffer.to(torch.device(slot.device_type, index))


def _slots(value, tensors: list, seen: dict | None = None):
    """`value` with a _TensorSlot for each tensor, `tensors` in slot order. A tensor met twice (a
    decoder's encoder states, also inside the encoder's output) is one slot, sent once."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            tensors.append(value)
            seen[id(value)] = _TensorSlot(len(tensors) - 1, value)
        return seen[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_slots(v, tensors, seen) for v in value)
    if isinstance(value, dict):
        return _like(value, {k: _slots(v, tensors, seen) for k, v in value.items()})
    if isinstance(value, torch.nn.Module) and _module_path(value) is not None:
        return _ModuleRef(_module_path(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _Fields(type(value), {k: _slots(v, tensors, seen) for k, v in _attributes(value).items()})
    return value


def _filled(value, tensors: list):
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, (tuple, list)):
        return type(value)(_filled(v, tensors) for v in value)
    if isinstance(value, dict):
        return _like(value, {k: _filled(v, tensors) for k, v in value.items()})
    if isinstance(value, _ModuleRef):
        if PIPE.model is None:
            raise RuntimeError(f"a hand-off holds the module {value.path}, and no stage's model is set to read it from")
        return PIPE.model.get_submodule(value.path)
    if isinstance(value, _Fields):
        return value.rebuilt({k: _filled(v, tensors) for k, v in value.fields.items()})
    return value


class _Received(torch.autograd.Function):
    """A received tensor as the stage's code sees it: a non-leaf sharing the leaf's storage. An
    in-place op first thing in a stage (a block opening with ReLU(inplace=True)) is refused on a
    leaf that needs gradients; a clone would copy every hand-off. The leaf keeps the .grad sent back."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _received(structure, tensors: list):
    """`structure` filled with the received `tensors`, those needing gradients as _Received aliases."""
    return _filled(structure, [_Received.apply(t) if t.requires_grad else t for t in tensors])


def _like(value: dict, items: dict) -> dict:
    """`items` as `value`'s own dict class where it is built from keywords (transformers'
    ModelOutput keeps its attributes: `out.last_hidden_state`), else a plain dict."""
    if type(value) is dict:
        return items
    try:
        return type(value)(**items)
    except TypeError:
        return items


def _tag(kind: int, stage: int, micro: int, piece: int) -> int:
    return ((kind * 256 + stage) * 16384 + micro) * 64 + piece


# --------------------------------------------------------------------------
# Pipeline hand-offs: metadata once, then one message per tensor, posted in batches
# --------------------------------------------------------------------------
#
# * Metadata once.  Besides tensor data, a forward hand-off holds metadata: its structure,
#   its plain Python values, and each tensor's shape, dtype and requires_grad.  It is the
#   same for every micro-batch with the same input shapes.  The first hand-off for a given
#   (peer, stage, input shapes) sends the metadata as a header: an int64 size, then the
#   pickled structure.  Both sides cache it under that key.  Later hand-offs send only the
#   tensors, one message each.  The input shapes are shape_key(micro-batch), which every
#   rank of the pipeline holds.  So a smaller last micro-batch, or a step with other shapes,
#   gets its own header.  The receiver rebuilds every container (tuple, list, dict) for
#   every hand-off (_filled), so no two micro-batches share a list or dict.
# * Only plain metadata is cached.  A hand-off that holds any other object (a transformers
#   DynamicCache, which carries tensors the header pickles with their data) sends its header
#   with every hand-off.  Both sides see this in the first header, so they agree without a
#   message.
# * A mismatch is refused.  A sender whose metadata differs from the cached one under the
#   same key (shapes or plain values that depend on the data, not only on the input shapes)
#   raises HandoffMismatch.  Otherwise the receiver would misread the message.  The fix is
#   HANDOFF_METADATA = "every" (in this file, the same on every rank), which sends the
#   header with every hand-off.
# * Gradients need no header.  They have the shapes and dtypes of the tensors they belong
#   to, which the receiving side sent itself.
# * Batched.  activation_sends / activation_recvs / grad_sends / grad_recvs only build
#   torch.distributed.P2POp lists.  post_p2p posts them with one dist.batch_isend_irecv.
#   train.py posts each action's sends together with the next action's receives.  It waits
#   for the receives (wait_activations / wait_grads) right before the action that needs
#   them, and for the sends at the end of the step.  A rank therefore blocks at the same
#   points as with a blocking recv before each action, so a schedule that the simulator
#   finds deadlock-free stays so.

HANDOFF_METADATA = "once"      # or "every": a header with every forward hand-off
_SENT_HEADERS: dict = {}       # (dst, stage, key) -> (signature, structure) sent (sender's cache)
_RECEIVED_HEADERS: dict = {}   # (src, stage, key) -> (structure, tensor slots) received (receiver's cache)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


class HandoffMismatch(RuntimeError):
    """A stage handed over values whose metadata differs from the cached header."""


def shape_key(value):
    """What the hand-off metadata is cached under: the shapes and dtypes of a micro-batch's
    tensors and its plain values.  Every rank of a pipeline computes it from the same
    micro-batch, so sender and receiver agree on it without a message."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(shape_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, shape_key(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _cacheable(structure) -> bool:
    """Whether a hand-off's metadata can be cached: tensors, containers, dataclasses, modules of the
    model and plain values only."""
    if isinstance(structure, (_TensorSlot, _ModuleRef, _PLAIN)):
        return True
    if isinstance(structure, _Fields):
        return _cacheable(structure.fields)
    if isinstance(structure, (tuple, list)):
        return all(_cacheable(v) for v in structure)
    if isinstance(structure, dict):
        return all(_cacheable(k) and _cacheable(v) for k, v in structure.items())
    return False


def _signature(value, tensors: list, seen: dict | None = None):
    """The metadata of handed-over values as a tuple to compare with ==, collecting their tensors
    on the way.  The sender checks each hand-off against the cached header with it: cheaper than
    pickling the structure each time.  Types are part of it, so 1, 1.0 and True differ (as in the
    pickled header); floats compare by repr, so a NaN matches itself.  A tensor met again (a UNet's
    skip, in the list of skips and on its own) is collected once, as _slots sends it, and its
    signature names the slot it shares."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return ("again", seen[id(value)])
        seen[id(value)] = len(tensors)
        tensors.append(value)
        return (torch.Tensor, tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_signature(v, tensors, seen) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _signature(v, tensors, seen)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((k, _signature(v, tensors, seen)) for k, v in _attributes(value).items()))
    if isinstance(value, (float, complex)):
        return (type(value), repr(value))
    return (type(value), value)


def _clear_handoff_cache() -> None:
    _SENT_HEADERS.clear()
    _RECEIVED_HEADERS.clear()


class Incoming:
    """One hand-off this rank will receive.  It holds the irecv operations (posted by
    post_p2p with this rank's sends), their requests once posted, and what wait_activations /
    wait_grads need to rebuild the values.  ``structure`` is None while the header is still to
    come."""

    def __init__(self, src: int, kind: int, stage: int, micro: int, structure=None, slots=None,
                 key=None):
        self.src, self.kind, self.stage, self.micro, self.key = src, kind, stage, micro, key
        self.structure = structure
        self.buffers: list = []
        self.ops: list = []
        self.requests: list = []
        if slots is not None:
            self._expect(slots)

    def _expect(self, slots) -> None:
        """irecv operations for tensors of these (shape, dtype, requires_grad) slots."""
        self.slots = slots
        device = _p2p_device()
        self.buffers = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
        self.ops = [dist.P2POp(dist.irecv, b, self.src, tag=_tag(self.kind, self.stage, self.micro, 2 + k))
                    for k, b in enumerate(self.buffers)]


def _header_pieces(structure_bytes: bytes) -> list:
    payload = torch.frombuffer(bytearray(structure_bytes), dtype=torch.uint8)
    return [torch.tensor([payload.numel()], dtype=torch.int64), payload]


def _mismatch(old, new) -> str:
    """How the new metadata differs from the cached one, in words."""
    old_slots, new_slots = [], []
    _slots_of(old, old_slots)
    _slots_of(new, new_slots)
    if len(old_slots) != len(new_slots):
        return f"{len(old_slots)} tensor(s) first, now {len(new_slots)}"
    for k, (a, b) in enumerate(zip(old_slots, new_slots)):
        for what in ("shape", "dtype", "requires_grad"):
            if getattr(a, what) != getattr(b, what):
                return f"tensor {k}: {what} {getattr(a, what)} first, now {getattr(b, what)}"
    return "the structure or a plain value differs"


def activation_sends(values: tuple, dst: int, stage: int, micro: int, key=()) -> list:
    """The isend operations that hand `values` to pipeline stage `stage` on global rank `dst`:
    the header if (dst, stage, key) has not been sent before (or HANDOFF_METADATA is "every"),
    then one per tensor.  Nothing is sent until post_p2p posts them."""
    tensors: list = []
    cache_key = (dst, stage, key)
    cached = None if HANDOFF_METADATA == "every" else _SENT_HEADERS.get(cache_key)
    pieces = [None, None]
    if cached is None:
        structure = _slots(values, tensors)
        pieces = _header_pieces(pickle.dumps(structure))
        if HANDOFF_METADATA != "every" and _cacheable(structure):
            _SENT_HEADERS[cache_key] = (_signature(values, []), structure)
        COUNTERS["handoff_headers"] += 1
    elif _signature(values, tensors) != cached[0]:
        # the receiver would read these tensors with the cached shapes: refuse before sending
        raise HandoffMismatch(
            f"pipeline hand-off to stage {stage} (micro-batch {micro}): the values differ from "
            f"those of an earlier micro-batch with the same input shapes "
            f"({_mismatch(cached[1], _slots(values, []))}). The receiver "
            f"would read them with the cached metadata. If it depends on the data, set "
            f"HANDOFF_METADATA = \"every\" in _comm.py (on every rank) to send them with every hand-off.")
    pieces += [t.detach().contiguous() for t in tensors]
    device, ops = _p2p_device(), []
    for k, piece in enumerate(pieces):
        if piece is not None:
            _record("send", piece)
            ops.append(dist.P2POp(dist.isend, piece.to(device), dst, tag=_tag(0, stage, micro, k)))
    return ops


def activation_recvs(src: int, stage: int, micro: int, key=()) -> Incoming:
    """The hand-off stage `stage` will receive from global rank `src`: irecv operations for its
    tensors when the header for (src, stage, key) is cached, else none yet (wait_activations
    receives the header first)."""
    cached = None if HANDOFF_METADATA == "every" else _RECEIVED_HEADERS.get((src, stage, key))
    if cached is None:
        return Incoming(src, 0, stage, micro, key=key)
    structure, slots = cached
    return Incoming(src, 0, stage, micro, structure, slots, key)


def grad_sends(tensors: list, dst: int, stage: int, micro: int) -> list:
    """The isend operations that send the gradients of received tensors back to the previous
    stage (global rank `dst`): one per tensor that needed a gradient."""
    ops = []
    for k, t in enumerate(x for x in tensors if x.requires_grad):
        grad = (t.grad if t.grad is not None else torch.zeros_like(t)).contiguous()
        _record("send", grad)
        ops.append(dist.P2POp(dist.isend, grad.to(_p2p_device()), dst, tag=_tag(1, stage, micro, 2 + k)))
    return ops


def grad_recvs(outputs: list, src: int, stage: int, micro: int) -> Incoming:
    """The gradients this stage will receive from the next one (global rank `src`, running
    `stage`) for its outputs that need them: their shapes and dtypes, no header."""
    slots = [_TensorSlot(k, t) for k, t in enumerate(x for x in outputs if x.requires_grad)]
    return Incoming(src, 1, stage, micro, slots=slots)


def post_p2p(sends: list, incoming: Incoming | None = None) -> list:
    """Post this rank's sends and the receives of `incoming` together, with one
    dist.batch_isend_irecv.  Returns the send requests (wait on them before the step ends);
    the receive requests stay with `incoming`."""
    receives = incoming.ops if incoming is not None else []
    if not sends and not receives:
        return []
    requests = dist.batch_isend_irecv(sends + receives)
    if incoming is not None:
        incoming.requests, incoming.ops = requests[len(sends):], []
    return requests[:len(sends)]


def _recv_header(incoming: Incoming) -> bytes:
    size = torch.empty(1, dtype=torch.int64, device=_p2p_device())
    dist.recv(size, incoming.src, tag=_tag(0, incoming.stage, incoming.micro, 0))
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=_p2p_device())
    dist.recv(payload, incoming.src, tag=_tag(0, incoming.stage, incoming.micro, 1))
    return payload.cpu().numpy().tobytes()


def wait_activations(incoming: Incoming) -> tuple[tuple, list]:
    """Wait for a posted hand-off; return its values and its tensors.  When no header was
    cached, receive the header now (two blocking recvs), cache it, then the tensors.  Tensors
    that needed gradients on the sender need them here."""
    if incoming.structure is None:
        incoming.structure = pickle.loads(_recv_header(incoming))
        slots: list = []
        _slots_of(incoming.structure, slots)
        if HANDOFF_METADATA != "every" and _cacheable(incoming.structure):
            _RECEIVED_HEADERS[(incoming.src, incoming.stage, incoming.key)] = (incoming.structure, slots)
        incoming._expect(slots)
        incoming.requests = dist.batch_isend_irecv(incoming.ops) if incoming.ops else []
        incoming.ops = []
    for request in incoming.requests:
        request.wait()
    _record("recv", None)
    landed = [_landed(b, s) for b, s in zip(incoming.buffers, incoming.slots)]
    tensors = [b.requires_grad_() if s.requires_grad else b for b, s in zip(landed, incoming.slots)]
    return _received(incoming.structure, tensors), tensors


def wait_grads(incoming: Incoming) -> list:
    """Wait for posted gradients; return them in the order of the outputs that need them."""
    for request in incoming.requests:
        request.wait()
        _record("recv", None)
    return [_landed(b, s) for b, s in zip(incoming.buffers, incoming.slots)]


def send_values(values: tuple, dst: int, stage: int, micro: int, key=()) -> list:
    """Send handed-over values to global rank `dst` now, without waiting (activation_sends,
    posted alone).  Returns the requests to wait on."""
    return post_p2p(activation_sends(values, dst, stage, micro, key))


def recv_values(src: int, stage: int, micro: int, key=()) -> tuple[tuple, list]:
    """Receive what send_values sent, waiting for it (activation_recvs, posted alone)."""
    incoming = activation_recvs(src, stage, micro, key)
    post_p2p([], incoming)
    return wait_activations(incoming)


def flat_tensors(values) -> list:
    """The tensors inside handed-over values, in the order send_values sends them."""
    tensors: list = []
    _slots(values, tensors)
    return tensors


def _slots_of(value, found: list):
    if isinstance(value, _TensorSlot):
        if not any(slot is value for slot in found):     # one slot, however often it is referred to
            found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _slots_of(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _slots_of(v, found)
    elif isinstance(value, _Fields):
        _slots_of(value.fields, found)
    return value


def send_grads(tensors: list, dst: int, stage: int, micro: int) -> list:
    """Send the gradients of received tensors back to the previous stage now, without waiting."""
    return post_p2p(grad_sends(tensors, dst, stage, micro))


def recv_grads(outputs: list, src: int, stage: int, micro: int) -> list:
    """Gradients for this stage's outputs that need them, from the next stage (waiting for them)."""
    incoming = grad_recvs(outputs, src, stage, micro)
    post_p2p([], incoming)
    return wait_grads(incoming)


# --------------------------------------------------------------------------
# Interlaced pipeline: vocabulary-parallel modules over all pipeline ranks
# --------------------------------------------------------------------------
# The embedding (and the modules sharing its weight: an LM head) is split on the vocabulary
# over every device of the tp x pp mesh (PP_TP: piece pp_index * tp + tp_index). Each call is a
# step of the schedule of its own that every rank takes part in: "0E3" is the step of the first
# call in stage 0's forward of micro-batch 3, "0G3c1" of the second call in its backward. The
# stage making the call (the owner) runs it where its step makes the call: it broadcasts a small
# header (what runs, on what shape) and the input along its pipeline line (each tp peer of the
# owner to its own line); every device computes its rows and the pieces are summed (embedding)
# or gathered (head) over PP_TP. The other ranks run it between two of their own steps.

_V_EMBED, _V_LINEAR, _V_EMBED_GRAD, _V_LINEAR_GRAD, _V_LOSS, _V_LOSS_GRAD = 1, 2, 3, 4, 5, 6
_V_HEADER = 12
_REDUCTIONS = ("mean", "sum", "none")


class VocabState:
    """The vocabulary-split modules of this rank (VOCAB_MODULES order); in an owner's step, its
    stage and micro-batch, its call counters and the vocabulary steps it runs where it pauses at
    its calls (`queue`); what the other ranks keep from a forward step for its backward; the
    output gradients of the owner's embedding calls, whose backward steps run after its step."""

    def __init__(self) -> None:
        self.modules: list = []
        self.calls = 0
        self.grads = 0
        self.step = None
        self.queue: list = []
        self.saved: dict = {}
        self.stash: dict = {}
        self.pending: dict = {}     # a fused head's placeholder logits (id of their base) -> (module, input, call)


VOCAB = VocabState()


def _broadcast(t: torch.Tensor, src: int, axis: Axis) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` over ``axis``."""
    if axis.size > 1:
        _record("broadcast", t if GLOBAL_RANK == src else None)
        dist.broadcast(t, src=src, group=axis.group)
    return t



def _vocab_rows(weight: torch.Tensor) -> tuple[int, int]:
    rows = weight.shape[0]
    return PP_TP.rank * rows, rows


def _embed_local(ids: torch.Tensor, weight: torch.Tensor, padding_idx) -> torch.Tensor:
    start, rows = _vocab_rows(weight)
    outside = (ids < start) | (ids >= start + rows)
    out = F.embedding((ids - start).masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _embed_grad(ids: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, padding_idx) -> torch.Tensor:
    start, rows = _vocab_rows(weight)
    keep = (ids >= start) & (ids < start + rows)
    if padding_idx is not None:
        keep &= ids != (padding_idx if padding_idx >= 0 else padding_idx + rows * PP_TP.size)
    rows_of = (ids - start).masked_fill(~keep, 0).reshape(-1)
    grad = grad.to(weight.dtype).masked_fill(~keep.unsqueeze(-1), 0.0).reshape(-1, weight.shape[-1])
    return torch.zeros_like(weight).index_add_(0, rows_of, grad)


def _header(values: list[int], src: int, device) -> list[int]:
    """The owner (src) sends `values`; the other ranks get them."""
    t = torch.tensor(values + [0] * (_V_HEADER - len(values)), dtype=torch.long, device=device)
    _broadcast(t, src, PP)
    return values if src == GLOBAL_RANK else t.tolist()


def _owner_header(kind: int, call: int, index: int, x: torch.Tensor) -> None:
    _header([kind, call, index, x.dim(), *x.shape], GLOBAL_RANK, x.device)


class _VocabEmbedding(torch.autograd.Function):
    """Forward: the ids to every device, each looks up its rows, all-reduce(sum) over PP_TP.
    Backward: the output's gradient to every device, each accumulates its rows' gradient."""

    @staticmethod
    def forward(ctx, ids, weight, index, padding_idx, call):
        ids = ids.long().contiguous()
        _serve_queue()
        _owner_header(_V_EMBED, call, index, ids)
        _broadcast(ids, GLOBAL_RANK, PP)
        out = _all_reduce(_embed_local(ids, weight, padding_idx).contiguous(), PP_TP)
        ctx.save_for_backward(ids, weight)
        ctx.meta = (index, padding_idx, call)
        return out

    @staticmethod
    def backward(ctx, grad):
        # no gradient to the ids: the call's backward step runs after the owner's step (vocab_deferred)
        ids, weight = ctx.saved_tensors
        index, padding_idx, call = ctx.meta
        grad = grad.contiguous()
        if VOCAB.step is None:      # outside a pipeline schedule (a dry run): the step at once
            _owner_header(_V_EMBED_GRAD, call, index, grad)
            _broadcast(grad, GLOBAL_RANK, PP)
            return None, _embed_grad(ids, grad, weight, padding_idx), None, None, None
        VOCAB.stash[(*VOCAB.step, VOCAB.grads)] = (index, call, ids, grad)
        VOCAB.grads += 1
        return None, None, None, None, None


class _VocabLinear(torch.autograd.Function):
    """Forward: the input to every device along its pipeline line, each computes its vocabulary
    slice of the output; the owner's tp peers gather their lines' slices, then all-gather them
    among themselves (the whole logits on the owner only). Backward: the owner scatters the
    output's gradient along its line, each device its own slice; each computes its weight rows'
    gradient and its part of the input's, all-reduce(sum) over PP_TP."""

    @staticmethod
    def forward(ctx, x, weight, index, call):
        x = x.to(weight.dtype).contiguous()
        _serve_queue()
        _owner_header(_V_LINEAR, call, index, x)
        _broadcast(x, GLOBAL_RANK, PP)
        ctx.save_for_backward(x, weight)
        ctx.meta = (index, call)
        line = _gather(F.linear(x, weight), GLOBAL_RANK, PP)            # pieces p * tp + TP.rank, p = 0..pp-1
        line = torch.stack(line)
        peers = _all_gather(line, TP) if TP.size > 1 else [line]         # every tp peer's line
        return torch.cat([peers[t][p] for p in range(PP.size) for t in range(TP.size)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        index, call = ctx.meta
        VOCAB.grads += 1
        grad = grad.contiguous()
        _serve_queue()
        _owner_header(_V_LINEAR_GRAD, call, index, grad)
        rows = weight.shape[0]
        pieces = [grad[..., (p * TP.size + TP.rank) * rows:(p * TP.size + TP.rank + 1) * rows] for p in range(PP.size)]
        mine = _scatter(pieces, GLOBAL_RANK, PP)
        gw, gx = _linear_grads(x, mine, weight)
        return _all_reduce(gx, PP_TP), gw, None, None


def _linear_grads(x, mine, weight):
    """This device's weight rows' gradient and its part of the input's, from its slice of the
    output's gradient."""
    rows = weight.shape[0]
    gw = mine.reshape(-1, rows).t().matmul(x.reshape(-1, x.shape[-1]))
    return gw, mine.matmul(weight).contiguous()


def _gather(t: torch.Tensor, dst: int, axis: Axis) -> list[torch.Tensor] | None:
    """Gather ``t`` over ``axis`` to global rank ``dst``: one tensor per axis index there, None
    elsewhere."""
    t = t.contiguous()
    if axis.size == 1:
        return [t]
    _record("gather", t if GLOBAL_RANK != dst else None)
    parts = [torch.empty_like(t) for _ in range(axis.size)] if GLOBAL_RANK == dst else None
    dist.gather(t, parts, dst=dst, group=axis.group)
    return parts


def _scatter(pieces: list[torch.Tensor] | None, src: int, axis: Axis, like: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter ``pieces`` (one per axis index, on global rank ``src``) over ``axis``: this rank's."""
    if axis.size == 1:
        return pieces[0].contiguous()
    pieces = [p.contiguous() for p in pieces] if GLOBAL_RANK == src else None
    out = torch.empty_like(pieces[0] if pieces is not None else like)
    _record("scatter", out if pieces is not None else None)
    dist.scatter(out, pieces, src=src, group=axis.group)
    return out


class VocabEmbedding(torch.nn.Embedding):
    """nn.Embedding whose weight holds this device's rows of the vocabulary (PP_TP)."""

    def forward(self, ids):
        VOCAB.calls += 1
        return _VocabEmbedding.apply(ids, self.weight, self.vocab_index, self.padding_idx, VOCAB.calls - 1)


class VocabLinear(torch.nn.Linear):
    """nn.Linear (no bias) whose weight holds this device's rows (outputs) of the vocabulary (PP_TP)."""

    def forward(self, x):
        VOCAB.calls += 1
        if getattr(self, "vocab_loss", False):      # its step runs at the loss (vocab_cross_entropy)
            return _pending_logits(self, x, VOCAB.calls - 1)
        return _VocabLinear.apply(x, self.weight, self.vocab_index, VOCAB.calls - 1)


def vocab_split(model: torch.nn.Module, paths: list[str], losses: Iterable[str] = ()) -> None:
    """Turn the modules at `paths` into their vocabulary-parallel kind: the weight (one parameter
    however many modules share it) keeps this device's rows, dim 0 split over PP_TP. `losses`:
    the heads whose every call feeds a cross entropy (vocab_cross_entropy): their logits are
    never formed, their step is the loss's."""
    shards: dict[int, torch.nn.Parameter] = {}
    VOCAB.modules = []
    for path in paths:
        module = model.get_submodule(path)
        module.vocab_loss = path in losses
        if any(module is done for done in VOCAB.modules):
            continue                    # one module under two names (`shared`, `encoder.embed`): split once
        base = VocabEmbedding if isinstance(module, torch.nn.Embedding) else VocabLinear
        if not isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) or \
                (base is VocabLinear and module.bias is not None):
            raise TypeError(f"{path}: only an nn.Embedding or an nn.Linear without bias is split on the vocabulary")
        if not isinstance(module, base):
            cls = type(module)
            module.__class__ = base if cls in (torch.nn.Embedding, torch.nn.Linear) else \
                type(cls.__name__, (cls, base), {})
        weight = module.weight
        if id(weight) not in shards:
            rows = weight.shape[0]
            if rows % PP_TP.size:
                raise ValueError(f"{path}: {rows} rows do not split over {PP_TP.size} tp x pp devices")
            part = rows // PP_TP.size
            shards[id(weight)] = torch.nn.Parameter(weight.detach()[PP_TP.rank * part:(PP_TP.rank + 1) * part].clone(),
                                                    requires_grad=weight.requires_grad)
        module.weight = shards[id(weight)]
        module.vocab_index = len(VOCAB.modules)
        VOCAB.modules.append(module)


def vocab_begin(stage: int, micro: int, queue: list) -> None:
    """The owner starts a step of a stage that calls vocabulary-split modules. `queue`: the
    vocabulary steps of the schedule it runs where it pauses at its calls, in order, each
    (kind, stage, micro, call, src: the owner's global rank or None for this rank's own stage,
    mine: a call of this step)."""
    VOCAB.calls = VOCAB.grads = 0
    VOCAB.step, VOCAB.queue = (stage, micro), list(queue)


def _serve_queue() -> None:
    """At an owner's call: first the vocabulary steps the schedule puts before it (other stages'
    calls, this rank's earlier embeddings' backward steps), then the call itself (its caller's).
    Outside a pipeline schedule (a dry run) there is nothing to serve."""
    if VOCAB.step is None:
        return
    while VOCAB.queue:
        kind, stage, micro, call, src, mine = VOCAB.queue.pop(0)
        if mine:
            return
        if src is None:
            vocab_deferred(stage, micro, call)
        else:
            vocab_share(kind, stage, micro, src)
    raise RuntimeError(f"a call of a vocabulary-split module in stage {VOCAB.step[0]}'s step of micro-batch "
                       f"{VOCAB.step[1]} that the schedule does not list (SCHEDULE, VOCAB_CALLS)")


def vocab_end(expected: int) -> None:
    """The owner ends such a step: it must have made the calls the other ranks serve (the
    plan's count), else they would wait on."""
    made = VOCAB.calls if VOCAB.grads == 0 else VOCAB.grads
    VOCAB.step = None
    if VOCAB.pending:
        VOCAB.pending.clear()
        raise RuntimeError("a head whose calls the plan fuses with their cross entropy made logits that no "
                           "vocab_cross_entropy took: the other ranks wait for its step")
    if made != expected or VOCAB.queue:
        raise RuntimeError(f"this pipeline step made {made} calls of vocabulary-split modules, the other "
                           f"ranks serve {expected} (VOCAB_CALLS)" +
                           (f"; {len(VOCAB.queue)} vocabulary steps it should run are left" if VOCAB.queue else ""))


def vocab_deferred(stage: int, micro: int, call: int) -> None:
    """The backward step of an embedding call of this rank's own stage (its `call`-th in the
    backward of micro-batch `micro`), after the step that kept its output's gradient: the gradient
    to every device, each accumulates its rows' gradient."""
    index, forward_call, ids, grad = VOCAB.stash.pop((stage, micro, call))
    module = VOCAB.modules[index]
    _owner_header(_V_EMBED_GRAD, forward_call, index, grad)
    _broadcast(grad, GLOBAL_RANK, PP)
    weight = module.weight
    if weight.requires_grad:
        gw = _embed_grad(ids, grad, weight, module.padding_idx)
        weight.grad = gw if weight.grad is None else weight.grad + gw


def _vocab_device():
    return VOCAB.modules[0].weight.device if VOCAB.modules else torch.device("cpu")


def vocab_share(kind: str, stage: int, micro: int, src: int) -> None:
    """This rank's part of one vocabulary step of another stage's step (`src`: the global rank of
    its owner on this rank's pipeline line): "E" of a call in its forward, "G" in its backward.
    Reads the owner's header (which call, which module, what shape), computes this device's rows;
    a forward keeps its input for the call's backward."""
    device = _vocab_device()
    what, call, index, ndim, *rest = _header([], src, device)
    shape = rest[:ndim]
    module = VOCAB.modules[index]
    weight = module.weight
    if what == _V_EMBED:
        ids = _broadcast(torch.empty(shape, dtype=torch.long, device=device), src, PP)
        _all_reduce(_embed_local(ids, weight.detach(), module.padding_idx).contiguous(), PP_TP)
        VOCAB.saved[(stage, micro, call)] = ids
    elif what == _V_LINEAR:
        x = _broadcast(torch.empty(shape, dtype=weight.dtype, device=device), src, PP)
        _gather(F.linear(x, weight.detach()), src, PP)       # to the owner's tp peer on this line
        VOCAB.saved[(stage, micro, call)] = x
    elif what == _V_LOSS:
        ignore_index, reduction, smoothing = _loss_options(rest[ndim:])
        x = _broadcast(torch.empty(shape, dtype=weight.dtype, device=device), src, PP)
        target = _broadcast(torch.empty(shape[:-1], dtype=torch.long, device=device), src, PP)
        _, ignored, saved = _head_loss(x, weight.detach(), target, ignore_index, smoothing)
        VOCAB.saved[(stage, micro, call)] = (x, ignored, saved, reduction, smoothing)
    elif what == _V_LOSS_GRAD:
        x, ignored, saved, reduction, smoothing = VOCAB.saved.pop((stage, micro, call))
        grad_out = _broadcast(torch.empty(shape, dtype=torch.float32, device=device), src, PP)
        gw, gx = _head_loss_grads(x, weight.detach(), ignored, saved, grad_out, reduction, smoothing)
        _all_reduce(gx, PP_TP)
        if weight.requires_grad:
            weight.grad = gw if weight.grad is None else weight.grad + gw
    else:
        saved = VOCAB.saved.pop((stage, micro, call))
        if what == _V_EMBED_GRAD:
            grad = _broadcast(torch.empty(shape, dtype=weight.dtype, device=device), src, PP)
            gw = _embed_grad(saved, grad, weight, module.padding_idx)
        else:               # this device's slice of the logits' gradient, from the owner's tp peer
            mine = _scatter(None, src, PP, torch.empty([*shape[:-1], weight.shape[0]], dtype=weight.dtype,
                                                       device=device))
            gw, gx = _linear_grads(saved, mine, weight.detach())
            _all_reduce(gx, PP_TP)
        if weight.requires_grad:
            weight.grad = gw if weight.grad is None else weight.grad + gw


# A head and its cross entropy fused (Megatron-LM's vocabulary-parallel cross entropy, over PP_TP):
# the head's call returns a placeholder instead of its logits and runs no step; the loss's call
# (vocab_cross_entropy, which the rewrite puts where the source computes the loss) is the step.
# The input and the targets go to every device along its pipeline line; each computes its slice
# of the logits, and the loss takes one all-reduce(max) and one all-reduce(sum) of token-sized
# tensors over PP_TP (_cross_entropy_pieces); no logits move. Backward: the loss's gradient
# along the lines, each device its slice's gradient, the input's summed over PP_TP.

def _pending_logits(module, x: torch.Tensor, call: int) -> torch.Tensor:
    """The fused head's output: NaN of the logits' shape (one element, expanded: nothing
    allocated), which only vocab_cross_entropy takes; any other use shows as NaN."""
    vocab = module.weight.shape[0] * PP_TP.size
    element = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    VOCAB.pending[id(element)] = (module, x, call, element)      # every view of it has it as its _base
    return element.expand(*x.shape[:-1], vocab)


def _loss_options(values: list[int]) -> tuple[int, str, float]:
    ignore_index, reduction, smoothing = values[:3]
    return ignore_index, _REDUCTIONS[reduction], struct.unpack("<d", struct.pack("<q", smoothing))[0]


def _head_loss(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float):
    """This device's slice of the logits and the loss per token from it (_cross_entropy_pieces over PP_TP)."""
    start, rows = _vocab_rows(weight)
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight).float()
    return _cross_entropy_pieces(logits, target.reshape(-1), start, rows * PP_TP.size, PP_TP, ignore_index, smoothing)


def _head_loss_grads(x, weight, ignored, saved, grad_out, reduction: str, smoothing: float):
    """The weight rows' gradient and this device's part of the input's, from the loss's gradient."""
    grad = _cross_entropy_grad(saved, ignored, grad_out, reduction, smoothing, weight.shape[0] * PP_TP.size)
    return _linear_grads(x, grad.to(weight.dtype).view(*x.shape[:-1], weight.shape[0]), weight)


class _VocabHeadLoss(torch.autograd.Function):
    """The owner's part of a fused head and loss step (see above)."""

    @staticmethod
    def forward(ctx, x, weight, target, index, call, ignore_index, reduction, smoothing):
        x = x.to(weight.dtype).contiguous()
        target = target.reshape(x.shape[:-1]).long().contiguous()
        _serve_queue()
        bits = struct.unpack("<q", struct.pack("<d", smoothing))[0]
        _header([_V_LOSS, call, index, x.dim(), *x.shape, ignore_index, _REDUCTIONS.index(reduction), bits],
                GLOBAL_RANK, x.device)
        _broadcast(x, GLOBAL_RANK, PP)
        _broadcast(target, GLOBAL_RANK, PP)
        loss, ignored, saved = _head_loss(x, weight, target, ignore_index, smoothing)
        ctx.save_for_backward(x, weight, ignored, *saved)
        ctx.meta = (index, call, reduction, smoothing)
        return _reduced(loss, ignored, reduction, target.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, ignored, *saved = ctx.saved_tensors
        index, call, reduction, smoothing = ctx.meta
        VOCAB.grads += 1
        grad_out = grad_out.float().contiguous()
        _serve_queue()
        _owner_header(_V_LOSS_GRAD, call, index, grad_out)
        _broadcast(grad_out, GLOBAL_RANK, PP)
        gw, gx = _head_loss_grads(x, weight, ignored, saved, grad_out, reduction, smoothing)
        return _all_reduce(gx, PP_TP) if PP_TP.size > 1 else gx, gw, None, None, None, None, None, None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, loss: torch.nn.Module | None = None, *,
                        weight=None, ignore_index: int = -100, reduction: str = "mean",
                        label_smoothing: float = 0.0, **legacy) -> torch.Tensor:
    """F.cross_entropy(logits, target, ...), or ``loss(logits, target)`` for an nn.CrossEntropyLoss
    `loss`, where `logits` may be a fused head's output (any view of it): then the head's step and
    the loss run as one vocabulary-parallel step over PP_TP (its result: the loss on the owner).
    Any other logits: the loss as the source computes it."""
    options = dict(weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                   **legacy)
    if loss is not None:
        options = dict(weight=loss.weight, ignore_index=loss.ignore_index, reduction=loss.reduction,
                       label_smoothing=loss.label_smoothing)
    entry = VOCAB.pending.pop(id(logits._base), None) if VOCAB.pending and logits._base is not None else None
    if entry is None:
        return F.cross_entropy(logits, target, **options)
    module, x, call, _ = entry
    if options["weight"] is not None or legacy or options["reduction"] not in _REDUCTIONS or \
            logits.shape[-1] != module.weight.shape[0] * PP_TP.size or logits.numel() // logits.shape[-1] != \
            target.numel():
        raise ValueError("vocab_cross_entropy: a fused head's logits take the cross entropy over their last dim "
                         "without class weights, one target per row")
    out = _VocabHeadLoss.apply(x, module.weight, target, module.vocab_index, call, int(options["ignore_index"]),
                               options["reduction"], float(options["label_smoothing"]))
    return out.view(target.shape) if options["reduction"] == "none" else out
