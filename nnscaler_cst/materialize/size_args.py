"""Where a view's, expand's or split's sizes are written in the source, so a split dim can be made local."""
from __future__ import annotations

import libcst as cst

from ..graph.graph import Graph
from ..trace.records import Node

# Calls whose positional arguments after the tensor are the output sizes.
SIZE_ARGUMENTS = {"Tensor.view", "Tensor.reshape", "torch.reshape", "Tensor.expand"}
SPLIT_SIZES = {"Tensor.split", "torch.split"}


def locate_size_argument(graph: Graph, node: Node, dim: int) -> tuple | None | str:
    """Where the size of output `dim` is written in a view/reshape call: (argument path, tuple
    item), None when it is -1 (nothing to rewrite), or why it cannot be rewritten."""
    shape = graph.trace.tensors[node.outputs[0]].shape
    sizes = [op for op in node.operands if op.name.startswith("arg") and op.name != "arg0"]
    if len(sizes) == 1 and isinstance(sizes[0].value, tuple):
        values, paths = list(sizes[0].value), [(sizes[0].path, i) for i in range(len(shape))]
    else:
        values, paths = [op.value for op in sizes], [(op.path, None) for op in sizes]
    if len(values) != len(shape):
        return f"cannot tell which argument of {node.callee} sets dim {dim}"
    if values[dim] == -1:
        return None
    path, item = paths[dim]
    call = graph.source_node(node)
    if not isinstance(call, cst.Call) or path[0] != "pos":
        return f"cannot find the size argument of {node.callee}"
    from_end = len(values) - dim       # after a `*lead`, sizes are found by their place from the end
    if item is None:
        positional = [a for a in call.args if a.keyword is None]
        written = _written_at(positional, path[1], from_end, lambda a: bool(a.star))
        if written is None:
            return f"the size of dim {dim} is inside *args"
        # the emitter counts positional arguments without the starred ones
        return (path[0], written - sum(1 for a in positional[:written] if a.star)), None
    if path[1] >= len(call.args):
        return f"cannot find the size argument of {node.callee}"
    value = call.args[path[1]].value
    if isinstance(value, (cst.Tuple, cst.List)):
        written = _written_at(list(value.elements), item, from_end, lambda e: isinstance(e, cst.StarredElement))
        if written is not None:
            return path, written
    return f"the size of split dim {dim} comes from `{cst.Module([]).code_for_node(value)}`, which the " \
           "rewrite cannot make local"


def _written_at(items: list, at: int, from_end: int, starred) -> int | None:
    """Where in the source's items the size at runtime position `at` is written: at `at` when no
    starred item comes before it, else `from_end` from the end when no starred item comes after."""
    if at < len(items) and not any(starred(i) for i in items[:at + 1]):
        return at
    last_star = max((k for k, i in enumerate(items) if starred(i)), default=-1)
    if from_end <= len(items) - 1 - last_star:
        return len(items) - from_end
    return None
