"""Read a plan IR back into per-invocation splits: what the rewrite is given.

op_trans names one algo per site (the split label of its first instance); every instance of
that site takes the option with the same layouts. Parameter layouts and the parameters whose
gradients stay partial follow from those choices.
"""
from __future__ import annotations

from ..errors import UserError
from ..graph.graph import Graph
from .ir import Plan
from .layouts import REPLICATE, Layout, layouts_for
from .refine import refine_factors
from .search import (AxisChoices, _operand_names, _partial_grad_params, site_options,
                     unread_params_follow_constructor)


def site_keys(graph: Graph) -> dict:
    """Each call site's name in the plan IR (op_trans, op_assign): its path:line:col, and where it
    ends when another site starts at the same place. The calls of a method chain on one line
    (`x.reshape(...).transpose(2, 3).reshape(...)`) all start at `x`: by path:line:col alone, the
    plan's split of the outer reshape was read back for the inner one."""
    spans_at: dict[str, set] = {}
    for span, _ in graph.sites:
        spans_at.setdefault(span.label, set()).add(span)
    return {span: span.label if len(spans_at[span.label]) == 1 else
            f"{span.label}-{span.end_line}:{span.end_col + 1}" for span, _ in graph.sites}


def choices_from_plan(graph: Graph, plan: Plan, axis: str = "tp", *, batch_slices: int = 1,
                      every_size_read: bool = False) -> AxisChoices | None:
    n = plan.mesh.get(axis, 1)
    if n == 1:
        return None
    refine_factors(graph)
    wanted = {(t.site, t.callee, t.group): t for t in plan.trans if t.axis == axis}
    keys = site_keys(graph)
    options = site_options(graph, n, batch_slices, every_size_read)
    node_choice: dict[int, str] = {}
    chunks: dict[int, int] = {}
    for sid, opts in options.items():
        trans = None if sid[0] == "node" else wanted.get((keys[sid[0]], sid[1], sid[2] if len(sid) > 2 else ""))
        algo = trans.algo if trans is not None else REPLICATE
        if trans is not None and trans.n > n:        # co-shard: n = C * |axis|
            chunks.update({i: trans.n // n for i in opts.nodes})
        if algo not in opts.options:
            raise UserError(f"the plan splits {sid[1]} by {algo!r}, which this site does not allow "
                            f"(options: {', '.join(opts.options)})", sid[0].start if sid[0] != "node" else None)
        k = opts.options.index(algo)
        for i in opts.nodes:
            node_choice[i] = opts.labels[i][k]
    param_layout: dict[str, Layout] = {}
    for node in graph.nodes:
        names = _operand_names(graph, node.index)
        for name, tid in graph.param_operands(node.index):
            layout = layouts_for(graph.dims.get(node.index), node_choice[node.index], names).inputs[name]
            param = graph.trace.tensors[tid].param
            if param_layout.setdefault(param, layout) != layout:
                raise UserError(f"parameter {param} would need two layouts ({param_layout[param]}, {layout})",
                                node.span.start if node.span else None)
    return AxisChoices(axis, n, node_choice, unread_params_follow_constructor(graph, param_layout, n),
                       _partial_grad_params(graph, node_choice), options, chunks, batch_slices)
