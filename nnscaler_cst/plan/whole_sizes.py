"""Sizes the source reads from a tensor and hands to a call that needs the full size.

`torch.arange(x.shape[1])` builds whole positions from x's size: if x were split on dim 1,
every rank would read its local size and build the wrong positions. A view or split of a
split tensor is another matter: the rewrite makes its sizes local, so reading the local size
there is right. Which tensor dims must therefore stay whole; decides nothing else.
"""
from __future__ import annotations

from collections import defaultdict

import libcst as cst

from ..graph.graph import Graph
from ..materialize.size_args import SIZE_ARGUMENTS, SPLIT_SIZES, dims_sized_by_read, expand_broadcasts
from ..trace.records import Node
from .layouts import REPLICATE, ChoiceLayouts, layouts_for

ANY_DIM = None           # `x.shape` read whole: every dim of x is read


def dims_read_whole(graph: Graph, every_read: bool = False) -> dict[int, set[int | None]]:
    """Tensor id -> dims (from 0, or ANY_DIM) whose size a call other than a view reads; with
    `every_read`, also sizes assigned to names (`B, T, C = x.shape`), whose uses the trace
    cannot follow: the cautious answer when the first plan's dry run failed."""
    at_span = {n.span: n for n in graph.nodes if n.span is not None}
    handed_back = _handed_back(graph) if every_read else {}
    out: dict[int, set[int | None]] = defaultdict(set)
    innermost: dict = {}
    for span, tid, dim in graph.trace.size_queries:
        # `key.float().reshape(*key.shape[:-1], -1, 2)` on a float32 key: float() hands key back,
        # so the trace sees the view's own input read, but the source reads `key`, which the
        # rewrite may convert before the call (`tp_gather(key, ...).float()`): the size is then
        # key's, local, where the view runs whole. Cautiously, the tensors handed back are read.
        earlier = _earlier(handed_back, tid)
        if earlier:
            rank = len(graph.trace.tensors[tid].shape)
            dims = {dim % rank} if isinstance(dim, int) and rank else _indexed_dims(graph, span, rank)
            for t in (tid, *earlier):
                out[t].update(dims)
            continue
        consumer = innermost.get(span, span)
        if consumer is span:      # (a block's repeats read their sizes at one span: found once)
            around = [s for s in at_span if s != span and s.contains(span)]
            # the innermost call around the read: it starts last, and of those ends first
            consumer = innermost[span] = max(around, key=lambda s: (s.line, s.col, -s.end_line, -s.end_col),
                                             default=None)
        if consumer is None and not every_read:
            continue                # assigned to a name: local is right where views use it
        view = at_span[consumer] if consumer is not None else None
        rank = len(graph.trace.tensors[tid].shape)
        if view is not None and view.callee in SIZE_ARGUMENTS | SPLIT_SIZES:
            if not every_read or any(op.name == "arg0" and op.tid == tid for op in view.operands):
                continue        # a view's size: the rewrite makes the view local
            # the cautious answer: the plan may run the view whole while the size is another
            # tensor's (`y.expand(*x.size(), n)`), so x stays whole. Not where the expand
            # broadcasts a dim of size 1 (`mask.expand(x.size())`): that one is right local
            kept = _expanded_read_dims(graph, view, span, rank, dim)
            if kept is not None:
                out[tid].update(kept)
                continue
        if isinstance(dim, int) and rank:
            out[tid].add(dim % rank)
        else:
            out[tid].update(_indexed_dims(graph, span, rank))
    return dict(out)


def _handed_back(graph: Graph) -> dict[int, int]:
    """Result tensor id -> the input a call handed back as that result, unmodified (`x.float()` of
    a float32 x, `x.contiguous()` of a contiguous one): one object under two ids in the trace."""
    tensors = graph.trace.tensors
    out = {}
    for op in graph.trace.ops:
        if op.returns_input and len(op.outputs) == 1:
            same = [t for t in op.inputs if tensors[t].shape == tensors[op.outputs[0]].shape]
            if len(same) == 1:
                out[op.outputs[0]] = same[0]
    return out


def _earlier(handed_back: dict[int, int], tid: int) -> list[int]:
    """The ids `tid`'s object had before calls handed it back, latest first."""
    chain = []
    while tid in handed_back and handed_back[tid] not in chain:
        tid = handed_back[tid]
        chain.append(tid)
    return chain


def _expanded_read_dims(graph: Graph, view: Node, span, rank: int, dim: int | None) -> set[int] | None:
    """The dims of a size read into an expand that size a dim the expand does not broadcast;
    None where the read's place among the sizes is not known."""
    sized = dims_sized_by_read(graph, view, span, rank, dim) if view.callee == "Tensor.expand" else {}
    if not sized:
        return None
    return {read for read, at in sized.items() if not expand_broadcasts(graph, view, at)}


def _int(node: cst.BaseExpression | None) -> int | None:
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and isinstance(
            node.expression, cst.Integer):
        return -int(node.expression.value)
    return None


def _indexed_dims(graph: Graph, span, rank: int) -> set[int | None]:
    """The dims a whole-shape read uses when the source indexes it at once with constants
    (`x.shape[-1]`, `x.size()[1]`, `x.shape[:-1]`), else ANY_DIM."""
    if graph.sources is None or span.path not in graph.sources or not rank:
        return {ANY_DIM}
    source = graph.sources.get(span.path)
    node = source.node_at(span.line, span.col, span.end_line, span.end_col)
    parent = source.parents.get(node) if node is not None else None
    if isinstance(parent, cst.Call) and parent.func is node and not parent.args:   # x.size()
        node, parent = parent, source.parents.get(parent)
    if isinstance(parent, cst.Assign) and parent.value is node:
        return _unpacked_dims(source, parent, rank)
    if not (isinstance(parent, cst.Subscript) and parent.value is node and len(parent.slice) == 1):
        return {ANY_DIM}
    index = parent.slice[0].slice
    if isinstance(index, cst.Index):
        at = _int(index.value)
        return {ANY_DIM} if at is None or not -rank <= at < rank else {at % rank}
    if isinstance(index, cst.Slice) and index.step is None:
        bounds = [_int(b) if b is not None else None for b in (index.lower, index.upper)]
        if any(b is None and e is not None for b, e in zip(bounds, (index.lower, index.upper))):
            return {ANY_DIM}
        return set(range(rank)[slice(*bounds)])
    return {ANY_DIM}


def _unpacked_dims(source, assign: cst.Assign, rank: int) -> set[int | None]:
    """`B, T, _ = x.shape`: the dims whose names the enclosing function uses again. A name
    nothing reads (`_`, `three_times_hidden_size` in Bloom's attention) holds a size no one
    sees, whole or local; any other appearance of the name, even assigned again, counts as a
    use. ANY_DIM when the shape is not unpacked into plain names, one per dim."""
    if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, (cst.Tuple, cst.List)):
        return {ANY_DIM}
    elements = assign.targets[0].target.elements
    if len(elements) != rank or not all(isinstance(e, cst.Element) and isinstance(e.value, cst.Name)
                                        for e in elements):
        return {ANY_DIM}
    scope = source.parents.get(assign)
    while scope is not None and not isinstance(scope, (cst.FunctionDef, cst.Module)):
        scope = source.parents.get(scope)
    if scope is None:
        return {ANY_DIM}
    targets = {id(e.value) for e in elements}
    seen: dict[str, int] = {}

    class _Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            if id(name) not in targets:
                seen[name.value] = seen.get(name.value, 0) + 1

    scope.visit(_Names())
    return {d for d, e in enumerate(elements) if seen.get(e.value.value)}


def splits_read_size(graph: Graph, index: int, lay: ChoiceLayouts, read: dict[int, set[int | None]]) -> str | None:
    """Why this layout would split a dim whose full size a call reads, or None."""
    node = graph.nodes[index]
    # (asked per invocation and candidate split: most tensors have no size read, so look those up first)
    for k, tid in enumerate(node.outputs):
        dims = read.get(tid)
        if dims and k < len(lay.outputs) and _splits_read(lay.outputs[k], dims):
            return f"it would split dim {lay.outputs[k].dim} of a tensor whose full size the source reads"
    for op in node.operands:
        dims = read.get(op.tid) if op.tid is not None else None
        if dims and op.name in lay.inputs and _splits_read(lay.inputs[op.name], dims):
            return f"it would split dim {lay.inputs[op.name].dim} of a tensor whose full size the source reads"
    return None


def _splits_read(layout, dims: set[int | None]) -> bool:
    return layout.kind == "S" and (ANY_DIM in dims or layout.dim in dims)


def splits_a_read_size(graph: Graph, node_choice: dict[int, str]) -> bool:
    """Some op of a plan holds a tensor split on a dim whose size the source reads anywhere."""
    read = dims_read_whole(graph, every_read=True)
    return any(splits_read_size(graph, i, layouts_for(graph.dims.get(i), label, [
        op.name for op in graph.nodes[i].operands if op.tid is not None]), read)
        for i, label in node_choice.items() if label != REPLICATE)
