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
    args = call.args
    if any(a.star for a in args[:path[1] + 1]):
        return f"the size of dim {dim} is inside *args"
    if path[1] >= len(args):
        return f"cannot find the size argument of {node.callee}"
    value = args[path[1]].value
    if item is not None and not (isinstance(value, (cst.Tuple, cst.List)) and item < len(value.elements) and not any(
            isinstance(e, cst.StarredElement) for e in value.elements[:item + 1])):
        return f"the size of split dim {dim} comes from `{cst.Module([]).code_for_node(value)}`, which the " \
               "rewrite cannot make local"
    return path, item
