"""Search one mesh axis: pick, for every source site, how it is split (op-trans), under the
plan's constraints, minimising the analytical cost with z3.

Variables are per *site*, not per invocation: all instances of a site run the same source,
so they must be split alike, and a model with 96 identical blocks has the variables of one.
Constraints are tracked z3 assertions, so a contradictory set comes back as an unsat core
naming each constraint's file and line.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import z3

from ..errors import Location, UserError
from ..graph.graph import Graph
from ..materialize.conversions import conversion, conversion_time
from ..materialize.size_args import SIZE_ARGUMENTS, locate_size_argument
from ..sizes import format_bytes
from .batch import batch_labels
from .cost import DeviceSpec, all_reduce_time, node_time
from .layouts import REPLICATE, R, Layout, layouts_for
from .memory import saved_bytes
from .refine import refine_factors
from .tables import Constraint, leaves_partial_param_grad
from .whole_sizes import dims_read_whole, splits_read_size

SiteId = tuple
BYTES_PER_PARAM_STATE = 16      # fp32 weight, gradient and two AdamW moments


@dataclass
class SiteOptions:
    """The ways one site may be split. Instances of a site may name a split differently (q has
    4 heads refined to (g r), k has 2), so an option is matched across instances by the
    layouts it gives; labels[node][k] is option k's label in that instance."""

    site: SiteId
    nodes: list[int]
    options: list[str]                        # option names, from the first instance
    labels: dict[int, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)   # option -> why it is not possible


@dataclass
class AxisChoices:
    """How every invocation is split along one axis: what the rewrite needs (plan/choices.py
    reads it back from the plan IR)."""

    axis: str
    n: int
    node_choice: dict[int, str]
    param_layout: dict[str, Layout]        # canonical param name -> layout on this axis
    partial_grad_params: list[str]         # whole params whose grads need an all-reduce
    options: dict[SiteId, SiteOptions]
    chunks: dict[int, int] = field(default_factory=dict)   # node -> co-shard pieces per device (> 1)
    batch_slices: int = 1                  # pieces data parallelism and micro-batches cut the batch in


@dataclass
class AxisPlan:
    """The search's result: the choices, and what only the search knows about them."""

    choices: AxisChoices
    site_choice: dict[SiteId, str]
    cost: float                            # seconds per step, this axis's share
    memory: float                          # bytes per device: weights, optimizer state, activations
    restricted: dict[str, list[SiteId]] = field(default_factory=dict)   # constraint id -> sites it narrowed
    left_whole: list[str] = field(default_factory=list)   # warnings: weights a blanket split could not split

    @property
    def axis(self) -> str:
        return self.choices.axis

    @property
    def n(self) -> int:
        return self.choices.n

    @property
    def node_choice(self) -> dict[int, str]:
        return self.choices.node_choice

    @property
    def param_layout(self) -> dict[str, Layout]:
        return self.choices.param_layout

    @property
    def partial_grad_params(self) -> list[str]:
        return self.choices.partial_grad_params

    @property
    def options(self) -> dict[SiteId, SiteOptions]:
        return self.choices.options


def site_id(graph: Graph, index: int) -> SiteId:
    node = graph.nodes[index]
    return (node.span, node.callee) if node.span is not None and node.mapped else ("node", index)


def option_valid(graph: Graph, index: int, label: str, n: int, local_batch: dict[int, tuple[str, int]],
                 read_whole: dict[int, set]) -> str | None:
    """Why `label` cannot split this invocation n ways, or None when it can. `local_batch`:
    each op's batch label and the number of slices data parallelism and micro-batches cut it in;
    `read_whole`: the tensor dims whose full size the source reads."""
    dims = graph.dims[index]
    size = dims.sizes().get(label)
    batch_label, slices = local_batch.get(index, (None, 1))
    if size is not None and label == batch_label:
        size //= slices
    if size is None or size % n:
        return f"a dim of size {size} is not divisible by {n} devices"
    node = graph.nodes[index]
    if node.callee in SIZE_ARGUMENTS:
        out = layouts_for(dims, label, []).outputs
        if out and out[0].kind == "S":
            problem = locate_size_argument(graph, node, out[0].dim)
            if isinstance(problem, str):
                return problem
    whole = splits_read_size(graph, index, layouts_for(dims, label, _operand_names(graph, index)), read_whole)
    if whole:
        return whole
    rule = graph.node_rule.get(index)
    # a derived partial sum was probed with every other operand whole: none is added twice
    if label in dims.reduced and label not in dims.impl and not (rule is not None and rule.name == "derived"):
        bias = graph.partial_bias(index)
        for name, tensor in dims.inputs.items():
            if label not in tensor.labels() and name != bias and graph.trace.tensors[tensor.tid].shape:
                return f"splitting {label} would add {name} once per device"
    return None


def _operand_names(graph: Graph, index: int) -> list[str]:
    return [op.name for op in graph.nodes[index].operands if op.tid is not None]


def from_end(layout: Layout, ndim: int) -> Layout:
    """A split dim counted from the end: one line called on (B, S, H) in some instances and on
    (tokens, H) in others splits H as dim -1 in both (the emitted collective says `dim=-1`)."""
    return Layout("S", layout.dim - ndim, layout.groups) if layout.kind == "S" and layout.dim >= 0 else layout


def _signature(graph: Graph, index: int, label: str, operands: set[str], outputs: int):
    """The layouts a choice implies, on the operands and results every instance of the site has
    (one call site may pass an optional mask in some instances and not in others), split dims
    counted from the end so that instances of different ranks can agree."""
    node = graph.nodes[index]
    tensors = graph.trace.tensors
    lay = layouts_for(graph.dims.get(index), label, _operand_names(graph, index))
    ins = tuple(sorted((k, str(from_end(v, len(tensors[node.operand(k).tid].shape))))
                       for k, v in lay.inputs.items() if k in operands))
    outs = tuple(str(from_end(lay.outputs[k], len(tensors[node.outputs[k]].shape))) if k < len(lay.outputs)
                 else str(R) for k in range(outputs))         # an instance with no rule: whole results
    return ins, outs


def site_options(graph: Graph, n: int, batch_slices: int = 1, every_size_read: bool = False) -> dict[SiteId, SiteOptions]:
    """Every valid way to split each site n ways (constraints of the plan come later), on a
    batch cut in `batch_slices` by data parallelism and micro-batches; `every_size_read`: see
    dims_read_whole."""
    local_batch = {i: (label, batch_slices) for i, label in batch_labels(graph).items()} if batch_slices > 1 else {}
    read_whole = dims_read_whole(graph, every_size_read)
    grouped: dict[SiteId, list[int]] = defaultdict(list)
    for node in graph.nodes:
        grouped[site_id(graph, node.index)].append(node.index)
    result = {}
    for sid, nodes in grouped.items():
        why: dict[str, str] = {}
        per_node: dict[int, dict] = {}
        splittable = sid[0] != "node" and all(i in graph.dims for i in nodes)
        operands = set.intersection(*(set(_operand_names(graph, i)) for i in nodes))
        outputs = min(len(graph.nodes[i].outputs) for i in nodes)
        for i in nodes:
            allowed = {}
            for label in [REPLICATE, *(graph.dims[i].splittable() if splittable else [])]:
                reason = option_valid(graph, i, label, n, local_batch, read_whole) if label != REPLICATE else None
                if reason:
                    why.setdefault(label, reason)
                else:
                    allowed.setdefault(_signature(graph, i, label, operands, outputs), label)
            per_node[i] = allowed
        first = per_node[nodes[0]]
        common = [sig for sig in first if all(sig in per_node[i] for i in nodes)]
        result[sid] = SiteOptions(sid, nodes, [first[s] for s in common],
                                  {i: [per_node[i][s] for s in common] for i in nodes}, why)
    return result


def search_axis(graph: Graph, axis: str, n: int, constraints: list[Constraint],
                device: DeviceSpec = DeviceSpec(), *, memory_budget: float | None = None,
                data_parallel: int = 1, micro_batches: int = 1, every_size_read: bool = False) -> AxisPlan:
    """The cheapest per-site split satisfying `constraints`; `data_parallel` divides the batch,
    and each data-parallel slice runs in `micro_batches` pieces."""
    refine_factors(graph)
    tensors = graph.trace.tensors
    options = site_options(graph, n, data_parallel * micro_batches, every_size_read)
    sids = list(options)
    var = {sid: z3.Int(f"site{k}") for k, sid in enumerate(sids)}
    hard: list = []
    tracked: list[tuple[z3.BoolRef, z3.BoolRef, Constraint]] = []
    restricted: dict[str, list[SiteId]] = defaultdict(list)
    blocked: dict[str, SiteId] = {}      # a constraint's literal -> the site it leaves no option
    left_whole: list[str] = []           # warnings: weight matrices no valid split of this instance splits
    for sid in sids:
        if not options[sid].options:        # never expected: replicating fits every instance
            raise UserError(f"internal error: the calls of {sid[1]} here agree on no layout, not even whole "
                            "(please report it)", _site_location(graph, options, sid))
        hard += [var[sid] >= 0, var[sid] < len(options[sid].options)]
    for constraint in constraints:
        narrowed = []
        for sid in sids:
            opts = options[sid]
            selected = [i for i in opts.nodes if constraint.selects(graph, i)]
            if selected:
                narrowed.append((sid, [k for k in range(len(opts.options))
                                       if all(constraint.allows(graph, i, opts.labels[i][k]) for i in selected)]))
        # a blanket split that fits some weights leaves the others whole; one that fits none
        # stays hard, so that the unsat core says which sizes do not divide
        cannot = {sid for sid, allowed in narrowed if not allowed and _weights_cannot_split_here(constraint, options[sid])}
        if len(cannot) == len(narrowed):
            cannot = set()
        for sid, allowed in narrowed:
            opts = options[sid]
            if sid in cannot:
                left_whole.append(_left_whole_warning(graph, options, sid, n))
                continue
            if len(allowed) < len(opts.options):
                restricted[constraint.id].append(sid)
                literal = z3.Bool(f"{constraint.id}#{len(tracked)}")
                if not allowed:
                    blocked[str(literal)] = sid
                tracked.append((literal, z3.Or([var[sid] == k for k in allowed]) if allowed else z3.BoolVal(False),
                                constraint))

    uses = _param_uses(graph, options)
    terms, memory_terms, impossible, disagree = _cost_terms(graph, options, var, n, device, data_parallel, uses)
    # The model's own facts (a tied weight has one layout, no collective joins some pairs of
    # splits, one line's argument gets one conversion) are tracked too, so that an unsat core
    # always names sites, never nothing.
    facts = [*_param_facts(graph, options, uses, var), *_edge_facts(graph, options, impossible),
             *_agreement_facts(graph, options, disagree)]
    hard += [expr for _, expr, _ in facts]

    checker = z3.Solver()
    checker.add(*hard[:len(hard) - len(facts)])
    for literal, expr, constraint in [*tracked, *facts]:
        checker.assert_and_track(expr, literal)
    if checker.check() != z3.sat:
        _report_core(checker.unsat_core(), [*tracked, *facts], options, axis, n, graph, blocked)

    model = _minimize(hard + [expr for _, expr, _ in tracked], terms, memory_terms, memory_budget, axis, n)
    picked = {sid: model.eval(var[sid]).as_long() for sid in sids}
    node_choice = {i: options[sid].labels[i][picked[sid]] for sid in sids for i in options[sid].nodes}
    param_layout = {p: entries[0][1][picked[entries[0][0]]] for p, entries in uses.items()}
    partial = _partial_grad_params(graph, node_choice)
    cost = _weighed(model, terms) / 1e9
    for name in partial:
        cost += all_reduce_time(tensors[graph.trace.params[name].tid].nbytes, n, device)
    memory = _weighed(model, memory_terms)
    choices = AxisChoices(axis, n, node_choice, param_layout, partial, options)
    return AxisPlan(choices, {sid: options[sid].options[k] for sid, k in picked.items()}, cost, float(memory),
                    dict(restricted), left_whole)


def _weights_cannot_split_here(constraint: Constraint, opts: SiteOptions) -> bool:
    """A plan's blanket "split every weight matrix" meets a site none of whose valid options
    splits its weights (its sizes do not divide, or the source reads their full size): the
    site runs whole, with a warning, rather than making the plan unsatisfiable. A constraint
    naming the site (by callee, module or line) stays hard."""
    return constraint.algo == "split" and constraint.select == {"params": "matrix"} and bool(opts.why)


def _left_whole_warning(graph: Graph, options, sid: SiteId, n: int) -> str:
    reasons = "; ".join(sorted(set(options[sid].why.values())))
    where = _site_location(graph, options, sid) or "?"
    return (f"{where}: warning: {sid[1]} keeps its weights whole on every tensor-parallel rank: no split of them "
            f"works {n} ways here ({reasons})")


Weighted = list[tuple[z3.BoolRef, int]]     # a sum: each weight counts when its condition holds


def _weighed(model, terms: Weighted) -> int:
    return sum(w for cond, w in terms if z3.is_true(model.eval(cond, model_completion=True)))


def _minimize(constraints: list, time: Weighted, memory: Weighted, budget: float | None, axis: str, n: int):
    """The cheapest assignment when it fits the budget, else the one using least memory,
    cheapest among those. (z3 with the budget as a hard bound takes minutes; two optimisations
    take seconds. Merging equal terms is what makes a 7B model's axis fast: 20.6 -> 7.4 s in z3.
    Weighted MaxSAT was as fast but broke ties differently, and its pick for hf_llama at
    TP=2 x DP=2 hit a rotary broadcast the dry run refuses: a latent bug, not yet found.)"""
    def total(terms: Weighted):
        merged: dict[int, list] = {}            # z3 shares equal terms: one If each
        for cond, w in terms:
            if w > 0:
                merged.setdefault(cond.get_id(), [cond, 0])[1] += w
        return z3.Sum([z3.If(cond, w, 0) for cond, w in merged.values()]) if merged else z3.IntVal(0)

    solver = z3.Optimize()
    solver.add(*constraints)
    solver.minimize(total(time))
    solver.check()
    model = solver.model()
    if budget is None or _weighed(model, memory) <= budget:
        return model
    solver = z3.Optimize()
    solver.set(priority="lex")
    solver.add(*constraints)
    solver.minimize(total(memory))
    solver.minimize(total(time))
    solver.check()
    model = solver.model()
    least = _weighed(model, memory)
    if least > budget:
        raise UserError(f"no {axis} plan on {n} devices fits the memory budget: the least it needs is "
                        f"{format_bytes(least)} per device, the budget is {format_bytes(budget)}",
                        hint="raise --memory-budget, or use more devices")
    return model


def _report_core(core, tracked, options, axis: str, n: int, graph: Graph, blocked: dict) -> None:
    names = {str(c) for c in core}
    related: list[tuple[Location, str]] = []
    seen = set()
    for literal, _, constraint in tracked:
        if str(literal) not in names:
            continue
        key, item = constraint.id, (constraint.location, constraint.describe())
        if key not in seen:
            seen.add(key)
            related.append(item)
        sid = blocked.get(str(literal))
        if sid is not None:       # the constraint leaves this site no option at all: say which and why
            why = "; ".join(sorted(set(options[sid].why.values()))) or "none of its splits is one the constraint allows"
            related.append((_site_location(graph, options, sid),
                            f"{graph.nodes[options[sid].nodes[0]].callee} cannot be split that way: {why}"))
    hint = "drop or relax one of the constraints listed (the unsat core)"
    sizes = sorted({int(s) for _, text in related for s in re.findall(r"size (\d+) is not divisible", text)},
                   reverse=True)
    if sizes:       # a size that does not divide: say which, and what would
        common = math.gcd(*sizes)
        fits = [d for d in range(2, min(common, 64) + 1) if common % d == 0][:4]
        hint = (f"{', '.join(map(str, sizes))} {'is' if len(sizes) == 1 else 'are'} not divisible by {n}: "
                + (f"use --{axis} {' or '.join(map(str, fits))}, or " if fits else "")
                + "change the sizes, or " + hint)
    raise UserError(f"no {axis} plan on {n} devices satisfies these {len(seen)} constraints together",
                    related[0][0] if related else None, related=related, hint=hint)


def _partial_grad_params(graph: Graph, node_choice: dict[int, str]) -> list[str]:
    out: list[str] = []
    for node in graph.nodes:
        label = node_choice[node.index]
        if node.index in graph.dims and leaves_partial_param_grad(graph, node.index, label):
            dims = graph.dims[node.index]
            bias = graph.partial_bias(node.index) if label in dims.reduced else None
            for name, tid in graph.param_operands(node.index):
                pname = graph.trace.tensors[tid].param
                if name != bias and (name not in dims.inputs or dims.inputs[name].where(label) is None) \
                        and pname not in out:
                    out.append(pname)
    return out


def _param_uses(graph: Graph, options) -> dict[str, list[tuple[SiteId, list[Layout]]]]:
    """Per parameter, the sites using it and the layout each of their options gives it."""
    uses: dict[str, list[tuple[SiteId, list[Layout]]]] = defaultdict(list)
    for sid, opts in options.items():
        i = opts.nodes[0]   # option k gives the same layouts in every instance of a site
        names = _operand_names(graph, i)
        for node in opts.nodes:
            for name, tid in graph.param_operands(node):
                param = graph.trace.tensors[tid].param
                if any(s == sid for s, _ in uses[param]):
                    continue
                layouts = [layouts_for(graph.dims.get(i), label, names).inputs[name] for label in opts.labels[i]]
                uses[param].append((sid, layouts))
    return uses


@dataclass(frozen=True)
class _Fact:
    """A constraint the model itself imposes, in the shape of a table's for the unsat core."""

    id: str
    location: Location | None
    text: str

    def describe(self) -> str:
        return self.text


def _site_location(graph: Graph, options, sid) -> Location | None:
    node = graph.nodes[options[sid].nodes[0]]
    return node.span.start if node.span is not None else None


def _param_facts(graph: Graph, options, uses, var) -> list:
    """A parameter has one layout, whoever uses it: tied weights stay tied."""
    facts = []
    for param, entries in uses.items():
        (first, first_layouts), *others = entries
        hard = [z3.Not(z3.And(var[first] == a, var[sid] == b))
                for sid, layouts in others for a, la in enumerate(first_layouts)
                for b, lb in enumerate(layouts) if la != lb]
        if hard:
            callees = ", ".join(sorted({sid[1] if sid[0] != "node" else graph.nodes[sid[1]].callee
                                        for sid, _ in entries}))
            fact = _Fact(f"param:{param}", _site_location(graph, options, first),
                         f"{param} is one tensor used by {callees}: they must agree on how it is split")
            facts.append((z3.Bool(fact.id), z3.And(hard), fact))
    return facts


def _edge_facts(graph: Graph, options, impossible: dict) -> list:
    """Pairs of splits no collective sequence connects, one fact per producer and consumer."""
    facts = []
    for (su, sv), hard in impossible.items():
        producer, consumer = (graph.nodes[options[s].nodes[0]] for s in (su, sv))
        where = producer.span.start if producer.span is not None else "?"
        fact = _Fact(f"edge:{len(facts)}", _site_location(graph, options, sv),
                     f"no collective turns the result of {producer.callee} ({where}) into the layout "
                     f"{consumer.callee} needs")
        facts.append((z3.Bool(fact.id), z3.And(hard), fact))
    return facts


def _agreement_facts(graph: Graph, options, disagree: dict) -> list:
    facts = []
    for (sv, name), hard in disagree.items():
        consumer = graph.nodes[options[sv].nodes[0]]
        fact = _Fact(f"agree:{len(facts)}", _site_location(graph, options, sv),
                     f"{consumer.callee} takes its {name} from different producers in different calls: "
                     f"they must hand it over in layouts that need the same conversion")
        facts.append((z3.Bool(fact.id), z3.And(hard), fact))
    return facts


def _cost_terms(graph: Graph, options, var, n: int, device: DeviceSpec, data_parallel: int, uses):
    """z3 terms of the step time (ns), of the memory per device (bytes), and the pairs of
    choices no collective sequence can connect."""
    tensors = graph.trace.tensors
    layout_cache: dict = {}

    def lay(index: int, label: str):
        if (index, label) not in layout_cache:
            layout_cache[(index, label)] = layouts_for(graph.dims.get(index), label, _operand_names(graph, index))
        return layout_cache[(index, label)]

    def ns(seconds: float) -> int:
        return int(round(seconds * 1e9 / data_parallel))

    def shapes(index: int) -> tuple:
        node = graph.nodes[index]
        return (tuple((tensors[o.tid].shape, tensors[o.tid].dtype) for o in node.operands if o.tid is not None),
                tuple(tensors[t].shape for t in node.outputs))

    # A model's repeated blocks call each site with the same shapes: price each once.
    priced: dict[tuple, tuple[float, float]] = {}

    def price(sid: SiteId, index: int, label: str) -> tuple[float, float]:
        key = (sid, label, shapes(index))
        if key not in priced:
            ways = n if label != REPLICATE else 1
            seconds = node_time(graph.nodes[index], graph.dims.get(index), graph.trace, device, ways,
                                dims_of=graph.dims.get)
            if graph.dims.get(index) is not None and leaves_partial_param_grad(graph, index, label):
                seconds += sum(all_reduce_time(tensors[tid].nbytes, n, device)
                               for _, tid in graph.param_operands(index))
            priced[key] = seconds, saved_bytes(graph.nodes[index], graph.trace) / ways
        return priced[key]

    terms, activation = [], []
    impossible: dict[tuple[SiteId, SiteId], list] = defaultdict(list)
    for sid, opts in options.items():
        for k in range(len(opts.options)):
            total, saved = 0.0, 0.0
            for i in opts.nodes:
                seconds, kept = price(sid, i, opts.labels[i][k])
                total += seconds
                saved += kept
            if total:
                terms.append((var[sid] == k, ns(total)))
            if saved:
                activation.append((var[sid] == k, int(saved / data_parallel)))

    producer_out = {tid: (node.index, k) for node in graph.nodes for k, tid in enumerate(node.outputs)}

    def rank_in(index: int, name: str) -> int:
        return len(tensors[graph.nodes[index].operand(name).tid].shape)

    def rank_out(index: int, k: int) -> int:
        outputs = graph.nodes[index].outputs
        return len(tensors[outputs[k]].shape) if k < len(outputs) else 0
    # Option k of a site gives the same layouts in every instance, so an edge's cost depends only
    # on which sites, output and operand it joins: count edges, cost each kind once.
    edges: dict[tuple, int] = defaultdict(int)
    consumer_of: dict[tuple, int] = {}    # an instance that has the operand (optional ones may be absent)
    for node in graph.nodes:
        sv = site_id(graph, node.index)
        for operand in node.operands:
            if operand.tid is None or tensors[operand.tid].param is not None:
                continue
            info = tensors[operand.tid]
            source = producer_out.get(operand.tid)
            su, k = (site_id(graph, source[0]), source[1]) if source else (None, None)
            key = (su, k, sv, operand.name, info.nbytes, info.requires_grad, len(info.shape))
            edges[key] += 1
            consumer_of.setdefault(key, node.index)
    pair_cost: dict[tuple[SiteId, SiteId], dict[tuple[int, int], float | None]] = defaultdict(dict)
    for key, count in edges.items():
        su, k, sv, name, nbytes, requires_grad, _ = key
        v = consumer_of[key]
        for b, label in enumerate(options[sv].labels[v]):
            wanted = lay(v, label)
            need = from_end(wanted.inputs[name], rank_in(v, name))
            if su is None:
                steps = conversion(R, need, consumer_split=wanted.split, requires_grad=requires_grad)
                cost = count * conversion_time(steps, nbytes, n, device)
                if cost:
                    terms.append((var[sv] == b, ns(cost)))
                continue
            u = options[su].nodes[0]
            table = pair_cost[(su, sv)]
            for a, u_label in enumerate(options[su].labels[u]):
                outs = lay(u, u_label).outputs
                steps = conversion(from_end(outs[k], rank_out(u, k)) if k < len(outs) else R, need,
                                   consumer_split=wanted.split, requires_grad=requires_grad)
                if steps is None:
                    table[(a, b)] = None
                elif table.get((a, b), 0.0) is not None:
                    table[(a, b)] = table.get((a, b), 0.0) + count * conversion_time(steps, nbytes, n, device)
    loss_source = None
    if graph.trace.loss is not None and graph.trace.loss in producer_out:
        u, k = producer_out[graph.trace.loss]
        loss_source = (site_id(graph, u), k)
    disagree = _disagreeing_sources(graph, options, edges, consumer_of, lay, var, loss_source, rank_in, rank_out)
    loss = graph.trace.loss
    if loss is not None and loss in producer_out:
        u, k = producer_out[loss]
        su = site_id(graph, u)
        for a, label in enumerate(options[su].labels[u]):
            outs = lay(u, label).outputs
            steps = conversion(outs[k] if k < len(outs) else R, R, consumer_split=False, requires_grad=False)
            cost = conversion_time(steps, tensors[loss].nbytes, n, device)
            if cost:
                terms.append((var[su] == a, ns(cost)))
    for (su, sv), table in pair_cost.items():
        for (a, b), cost in table.items():
            if su == sv and a != b:
                continue
            cond = var[su] == a if su == sv else z3.And(var[su] == a, var[sv] == b)
            if cost is None:
                impossible[(su, sv)].append(z3.Not(cond))    # no collective sequence gives this layout
            elif cost:
                terms.append((cond, ns(cost)))

    # weights, gradients and optimizer state, counted at the first site that uses each parameter
    for param, ((sid, layouts), *_) in uses.items():
        size = tensors[graph.trace.params[param].tid].nbytes // 4 * BYTES_PER_PARAM_STATE
        for k, layout in enumerate(layouts):
            activation.append((var[sid] == k, size // (n if layout.kind == "S" else 1)))

    return terms, activation, impossible, disagree


def _disagreeing_sources(graph: Graph, options, edges, consumer_of, lay, var, loss_source, rank_in,
                         rank_out) -> dict:
    """An argument written once in source but fed by different producers in different instances
    (a block's input: the embedding first, the previous block's residual after) gets one
    conversion on its line, so what each producer leaves to it must be the same. What a producer
    leaves: its conversion to that argument, less the steps all its uses share (those go on the
    producer's result, as materialize/edits.py writes them).

    In z3, per producer output: each use's steps as codes by position, the length of the prefix
    they share, and per shared argument the code of what is left; the codes must be equal. Every
    term joins the producer's choice with one consumer's, so a value read by many sites costs
    terms in proportion, not in product."""
    instance: dict[tuple, int] = {}
    grad: dict[tuple, bool] = defaultdict(bool)
    feeds: dict[tuple, set] = defaultdict(set)       # producer output -> arguments it feeds
    sources: dict[tuple, set] = defaultdict(set)     # argument -> producer outputs feeding it
    for key in edges:
        su, k, sv, name, _, requires_grad, _ = key
        argument = (sv, name)
        instance.setdefault(argument, consumer_of[key])
        grad[argument] |= requires_grad
        sources[argument].add((su, k))
        feeds[(su, k)].add(argument)
    shared = {argument for argument, feeding in sources.items() if len(feeding) > 1}
    codes: dict[str, int] = {"absent": -1}
    terms: dict[tuple, list] = defaultdict(list)
    left: dict[tuple, z3.ArithRef] = {}             # (producer output, argument) -> what is left, coded
    for n_source, source in enumerate(sorted({s for a in shared for s in sources[a]}, key=str)):
        su, k = source
        u = options[su].nodes[0] if su is not None else None
        haves = [R] if su is None else [
            from_end(outs[k], rank_out(u, k)) if k < len(outs) else R
            for outs in (lay(u, label).outputs for label in options[su].labels[u])]
        uses = sorted(feeds[source], key=str) + (["loss"] if source == loss_source else [])
        table = {}                                   # (use, producer option, consumer option) -> steps
        for use in uses:
            consumer_options = [None] if use == "loss" else range(len(options[use[0]].options))
            for a, have in enumerate(haves):
                for b in consumer_options:
                    if use == "loss":
                        need, split, needs_grad = R, False, False
                    else:
                        v = instance[use]
                        wanted = lay(v, options[use[0]].labels[v][b])
                        need, split, needs_grad = from_end(wanted.inputs[use[1]], rank_in(v, use[1])), \
                            wanted.split, grad[use]
                    steps = conversion(have, need, consumer_split=split, requires_grad=needs_grad)
                    if steps is not None:    # pairs no collective joins are ruled out by the edge facts
                        table[(use, a, b)] = steps
        depth = max((len(steps) for steps in table.values()), default=0)
        wraps = su is not None and graph.result_wrappable(graph.nodes[u])
        # the steps each use needs, position by position, as codes
        step_at = {(use, p): z3.Int(f"src{n_source}_{uses.index(use)}_{p}") for use in uses for p in range(depth)}
        definitions = []
        for (use, a, b), steps in table.items():
            chosen = [var[su] == a] if su is not None else []
            chosen += [var[use[0]] == b] if use != "loss" else []
            for p in range(depth):
                code = codes.setdefault(str(steps[p]), len(codes)) if p < len(steps) else -1
                definitions.append(z3.Implies(z3.And(chosen), step_at[(use, p)] == code))
        prefix = z3.Int(f"src{n_source}_prefix")     # how many leading steps every use shares
        shares = [z3.And([step_at[(use, p)] == step_at[(uses[0], p)] for use in uses] +
                         [step_at[(uses[0], p)] != -1]) for p in range(depth)] if wraps else []
        # all the shared steps, or none: the rewrite keeps a producer's steps off its result where
        # they would leave an argument's instances different conversions
        definitions.append(z3.Or(prefix == 0, prefix == z3.Sum([z3.If(z3.And(shares[:p + 1]), 1, 0)
                                                                 for p in range(len(shares))]))
                           if shares else prefix == 0)
        for (use, a, b), steps in table.items():
            if use == "loss" or use not in shared:
                continue
            rest = left.setdefault((source, use), z3.Int(f"src{n_source}_left{len(left)}"))
            chosen = ([var[su] == a] if su is not None else []) + [var[use[0]] == b]
            for p in range(len(steps) + 1):
                code = codes.setdefault(str(steps[p:]), len(codes))
                definitions.append(z3.Implies(z3.And(chosen + [prefix == p]), rest == code))
        terms[next(use for use in uses if use in shared)] += definitions
    for argument in shared:
        remainders = [left[(s, argument)] for s in sorted(sources[argument], key=str) if (s, argument) in left]
        terms[argument] += [x == remainders[0] for x in remainders[1:]]
    return {argument: hard for argument, hard in terms.items() if hard}
