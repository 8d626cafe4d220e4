"""Search one mesh axis: pick, for every source site, how it is split (op-trans), under the
plan's constraints, minimising the analytical cost with z3.

Variables are per *site*, not per invocation: all instances of a site run the same source,
so they must be split alike, and a model with 96 identical blocks has the variables of one.
Constraints are tracked z3 assertions, so a contradictory set comes back as an unsat core
naming each constraint's file and line.
"""
from __future__ import annotations

import dataclasses
import functools

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import libcst as cst
import z3

from ..errors import Location, UserError
from ..graph.graph import Graph
from ..trace.records import Operand
from ..graph.mixed import mixed_edges
from ..materialize.conversions import conversion, conversion_time, fusing
from ..materialize.buffers import buffer_split_problem
from ..materialize.size_args import SIZE_ARGUMENTS, factory_size, locate_size_argument, shape_names
from ..sizes import format_bytes
from .batch import batch_labels
from .cost import DeviceSpec, all_reduce_time, node_time
from .eliminate import Combination, GaveUp, TooWide, minimize_avoiding
from .instances import instance_groups, mixed_lines
from .layouts import REPLICATE, R, Layout, layouts_for
from .memory import saved_bytes
from .refine import refine_factors
from .tables import Constraint, _matrices, leaves_partial_param_grad, residual_labels, splits_every_matrix
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
    mixed: bool = False         # its instances run layers that split differently (options dropped)
    whole_because: str | None = None    # why the site cannot split at all, whatever its sizes
    unlike_instances: str | None = None  # its instances' own splits, where they share none (one line, unlike layers)


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


def line_id(graph: Graph, index: int) -> SiteId:
    """The site of an invocation as its source line has it: (span, callee), every instance alike."""
    node = graph.nodes[index]
    return (node.span, node.callee) if node.span is not None and (node.mapped or index in graph.unpackings) \
        else ("node", index)


def site_id(graph: Graph, index: int) -> SiteId:
    """The plan's variable for an invocation: its line's, or (span, callee, group) where the
    instances of its method split unalike and are planned per group (plan/instances.py)."""
    sid = line_id(graph, index)
    group = instance_groups(graph).of_node.get(index) if sid[0] != "node" else None
    return (*sid, group) if group is not None else sid


def in_mixed_container(graph: Graph, span) -> bool:
    """A layer of an nn.Sequential whose calls from this line run different layers: no edit can
    be written between its layers (there is one source line for all), only around the call, so
    it splits only where its layers need no conversion between them (_mixed_facts), else runs
    whole (a loop calling different layers from one line: runs_unlike_layers)."""
    return bool(span.via) and dataclasses.replace(span, via=()) in mixed_lines(graph)


def runs_unlike_layers(graph: Graph, span) -> bool:
    """A line that calls layers of different classes from one call (a loop over a model's
    children, `for name, module in self.items(): x = module(x)`): its argument can take only one
    conversion, and a split layer and a whole one need different ones, so its layers run whole."""
    cache = _search_cache(graph)
    if "unlike_lines" not in cache:
        callees: dict = defaultdict(set)
        for node in graph.nodes:
            if node.span is not None and not node.span.via and node.callee_kind == "module":
                callees[node.span].add(node.callee)
        # a block with a forward of its own leaves no op on the line that calls it, yet takes the
        # line's conversion too (`for module in self: x = module(x)` over blocks and a head): the
        # children of one module called in turn from one line (not an nn.Sequential's, which the
        # rewrite cuts apart; not one line's calls in unlike instances, grouped in plan/instances.py)
        trace = graph.trace
        classes: dict = defaultdict(set)
        for path, (line, _) in trace.module_calls.items():
            if not line.via and line not in trace.containers:
                classes[(line, path.rpartition(".")[0])].add(trace.module_types.get(path))
        cache["unlike_lines"] = {line for line, called in callees.items() if len(called) > 1} | {
            line for (line, _), called in classes.items() if len(called) > 1}
    return span in cache["unlike_lines"]


def _divides(size: int | None, n: int) -> str | None:
    if size is None or size % n:
        return f"a dim of size {size} is not divisible by {n} devices"
    return None


def _split_problems(graph: Graph, index: int, labels: list[str], read_whole: dict[int, set]) -> list[str | None]:
    """What rules a split by each label out whatever the number of devices: a size argument or a
    size the source reads that it would make wrong, a whole operand it would add once per device.
    (Asked for every invocation and label of a model: AlphaFold2's 115,647; what does not depend
    on the label is looked up once.) _split_context lists what it reads: keep the two together."""
    if labels == [REPLICATE]:       # (an invocation with no rule)
        return [None]
    dims = graph.dims[index]
    node = graph.nodes[index]
    tensors = graph.trace.tensors
    sized = node.callee in SIZE_ARGUMENTS
    reads = any(t in read_whole for t in node.outputs) or any(
        op.tid in read_whole for op in node.operands if op.tid is not None)
    buffers = any(tensors[op.tid].buffer is not None for op in node.operands if op.tid is not None)
    param_operands = graph.param_operands(index)
    rule = graph.node_rule.get(index)
    bias = graph.partial_bias(index)
    structure = _structure(graph, index)
    layouts_of = _search_table(graph, "layouts by structure")      # (_layout's, looked up here first)

    def problem(label: str) -> str | None:
        if sized:
            out = layouts_for(dims, label, []).outputs
            if out and out[0].kind == "S":
                found = locate_size_argument(graph, node, out[0].dim)
                if isinstance(found, str):
                    return found
        layouts = layouts_of.get((structure, label)) or _layout(graph, index, label)
        if reads:
            whole = splits_read_size(graph, index, layouts, read_whole)
            if whole:
                return whole
        for name, tid in param_operands:
            layout = layouts.inputs.get(name)
            if layout is not None and layout.kind == "S":
                found = parameter_size_problem(graph, tensors[tid].param, layout.dim)
                if found:
                    return found
        if buffers:
            params = {tensors[tid].param: layouts.inputs[name] for name, tid in param_operands if name in layouts.inputs}
            found = buffer_split_problem(graph, index, layouts.inputs, params)
            if found:
                return found
        if label not in dims.reduced:
            return None
        if bias is not None and node.operand(bias) is not None and node.operand(bias).tid is not None and \
                not graph.result_wrappable(node):
            # the rewrite adds the bias to the reduced result (materialize/edits.py _check_biases_added)
            return "its bias is added once after its partial sums are reduced, and its result is stored or " \
                   "unpacked where it is made, so the reduction cannot be written on it"
        # a derived partial sum was probed with every other operand whole: none is added twice
        if label not in dims.impl and not (rule is not None and rule.name == "derived"):
            for name, tensor in dims.inputs.items():
                if label not in tensor.labels() and name != bias and tensors[tensor.tid].shape:
                    return f"splitting {label} would add {name} once per device"
        return None
    return [problem(label) if label != REPLICATE else None for label in labels]


def _split_context(graph: Graph, index: int, read_whole: dict[int, set]) -> tuple | None:
    """All that _split_problems reads of an invocation besides its _structure (keep the two
    together: a check added there reads something to add here), so that a block's repeats derive
    their candidates once. None where it reads the call's own size arguments or buffers, or records
    what it finds (parameters built by a factory in the model file): those derive on their own."""
    node = graph.nodes[index]
    dims = graph.dims.get(index)
    tensors = graph.trace.tensors
    if dims is None or node.callee in SIZE_ARGUMENTS or any(
            tensors[op.tid].buffer is not None for op in node.operands if op.tid is not None) or any(
            _factory_built(graph, tensors[tid].param) for _, tid in graph.param_operands(index)):
        return None
    reads = tuple((k, frozenset(read_whole[t])) for k, t in enumerate(node.outputs) if t in read_whole) + tuple(
        (k, op.name, frozenset(read_whole[op.tid])) for k, op in enumerate(node.operands) if op.tid in read_whole)
    rule = graph.node_rule.get(index)
    bias = graph.partial_bias(index)
    added = bias is not None and dims.reduced and node.operand(bias) is not None and node.operand(bias).tid is not None
    return (node.callee, frozenset(dims.fixed), frozenset(dims.impl), rule.name if rule is not None else None, bias,
            graph.result_wrappable(node) if added else None, reads)


def parameter_size_problem(graph: Graph, param: str | None, dim: int) -> str | None:
    """Why splitting `param` on `dim` cannot be written at its construction, or None. A parameter
    made in the model file by a tensor factory (`nn.Parameter(init * torch.ones(n))`) is built at
    its local size by dividing the factory's size argument; where that argument cannot be found
    the parameter stays whole (and the split that needs it is not an option), with a warning."""
    if not _factory_built(graph, param):
        return None
    info = graph.trace.params[param]
    rank = len(info.shape)
    dim %= max(rank, 1)
    found = _search_table(graph, "factory_sizes")
    if (param, dim) not in found:
        span = info.ctor_span
        source = graph.sources.get(span.path)
        call = source.node_at(span.line, span.col, span.end_line, span.end_col)
        if not isinstance(call, cst.Call):
            found[(param, dim)] = "cannot find its constructor call"
        else:
            function = call
            while function is not None and not isinstance(function, cst.FunctionDef):
                function = source.parents.get(function)
            size = factory_size(call, dim, rank, shape_names(function))
            found[(param, dim)] = size if isinstance(size, str) else None
    problem = found[(param, dim)]
    return f"parameter {param} stays whole: {problem}" if problem else None


def _factory_built(graph: Graph, param: str | None) -> bool:
    """A parameter the model file makes with a tensor factory, whose size argument a split must
    divide (parameter_size_problem); a layer without such a rule is built whole and cut after
    build() (materialize/edits.py)."""
    info = graph.trace.params.get(param) if param is not None else None
    if info is None or info.ctor_span is None or graph.sources is None:
        return False
    rule = graph.rules.ctor_for(info.module_type)
    return rule is not None and (rule.params.get(info.attr) or rule.params.get("*")) == [["*"]]


def params_kept_whole(graph: Graph, param_layout: dict[str, Layout]) -> list[str]:
    """Warnings, at each constructor, for the factory-made parameters a split would have needed
    at their local size, which the rewrite cannot write: they stay whole on every rank."""
    kept: dict[tuple, list[str]] = {}      # (constructor, dim, why) -> parameters (a block's instances)
    for (param, dim), problem in sorted(_search_cache(graph).get("factory_sizes", {}).items()):
        if problem and param_layout.get(param, R).kind != "S":
            kept.setdefault((graph.trace.params[param].ctor_span, dim, problem), []).append(param)
    out = []
    for (span, dim, problem), params in kept.items():
        more = f" (and {len(params) - 1} more made there)" if len(params) > 1 else ""
        out.append(f"{span.start}: warning: {params[0]}{more} stays whole on every tensor-parallel rank: split on "
                   f"dim {dim} it would be built at its local size, but {problem}; the ops using it run whole "
                   "(write the sizes out in the factory call, as in nn.Parameter(torch.ones(n)), to split it)")
    return out


def _operand_names(graph: Graph, index: int) -> list[str]:
    return [op.name for op in graph.nodes[index].operands if op.tid is not None]


def _kept_operand_names(graph: Graph, index: int) -> tuple[str, ...]:
    """_operand_names, kept per graph (the search asks for each invocation's once per label)."""
    cache = _search_table(graph, "operand names")
    found = cache.get(index)
    if found is None:
        found = cache[index] = tuple(_operand_names(graph, index))
    return found


def _end_name(layout: Layout, ndim: int) -> str:
    """str(from_end(layout, ndim)), without making a Layout where nothing is split."""
    return layout.kind if layout.kind != "S" else str(from_end(layout, ndim))


def from_end(layout: Layout, ndim: int) -> Layout:
    """A split dim counted from the end: one line called on (B, S, H) in some instances and on
    (tokens, H) in others splits H as dim -1 in both (the emitted collective says `dim=-1`)."""
    return Layout("S", layout.dim - ndim, layout.groups) if layout.kind == "S" and layout.dim >= 0 else layout


def _operands_by_name(graph: Graph, index: int) -> dict[str, Operand]:
    """node.operand(name) for every name of an invocation, kept per graph."""
    cache = _search_table(graph, "operands by name")
    found = cache.get(index)
    if found is None:
        found = cache[index] = {}
        for op in graph.nodes[index].operands:
            found.setdefault(op.name, op)
    return found


def _structure(graph: Graph, index: int) -> int:
    """All that _signature and _layout read of an invocation (its operand names, the factors of
    each operand's and result's dims, its reduced labels, the ranks), numbered: a block's repeats
    have equal structures, so their layouts are derived once (thousands of invocations in a deep
    model), and a number hashes faster than the tuple."""
    cache = graph.__dict__.get("_structures")     # (asked per invocation and label: no call to find it)
    if cache is None:
        cache = graph.__dict__["_structures"] = _search_table(graph, "structures")
    found = cache.get(index)
    if found is not None:
        return found
    numbers = _search_table(graph, "structure numbers")
    dims = graph.dims.get(index)
    names = _kept_operand_names(graph, index)
    named = _operands_by_name(graph, index)
    tensors = graph.trace.tensors
    ranks = tuple(len(tensors[named[k].tid].shape) for k in names)
    out_ranks = tuple(len(tensors[t].shape) for t in graph.nodes[index].outputs)
    structure = (names, ranks, out_ranks) if dims is None else (
        names, ranks, out_ranks, tuple((k, tuple(t.dims)) for k, t in dims.inputs.items()),
        tuple(tuple(t.dims) for t in dims.outputs), frozenset(dims.reduced))
    found = cache[index] = numbers.setdefault(structure, len(numbers))
    return found


def _signature(graph: Graph, index: int, label: str, operands: set[str], outputs: int, structure: int):
    """The layouts a choice implies, on the operands and results every instance of the site has
    (one call site may pass an optional mask in some instances and not in others), split dims
    counted from the end so that instances of different ranks can agree; kept per `structure`
    (_structure)."""
    cache = _search_table(graph, "signatures")
    key = (structure, label, operands, outputs)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _derived_signature(graph, index, label, operands, outputs)
    return found


def _derived_signature(graph: Graph, index: int, label: str, operands: set[str], outputs: int):
    node = graph.nodes[index]
    tensors = graph.trace.tensors
    lay = _layout(graph, index, label)
    named = _operands_by_name(graph, index)
    ins = tuple(sorted((k, _end_name(v, len(tensors[named[k].tid].shape)))
                       for k, v in lay.inputs.items() if k in operands))
    outs = tuple(_end_name(lay.outputs[k], len(tensors[node.outputs[k]].shape)) if k < len(lay.outputs)
                 else str(R) for k in range(outputs))         # an instance with no rule: whole results
    return ins, outs


class _Candidate(NamedTuple):
    """One way to split one invocation, with what does not depend on the number of devices (a
    tuple: a model's candidates are made and hashed by the hundred thousand)."""

    label: str
    signature: tuple
    size: int | None             # the label's traced (global) size
    batch: bool                  # the label is this op's batch dim (data parallelism divides it)
    problem: str | None          # _split_problems' answer


def _search_cache(graph: Graph) -> dict:
    """What the search derives from the graph alone, kept on it: `plan --plan auto` solves one
    axis for every tensor-parallel size, and each solve would otherwise derive it again."""
    cache = graph.__dict__.get("_search_cache")
    if cache is None:
        cache = graph.__dict__["_search_cache"] = {}
    return cache


def _search_table(graph: Graph, name) -> dict:
    """_search_cache(graph)[name], empty at first: a lookup (asked per invocation and label)."""
    try:
        return graph.__dict__["_search_cache"][name]
    except KeyError:
        return _search_cache(graph).setdefault(name, {})


def _refined(graph: Graph) -> None:
    """refine_factors, once per graph: it runs to its fixed point, so a second run changes nothing."""
    cache = _search_cache(graph)
    if not cache.get("refined"):
        refine_factors(graph)
        cache["refined"] = True


def _layout(graph: Graph, index: int, label: str):
    """layouts_for an invocation's choice, kept per graph, one object for the invocations of one
    _structure (read only)."""
    cache = graph.__dict__.get("_layouts")
    if cache is None:
        cache = graph.__dict__["_layouts"] = _search_table(graph, "layouts")
    found = cache.get((index, label))
    if found is None:
        shared = _search_table(graph, "layouts by structure")
        key = (_structure(graph, index), label)
        found = shared.get(key)
        if found is None:
            found = shared[key] = layouts_for(graph.dims.get(index), label, _kept_operand_names(graph, index))
        cache[(index, label)] = found
    return found


def _site_candidates(graph: Graph, every_size_read: bool) -> dict[SiteId, tuple[list[int], list[tuple[tuple, list[int]]]]]:
    """Per site, its invocations and their candidate splits, the invocations with equal candidates
    together: the lines' (line_candidates), each line whose instances are planned per group
    (plan/instances.py) taken apart into a site per group."""
    lines = line_candidates(graph, every_size_read)
    of_node = instance_groups(graph).of_node
    if not of_node:
        return lines
    cache = _search_cache(graph)
    key = ("site candidates", every_size_read)
    if key not in cache:
        result = {}
        for lid, entry in lines.items():
            if not any(i in of_node for i in entry[0]):
                result[lid] = entry
                continue
            by_group: dict[SiteId, list[int]] = {}
            for i in entry[0]:
                by_group.setdefault(site_id(graph, i), []).append(i)
            for sid, nodes in by_group.items():
                result[sid] = _candidates_of(graph, sid, nodes, every_size_read)
        cache[key] = result
    return cache[key]


def line_candidates(graph: Graph, every_size_read: bool) -> dict[SiteId, tuple[list[int], list[tuple[tuple, list[int]]]]]:
    """Per line (line_id), its invocations and their candidate splits, the invocations with equal
    candidates together (a block's repeats)."""
    cache = _search_cache(graph)
    key = ("candidates", every_size_read)
    if key in cache:
        return cache[key]
    grouped: dict[SiteId, list[int]] = defaultdict(list)
    for node in graph.nodes:
        grouped[line_id(graph, node.index)].append(node.index)
    result = {sid: _candidates_of(graph, sid, nodes, every_size_read) for sid, nodes in grouped.items()}
    cache[key] = result
    return result


def _derivation_inputs(graph: Graph, every_size_read: bool) -> tuple[dict, dict]:
    """(batch_labels, dims_read_whole), once per graph."""
    cache = _search_cache(graph)
    key = ("derivation inputs", every_size_read)
    if key not in cache:
        cache[key] = batch_labels(graph), dims_read_whole(graph, every_size_read)
    return cache[key]


# Invocations whose structure and _split_context are equal share their candidates (off: each
# derives its own; tests/test_instantiate_once.py compares the two)
SHARE_CANDIDATES = True


def _candidates_of(graph: Graph, sid: SiteId, nodes: list[int], every_size_read: bool):
    # an instance with no derived rule (a 1x1 window's one-row table) runs whole; the
    # site's options are those every instance has, so the others run whole too
    splittable = sid[0] != "node" and not runs_unlike_layers(graph, sid[0])
    operands = frozenset.intersection(*(frozenset(_kept_operand_names(graph, i)) for i in nodes))
    outputs = min(len(graph.nodes[i].outputs) for i in nodes)
    # an invocation's candidates depend on these and on itself alone: a line taken apart into a
    # site per group of instances (_site_candidates) finds its members' already derived
    batch, read_whole = _derivation_inputs(graph, every_size_read)
    known = _search_table(graph, ("node candidates", every_size_read))
    alike = _search_table(graph, ("candidates by context", every_size_read))     # a block's repeats
    signatures = _search_table(graph, "signatures")     # (_signature's, looked up here first)
    groups: dict[tuple, list[int]] = {}      # instances with the same candidates (a block's repeats)
    for i in nodes:
        key = (i, splittable, operands, outputs)
        candidates = known.get(key)
        if candidates is None:
            structure = _structure(graph, i)
            context = _split_context(graph, i, read_whole) if SHARE_CANDIDATES else None
            if context is not None:
                context = (splittable, operands, outputs, structure, batch.get(i), context)
                candidates = alike.get(context)
        if candidates is None:
            derived = splittable and i in graph.dims
            labels = [REPLICATE, *(graph.dims[i].splittable() if derived else [])]
            sizes = graph.dims[i].sizes() if derived else {}
            candidates = tuple(
                _Candidate(label, signatures.get((structure, label, operands, outputs)) or
                           _signature(graph, i, label, operands, outputs, structure), sizes.get(label),
                           label == batch.get(i), problem)
                for label, problem in zip(labels, _split_problems(graph, i, labels, read_whole)))
            if context is not None:
                alike[context] = candidates
        known[key] = candidates
        groups.setdefault(candidates, []).append(i)
    return nodes, list(groups.items())


def site_options(graph: Graph, n: int, batch_slices: int = 1, every_size_read: bool = False,
                 mixed_whole: bool = False) -> dict[SiteId, SiteOptions]:
    """Every valid way to split each site n ways (constraints of the plan come later), on a
    batch cut in `batch_slices` by data parallelism and micro-batches; `every_size_read`: see
    dims_read_whole; `mixed_whole`: the layers of nn.Sequentials whose calls from one line run
    different layers say why they run whole (search_axis's second try)."""
    result = {}
    for sid, (nodes, groups) in _site_candidates(graph, every_size_read).items():
        why: dict[str, str] = {}
        per_node: dict[int, dict] = {}
        for candidates, members in groups:
            allowed = {}
            for c in candidates:
                if c.label == REPLICATE:
                    allowed.setdefault(c.signature, c.label)
                    continue
                size = c.size // batch_slices if c.size is not None and c.batch and batch_slices > 1 else c.size
                reason = _divides(size, n) or c.problem
                if reason:
                    why.setdefault(c.label, reason)
                else:
                    allowed.setdefault(c.signature, c.label)
            for i in members:
                per_node[i] = allowed
        first = per_node[nodes[0]]
        # a block's repeats share one `allowed` (AlphaFold2: 144 instances a site): ask each once
        distinct = list({id(allowed): allowed for allowed in per_node.values()}.values())
        common = [sig for sig in first if all(sig in allowed for allowed in distinct)]
        # one line calling layers that split differently; a split the first instance lacks is
        # named too, so that the blanket split leaves the line whole rather than unsatisfiable
        union = {sig: label for allowed in reversed(distinct) for sig, label in allowed.items()}
        union.update(first)
        for sig in union.keys() - set(common):
            lacking = next(i for i in nodes if sig not in per_node[i])
            why.setdefault(union[sig], f"the {len(nodes)} calls from this line do not all split this way " + (
                "(they run different layers)" if lacking in graph.dims else
                f"(the one in {graph.nodes[lacking].module_path or 'the model'} has no split rule at its sizes)"))
        labels = {id(allowed): [allowed[s] for s in common] for allowed in distinct}
        whole_because = _unwritable(graph, sid, mixed_whole)
        # an instance with no rule at its sizes is named by `why`, not as a layout of its own
        unlike = _instance_layouts(graph, nodes, per_node, common) \
            if len(distinct) > 1 and not whole_because and all(i in graph.dims for i in nodes) else None
        result[sid] = SiteOptions(sid, nodes, [first[s] for s in common],
                                  {i: labels[id(per_node[i])] for i in nodes}, why,
                                  mixed=whole_because is not None or len(common) < len(union),
                                  whole_because=whole_because, unlike_instances=unlike)
    return result


def _instance_layouts(graph: Graph, nodes: list[int], per_node: dict[int, dict], common: list) -> str | None:
    """`dw.conv splits arg0 S(1) -> S(1); pw.conv splits arg0 R -> S(1) or ...`: the splits each
    kind of instance of one line could take, where some split of one is no split of another (one
    ConvBN class's `self.conv(x)` running a depthwise and a pointwise conv). None where every
    instance's splits are shared by all (nothing is lost to the line)."""
    kinds: dict[int, list[int]] = {}
    for i in nodes:
        kinds.setdefault(id(per_node[i]), []).append(i)
    by_splits: dict[str, list[int]] = {}     # instances of other sizes that split alike are one kind
    for members in kinds.values():
        allowed = per_node[members[0]]
        own = [label for sig, label in allowed.items() if label != REPLICATE and sig not in common]
        splits = " or ".join(_layout_note(graph, members[0], label) for label in own) or "only as all the others do"
        by_splits.setdefault(splits, []).extend(members)
    if len(by_splits) < 2:
        return None
    described = []
    for splits, members in by_splits.items():
        paths = [graph.nodes[i].callee_path or graph.nodes[i].module_path or "the model" for i in members]
        who = paths[0] + (f" (and {len(paths) - 1} more like it)" if len(paths) > 1 else "")
        described.append(f"{who} splits {splits}")
    return "; ".join(described)


def _layout_note(graph: Graph, index: int, label: str) -> str:
    """`arg0 S(1) -> S(1)`: the layouts of an invocation's tensor operands and results under a split."""
    lay = _layout(graph, index, label)
    ins = ", ".join(f"{name} {lay.inputs[name]}" for name in _operand_names(graph, index)
                    if graph.trace.tensors[graph.nodes[index].operand(name).tid].param is None)
    return f"{ins} -> {', '.join(map(str, lay.outputs))}"


def _unwritable(graph: Graph, sid: SiteId, mixed_whole: bool = False) -> str | None:
    """Why no split of a site could be written in the source, whatever its sizes: the site runs
    whole (its weights too, with a warning) rather than making a blanket split unsatisfiable."""
    if sid[0] == "node":
        node = graph.nodes[sid[1]]
        return (f"its call (in {node.module_path or 'the model'}) is at no place in the model's source that the "
                "rewrite can edit")
    if mixed_whole and in_mixed_container(graph, sid[0]):
        return (f"it runs in an nn.Sequential called at {sid[0].start} whose calls run different layers, which "
                "one line cannot split apart: no split of them needs conversions only around the call, where "
                "that line can hold them")
    if runs_unlike_layers(graph, sid[0]):
        return (f"its line {sid[0].start} calls layers of different classes in turn (a loop over a model's "
                "children), and one line holds one conversion of their input for all of them")
    return None


def search_axis(graph: Graph, axis: str, n: int, constraints: list[Constraint],
                device: DeviceSpec = DeviceSpec(), *, memory_budget: float | None = None,
                data_parallel: int = 1, micro_batches: int = 1, every_size_read: bool = False,
                explain: bool = True) -> AxisPlan:
    """The cheapest per-site split satisfying `constraints`; `data_parallel` divides the batch,
    and each data-parallel slice runs in `micro_batches` pieces. `explain`: when no split satisfies
    the constraints, name the ones in conflict (z3's unsat core; --plan auto, trying every size,
    only needs to know). Megatron's layout of the blocks (splitting-the-residual) is kept where
    it fits: when no plan has it together with the other constraints, the plan is solved without
    it, with a warning saying why."""
    solve = functools.partial(_solve_mixed_first, graph, axis, n, device=device, memory_budget=memory_budget,
                              data_parallel=data_parallel, micro_batches=micro_batches,
                              every_size_read=every_size_read, explain=explain)
    layout = [c for c in constraints if c.forbid == "splitting-the-residual"]
    if not layout:
        return solve(constraints)
    try:
        return solve(constraints)
    except UserError as exc:
        if not exc.message.startswith(f"no {axis} plan on {n} devices satisfies"):
            raise
        plan = solve([c for c in constraints if c not in layout])
        plan.left_whole.append(f"{layout[0].location}: warning: {layout[0].id}: no plan splits every block by heads "
                               f"and hidden together with the other constraints ({exc.message}); the blocks are split "
                               "as the cost model prefers")
        return plan


def _solve_mixed_first(graph: Graph, axis: str, n: int, constraints: list[Constraint], **kwargs) -> AxisPlan:
    """The layers of nn.Sequentials whose calls from one line run different layers split where
    their conversions fit around the call; when no plan does that together with the constraints
    (a blanket split of every weight, and a block whose every split needs a conversion between
    its layers), the plan is solved again with those layers whole, each with a warning."""
    if not mixed_edges(graph, mixed_lines(graph)).calls:
        return _search_axis(graph, axis, n, constraints, mixed_whole=False, **kwargs)
    try:
        return _search_axis(graph, axis, n, constraints, mixed_whole=False, **{**kwargs, "explain": False})
    except UserError as exc:
        if not exc.message.startswith(f"no {axis} plan on {n} devices"):
            raise
    return _search_axis(graph, axis, n, constraints, mixed_whole=True, **kwargs)


def _search_axis(graph: Graph, axis: str, n: int, constraints: list[Constraint], *, device: DeviceSpec,
                 memory_budget: float | None, data_parallel: int, micro_batches: int, every_size_read: bool,
                 explain: bool, mixed_whole: bool) -> AxisPlan:
    """`mixed_whole`: the layers of every mixed nn.Sequential call (graph/mixed.py) run whole."""
    _refined(graph)
    tensors = graph.trace.tensors
    options = site_options(graph, n, data_parallel * micro_batches, every_size_read, mixed_whole)
    sids = list(options)
    var = {sid: z3.Int(f"site{k}") for k, sid in enumerate(sids)}
    restricted: dict[str, list[SiteId]] = defaultdict(list)
    left_whole: list[str] = []           # warnings: weight matrices no valid split of this instance splits
    kept_whole: set[SiteId] = set()      # ... their sites
    narrowed_to: list[tuple[SiteId, list[int], Constraint]] = []     # what each tracked constraint leaves a site
    for sid in sids:
        if not options[sid].options:        # never expected: replicating fits every instance
            raise UserError(f"internal error: the calls of {sid[1]} here agree on no layout, not even whole "
                            "(please report it)", _site_location(graph, options, sid))
    # the second try (_solve_mixed_first): the layers of mixed calls have only their whole option
    whole_only = {sid: {k for k, label in enumerate(options[sid].options) if label == REPLICATE} for sid in sids
                  if mixed_whole and sid[0] != "node" and in_mixed_container(graph, sid[0])}
    candidates = _site_candidates(graph, every_size_read)
    for constraint in constraints:
        _, _, selected_at, groups_selected, allows_every = _constraint_answers(graph, constraint)
        excepted = constraint.select.get("except_params")
        narrowed = []
        for sid in sids:
            opts = options[sid]
            selected = selected_at(sid, opts.nodes)
            if selected and excepted and any(graph.trace.tensors[tid].param in excepted
                                             for i in opts.nodes for _, tid in graph.param_operands(i)):
                # one choice serves every call of a site: where one instance's parameter is kept
                # whole (a plan solved again, rewrite.py), the constraint leaves the others be too
                continue
            if selected:
                # the instances with equal candidates have one list of labels (site_options): asked per group
                kinds = groups_selected(sid, candidates[sid][1], selected, every_size_read)
                narrowed.append((sid, [k for k in range(len(opts.options)) if k in whole_only.get(sid, (k,))
                                       and all(allows_every(kind, opts.labels[kind[0]][k]) for kind in kinds)]))
        # a blanket split that fits some weights leaves the others whole; one that fits none
        # stays hard, so that the unsat core says which sizes do not divide (unless a line's
        # calls split differently: no size would help there)
        cannot = {sid for sid, allowed in narrowed if not allowed and _weights_cannot_split_here(constraint, options[sid])}
        if len(cannot) == len(narrowed) and not any(options[sid].mixed for sid in cannot):
            cannot = set()
        for sid, allowed in narrowed:
            opts = options[sid]
            if sid in cannot:
                left_whole.append(_left_whole_warning(graph, options, sid, n))
                kept_whole.add(sid)
                continue
            if not allowed and constraint.forbid == "splitting-the-residual":
                # Megatron's layout does not fit this layer here: another split of its weights
                # instead, said where its dim exists (a layer kept whole has its own warning)
                warning = _not_megatron_warning(graph, options, sid, n) if sid not in kept_whole else None
                if warning:
                    left_whole.append(warning)
                continue
            if len(allowed) < len(opts.options):
                restricted[constraint.id].append(sid)
                narrowed_to.append((sid, allowed, constraint))

    uses = _param_uses(graph, options)
    # the tables read the options (the sizes and slicing), never the constraints: --plan auto's
    # variants of one tensor-parallel size (free, sequence parallel, co-shard) share them, and the
    # ops' own prices do not depend on whether collectives fuse either
    key = (n, device, data_parallel, micro_batches, every_size_read, mixed_whole)
    tables = _search_table(graph, "cost_tables").get((*key, fusing()))
    if tables is None:
        tables = _search_table(graph, "cost_tables")[(*key, fusing())] = _cost_tables(
            graph, options, n, device, data_parallel, uses, _search_table(graph, "op_costs").setdefault(key, {}))
    allowed_by = {sid: set(range(len(options[sid].options))) for sid in sids}
    for sid, allowed, _ in narrowed_to:
        allowed_by[sid] &= set(allowed)
    for sid, whole in whole_only.items():
        allowed_by[sid] &= whole
        narrowed_to.append((sid, sorted(allowed_by[sid]), Constraint(
            "mixed-whole", _site_location(graph, options, sid), axis, {}, forbid="splitting")))
    picked = _eliminated(graph, options, var, tables, uses, allowed_by)
    if picked is INFEASIBLE:
        if not explain:
            raise UserError(f"no {axis} plan on {n} devices satisfies the constraints together")
        picked = None
    if picked is not None:
        memory = sum(tables.memory[sid][k] for sid, k in picked.items())
        if memory_budget is not None and memory > memory_budget:
            # over the budget: the least memory instead, cheapest among those
            picked = _eliminated(graph, options, var, tables, uses, allowed_by, memory_first=True)
            picked = None if picked is INFEASIBLE else picked
            if picked is not None:
                memory = sum(tables.memory[sid][k] for sid, k in picked.items())
                if memory > memory_budget:
                    raise UserError(_over_budget(axis, n, memory, memory_budget),
                                    hint="raise --memory-budget, or use more devices")
    if picked is not None:
        time_ns = sum(tables.unary[sid][k] for sid, k in picked.items()) + sum(
            table.get((picked[su], picked[sv]), 0) for (su, sv), table in tables.pairs.items())
    else:
        picked, time_ns, memory, stopped = _solved_by_z3(graph, options, var, tables, uses, narrowed_to,
                                                         memory_budget, axis, n)
        if stopped:
            left_whole.append(f"warning: the {axis} split search stopped after {Z3_LIMIT_S:g} s without proving "
                              f"its plan the cheapest: this is the best plan it found by then")
    node_choice = {i: labels[i][k] for sid, k, labels, nodes in
                   ((sid, picked[sid], options[sid].labels, options[sid].nodes) for sid in sids) for i in nodes}
    param_layout = unread_params_follow_constructor(
        graph, {p: entries[0][1][picked[entries[0][0]]] for p, entries in uses.items()}, n)
    partial = _partial_grad_params(graph, node_choice)
    cost = time_ns / 1e9
    for name in partial:
        cost += all_reduce_time(tensors[graph.trace.params[name].tid].nbytes, n, device)
    choices = AxisChoices(axis, n, node_choice, param_layout, partial, options)
    return AxisPlan(choices, {sid: options[sid].options[k] for sid, k in picked.items()}, cost, float(memory),
                    dict(restricted), left_whole)


def _constraint_answers(graph: Graph, constraint: Constraint):
    """constraint.selects and .allows, each answer kept per graph: they read only the graph, and
    --plan auto asks the same ones for every tensor-parallel size."""
    cache = _search_table(graph, "constraints")
    entry = cache.get(id(constraint))
    if entry is None or entry[0] is not constraint:
        # constraints selecting alike (`params = "matrix"`) share the answers of `selects`
        selected = _search_table(graph, "selections").setdefault(repr(constraint.select), {})
        entry = cache[id(constraint)] = (constraint, selected, {}, {}, {}, {})
    _, selected, allowed, by_site, kinds_at, every = entry

    def selects(index: int) -> bool:
        if index not in selected:
            selected[index] = constraint.selects(graph, index)
        return selected[index]

    def allows(index: int, label: str) -> bool:
        key = (index, label)
        if key not in allowed:
            allowed[key] = constraint.allows(graph, index, label)
        return allowed[key]

    def selected_at(sid, nodes: list[int]) -> list[int]:
        """A site's instances the constraint selects (its instances are the graph's: kept)."""
        found = by_site.get(sid)
        if found is None:
            found = by_site[sid] = [i for i in nodes if selects(i)]
        return found

    def groups_selected(sid, groups, chosen: list[int], every_size_read: bool) -> list[tuple[int, ...]]:
        """A site's selected instances (`chosen`) per candidate group (_candidates_of: equal
        candidates, so one list of labels in any search's site_options), where a group has some."""
        key = (sid, every_size_read)
        found = kinds_at.get(key)
        if found is None:
            chosen = set(chosen)
            found = kinds_at[key] = [kind for kind in (tuple(i for i in members if i in chosen)
                                                       for _, members in groups) if kind]
        return found

    def allows_every(kind: tuple[int, ...], label: str) -> bool:
        """allows(i, label) for every instance of one kind: the same at every size that names `label`."""
        key = (id(kind), label)         # kinds_at keeps each kind alive: ids stay unique
        found = every.get(key)
        if found is None:
            found = every[key] = all(allows(i, label) for i in kind)
        return found
    return selects, allows, selected_at, groups_selected, allows_every


MAX_SOLVES = 256       # elimination subproblems before the whole problem goes to z3
Z3_LIMIT_S = 30.0      # z3's optimiser stops here with the best plan found (a plan, never a hang)
INFEASIBLE = object()  # _eliminated: the constraints and pairwise facts leave no choice


def _over_budget(axis: str, n: int, least: float, budget: float) -> str:
    return (f"no {axis} plan on {n} devices fits the memory budget: the least it needs is "
            f"{format_bytes(least)} per device, the budget is {format_bytes(budget)}")


def _eliminated(graph: Graph, options, var, tables: "_Tables", uses, allowed_by,
                memory_first: bool = False) -> dict[SiteId, int] | None:
    """The cheapest choice per site by variable elimination (plan/eliminate.py) over the pairwise
    terms and facts, checked with z3 against the facts that are not pairs (an argument fed by
    several producers); a combination z3 finds in conflict is ruled out (eliminate.py's
    `minimize_avoiding`) and the search goes on. INFEASIBLE when no choice satisfies the pairwise facts; None
    (z3 then takes the whole problem, and names the constraints in conflict) when no choice
    satisfies them all, when the sites interact too densely, or after MAX_SOLVES subproblems.
    `memory_first`: the least memory, cheapest among those (memory x K + time, K past any step
    time, in exact integers)."""
    sids = list(options)
    index = {sid: k for k, sid in enumerate(sids)}
    inf = math.inf
    # integer ns, summed exactly as Python integers (memory x K + time included)
    scale = 0
    if memory_first:                     # past the most any assignment's time can add up to
        scale = 1 + sum(max(row, default=0) for row in tables.unary.values()) + sum(
            max(t.values(), default=0) for t in tables.pairs.values())
    unary = []
    for sid in sids:
        row = [w + scale * m for w, m in zip(tables.unary[sid], tables.memory[sid])] if memory_first \
            else list(tables.unary[sid])
        for k in range(len(row)):
            if k not in allowed_by[sid] or k in tables.impossible_alone.get(sid, ()):
                row[k] = inf
        unary.append(row)
    pairs: dict[tuple[int, int], list[list[float]]] = {}

    def pair(su, sv) -> list[list[float]]:
        key = (index[su], index[sv])
        if key not in pairs:
            pairs[key] = [[0] * len(options[sv].options) for _ in options[su].options]
        return pairs[key]

    for (su, sv), table in tables.pairs.items():
        grid = pair(su, sv)
        for (a, b), w in table.items():
            grid[a][b] += w
    for (su, sv), bad in tables.impossible.items():
        grid = pair(su, sv)
        for a, b in bad:
            grid[a][b] = inf
    for param, ((first, first_layouts), *others) in uses.items():
        for sid, layouts in others:
            grid = pair(first, sid)
            for a, la in enumerate(first_layouts):
                for b, lb in enumerate(layouts):
                    if la != lb:
                        grid[a][b] = inf
    domains = [len(options[sid].options) for sid in sids]
    checkers: dict[frozenset, z3.Solver] = {}
    involved = {var[sid].get_id(): sid for sid in sids}
    _, groups, group_sites = _agreement_structure(graph, tables)
    # each group's facts name its own sites only: z3 is told those sites' choices, not every site's
    group_sids = {arguments: [sid for sid in sids if sid in group_sites[arguments]] for arguments, _ in groups}
    # conflicts named by the graph's split searches, by site and option name (see below)
    known_conflicts = _search_table(graph, "known_conflicts")

    def disagreeing(arguments: frozenset, fixed: dict | None = None) -> list:
        return [expr for hard in _disagreeing_sources(
            graph, options, tables.edges, tables.consumer_of, tables.lay, var, tables.loss_source,
            tables.rank_in, tables.rank_out, fixed=fixed, only=arguments).values() for expr in hard]

    def checker_for(arguments: frozenset) -> z3.Solver:
        """That group's facts over every choice of its sites, to name the choices breaking it.
        Building them is most of a conflict's cost, and --plan auto's other searches often build
        the very same ones (same sites and variables, same steps per pair of options): kept per
        graph by what they are built from."""
        checker = checkers.get(arguments)
        if checker is None:
            built = _search_table(graph, "agreement_checkers")
            key = _agreement_key(graph, options, tables, None, only=arguments)[0][1] + tuple(
                (sid, index[sid], domains[index[sid]]) for sid in group_sids[arguments])
            checker = built.get(key)
            if checker is None:
                checker = built[key] = z3.Solver()
                checker.add(*[var[sid] >= 0 for sid in group_sids[arguments]],
                            *[var[sid] < domains[index[sid]] for sid in group_sids[arguments]])
                checker.add(*disagreeing(arguments))
            checkers[arguments] = checker
        return checker

    def conflict(assignment: list[int]) -> Combination | None:
        """None when the optimum keeps every argument's agreement, else the combination of
        choices z3 names as breaking one (the unsat core of the choices as assumptions)."""
        picked = {sid: assignment[index[sid]] for sid in sids}
        # The facts fall apart into groups of shared arguments joined by a producer (_agreement_
        # groups), over variables of their own: the assignment keeps them all when it keeps each.
        # --plan auto checks the optimum of every tensor-parallel size, and most of them hand a
        # group the same steps: z3's answer is kept per group's _agreement_key
        answers = _search_table(graph, "agreement_answers")
        broken = None
        for arguments, agreement in _agreement_key(graph, options, tables, picked):
            if agreement not in answers:
                fixed = z3.Solver()
                fixed.add(*[var[sid] == picked[sid] for sid in group_sids[arguments]])
                fixed.add(*disagreeing(arguments, picked))
                answers[agreement] = fixed.check() == z3.sat
            if not answers[agreement]:
                broken = arguments
                break
        if broken is None:
            return None
        checker = checker_for(broken)
        own = {sid: picked[sid] for sid in group_sids[broken]}
        if checker.check(*[var[sid] == k for sid, k in own.items()]) != z3.unsat:
            raise GaveUp("z3 did not confirm the conflict")
        core = [involved[c.arg(0).get_id()] for c in checker.unsat_core()]
        if not core:
            raise GaveUp("z3 named no choice in conflict")
        # z3's core is seldom the smallest; each choice it can do without is dropped, so the
        # combination ruled out is short (a long one spans the chain and forbids too little)
        for sid in list(core):
            rest = [other for other in core if other != sid]
            if checker.check(*[var[other] == picked[other] for other in rest]) == z3.unsat:
                core = rest
        if not core:
            raise GaveUp("the facts conflict whatever the choices")
        known_conflicts.setdefault(broken, set()).add(tuple(sorted(
            (sid, options[sid].options[picked[sid]]) for sid in core)))
        sites = tuple(sorted(index[sid] for sid in core))
        return sites, tuple(assignment[v] for v in sites)

    # Conflicts named in the graph's other split searches (--plan auto's other sizes and
    # variants), by site and option name: each is ruled out from the start where z3 confirms it
    # breaks this problem's facts too (it names the same steps at most sizes), which spares the
    # eliminations and cores that would find it again
    confirmed: list[Combination] = []
    for arguments in [a for a, _ in groups if a in known_conflicts]:
        for combination in sorted(known_conflicts[arguments], key=str):
            if not all(sid in index and label in options[sid].options for sid, label in combination):
                continue
            chosen = [(sid, options[sid].options.index(label)) for sid, label in combination]
            if any(unary[index[sid]][k] == inf for sid, k in chosen):
                continue                # ruled out here already
            if checker_for(arguments).check(*[var[sid] == k for sid, k in chosen]) == z3.unsat:
                sites = sorted((index[sid], k) for sid, k in chosen)
                confirmed.append((tuple(v for v, _ in sites), tuple(k for _, k in sites)))
    try:
        value, assignment = minimize_avoiding(domains, unary, pairs, conflict, MAX_SOLVES, known=confirmed)
    except (TooWide, GaveUp):
        return None
    if not math.isfinite(value):
        return INFEASIBLE if not checkers else None    # None: z3 then names the conflict
    return {sid: assignment[index[sid]] for sid in sids}


def _solved_by_z3(graph: Graph, options, var, tables: "_Tables", uses, narrowed_to, memory_budget, axis: str,
                  n: int) -> tuple[dict[SiteId, int], int, int, bool]:
    """The whole problem in z3: the unsat core when the constraints contradict each other, the
    least memory when the cheapest plan is over the budget, and every case elimination declines."""
    hard = [bound for sid in options for bound in (var[sid] >= 0, var[sid] < len(options[sid].options))]
    tracked: list[tuple[z3.BoolRef, z3.BoolRef, Constraint]] = []
    blocked: dict[str, SiteId] = {}      # a constraint's literal -> the site it leaves no option
    for sid, allowed, constraint in narrowed_to:
        literal = z3.Bool(f"{constraint.id}#{len(tracked)}")
        if not allowed:
            blocked[str(literal)] = sid
        tracked.append((literal, z3.Or([var[sid] == k for k in allowed]) if allowed else z3.BoolVal(False),
                        constraint))
    terms, memory_terms, impossible = tables.z3_terms(var)
    disagree = _disagreeing_sources(graph, options, tables.edges, tables.consumer_of, tables.lay, var,
                                    tables.loss_source, tables.rank_in, tables.rank_out)
    # The model's own facts (a tied weight has one layout, no collective joins some pairs of
    # splits, one line's argument gets one conversion) are tracked too, so that an unsat core
    # always names sites, never nothing.
    facts = [*_param_facts(graph, options, uses, var), *_edge_facts(graph, options, impossible),
             *_agreement_facts(graph, options, disagree)]
    checker = z3.Solver()
    checker.add(*hard)
    for literal, expr, constraint in [*tracked, *facts]:
        checker.assert_and_track(expr, literal)
    if checker.check() != z3.sat:
        _report_core(checker.unsat_core(), [*tracked, *facts], options, axis, n, graph, blocked)
    constraints = hard + [expr for _, expr, _ in facts] + [expr for _, expr, _ in tracked]
    model, stopped = _minimize(constraints, terms, memory_terms, memory_budget, axis, n, checker.model())
    picked = {sid: model.eval(var[sid], model_completion=True).as_long() for sid in options}
    return picked, _weighed(model, terms), _weighed(model, memory_terms), stopped


def _weights_cannot_split_here(constraint: Constraint, opts: SiteOptions) -> bool:
    """A plan's blanket "split every weight matrix" meets a site none of whose valid options
    splits its weights (its sizes do not divide, or the source reads their full size): the
    site runs whole, with a warning, rather than making the plan unsatisfiable. A constraint
    naming the site (by callee, module or line) stays hard; one that only excepts parameters kept
    whole (a plan solved again, rewrite.py) is as blanket as before."""
    select = {k: v for k, v in constraint.select.items() if k != "except_params"}
    return constraint.algo == "split" and select == {"params": "matrix"} and bool(opts.why or opts.whole_because)


def _left_whole_warning(graph: Graph, options, sid: SiteId, n: int) -> str:
    """Names the weight, its sizes and why none of its dims splits; not the other operands'."""
    opts, where = options[sid], _site_location(graph, options, sid) or "?"
    index, dims = opts.nodes[0], graph.dims.get(opts.nodes[0])
    named = []
    for name, tid in graph.param_operands(index):
        tensor = graph.trace.tensors[tid]
        on_weight = dims.inputs[name].dims if dims and name in dims.inputs else []
        labels = {f.label for factors in on_weight for f in factors}
        # a factor of size 1 splits under no --tp: nothing to act on
        reasons = sorted({opts.why[label] for label in labels
                          if label in opts.why and "of size 1 " not in opts.why[label]})
        sizes = " x ".join(map(str, tensor.shape))
        named.append(f"{tensor.param} ({sizes})" + (f": {'; '.join(reasons)}" if reasons else ""))
    others = f" (so do its {len(opts.nodes) - 1} more calls from this line)" if len(opts.nodes) > 1 else ""
    if opts.unlike_instances:
        return (f"{where}: warning: {sid[1]} keeps its weights whole on every tensor-parallel rank: its "
                f"instances need different layouts: {opts.unlike_instances}; one source line holds one "
                "conversion of its input and result for all of them (docs/per-instance-splits.md): "
                + ", ".join(named) + others)
    if opts.whole_because:
        callee = graph.nodes[index].callee
        return (f"{'' if where == '?' else f'{where}: '}warning: {callee} keeps its weights whole on every "
                f"tensor-parallel rank: {opts.whole_because}: " + ", ".join(named) + others)
    # the first call's weights carry no dim the others split (Swin's 3-head table): the site's reasons
    unnamed = "" if not named or not opts.why or any(": " in entry for entry in named) else \
        f": {'; '.join(sorted(set(opts.why.values())))}"
    return (f"{where}: warning: {sid[1]} keeps its weights whole on every tensor-parallel rank, "
            f"no split of them works {n} ways: " + ", ".join(named or sorted(set(opts.why.values()))) + unnamed
            + others)


def _weights_named(graph: Graph, index: int) -> str:
    """`h.0.mlp.fc_1.weight (63, 32)`: the weight matrices an op holds, with their sizes."""
    tensors = graph.trace.tensors
    return ", ".join(f"{tensors[tid].param} {tuple(tensors[tid].shape)}" for name, tid in graph.param_operands(index)
                     if name in _matrices(graph, index))


def _not_megatron_warning(graph: Graph, options, sid: SiteId, n: int) -> str | None:
    """Why a block's layer is not split by heads or hidden (Megatron's layout) though its weights
    have such a dim: the split's problem at this size. None for a layer whose weights have no
    other dim than the block's width (a single matrix from the residual stream back to it)."""
    index = options[sid].nodes[0]
    dims = graph.dims.get(index)
    residual = residual_labels(graph, index)
    megatron = [label for label in (dims.splittable() if dims is not None else [])
                if label not in residual and splits_every_matrix(graph, index, label)]
    if not megatron:
        return None
    sizes = dims.sizes()
    reasons = "; ".join(f"{label} = {sizes.get(label)}: {options[sid].why.get(label, 'its calls agree on no layout')}"
                        for label in megatron)
    where = _site_location(graph, options, sid) or "?"
    return (f"{where}: warning: {sid[1]} is not split by heads or hidden as Megatron splits a block "
            f"({_weights_named(graph, index)}): {reasons}; its weights are split along the blocks' width instead")


Weighted = list[tuple[z3.BoolRef, int]]     # a sum: each weight counts when its condition holds


def _weighed(model, terms: Weighted) -> int:
    return sum(w for cond, w in terms if z3.is_true(model.eval(cond, model_completion=True)))


def _minimize(constraints: list, time: Weighted, memory: Weighted, budget: float | None, axis: str, n: int,
              feasible):
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
    model, stopped = _best_within_limit(solver, feasible)
    if budget is None or _weighed(model, memory) <= budget:
        return model, stopped
    solver = z3.Optimize()
    solver.set(priority="lex")
    solver.add(*constraints)
    solver.minimize(total(memory))
    solver.minimize(total(time))
    model, stopped = _best_within_limit(solver, feasible)
    least = _weighed(model, memory)
    if least > budget:
        raise UserError(_over_budget(axis, n, least, budget), hint="raise --memory-budget, or use more devices")
    return model, stopped


def _best_within_limit(solver: z3.Optimize, feasible):
    """(model, stopped): z3's optimum, or, when the optimiser has not proved one within
    Z3_LIMIT_S (a model too densely connected for elimination), the best plan it found by then
    (at worst `feasible`, a plan meeting every constraint)."""
    solver.set(timeout=int(Z3_LIMIT_S * 1000))
    if solver.check() == z3.sat:
        return solver.model(), False
    try:
        return solver.model(), True
    except z3.Z3Exception:
        return feasible, True


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


def unread_params_follow_constructor(graph: Graph, param_layout: dict[str, Layout], n: int) -> dict[str, Layout]:
    """A parameter no traced op reads (a module the example inputs do not reach: DeepSeek-V4's
    compressor, whose branch needs longer sequences) has no layout of its own, but its class's
    constructor is divided for the instances that are split. It takes their layout, so that its
    share of the state dict has the size the rank builds; where they disagree, or its size does
    not divide, it stays whole and the constructor check refuses the plan with its location."""
    split_at: dict[tuple, set[Layout]] = defaultdict(set)
    for name, layout in param_layout.items():
        info = graph.trace.params.get(name)
        if info is not None and info.ctor_span is not None and layout.kind == "S":
            split_at[(info.ctor_span, info.attr)].add(layout)
    followed = dict(param_layout)
    for name, info in graph.trace.params.items():
        layouts = split_at.get((info.ctor_span, info.attr)) if name not in param_layout else None
        if layouts and len(layouts) == 1:
            [layout] = layouts
            if -len(info.shape) <= layout.dim < len(info.shape) and info.shape[layout.dim] % (n * layout.groups) == 0:
                followed[name] = layout
    return followed


def _partial_grad_params(graph: Graph, node_choice: dict[int, str]) -> list[str]:
    out: dict[str, None] = {}
    cache = _search_table(graph, "partial_grads")
    reading = _search_cache(graph).get("param_readers")
    if reading is None:                  # only an op reading a parameter leaves its gradient partial
        reading = _search_cache(graph)["param_readers"] = [i for i in range(len(graph.nodes))
                                                           if _param_operands(graph, i)]
    for index in reading:
        key = (index, node_choice[index])
        found = cache.get(key)
        if found is None:
            found = cache[key] = _partial_grads_of(graph, *key)
        for pname in found:
            out.setdefault(pname)
    return list(out)


def _partial_grads_of(graph: Graph, index: int, label: str) -> list[str]:
    """The parameters of one op whose gradients stay partial sums when it is split by `label`."""
    out = []
    if index in graph.dims and leaves_partial_param_grad(graph, index, label):
        dims = graph.dims[index]
        bias = graph.partial_bias(index) if label in dims.reduced or label in dims.impl else None
        for name, tid in _param_operands(graph, index):
            if name != bias and (name not in dims.inputs or dims.inputs[name].where(label) is None):
                out.append(graph.trace.tensors[tid].param)
    return out


def _param_operands(graph: Graph, index: int) -> list[tuple[str, int]]:
    cache = _search_table(graph, "param_operands")
    if index not in cache:
        cache[index] = graph.param_operands(index)
    return cache[index]


def _layout_inputs(graph: Graph, index: int) -> set[str]:
    dims = graph.dims.get(index)
    return set(dims.inputs) if dims is not None else set()


def _param_uses(graph: Graph, options) -> dict[str, list[tuple[SiteId, list[Layout]]]]:
    """Per parameter, the sites using it and the layout each of their options gives it."""
    cache = _search_cache(graph)
    if "param_sites" not in cache:      # (site, operand name, parameter), first use per site and parameter
        seen: dict[str, list] = defaultdict(list)
        order = []
        for sid, nodes in ((sid, nodes) for sid, (nodes, _) in _site_candidates(graph, False).items()):
            for node in nodes:
                for name, tid in _param_operands(graph, node):
                    param = graph.trace.tensors[tid].param
                    if sid not in seen[param]:
                        seen[param].append(sid)
                        order.append((sid, name, param, node))
        cache["param_sites"] = order
    uses: dict[str, list[tuple[SiteId, list[Layout]]]] = defaultdict(list)
    known = cache.setdefault("param_layouts", {})     # (node, operand, its options' labels) -> layouts
    for sid, name, param, node in cache["param_sites"]:
        opts = options[sid]
        # option k gives the same layouts in every instance of a site that has the operand; the
        # first instance may lack it (one call line building convs with and without a bias)
        i = opts.nodes[0] if name in _layout_inputs(graph, opts.nodes[0]) else node
        key = (i, name, tuple(opts.labels[i]))
        layouts = known.get(key)
        if layouts is None:
            layouts = known[key] = [_layout(graph, i, label).inputs[name] for label in opts.labels[i]]
        uses[param].append((sid, list(layouts)))
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


@dataclass
class _Tables:
    """The search's objective and pairwise facts as plain numbers: step time in integer ns per
    site option and per pair of options, memory in bytes per site option, and the pairs (and
    single options of a site feeding itself) that no collective sequence joins. Also what the
    argument-agreement facts are built from."""

    unary: dict[SiteId, list[int]]
    pairs: dict[tuple[SiteId, SiteId], dict[tuple[int, int], int]]
    impossible: dict[tuple[SiteId, SiteId], list[tuple[int, int]]]
    impossible_alone: dict[SiteId, set[int]]
    memory: dict[SiteId, list[int]]
    edges: dict
    consumer_of: dict
    lay: object
    loss_source: tuple | None
    rank_in: object
    rank_out: object

    def z3_terms(self, var):
        """The same objective as z3 terms, and the impossible pairs as z3 facts."""
        terms = [(var[sid] == k, w) for sid, row in self.unary.items() for k, w in enumerate(row) if w]
        terms += [(z3.And(var[su] == a, var[sv] == b), w) for (su, sv), table in self.pairs.items()
                  for (a, b), w in table.items() if w]
        memory = [(var[sid] == k, w) for sid, row in self.memory.items() for k, w in enumerate(row) if w]
        impossible: dict[tuple[SiteId, SiteId], list] = defaultdict(list)
        for sid, bad in self.impossible_alone.items():
            impossible[(sid, sid)] += [z3.Not(var[sid] == a) for a in sorted(bad)]
        for (su, sv), bad in self.impossible.items():
            impossible[(su, sv)] += [z3.Not(z3.And(var[su] == a, var[sv] == b)) for a, b in bad]
        return terms, memory, impossible


def _graph_edges(graph: Graph):
    """Per graph, once: which output of which site feeds which operand of which site, counted.
    Option k of a site gives the same layouts in every instance, so an edge's cost depends only
    on which sites, output and operand it joins: count edges, cost each kind once."""
    cache = _search_cache(graph)
    if "edges" not in cache:
        tensors = graph.trace.tensors
        producer_out = {tid: (node.index, k) for node in graph.nodes for k, tid in enumerate(node.outputs)}
        edges: dict[tuple, int] = defaultdict(int)
        consumer_of: dict[tuple, int] = {}    # an instance that has the operand (optional ones may be absent)
        sites = {node.index: site_id(graph, node.index) for node in graph.nodes}
        for node in graph.nodes:
            sv = sites[node.index]
            for operand in node.operands:
                if operand.tid is None or tensors[operand.tid].param is not None:
                    continue
                info = tensors[operand.tid]
                source = producer_out.get(operand.tid)
                su, k = (sites[source[0]], source[1]) if source else (None, None)
                key = (su, k, sv, operand.name, info.nbytes, info.requires_grad, len(info.shape))
                edges[key] += 1
                consumer_of.setdefault(key, node.index)
        cache["edges"] = (producer_out, dict(edges), consumer_of)
    return cache["edges"]


def _mixed_facts(graph: Graph, options, mixed, lay, rank_in, rank_out, impossible) -> None:
    """The calls of one line that run different layers (graph/mixed.py) take their input in one
    layout and hand over their result in one layout, whichever layers take and give it: the
    conversions around the call are written once, on the line. Pairs of options of their first
    (last) layers that disagree go into `impossible`."""
    def agree(ends: list[tuple[SiteId, object]]) -> None:
        for (s1, ways1), (s2, ways2) in ((x, y) for i, x in enumerate(ends) for y in ends[i + 1:]):
            bad = [(a, b) for a, w1 in enumerate(ways1) for b, w2 in enumerate(ways2) if w1 != w2]
            if bad:
                impossible[(s1, s2)] = sorted(set(impossible.get((s1, s2), [])) | set(bad))

    for line, entries in mixed.entries.items():
        ends = {}
        for v, name in entries:
            sv = site_id(graph, v)
            ends.setdefault(sv, [(from_end(lay(v, label).inputs[name], rank_in(v, name)), lay(v, label).split)
                                 for label in options[sv].labels[v]])
        agree(list(ends.items()))
    for line, exits in mixed.exits.items():
        ends = {}
        for u, k in exits:
            su = site_id(graph, u)
            ends.setdefault(su, [from_end(outs[k], rank_out(u, k)) if k < len(outs) else R
                                 for outs in (lay(u, label).outputs for label in options[su].labels[u])])
        agree(list(ends.items()))


def _cost_tables(graph: Graph, options, n: int, device: DeviceSpec, data_parallel: int, uses,
                 op_costs: dict | None = None) -> _Tables:
    """The step time (ns), the memory per device (bytes), and the pairs of choices no collective
    sequence can connect, per site option and pair of options. `op_costs`: where the ops' own
    time and the memory (what no conversion changes) are kept for another call with these options."""
    tensors = graph.trace.tensors
    producer_out, edges, consumer_of = _graph_edges(graph)

    def lay(index: int, label: str):
        return _layout(graph, index, label)

    def ns(seconds: float) -> int:
        return int(round(seconds * 1e9 / data_parallel))

    shape_of = _search_cache(graph).get("shapes")
    if shape_of is None:
        # equal shapes, one small int: cheap to hash; with whether an output needs a gradient (a
        # no_grad recycling pass runs the same sites and shapes, without backward or saved tensors)
        interned: dict[tuple, int] = {}
        shape_of = _search_cache(graph)["shapes"] = {
            node.index: interned.setdefault(
                (tuple((tensors[o.tid].shape, tensors[o.tid].dtype) for o in node.operands if o.tid is not None),
                 tuple(tensors[t].shape for t in node.outputs),
                 any(tensors[t].requires_grad for t in node.outputs)), len(interned)) for node in graph.nodes}

    def op_tables() -> tuple[dict, dict]:
        """Each option's own compute time and the memory it holds (saved tensors, parameter state)."""
        # A model's repeated blocks call each site with the same shapes: price each once.
        priced: dict[tuple, tuple[float, float]] = {}

        def price(site: int, index: int, label: str) -> tuple[float, float]:
            key = (site, label, shape_of[index])
            if key not in priced:
                ways = n if label != REPLICATE else 1
                seconds = node_time(graph.nodes[index], graph.dims.get(index), graph.trace, device, ways,
                                    dims_of=graph.dims.get, label=label)
                if graph.dims.get(index) is not None and leaves_partial_param_grad(graph, index, label):
                    seconds += sum(all_reduce_time(tensors[tid].nbytes, n, device)
                                   for _, tid in _param_operands(graph, index))
                priced[key] = seconds, saved_bytes(graph.nodes[index], graph.trace) / ways
            return priced[key]

        unary = {sid: [0] * len(opts.options) for sid, opts in options.items()}
        memory = {sid: [0] * len(opts.options) for sid, opts in options.items()}
        for site, (sid, opts) in enumerate(options.items()):
            labels = opts.labels
            # a site has an instance per block, most alike (the same labels, one list object, and
            # shapes): each kind priced once, times its instances
            kinds: dict[tuple, list] = {}
            for i in opts.nodes:
                kind = kinds.get((id(labels[i]), shape_of[i]))
                if kind is None:
                    kinds[(id(labels[i]), shape_of[i])] = [i, 1]
                else:
                    kind[1] += 1
            for k in range(len(opts.options)):
                total, saved = 0.0, 0.0
                for i, count in kinds.values():
                    label = labels[i][k]
                    found = priced.get((site, label, shape_of[i]))
                    seconds, kept = found if found is not None else price(site, i, label)
                    total += seconds * count
                    saved += kept * count
                if total:
                    unary[sid][k] += ns(total)
                if saved:
                    memory[sid][k] += int(saved / data_parallel)

        # weights, gradients and optimizer state, counted at the first site that uses each parameter
        for param, ((sid, layouts), *_) in uses.items():
            size = tensors[graph.trace.params[param].tid].nbytes // 4 * BYTES_PER_PARAM_STATE
            for k, layout in enumerate(layouts):
                memory[sid][k] += size // (n if layout.kind == "S" else 1)
        return unary, memory

    op_costs = {} if op_costs is None else op_costs
    if "unary" not in op_costs:
        op_costs["unary"], op_costs["memory"] = op_tables()
    unary = {sid: list(row) for sid, row in op_costs["unary"].items()}
    memory = {sid: list(row) for sid, row in op_costs["memory"].items()}

    def rank_in(index: int, name: str) -> int:
        return len(tensors[graph.nodes[index].operand(name).tid].shape)

    def rank_out(index: int, k: int) -> int:
        outputs = graph.nodes[index].outputs
        return len(tensors[outputs[k]].shape) if k < len(outputs) else 0

    steps_of: dict[tuple, list | None] = {}

    def convert(have: Layout, need: Layout, split: bool, grad: bool):
        key = (have, need, split, grad)
        if key not in steps_of:
            steps_of[key] = conversion(have, need, consumer_split=split, requires_grad=grad)
        return steps_of[key]

    pair_cost: dict[tuple[SiteId, SiteId], dict[tuple[int, int], float | None]] = defaultdict(dict)
    seconds_of: dict[tuple, float] = {}     # (steps, bytes) -> conversion_time: a block repeats its edges

    def seconds(steps, nbytes: int) -> float:
        key = (id(steps), nbytes)            # steps_of keeps every steps list alive: ids stay unique
        found = seconds_of.get(key)
        if found is None:
            found = seconds_of[key] = conversion_time(steps, nbytes, n, device)
        return found

    # an invocation's layouts counted from the end, per graph: every edge of an output (and every
    # solve of --plan auto) asks for the same ones
    ends = _search_table(graph, "ends")

    def have_of(u: int, label: str, k: int) -> Layout:
        found = ends.get((u, label, k))
        if found is None:
            outs = lay(u, label).outputs
            found = ends[(u, label, k)] = from_end(outs[k], rank_out(u, k)) if k < len(outs) else R
        return found

    def need_of(v: int, label: str, name: str) -> Layout:
        found = ends.get((v, label, name))
        if found is None:
            found = ends[(v, label, name)] = from_end(lay(v, label).inputs[name], rank_in(v, name))
        return found

    mixed = mixed_edges(graph, mixed_lines(graph))
    inside = {(site_id(graph, u), site_id(graph, v)) for u, v in mixed.inside}
    for key, count in edges.items():
        su, k, sv, name, nbytes, requires_grad, _ = key
        v = consumer_of[key]
        if su is not None:                   # what each producer option hands over, once per edge
            u = options[su].nodes[0]
            table = pair_cost[(su, sv)]
            haves = [have_of(u, u_label, k) for u_label in options[su].labels[u]]
        for b, label in enumerate(options[sv].labels[v]):
            wanted = lay(v, label)
            need = need_of(v, label, name)
            if su is None:
                steps = convert(R, need, wanted.split, requires_grad)
                cost = count * seconds(steps, nbytes)
                if cost:
                    unary[sv][b] += ns(cost)
                continue
            for a, have in enumerate(haves):
                steps = convert(have, need, wanted.split, requires_grad)
                if steps is None or (steps and (su, sv) in inside):     # between a mixed call's layers
                    table[(a, b)] = None
                elif table.get((a, b), 0.0) is not None:
                    table[(a, b)] = table.get((a, b), 0.0) + count * seconds(steps, nbytes)
    loss_source = None
    loss = graph.trace.loss
    if loss is not None and loss in producer_out:
        u, k = producer_out[loss]
        su = site_id(graph, u)
        loss_source = (su, k)
        for a, label in enumerate(options[su].labels[u]):
            outs = lay(u, label).outputs
            steps = conversion(outs[k] if k < len(outs) else R, R, consumer_split=False, requires_grad=False)
            cost = conversion_time(steps, tensors[loss].nbytes, n, device)
            if cost:
                unary[su][a] += ns(cost)
    pairs: dict[tuple[SiteId, SiteId], dict[tuple[int, int], int]] = defaultdict(dict)
    impossible: dict[tuple[SiteId, SiteId], list[tuple[int, int]]] = defaultdict(list)
    impossible_alone: dict[SiteId, set[int]] = defaultdict(set)
    for (su, sv), table in pair_cost.items():
        for (a, b), cost in table.items():
            if su == sv and a != b:
                continue
            if cost is None:             # no collective sequence gives this layout
                if su == sv:
                    impossible_alone[su].add(a)
                else:
                    impossible[(su, sv)].append((a, b))
            elif cost:
                if su == sv:
                    unary[su][a] += ns(cost)
                else:
                    pairs[(su, sv)][(a, b)] = ns(cost)

    _mixed_facts(graph, options, mixed, lay, rank_in, rank_out, impossible)

    return _Tables(unary, dict(pairs), dict(impossible), dict(impossible_alone), memory, edges, consumer_of, lay,
                   loss_source, rank_in, rank_out)


def _arguments_fed(edges, consumer_of):
    """Per argument (consumer site, operand name): an instance that has it, whether it needs a
    gradient, the producer outputs feeding it; per producer output the arguments it feeds; and
    the arguments fed by more than one producer output (those must agree)."""
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
    return instance, grad, feeds, sources, shared


def _use_steps(options, lay, rank_in, rank_out, loss_source, source, feeds, instance, grad, fixed):
    """One producer output's uses (the arguments it feeds, and "loss"), and the conversion steps
    of each (use, producer option, consumer option) that some collective sequence joins."""
    su, k = source
    u = options[su].nodes[0] if su is not None else None
    haves = [R] if su is None else [
        from_end(outs[k], rank_out(u, k)) if k < len(outs) else R
        for outs in (lay(u, label).outputs for label in options[su].labels[u])]
    uses = sorted(feeds[source], key=str) + (["loss"] if source == loss_source else [])
    table = {}                                   # (use, producer option, consumer option) -> steps
    for use in uses:
        consumer_options = [None] if use == "loss" else \
            [fixed[use[0]]] if fixed is not None else range(len(options[use[0]].options))
        for a, have in enumerate(haves):
            if fixed is not None and su is not None and a != fixed[su]:
                continue        # checking one assignment: only its own steps
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
    return uses, table


def _agreement_structure(graph: Graph, tables: "_Tables"):
    """Per edge set, once: _arguments_fed, the groups of shared arguments (`_agreement_groups`),
    and per group the sites its facts name (its producers' and every consumer of what they feed)."""
    edges_key = ("agreement_args", id(tables.edges))
    cache = _search_cache(graph)
    fed = cache.get(edges_key)
    if fed is None or fed[0] is not tables.edges:
        found = _arguments_fed(tables.edges, tables.consumer_of)
        groups = _agreement_groups(found[3], found[4])
        feeds = found[2]
        sites = {arguments: frozenset({su for su, _ in sources if su is not None} |
                                      {use[0] for source in sources for use in feeds[source]})
                 for arguments, sources in groups}
        fed = cache[edges_key] = (tables.edges, found, groups, sites)
    return fed[1], fed[2], fed[3]


def _agreement_key(graph: Graph, options, tables: "_Tables", picked: dict | None,
                   only: frozenset | None = None) -> list[tuple[frozenset, tuple]]:
    """What the argument-agreement facts of one assignment amount to, per group of shared
    arguments (`_agreement_groups`): per producer output feeding one, whether its steps may go on
    its result and each use's steps. The facts _disagreeing_sources(fixed=picked, only=group)
    writes are a function of this alone (the option indices only select which steps; codes are
    the steps' text), so equal keys are equally satisfiable. Empty when no argument is shared.
    `picked` None: the steps of every pair of options (what the facts over every choice are
    built from, with the option indices); `only`: that group's key alone."""
    (instance, grad, feeds, sources, shared), groups, _ = _agreement_structure(graph, tables)
    keys = []
    for arguments, group_sources in groups:
        if only is not None and arguments != only:
            continue
        key = []
        for source in group_sources:
            su = source[0]
            uses, table = _use_steps(options, tables.lay, tables.rank_in, tables.rank_out, tables.loss_source,
                                     source, feeds, instance, grad, picked)
            wraps = su is not None and graph.result_wrappable(graph.nodes[options[su].nodes[0]])
            key.append((source, wraps, tuple(uses), tuple(((use, a, b) if picked is None else use, tuple(steps))
                                                           for (use, a, b), steps in table.items())))
        keys.append((arguments, (tuple(sorted(arguments, key=str)), tuple(key))))
    return keys


def _agreement_groups(sources: dict, shared: set) -> list[tuple[frozenset, list]]:
    """The shared arguments in groups joined by a producer output feeding two of them, each with its
    producer outputs (sorted): no fact of _disagreeing_sources spans two groups, so an assignment
    keeps them all when it keeps each group's, and a conflict names choices of one group only."""
    group_of: dict = {}
    for argument in sorted(shared, key=str):
        joined = {group_of[s] for s in sources[argument] if s in group_of}
        group = (set().union(*joined) if joined else set()) | {argument}
        for source in {s for a in group for s in sources[a]}:
            group_of[source] = frozenset(group)
    groups = sorted(set(group_of.values()), key=lambda g: min(map(str, g)))
    return [(g, sorted({s for a in g for s in sources[a]}, key=str)) for g in groups]


def _disagreeing_sources(graph: Graph, options, edges, consumer_of, lay, var, loss_source, rank_in,
                         rank_out, fixed: dict | None = None, only: frozenset | None = None) -> dict:
    """An argument written once in source but fed by different producers in different instances
    (a block's input: the embedding first, the previous block's residual after) gets one
    conversion on its line, so what each producer leaves to it must be the same. What a producer
    leaves: its conversion to that argument, less the steps all its uses share (those go on the
    producer's result, as materialize/edits.py writes them).

    In z3, per producer output: each use's steps as codes by position, the length of the prefix
    they share, and per shared argument the code of what is left; the codes must be equal. Every
    term joins the producer's choice with one consumer's, so a value read by many sites costs
    terms in proportion, not in product. `only`: the facts of these shared arguments alone (a group
    of _agreement_groups)."""
    instance, grad, feeds, sources, shared = _arguments_fed(edges, consumer_of)
    if only is not None:
        shared = shared & only
    # z3 builds an expression per call of its Python API; equal expressions are one term (hash-
    # consed), so each is built once here: same assertions, a third of the time for a 7B model
    built: dict[tuple, z3.BoolRef] = {}

    def equal(term, value: int, key: tuple) -> z3.BoolRef:
        found = built.get(key)
        if found is None:
            found = built[key] = term == value
        return found

    codes: dict[str, int] = {"absent": -1}
    terms: dict[tuple, list] = defaultdict(list)
    left: dict[tuple, z3.ArithRef] = {}             # (producer output, argument) -> what is left, coded
    for n_source, source in enumerate(sorted({s for a in shared for s in sources[a]}, key=str)):
        su, k = source
        u = options[su].nodes[0] if su is not None else None
        uses, table = _use_steps(options, lay, rank_in, rank_out, loss_source, source, feeds, instance, grad, fixed)
        depth = max((len(steps) for steps in table.values()), default=0)
        wraps = su is not None and graph.result_wrappable(graph.nodes[u])
        # the steps each use needs, position by position, as codes
        step_at = {(use, p): z3.Int(f"src{n_source}_{uses.index(use)}_{p}") for use in uses for p in range(depth)}
        definitions = []
        for (use, a, b), steps in table.items():
            chosen = [equal(var[su], a, ("site", su, a))] if su is not None else []
            chosen += [equal(var[use[0]], b, ("site", use[0], b))] if use != "loss" else []
            both = z3.And(chosen) if depth else None
            for p in range(depth):
                code = codes.setdefault(str(steps[p]), len(codes)) if p < len(steps) else -1
                definitions.append(z3.Implies(both, equal(step_at[(use, p)], code, ("step", n_source, use, p, code))))
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
            chosen = ([equal(var[su], a, ("site", su, a))] if su is not None else []) + \
                [equal(var[use[0]], b, ("site", use[0], b))]
            for p in range(len(steps) + 1):
                code = codes.setdefault(str(steps[p:]), len(codes))
                definitions.append(z3.Implies(z3.And(chosen + [equal(prefix, p, ("prefix", n_source, p))]),
                                              equal(rest, code, ("left", source, use, code))))
        terms[next(use for use in uses if use in shared)] += definitions
    for argument in shared:
        remainders = [left[(s, argument)] for s in sorted(sources[argument], key=str) if (s, argument) in left]
        terms[argument] += [x == remainders[0] for x in remainders[1:]]
    return {argument: hard for argument, hard in terms.items() if hard}
