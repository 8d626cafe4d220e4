"""Push a consumer's finer dim structure back to its producer.

`self.c_attn(x).split(C, dim=2)` sees dim 2 as (3 c), but the Linear producing it sees one
label n. Refining n into (n.0 n.1) = (3, C) everywhere in the Linear (output and weight)
lets it split c in 3 interleaved blocks, so q, k and v each arrive split by heads. The same
carries grouped-query attention's (g r) heads back to the projections.
"""
from __future__ import annotations

from ..graph.dims import Factor, OpDims
from ..graph.graph import Graph


def refine_factors(graph: Graph) -> None:
    """Refine in place until no producer label is coarser than what its consumers see.

    Runs to the fixed point: every caller (the search, reading a plan back) must see the same
    labels. A label only ever splits into more factors, so it ends; the bound catches a bug."""
    producer_out: dict[int, tuple[int, int]] = {}   # tid -> (node, output index)
    for index, dims in graph.dims.items():
        for k, tensor in enumerate(dims.outputs):
            producer_out[tensor.tid] = (index, k)
    for _ in range(1000):
        changed = False
        for index, dims in graph.dims.items():
            for tensor in dims.inputs.values():
                source = producer_out.get(tensor.tid)
                if source is None:
                    continue
                producer = graph.dims[source[0]]
                out = producer.outputs[source[1]]
                if len(out.dims) != len(tensor.dims):
                    continue
                for mine, theirs in zip(tensor.dims, out.dims):
                    if len(mine) > 1 and len(theirs) == 1 and _sizes(mine) == theirs[0].size:
                        _split_label(producer, theirs[0].label, [f.size for f in mine])
                        changed = True
                    elif len(theirs) > 1 and len(mine) == 1 and _sizes(theirs) == mine[0].size:
                        _split_label(dims, mine[0].label, [f.size for f in theirs])
                        changed = True
        if not changed:
            return
    raise RuntimeError("refining split labels did not reach a fixed point")


def _sizes(factors) -> int:
    total = 1
    for f in factors:
        total *= f.size
    return total


def _split_label(dims: OpDims, label: str, sizes: list[int]) -> None:
    parts = [Factor(f"{label}.{i}", s) for i, s in enumerate(sizes)]
    for tensor in [*dims.inputs.values(), *dims.outputs]:
        tensor.dims = [tuple(p for f in factors for p in (parts if f.label == label else [f]))
                       for factors in tensor.dims]
    for marks in (dims.reduced, dims.fixed):
        if label in marks:
            marks.discard(label)
            marks.update(p.label for p in parts)
    if label in dims.impl:
        dims.impl[parts[0].label] = dims.impl.pop(label)
    dims.flops = tuple(tuple(name for l in term for name in ([p.label for p in parts] if l == label else [l]))
                       for term in dims.flops)
