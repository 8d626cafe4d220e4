"""The split of a layer's buffers, which follow its constructor.

A layer builds its buffers from the same constructor arguments as its parameters (BatchNorm's
running_mean and running_var from num_features, as its weight and bias). Where a [[ctor]] rule
names a buffer, dividing the argument behind a split parameter builds the buffer split too: on
each rank it holds that rank's slice, and the state dict is sliced and joined alike. A buffer
no split parameter divides is built whole, so no split of it is offered. Decides splits only;
writes no source.
"""
from __future__ import annotations

from ..plan.layouts import Layout, shard


def buffer_layouts(graph, param_layout: dict[str, Layout]) -> dict[str, Layout]:
    """Buffer name -> its layout on the axis, for the buffers split with their layer's parameters
    (whole buffers are left out)."""
    buffers = sorted({info.buffer for info in graph.trace.tensors.values() if info.buffer is not None})
    found = {name: _built_split(graph, name, param_layout) for name in buffers}
    return {name: layout for name, layout in found.items() if layout is not None}


def buffer_split_problem(graph, index: int, inputs: dict[str, Layout], params: dict[str, Layout]) -> str | None:
    """Why a split of node `index` whose operands take `inputs` (its parameters `params`) cannot
    have a buffer it splits built at its local size, or None."""
    tensors = graph.trace.tensors
    for operand in graph.nodes[index].operands:
        buffer = tensors[operand.tid].buffer if operand.tid is not None else None
        wanted = inputs.get(operand.name)
        if buffer is not None and wanted is not None and wanted.kind == "S" \
                and _built_split(graph, buffer, params) != wanted:
            return f"its buffer {buffer} is built whole: no split parameter of its layer divides its size"
    return None


def _built_split(graph, buffer: str, param_layout: dict[str, Layout]) -> Layout | None:
    """The layout the layer's divided constructor builds `buffer` in, or None (whole)."""
    owner, _, attr = buffer.rpartition(".")
    for param, info in _params_by_owner(graph).get(owner, []):
        layout = param_layout.get(param)
        if layout is None or layout.kind != "S":
            continue
        rule = graph.rules.ctor_for(info.module_type)
        held, divided = (rule.params.get(attr), rule.params.get(info.attr)) if rule is not None else (None, None)
        if not held or not divided or layout.dim >= len(divided):
            continue
        dim = next((d for d, aliases in enumerate(held) if aliases == divided[layout.dim]), None)
        if dim is not None:
            return shard(dim, layout.groups)
    return None


def _params_by_owner(graph) -> dict[str, list]:
    """Module path -> its own parameters (name, ParamInfo); made once per graph (the search asks
    per node and candidate split)."""
    known = graph.__dict__.get("_params_by_owner")
    if known is None:
        known = {}
        for param, info in graph.trace.params.items():
            known.setdefault(param.rpartition(".")[0], []).append((param, info))
        graph.__dict__["_params_by_owner"] = known
    return known
