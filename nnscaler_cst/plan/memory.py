"""The memory model's activation term: what autograd keeps of each op's outputs for backward.

An output is kept when it requires a gradient; a view, or an input handed back unchanged,
shares storage already counted and adds nothing. Outputs that need no gradient (masks,
position tables, index tensors) are freed once their consumers ran. An upper bound still:
some ops keep less than their output (a relu keeps a mask in its place in fused kernels).
"""
from __future__ import annotations

from ..trace.records import Node, Trace
from .cost import moves_no_bytes


def saved_bytes(node: Node, trace: Trace) -> float:
    if moves_no_bytes(node, trace):
        return 0.0
    return float(sum(trace.tensors[t].nbytes for t in node.outputs if trace.tensors[t].requires_grad))
