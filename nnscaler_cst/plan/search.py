"""Search one mesh axis: pick, for every source site, how it is split (op-trans), under the
plan's constraints, minimising the analytical cost with z3.

Variables are per *site*, not per invocation: all instances of a site run the same source,
so they must be split alike, and a model with 96 identical blocks has the variables of one.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import z3

from ..errors import UserError
from ..graph.dims import OpDims
from ..graph.graph import Graph
from ..materialize.conversions import conversion, conversion_time
from ..materialize.size_args import SIZE_ARGUMENTS, locate_size_argument
from .cost import DeviceSpec, all_reduce_time, compute_time, node_flops
from .layouts import REPLICATE, R, Layout, layouts_for
from .refine import refine_factors

SiteId = tuple


@dataclass
class SiteOptions:
    """The ways one site may be split. Instances of a site may name a split differently (q has
    4 heads refined to (g r), k has 2), so an option is matched across instances by the
    layouts it gives; labels[node][k] is option k's label in that instance."""

    site: SiteId
    nodes: list[int]
    options: list[str]                        # option names, from the first instance
    labels: dict[int, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)   # option -> the constraint that removed it


@dataclass
class AxisPlan:
    axis: str
    n: int
    site_choice: dict[SiteId, str]
    node_choice: dict[int, str]
    param_layout: dict[str, Layout]        # canonical param name -> layout on this axis
    partial_grad_params: list[str]         # replicated params whose grads need an all-reduce
    cost: float
    options: dict[SiteId, SiteOptions]


def site_id(graph: Graph, index: int) -> SiteId:
    node = graph.nodes[index]
    return (node.span, node.callee) if node.span is not None and node.mapped else ("node", index)


def option_valid(graph: Graph, index: int, label: str, n: int) -> str | None:
    """Why `label` cannot split this invocation n ways, or None when it can."""
    dims = graph.dims[index]
    size = dims.sizes().get(label)
    if size is None or size % n:
        return f"a dim of size {size} is not divisible by {n} devices"
    node = graph.nodes[index]
    if node.callee in SIZE_ARGUMENTS:
        out = layouts_for(dims, label, []).outputs
        if out and out[0].kind == "S" and isinstance(locate_size_argument(graph, node, out[0].dim), str):
            return locate_size_argument(graph, node, out[0].dim)
    if label in dims.reduced and label not in dims.impl:
        bias = graph.partial_bias(index)
        for name, tensor in dims.inputs.items():
            if label not in tensor.labels() and name != bias and graph.trace.tensors[tensor.tid].shape:
                return f"splitting {label} would add {name} once per device"
    return None


class Constraints:
    """The plan's restrictions on choices; see rules/plans/*.toml."""

    def __init__(self, require_split_params: bool = False, allow_partial_param_grads: bool = True,
                 pinned: dict[SiteId, str] | None = None):
        self.require_split_params = require_split_params
        self.allow_partial_param_grads = allow_partial_param_grads
        self.pinned = pinned or {}

    def reject(self, graph: Graph, index: int, choice: str) -> str | None:
        params = graph.param_operands(index)
        matrix = any(len(graph.trace.tensors[tid].shape) >= 2 for _, tid in params)
        if choice == REPLICATE:
            return "parameterized ops are split" if self.require_split_params and matrix else None
        dims = graph.dims[index]
        bias = graph.partial_bias(index) if choice in dims.reduced else None
        for name, tid in params:
            if name == bias:
                continue
            where = dims.inputs[name].where(choice) if name in dims.inputs else None
            if where is None and not self.allow_partial_param_grads:
                return f"parameter {name} would be replicated with a partial gradient"
        return None


def _signature(graph: Graph, index: int, label: str):
    lay = layouts_for(graph.dims.get(index), label, _operand_names(graph, index))
    return tuple(sorted((k, str(v)) for k, v in lay.inputs.items())), tuple(map(str, lay.outputs))


def site_options(graph: Graph, n: int, constraints: Constraints) -> dict[SiteId, SiteOptions]:
    grouped: dict[SiteId, list[int]] = defaultdict(list)
    for node in graph.nodes:
        grouped[site_id(graph, node.index)].append(node.index)
    result = {}
    for sid, nodes in grouped.items():
        why: dict[str, str] = {}
        per_node: dict[int, dict] = {}
        splittable = sid[0] != "node" and all(i in graph.dims for i in nodes)
        for i in nodes:
            allowed = {}
            for label in [REPLICATE, *(graph.dims[i].splittable() if splittable else [])]:
                reason = (option_valid(graph, i, label, n) if label != REPLICATE else None) or \
                    constraints.reject(graph, i, label)
                if reason:
                    why.setdefault(label, reason)
                else:
                    allowed.setdefault(_signature(graph, i, label), label)
            per_node[i] = allowed
        first = per_node[nodes[0]]
        common = [sig for sig in first if all(sig in per_node[i] for i in nodes)]
        options = [first[sig] for sig in common]
        if sid in constraints.pinned:
            keep = [k for k, name in enumerate(options) if name == constraints.pinned[sid]]
            for k, name in enumerate(options):
                if k not in keep:
                    why[name] = f"pinned to {constraints.pinned[sid]}"
            common, options = [common[k] for k in keep], [options[k] for k in keep]
        labels = {i: [per_node[i][sig] for sig in common] for i in nodes}
        result[sid] = SiteOptions(sid, nodes, options, labels, why)
    return result


def _operand_names(graph: Graph, index: int) -> list[str]:
    return [op.name for op in graph.nodes[index].operands if op.tid is not None]


def search_axis(graph: Graph, axis: str, n: int, constraints: Constraints,
                device: DeviceSpec = DeviceSpec()) -> AxisPlan:
    refine_factors(graph)
    tensors = graph.trace.tensors
    options = site_options(graph, n, constraints)
    for sid, opts in options.items():
        if not opts.options:
            node = graph.nodes[opts.nodes[0]]
            reasons = "; ".join(f"{c}: {w}" for c, w in opts.why.items())
            raise UserError(f"no way to place {node.callee} on {n} devices ({reasons})",
                            node.span.start if node.span else None)
    sids = list(options)
    var = {sid: z3.Int(f"site{k}") for k, sid in enumerate(sids)}
    solver = z3.Optimize()
    terms = []
    layout_cache: dict[tuple[int, str], object] = {}

    def lay(index: int, choice: str):
        key = (index, choice)
        if key not in layout_cache:
            layout_cache[key] = layouts_for(graph.dims.get(index), choice, _operand_names(graph, index))
        return layout_cache[key]

    def ns(seconds: float) -> int:
        return int(round(seconds * 1e9))

    # compute, and gradient all-reduces of parameters left replicated under a split
    for sid in sids:
        opts = options[sid]
        solver.add(var[sid] >= 0, var[sid] < len(opts.options))
        for k, choice in enumerate(opts.options):
            total = 0.0
            for i in opts.nodes:
                flops = node_flops(graph.nodes[i], graph.dims.get(i), graph.trace)
                total += compute_time(flops, n if choice != REPLICATE else 1, device)
            if total:
                terms.append(z3.If(var[sid] == k, ns(total), 0))

    # conversions on every edge, summed per pair of sites
    pair_cost: dict[tuple[SiteId, SiteId], dict[tuple[int, int], float | None]] = defaultdict(dict)
    producer_out: dict[int, tuple[int, int]] = {}
    for index, node in enumerate(graph.nodes):
        for k, tid in enumerate(node.outputs):
            producer_out[tid] = (index, k)
    param_uses: dict[str, list[tuple[SiteId, dict[int, Layout]]]] = defaultdict(list)
    for node in graph.nodes:
        v = node.index
        sv = site_id(graph, v)
        v_opts = options[sv].labels[v]
        for operand in node.operands:
            if operand.tid is None:
                continue
            info = tensors[operand.tid]
            if info.param is not None:
                bias = None
                uses = {}
                for b, choice in enumerate(v_opts):
                    need = lay(v, choice).inputs[operand.name]
                    uses[b] = need
                param_uses[info.param].append((sv, uses))
                continue
            source = producer_out.get(operand.tid)
            for b, choice in enumerate(v_opts):
                need_layouts = lay(v, choice)
                need = need_layouts.inputs[operand.name]
                if source is None:
                    steps = conversion(R, need, consumer_split=need_layouts.split, requires_grad=info.requires_grad)
                    cost = conversion_time(steps, info.nbytes, n, device)
                    if cost:
                        terms.append(z3.If(var[sv] == b, ns(cost), 0))
                    continue
                u, k = source
                su = site_id(graph, u)
                for a, u_choice in enumerate(options[su].labels[u]):
                    outs = lay(u, u_choice).outputs
                    have = outs[k] if k < len(outs) else R
                    steps = conversion(have, need, consumer_split=need_layouts.split,
                                       requires_grad=info.requires_grad)
                    table = pair_cost[(su, sv)]
                    if steps is None:
                        table[(a, b)] = None
                    elif table.get((a, b), 0.0) is not None:
                        table[(a, b)] = table.get((a, b), 0.0) + conversion_time(steps, info.nbytes, n, device)
    # the loss must end up whole on every device
    if graph.trace.loss is not None and graph.trace.loss in producer_out:
        u, k = producer_out[graph.trace.loss]
        su = site_id(graph, u)
        for a, choice in enumerate(options[su].labels[u]):
            outs = lay(u, choice).outputs
            have = outs[k] if k < len(outs) else R
            cost = conversion_time(conversion(have, R, consumer_split=False, requires_grad=False),
                                   tensors[graph.trace.loss].nbytes, n, device)
            if cost:
                terms.append(z3.If(var[su] == a, ns(cost), 0))
    for (su, sv), table in pair_cost.items():
        for (a, b), cost in table.items():
            if su == sv and a != b:
                continue
            cond = var[su] == a if su == sv else z3.And(var[su] == a, var[sv] == b)
            if cost is None:
                solver.add(z3.Not(cond))
            elif cost:
                terms.append(z3.If(cond, ns(cost), 0))
    # a parameter has one layout, whoever uses it (tied weights); replicated under a split, its
    # gradient is partial and costs an all-reduce
    param_var = {}
    for p, uses in param_uses.items():
        layouts = sorted({l for _, u in uses for l in u.values()}, key=str)
        pv = param_var[p] = z3.Int(f"param_{len(param_var)}")
        solver.add(pv >= 0, pv < len(layouts))
        for sv, u in uses:
            for b, need in u.items():
                solver.add(z3.Implies(var[sv] == b, pv == layouts.index(need)))
        param_var[p] = (pv, layouts)
    objective = z3.Sum(terms) if terms else z3.IntVal(0)
    solver.minimize(objective)
    if solver.check() != z3.sat:
        raise UserError(f"no {axis} plan satisfies the constraints on {n} devices")
    model = solver.model()
    picked = {sid: model.eval(var[sid]).as_long() for sid in sids}
    site_choice = {sid: options[sid].options[k] for sid, k in picked.items()}
    node_choice = {i: options[sid].labels[i][picked[sid]] for sid in sids for i in options[sid].nodes}
    param_layout = {p: layouts[model.eval(pv).as_long()] for p, (pv, layouts) in param_var.items()}
    partial = _partial_grad_params(graph, node_choice, param_layout)
    cost = model.eval(objective).as_long() / 1e9
    for name in partial:
        cost += all_reduce_time(tensors[graph.trace.params[name].tid].nbytes, n, device)
    return AxisPlan(axis, n, site_choice, node_choice, param_layout, partial, cost, options)


def _partial_grad_params(graph: Graph, node_choice: dict[int, str], param_layout: dict[str, Layout]) -> list[str]:
    """Replicated parameters used by a split op (not as its once-added bias): partial gradients."""
    out = []
    for node in graph.nodes:
        choice = node_choice[node.index]
        if choice == REPLICATE:
            continue
        dims: OpDims | None = graph.dims.get(node.index)
        bias = graph.partial_bias(node.index) if dims and choice in dims.reduced else None
        for name, tid in graph.param_operands(node.index):
            pname = graph.trace.tensors[tid].param
            if name != bias and param_layout.get(pname, R) == R and pname not in out:
                out.append(pname)
    return out
