"""Does one call keep the samples of a batch apart? A probe against a trace at half the batch.

Data parallelism and micro-batches run the model's own code on a slice of the batch, so sizes
the source reads (`x.size()`, `x.stride()`) are the slice's, and a call built from them
(`x.as_strided(size, stride)`, `x.view(x.size(0), ...)`) has other arguments there, not only
other tensors. The split probe (derive.py) replays the traced arguments and cannot see that.
Here the model is traced again on the first half of its example batch; a call whose split rule
has no batch dim is called as that trace recorded it (its own arguments at half the batch) on
each half of the real tensors it read. It keeps the samples apart when every result is the
matching half of its whole result, or, unchanged by the batch, equal to it.

Each node of the second trace must be the same call at the same site as in the first (no
control flow on the batch size); otherwise nothing is claimed. A module's first call as a
whole (the tracer's module_replays) is probed the same way: a MoE layer that sorts the tokens
of the whole batch by expert and puts each result back in its token's place keeps the samples
apart, though the ops inside it do not. Answers one question; decides no plan.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..trace.records import Node, Trace
from ..trace.replay import Replay, TensorRef
from .derive import _CannotReplay, _Caller, _close, _equal, _filled_uninitialized_memory, too_large_to_probe, with_strides

SLICES = 2


def batch_kept_apart(node: Node, trace: Trace, half: Trace) -> dict[int, int] | None:
    """{output tensor id: its batch dim} (absent for a result the batch does not change) when the
    call, with its arguments at half the batch, gives each half of its whole result; else None."""
    found = _kept_apart(trace, trace.replays.get(node.index), half, _same_call(node, half))
    return found and {tid: dim for tid, dim in found.items() if tid in node.outputs}


def module_kept_apart(path: str, trace: Trace, half: Trace) -> dict[int, int] | None:
    """The same for the first call of the module at `path` as a whole: a MoE layer whose router
    sorts the tokens of the whole batch, then puts each token's result back in its place."""
    if trace.module_runs.get(path) != 1 or half.module_runs.get(path) != 1:
        return None           # called more than once: which call would the answer be for?
    return _kept_apart(trace, trace.module_replays.get(path), half, half.module_replays.get(path))


def _kept_apart(trace: Trace, full_replay: Replay | None, half: Trace,
                half_replay: Replay | None) -> dict[int, int] | None:
    if full_replay is None or full_replay.outputs is None or half_replay is None or half_replay.outputs is None:
        return None
    pairs = _paired_refs(full_replay, half_replay)
    if pairs is None:
        return None
    cuts: dict[int, int | None] = {}            # full tensor id -> the dim it is halved on (None: same)
    for full_tid, half_tid in pairs:
        cut = _halved_dim(trace.tensors[full_tid].shape, half.tensors[half_tid].shape)
        if cut is False or cuts.setdefault(full_tid, cut) != cut:
            return None
    if not any(cut is not None for cut in cuts.values()):
        return None
    if too_large_to_probe(trace, cuts):
        return None           # production shapes: nothing is claimed rather than GBs allocated
    with _filled_uninitialized_memory(), _without_dropout():
        whole_call = _Caller(trace, full_replay, sorted(cuts), strided=True)
        try:
            whole = whole_call()
        except _CannotReplay:
            return None
        half_call = _Caller(half, half_replay, sorted({h for _, h in pairs}))
        found: dict[int, int | None] = {}
        for k in range(SLICES):
            # each slice laid out as the half-batch trace has it: a rank's own tensor
            values = {h: with_strides(_piece(whole_call.base[f], cuts[f], k), getattr(half.tensors[h], "stride", None))
                      for f, h in pairs}
            try:
                pieces = half_call(values)
            except _CannotReplay:
                return None
            for position, (full, piece) in enumerate(zip(whole, pieces)):
                dim = _piece_of(piece, full, k)
                if dim is False or found.setdefault(position, dim) != dim:
                    return None
    return {tid: found[k] for k, tid in enumerate(full_replay.outputs) if found.get(k) is not None}


@contextlib.contextmanager
def _without_dropout():
    """Dropout keeps samples apart, but draws other masks for a half batch than for the whole:
    off while a module (a layer with its attention dropout) is called on both."""
    functional = torch.nn.functional
    names = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
    saved = {name: getattr(functional, name) for name in names}
    try:
        for name in names:
            setattr(functional, name, lambda input, *args, **kwargs: input)
        yield
    finally:
        for name, fn in saved.items():
            setattr(functional, name, fn)


def _same_call(node: Node, half: Trace) -> Replay | None:
    if node.index >= len(half.nodes):
        return None
    other = half.nodes[node.index]
    if other.callee != node.callee or other.span != node.span:
        return None
    replay = half.replays.get(node.index)
    return replay if replay is not None and replay.outputs is not None else None


def _paired_refs(full: Replay, half: Replay) -> list[tuple[int, int]] | None:
    """(full tensor id, half tensor id) of every tensor argument, matched by where it sits in
    the call; None when the two calls' arguments differ in structure."""
    pairs: list[tuple[int, int]] = []

    def walk(a, b) -> bool:
        if isinstance(a, TensorRef) or isinstance(b, TensorRef):
            if not (isinstance(a, TensorRef) and isinstance(b, TensorRef)):
                return False
            pairs.append((a.tid, b.tid))
            return True
        if type(a) in (tuple, list) or type(b) in (tuple, list):
            return type(a) is type(b) and len(a) == len(b) and all(walk(x, y) for x, y in zip(a, b))
        if type(a) is dict or type(b) is dict:
            return type(a) is type(b) and a.keys() == b.keys() and all(walk(a[k], b[k]) for k in a)
        return True

    if full.fn is not half.fn and type(full.fn) is not type(half.fn):
        return None
    if not (walk(full.args, half.args) and walk(full.kwargs, half.kwargs)) or full.state.keys() != half.state.keys():
        return None
    return pairs + [(full.state[name], half.state[name]) for name in full.state]


def _halved_dim(full: tuple[int, ...], half: tuple[int, ...]) -> int | None | bool:
    """The one dim `half` has half of, None when the shapes are equal, False otherwise."""
    if len(full) != len(half):
        return False
    differ = [d for d, (a, b) in enumerate(zip(full, half)) if a != b]
    if not differ:
        return None
    if len(differ) == 1 and full[differ[0]] == SLICES * half[differ[0]]:
        return differ[0]
    return False


def _piece(value: torch.Tensor, dim: int | None, k: int) -> torch.Tensor:
    if dim is None:
        return value
    size = value.shape[dim] // SLICES
    return value.narrow(dim, k * size, size).clone()    # a rank's own tensor, not a view of the batch


def _piece_of(piece: torch.Tensor, full: torch.Tensor, k: int) -> int | None | bool:
    """The dim along which `piece` is the k-th slice of `full`, None when equal, False otherwise."""
    if piece.shape == full.shape:
        return None if _equal(piece, full) or _close(piece, full) else False
    dim = _halved_dim(tuple(full.shape), tuple(piece.shape))
    if dim is None or dim is False:
        return False
    size = piece.shape[dim]
    return dim if _close(piece, full.narrow(dim, k * size, size)) or \
        _equal(piece, full.narrow(dim, k * size, size)) else False


def half_batch_trace(retrace: Callable[[int], Trace]) -> Trace | None:
    """The model traced again at half its batch, or None when it cannot be."""
    try:
        return retrace(SLICES)
    except Exception:   # noqa: BLE001 - any failure: nothing is claimed, the op stays refused
        return None
