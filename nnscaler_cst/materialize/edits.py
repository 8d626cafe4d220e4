"""From a solved tensor-parallel axis to the source edits that realise it.

For every tensor edge, the conversion its consumer needs (materialize/conversions.py) is
placed once: the steps every consumer shares go on the producer's expression, the rest on
each consumer's argument. Split sites get their size arguments divided, row-parallel sites
their bias moved after the reduction, vocabulary-split sites their split implementation,
and constructors of split parameters their size arguments divided.

Edits are keyed by source span, so one edit serves every instance of a site; instances that
would need different edits are refused, except where a block class's instances are planned per
group (plan/instances.py): each group's edits of that method are kept apart (`group_sites`), and
its instances get a variant of the class (emit/variants.py). Decides nothing about the plan;
writes no source.
"""
from __future__ import annotations

import dataclasses

import inspect
import re
from collections import defaultdict
from dataclasses import dataclass, field

import libcst as cst

from ..errors import UserError
from ..graph.graph import Graph
from ..graph.mixed import mixed_edges
from ..plan.batch import batch_factors, batch_labels, data_parallel_impl
from ..plan.layouts import REPLICATE, R, Layout, layouts_for, shard
from ..plan.instances import instance_groups, mixed_lines
from ..plan.search import AxisChoices
from .buffers import buffer_layouts
from .size_args import SIZE_ARGUMENTS, SPLIT_SIZES, dims_sized_by_read, expand_broadcasts, locate_size_argument
from .size_reads import full_size_reads
from ..source.files import Span
from ..trace.records import Node, TensorList
from .conversions import Step, common_prefix, conversion, steps_from_end
from .coshard import Region, coshard_regions


@dataclass(frozen=True)
class SizeEdit:
    path: tuple             # argument path in the call: ("pos", i) / ("kw", name)
    item: int | None        # element of a tuple/list literal, or None for the whole argument
    divisor: int
    note: str


@dataclass
class CtorEdit:
    aliases: list[str]      # constructor argument: positional "argN" and keyword names
    divisor: int
    note: str
    rank: int | None = None     # "factory:D": the parameter's number of dims (which size of the factory is D)


@dataclass
class SiteEdit:
    result: list[Step] = field(default_factory=list)               # wrap the call's result
    args: dict[tuple, list[Step]] = field(default_factory=dict)    # wrap an argument
    sizes: list[SizeEdit] = field(default_factory=list)
    replace: str | None = None      # a template for the whole call (split impl, row-parallel)
    # what the traced call received that the source call does not write, for the template: a
    # subclass's `super().forward(ids)` reaches `F.embedding(ids, self.weight, padding_idx=0)`
    traced: dict[str, str] = field(default_factory=dict)
    bias: str | None = None         # added after the reduction of a row-parallel call
    bias_trailing: int | None = None    # dims of the result after the bias's: `bias[:, None, None]` for a conv
    notes: list[str] = field(default_factory=list)
    # `x[i] = v`: the site is the assignment's target, so a conversion of x rebinds it on a line
    # of its own before the statement (`x = tp_gather(x, ...)`), and one of v wraps the value.
    writes: bool = False
    # a sequence argument that is not written out (`torch.stack(states, 1)`): its traced length,
    # so that converting every element can be written as a comprehension over it
    lengths: dict[tuple, int] = field(default_factory=dict)


@dataclass
class Edits:
    axis: str
    n: int
    sites: dict[Span, SiteEdit]
    ctors: dict[Span, list[CtorEdit]]
    param_layout: dict[str, Layout]         # every parameter's layout on this axis (split ones S)
    partial_grad_params: list[str]
    regions: list[Region] = field(default_factory=list)   # co-sharded statements
    warnings: list[str] = field(default_factory=list)     # path:line:col: warning: ... (ops run whole)
    full_sizes: dict[Span, int] = field(default_factory=dict)   # `self.tok.embedding_dim` read -> times n
    # parameters built whole and cut right after build(): name -> (dim, fused blocks, size attributes)
    split_after_build: dict[str, tuple[int, int, list[str]]] = field(default_factory=dict)
    # buffers split with their layer's parameters, built split by its divided constructor
    buffer_layout: dict[str, Layout] = field(default_factory=dict)
    # the sites of a method whose instances are planned per group, per group (plan/instances.py)
    group_sites: dict[str, dict[Span, SiteEdit]] = field(default_factory=dict)
    groups: dict[int, str] = field(default_factory=dict)     # node index -> its group, where the plan has them

    def site(self, span: Span, group: str | None = None) -> SiteEdit:
        sites = self.sites if group is None else self.group_sites.setdefault(group, {})
        return sites.setdefault(span, SiteEdit())

    def overlaid(self, sites: dict[Span, SiteEdit]) -> "Edits":
        """These edits with `sites` over their own: a group's sites, for the rewrite of its method."""
        return dataclasses.replace(self, sites={**self.sites, **sites})


def _mixed_lines(graph: Graph, edits: Edits) -> set[Span]:
    """The lines running unlike nn.Sequentials that the edits cannot cut apart: those whose
    instances the plan did not group (a plan without groups never derives them)."""
    return mixed_lines(graph) if edits.groups else graph.trace.mixed_containers


def _group(edits: Edits, node: Node) -> str | None:
    """The group of instances whose edits this invocation's site takes, or None (every instance)."""
    return edits.groups.get(node.index)


def _site_of(edits: Edits, node: Node) -> SiteEdit | None:
    group = _group(edits, node)
    return (edits.sites if group is None else edits.group_sites.get(group, {})).get(node.span)


SETITEM = "Tensor.__setitem__"


def _steps_note(steps: list[Step]) -> str:
    return " + ".join(s.op for s in steps)


def plan_edits(graph: Graph, plan: AxisChoices, *, strict: bool = True, coshard_devices: int | None = None) -> Edits:
    """`strict`: warn of a split tensor gathered because its consumer cannot be split (a named plan
    that does not fit this model everywhere); a free search chooses such gathers itself.
    `coshard_devices`: see coshard_regions."""
    n = plan.n
    trace = graph.trace
    tensors = trace.tensors
    edits = Edits(plan.axis, n, {}, {}, plan.param_layout, plan.partial_grad_params,
                  buffer_layout=buffer_layouts(graph, plan.param_layout), groups=instance_groups(graph).of_node)
    layout = {}
    # a fused dim (batch heads) split by heads is in batch / slices groups on each device
    local = {index: dict.fromkeys(labels, plan.batch_slices) for index, labels in batch_factors(graph).items()} \
        if plan.batch_slices > 1 else {}

    def lay(node: Node):
        key = node.index
        if key not in layout:
            names = [op.name for op in node.operands if op.tid is not None]
            layout[key] = layouts_for(graph.dims.get(node.index), plan.node_choice[node.index], names,
                                      local.get(node.index))
        return layout[key]

    # what each consumer needs of each tensor
    needs: dict[int, list[tuple[Node | None, tuple | None, list[Step]]]] = defaultdict(list)
    have: dict[int, Layout] = {}
    passed = graph.passed_through
    # expands run whole but built at a split tensor's local size: each rank broadcasts the whole
    # input into its own share, so the input's gradient is a partial sum (a `copy`)
    broadcast_split: set[int] = set()
    for node in graph.nodes:
        for k, tid in enumerate(node.outputs):
            outs = lay(node).outputs
            have[tid] = outs[k] if k < len(outs) else R
        if node.callee == "Tensor.expand" and node.outputs and have[node.outputs[0]] == R:
            sized = _dim_sized_by_a_split_tensor(graph, node, have)
            if sized is not None:       # planned whole, but built at the size a split tensor has
                have[node.outputs[0]] = shard(sized)
                broadcast_split.add(node.index)
    grad_at = _grad_at_argument(graph)
    handed: dict[int, list[Step]] = {}     # a call handing back its operand -> the conversion planned there
    handed_back_as = {graph.nodes[index].outputs[0]: tid for index, tid in passed.items()}
    for node in graph.nodes:
        wanted = lay(node)
        if node.index in passed:
            handed[node.index] = []
        for operand in node.operands:
            if operand.tid is None or tensors[operand.tid].param is not None:
                continue
            info = tensors[operand.tid]
            if info.buffer is not None and wanted.inputs.get(operand.name) == edits.buffer_layout.get(info.buffer, R):
                continue        # a layer's buffer, built as its constructor divides it
            if _arrives_as_is(graph.dims.get(node.index), operand.name, have.get(operand.tid, R)):
                continue
            split = node.index in broadcast_split or \
                _reaches_a_split_result(graph.dims.get(node.index), operand.name, wanted) and \
                not _added_once(graph, node, plan.node_choice[node.index], operand.name)
            steps = conversion(have.get(operand.tid, R), wanted.inputs[operand.name], consumer_split=split,
                               requires_grad=grad_at.get((node.span, operand.path), info.requires_grad))
            if steps is None:
                raise UserError(f"{node.callee} would need a partial sum as input", _loc(node))
            if strict:
                _warn_forced_regather(graph, plan, node, operand.name, steps, edits.warnings)
            if operand.tid == passed.get(node.index):
                handed[node.index] = steps
                continue
            needs[operand.tid].append((node, operand.path, steps))
        for operand in node.operands:   # tensors inside a list (torch.cat): each element converted
            if not isinstance(operand.value, TensorList):
                continue
            for k, tid in enumerate(operand.value):
                while tid in handed_back_as:    # unpriced by the search: read as the object it is
                    tid = handed_back_as[tid]
                element = (*operand.path, k) if operand.path else None
                if wanted.split is False:
                    steps = conversion(have.get(tid, R), R, consumer_split=False, requires_grad=False)
                    needs[tid].append((node, element, steps))
                    continue
                where = _list_element_layout(graph, node, plan.node_choice[node.index],
                                             f"{operand.name}[{k}]", local.get(node.index))
                steps = conversion(have.get(tid, R), where, consumer_split=True,
                                   requires_grad=grad_at.get((node.span, element), tensors[tid].requires_grad))
                if steps is None:
                    raise UserError(f"{node.callee} would need a partial sum as input", _loc(node))
                needs[tid].append((node, element, steps))
    if trace.loss is not None:
        needs[trace.loss].append((None, None, conversion(have.get(trace.loss, R), R, consumer_split=False,
                                                          requires_grad=False)))
    # A call handing back its operand (`x = x.contiguous()`) gives the same object under a second
    # name, and reads under either name are traced as reads of its result: nothing is converted on
    # its line, and each read of the result is a read of the operand that first takes the
    # conversion the search priced on that call (so that the instances of a line read alike, as
    # it planned them). Steps all reads share go on the operand's producer.
    for index in sorted(handed, reverse=True):      # the last call of a chain first
        reads = needs.pop(graph.nodes[index].outputs[0], [])
        needs[passed[index]] += [(consumer, path, handed[index] + steps) for consumer, path, steps in reads]

    # steps shared by every use of every instance of a producer's output go on the producer
    by_output: dict[tuple, list[tuple[int, Node | None, tuple | None, list[Step]]]] = defaultdict(list)
    for tid, uses in needs.items():
        producer = tensors[tid].producer
        node = graph.nodes[producer] if producer is not None else None
        key = (node.span, node.callee, node.outputs.index(tid), _group(edits, node)) if node is not None and node.span \
            else ("tensor", tid)
        by_output[key] += [(tid, consumer, path, steps) for consumer, path, steps in uses]
    prefixes = _producer_prefixes(graph, by_output, edits.groups)
    given: dict[tuple, list[Step]] = {}            # each argument's conversion, the same in every instance
    given_by: dict[tuple, int] = {}                # ... and the tensor of the instance that set it
    raw: dict[tuple, set] = defaultdict(set)       # ... as each instance counts its dims
    for key, uses in by_output.items():
        prefix = prefixes[key]
        producer = tensors[uses[0][0]].producer
        node = graph.nodes[producer] if producer is not None else None
        if prefix:
            instances = [graph.nodes[p] for p in dict.fromkeys(tensors[use[0]].producer for use in uses)]
            _same(edits.site(node.span, _group(edits, node)), "result", _bias_outside_scatter(graph, instances, prefix,
                                                                       len(tensors[uses[0][0]].shape), edits), node)
        for tid, consumer, path, steps in uses:
            rest = steps[len(prefix):]
            argument = _argument(consumer, path, edits.groups)
            if argument is not None:
                ended = steps_from_end(rest, len(tensors[tid].shape))
                given_by.setdefault(argument, tid)
                if given.setdefault(argument, ended) != ended:
                    error = UserError(f"instances of {consumer.callee} need different conversions of their "
                                      f"argument {_path_note(path)}: {_steps_note(given[argument]) or 'none'} and "
                                      f"{_steps_note(rest) or 'none'} (please report it)", _loc(consumer))
                    # the layers making those tensors split are planned again whole (rewrite.py), so that
                    # every instance gets its argument alike
                    error.misshapen_params = _split_makers(graph, [given_by[argument], tid], have)
                    raise error
                raw[argument].add(str(rest))
                if len(raw[argument]) > 1:     # instances of several ranks: dims counted from the end
                    rest = ended
            if not rest:
                continue
            if consumer is not None and consumer.callee == SETITEM and path not in (("self",), ("pos", 1)):
                raise UserError(f"{_steps_note(rest)} would have to go into the index of an indexed "
                                f"assignment", _loc(consumer), hint="compute the index on its own line")
            if consumer is None or path is None or not consumer.mapped:
                where = consumer or node
                raise UserError(f"cannot place {_steps_note(rest)} for a tensor of {tensors[tid].shape}: "
                                "the value is not an argument written in the model's source", _loc(where),
                                hint="pass the tensor as a plain argument, or pin this op to replicate")
            site = edits.site(consumer.span, _group(edits, consumer))
            site.writes = consumer.callee == SETITEM
            site.args[path] = rest
            if len(path) == 3:
                listed = next((o.value for o in consumer.operands if o.path == path[:2]), None)
                if isinstance(listed, TensorList):
                    site.lengths[path[:2]] = len(listed)

    for node in graph.nodes:
        choice = plan.node_choice[node.index]
        if choice == REPLICATE or node.span is None:
            continue
        _split_site_edits(graph, node, choice, n, edits, lay(node), have)
    _check_biases_added(graph, edits)
    _check_unrollable(graph, edits)
    _ctor_edits(graph, edits)
    edits.full_sizes = full_size_reads(graph, {name: layout for name, layout in plan.param_layout.items()
                                               if name not in edits.split_after_build}, n)
    edits.regions = coshard_regions(graph, plan, edits.sites, lay, have, coshard_devices) if plan.chunks else []
    return edits


def _split_makers(graph: Graph, tids: list[int], have: dict) -> list[str]:
    """The parameters of the nearest layers making these tensors not whole: walking back from
    each through ops without parameters (an add, a view) along inputs that are not whole."""
    tensors = graph.trace.tensors
    found, seen, frontier = set(), set(), [t for t in tids if have.get(t, R).kind != "R"]
    while frontier and len(seen) < 200:
        tid = frontier.pop()
        producer = tensors[tid].producer
        if tid in seen or producer is None:
            continue
        seen.add(tid)
        params = graph.param_operands(producer)
        if params:
            found.update(tensors[t].param for _, t in params)
            continue
        frontier += [o.tid for o in graph.nodes[producer].operands
                     if o.tid is not None and have.get(o.tid, R).kind != "R"]
    return sorted(found)


def _reaches_a_split_result(dims, name: str, wanted) -> bool:
    """A whole operand of a split call gets partial gradients (a `copy`: all-reduced backward)
    unless every result it reaches is whole on each rank: a cache update hands a whole value on
    whole, and the gradient coming back to it is already complete."""
    if not wanted.split:
        return False
    if dims is None or name not in dims.feeds:
        return True
    return any(k >= len(wanted.outputs) or wanted.outputs[k].kind != "R" for k in dims.feeds[name])


def _added_once(graph: Graph, node: Node, choice: str, name: str) -> bool:
    """The bias a split on a summed label (or a split implementation) adds once to the reduced,
    whole result: its gradient is that result's, complete on every rank, so it takes no `copy`
    (a bias computed in the model, `bias / tp_degree`, would get its gradient summed twice)."""
    dims = graph.dims.get(node.index)
    if dims is None or (choice not in dims.reduced and choice not in dims.impl):
        return False
    return graph.partial_bias(node.index) == name


def _arrives_as_is(dims, name: str, have: Layout) -> bool:
    """An operand the op reads for its shape only, split on a dim whose size the results do not
    depend on (or a partial sum, of the whole shape), needs no conversion."""
    if dims is None or name not in dims.shape_only:
        return False
    return have.kind == "P" or (have.kind == "S" and have.dim in dims.free.get(name, ()))


def one_device_edits(graph: Graph, stand_in: AxisChoices) -> Edits:
    """Co-shard on one device: only the regions of a C-way stand-in plan, its C pieces run one
    after another here; nothing else is split, so no other edit."""
    regions = plan_edits(graph, stand_in, strict=False, coshard_devices=1).regions
    return Edits(stand_in.axis, 1, {}, {}, {}, [], regions=regions)


def data_parallel_edits(graph: Graph, edits: Edits | None) -> Edits:
    """Ops that need the whole batch and have a data-parallel implementation (BatchNorm: the
    statistics summed over the ranks, `dp_batch_norm`) call it at their site; one inside an
    nn.Sequential whose line runs other modules in other instances, through the whole call
    (`dp_layers`)."""
    edits = edits if edits is not None else Edits("tp", 1, {}, {}, {}, [])
    for index, label in batch_labels(graph).items():
        node = graph.nodes[index]
        template = data_parallel_impl(graph.dims.get(index), label)
        if template is None or node.span is None:
            continue
        line = dataclasses.replace(node.span, via=())
        if node.span.via and line in _mixed_lines(graph, edits):
            # the line calls an nn.Sequential holding it in some instances, other modules in others: no
            # one unrolling serves them all, so the whole call runs each BatchNorm it meets synced
            site = edits.site(line)
            _same(site, "replace", "dp_layers({self}, {arg0}, DP)", node)
            _note(site, "each BatchNorm it runs sums its statistics over the data-parallel ranks")
            continue
        site = edits.site(node.span, _group(edits, node))
        _same(site, "replace", template, node)
        _note(site, "batch statistics summed over the data-parallel ranks")
    return edits


def vocab_loss_edits(graph: Graph, losses: list[int], edits: Edits | None) -> Edits:
    """Interlaced: each cross entropy of a vocabulary-split head's logits (`losses`, node indices:
    plan/interlaced.py fused_losses) calls vocab_cross_entropy, which runs the head and the loss as
    one vocabulary-parallel step; an nn.CrossEntropyLoss module is passed along for its options."""
    edits = edits if edits is not None else Edits("tp", 1, {}, {}, {}, [])
    for index in losses:
        node = graph.nodes[index]
        module = node.callee_kind == "module"
        site = edits.site(node.span, _group(edits, node))
        _same(site, "replace", "vocab_cross_entropy({arg0}, {arg1}, loss={self})" if module
              else "vocab_cross_entropy({arg0}, {arg1}{kwargs})", node)
        _note(site, "with the head: its slice of the logits on every tp x pp device, the loss from "
                    "token-sized all-reduces")
    return edits


def _producer_prefixes(graph: Graph, by_output: dict, groups: dict[int, str] | None = None) -> dict[tuple, list[Step]]:
    """Per producer output, the steps written on the producer: those all its uses share. An
    argument written once but fed by several producers (a block's input: the embedding first,
    the residual after) gets one conversion on its line; where the producers' prefixes would
    leave its instances different rests, those producers keep their steps off the result.
    `groups` (Edits.groups): a grouped method's argument is one per group of its instances."""
    tensors = graph.trace.tensors
    prefix: dict[tuple, list[Step]] = {}
    for key, uses in by_output.items():
        node = graph.nodes[tensors[uses[0][0]].producer] if key[0] != "tensor" else None
        wrappable = node is not None and graph.result_wrappable(node)
        prefix[key] = []
        if wrappable:
            prefix[key] = common_prefix([steps for _, _, _, steps in uses])
            # instances of several ranks (a mask (B, N, L) and states (B, N, L, H, D) sliced by one
            # line) agree on dims counted from the end
            ended = common_prefix([steps_from_end(steps, len(tensors[tid].shape)) for tid, _, _, steps in uses])
            if len(ended) > len(prefix[key]):
                prefix[key] = ended
    while True:
        rests: dict[tuple, dict[tuple, list[Step]]] = defaultdict(dict)    # argument -> key -> rest
        wholes: dict[tuple, dict[tuple, list[Step]]] = defaultdict(dict)   # argument -> key -> all its steps
        for key, uses in by_output.items():
            for tid, consumer, path, steps in uses:
                argument = _argument(consumer, path, groups)
                if argument is not None:
                    rests[argument][key] = steps_from_end(steps[len(prefix[key]):], len(tensors[tid].shape))
                    wholes[argument][key] = steps
        # producers feeding one argument with different rests keep on their results only what
        # leaves the argument one rest: all but the fewest last steps they need alike (a dense
        # MLP's reduction stays on its row-split layer, the scatter both it and an MoE block need
        # goes on the argument; a row-split layer's reduction, with its bias, stays on the layer
        # when both producers need it), or else only the steps they share, the rest on the argument
        changed = False
        for argument, by_key in rests.items():
            if len({str(r) for r in by_key.values()}) > 1:
                cut = _cut_before_common_ending(graph, argument, wholes[argument], prefix, by_output, groups)
                if cut is None:
                    shared = common_prefix([prefix[key] for key in by_key])
                    cut = {key: shared for key in by_key}
                for key in by_key:
                    if len(prefix[key]) > len(cut[key]):
                        prefix[key], changed = cut[key], True
        if not changed:
            return prefix


def _cut_before_common_ending(graph: Graph, argument, wholes: dict[tuple, list[Step]], prefix: dict,
                              by_output: dict, groups: dict[int, str] | None) -> dict[tuple, list[Step]] | None:
    """Per producer feeding one argument, its steps less the fewest last steps that every
    producer needs alike (dims counted from the end) such that each keeps no more than all its
    uses share; None where no such ending exists."""
    ends = []
    for key, steps in wholes.items():
        tid = next(tid for tid, consumer, path, _ in by_output[key] if _argument(consumer, path, groups) == argument)
        ends.append([str(s) for s in steps_from_end(steps, len(graph.trace.tensors[tid].shape))])
    common = 0
    while all(len(e) > common for e in ends) and len({e[len(e) - 1 - common] for e in ends}) == 1:
        common += 1
    for ending in range(1, common + 1):
        cut = {key: steps[:len(steps) - ending] for key, steps in wholes.items()}
        if all(len(cut[key]) <= len(prefix[key]) for key in wholes):
            return cut
    return None


def _check_biases_added(graph: Graph, edits: Edits) -> None:
    """A row-split call's bias is added after the reduction written on its result; a result
    whose partial sums are reduced only where it is used would lose the bias: refused."""
    for node in graph.nodes:
        site = _site_of(edits, node) if node.span is not None else None
        if site is None or site.bias is None:
            continue
        if not site.result or site.result[0].op not in ("reduce", "reduce_scatter"):
            raise UserError(f"{node.callee} is split by its reduced dim, but its partial sums are reduced only "
                            "where they are used, so its bias could not be added once", _loc(node),
                            hint="pin this call to another split, or give the layer bias=False")


def _bias_outside_scatter(graph: Graph, instances: list[Node], steps: list[Step], ndim: int,
                          edits: Edits) -> list[Step]:
    """A row-parallel result's bias is added whole after its partial sums are reduced; when the
    reduce-scatter would slice the bias's own dim (the last), reduce and scatter stay two steps
    with the bias added between them. Added to a slice of the other dims, the bias's gradient is
    that slice's sum: summed over the ranks after backward, like a norm's weight on slices."""
    first, node = steps[0], instances[0]
    bias = graph.partial_bias(node.index)
    if first.op != "reduce_scatter" or bias is None or node.operand(bias) is None or node.operand(bias).tid is None:
        return steps
    if first.dim % ndim == ndim - 1:
        return [Step("reduce"), Step("scatter", first.dim), *steps[1:]]
    for instance in instances:
        param = graph.trace.tensors[instance.operand(bias).tid].param
        if param is not None and param not in edits.partial_grad_params:
            edits.partial_grad_params = [*edits.partial_grad_params, param]
    return steps


def _list_element_layout(graph: Graph, node: Node, choice: str, name: str,
                         local: dict[str, int] | None = None) -> Layout:
    """The layout a split op wants for one tensor of a list operand (`torch.cat((a, b), 1)`)."""
    dims = graph.dims.get(node.index)
    tensor = dims.inputs.get(name) if dims is not None else None
    where = tensor.where(choice, local) if tensor is not None else None
    return shard(*where) if where else R


def _argument(consumer: Node | None, path: tuple | None, groups: dict[int, str] | None) -> tuple | None:
    """One argument as written in source: every instance of the call shares its conversion (every
    instance of its group, where a block class's instances are planned per group). None for
    tensors inside a list argument and for the loss: each such use is its own."""
    if consumer is None or consumer.span is None or path is None:
        return None
    return (consumer.span, path, groups.get(consumer.index) if groups else None)


def _path_note(path: tuple | None) -> str:
    return "" if path is None else ".".join(str(p) for p in path)


def _grad_at_argument(graph: Graph) -> dict[tuple, bool]:
    """Whether any instance of an argument carries a gradient: a backward all-reduce (tp_copy)
    written for it serves all of them (on a tensor without gradient it does nothing)."""
    grad: dict[tuple, bool] = {}
    for node in graph.nodes:
        if node.span is None:
            continue
        for operand in node.operands:
            if operand.tid is not None:
                key = (node.span, operand.path)
                grad[key] = grad.get(key, False) or graph.trace.tensors[operand.tid].requires_grad
            elif isinstance(operand.value, TensorList) and operand.path:   # torch.cat([a, b]), einsum(eq, (q, k))
                for k, tid in enumerate(operand.value):
                    key = (node.span, (*operand.path, k))
                    grad[key] = grad.get(key, False) or graph.trace.tensors[tid].requires_grad
    return grad


def _warn_forced_regather(graph: Graph, plan: AxisChoices, node: Node, operand: str, steps: list[Step],
                          warnings: list[str]) -> None:
    """A split tensor gathered because its consumer cannot be split (no rule, or sizes that do
    not divide) is correct but slow: the op runs whole on every device. Say where and why, by
    the dim the operand arrives split on; a dim of size 1 (a batch of one per data-parallel
    rank) splits under no --tp, so it is nothing to act on."""
    gathered = [step.dim for step in steps if step.op == "gather"]
    if plan.node_choice[node.index] != REPLICATE or not gathered:
        return      # a consumer that is split itself only re-splits what it is given
    if node.index not in graph.dims:
        why = f"{node.callee} has no split rule"
        hint = f"add a rule for {node.callee} to rules/ops/*.toml"
    else:
        from ..plan.search import site_id
        options = plan.options.get(site_id(graph, node.index))
        dims = graph.dims[node.index].inputs.get(operand)
        labels = {f.label for d in gathered if dims is not None and -len(dims.dims) <= d < len(dims.dims)
                  for f in dims.dims[d]}
        reasons = sorted({why for label, why in (options.why.items() if options else ())
                          if "not divisible" in why and label in labels and "of size 1 " not in why})
        if not reasons:
            return  # the planner chose to run it whole: cheaper than the alternatives
        why = f"cannot split {node.callee} {plan.n} ways: {'; '.join(reasons)}"
        hint = "a --tp that divides the model's sizes (heads, vocabulary, hidden) splits it"
    where = node.span.start if node.span is not None else "?"
    text = f"{where}: warning: {why}; it runs whole on every device, its input gathered first ({hint})"
    if text not in warnings:
        warnings.append(text)


def _loc(node: Node | None):
    return node.span.start if node is not None and node.span is not None else None


def _split_site_edits(graph: Graph, node: Node, choice: str, n: int, edits: Edits, layouts,
                      have: dict[int, Layout]) -> None:
    dims = graph.dims[node.index]
    rule = graph.node_rule[node.index]
    site = edits.site(node.span, _group(edits, node))
    if choice in dims.impl:
        template = dims.impl[choice]
        _same(site, "replace", template, node)
        site.traced = _traced_arguments(graph, node)
        _note(site, f"split {n}-way by {template.split('(')[0]}")
    elif choice in dims.reduced:
        bias = graph.partial_bias(node.index)
        present = bias is not None and node.operand(bias) is not None and node.operand(bias).tid is not None
        if present:
            _same(site, "replace", rule.partial["expr"], node)
            _same(site, "bias", bias, node)
            _same(site, "bias_trailing", _bias_trailing(graph, node, bias), node)
            _note(site, "partial sums reduced, bias added once")
    _size_edits(graph, node, choice, n, site, layouts, have)


def _bias_trailing(graph: Graph, node: Node, bias: str) -> int:
    """How many dims of the result follow the bias's (a conv's channels come before its
    spatial dims: its bias is added as `bias[:, None, None]`)."""
    dims = graph.dims[node.index]
    out = dims.outputs[0]
    where = out.where(dims.inputs[bias].dims[0][0].label) if bias in dims.inputs and dims.inputs[bias].dims else None
    return len(out.dims) - where[0] - 1 if where is not None else 0


def _traced_arguments(graph: Graph, node: Node) -> dict[str, str]:
    """Template values for what the traced call received, written as the site's method can
    read them: a parameter of the module whose code holds the site as `self.<name>`, a plain
    value as a literal; `{restN}` as the keywords whose values differ from the callee's defaults."""
    values: dict[str, str] = {}
    prefix = f"{node.module_path}." if node.module_path else ""
    for operand in node.operands:
        if operand.tid is not None:
            param = graph.trace.tensors[operand.tid].param
            if param is not None and param.startswith(prefix) and "." not in param[len(prefix):]:
                values[operand.name] = f"self.{param[len(prefix):]}"
        elif operand.value is None or isinstance(operand.value, (bool, int, float, str)):
            values[operand.name] = repr(operand.value)
    replay = graph.trace.replays.get(node.index)
    try:
        defaults = {name: p.default for name, p in inspect.signature(replay.fn).parameters.items()}
    except (AttributeError, TypeError, ValueError):
        return values
    keywords = "".join(f", {o.name}={values[o.name]}" for o in node.operands
                       if o.path and o.path[0] == "kw" and o.name in values and o.tid is None
                       and defaults.get(o.name, inspect.Parameter.empty) != o.value)
    positional = sum(1 for o in node.operands if o.path and o.path[0] == "pos")
    for i in range(positional + 1):
        values[f"rest{i}"] = keywords
    return values


def _note(site: SiteEdit, text: str) -> None:
    if text not in site.notes:
        site.notes.append(text)


def _same(site: SiteEdit, key: str, value, node: Node) -> None:
    """Set one edit of a site; every instance of the site must ask for the same."""
    current = getattr(site, key)
    if current and current != value:
        raise UserError(f"instances of {node.callee} need different rewrites", _loc(node))
    setattr(site, key, value)


def _size_edits(graph: Graph, node: Node, choice: str, n: int, site: SiteEdit, layouts,
                have: dict[int, Layout]) -> None:
    """Divide the size arguments that describe a split output dim.

    A size read from a tensor that is itself split (`logits.size(-1)`) is already local at
    run time and is left alone.
    """
    if node.callee not in SIZE_ARGUMENTS | SPLIT_SIZES or _reads_local_size(graph, node, have):
        return
    out = layouts.outputs[0] if layouts.outputs else R
    if out.kind != "S":
        return
    if node.callee in SPLIT_SIZES:
        dim = node.operand("arg2") or node.operand("dim")
        rank = len(graph.trace.tensors[node.outputs[0]].shape)
        if layouts.inputs.get("arg0", R).kind != "S" or out.dim != (dim.value % rank if dim else 0):
            return
        size = node.operand("arg1") or node.operand("split_size") or node.operand("split_size_or_sections")
        items = [None] if isinstance(size.value, int) else list(range(len(size.value)))
        new = [SizeEdit(size.path, item, n, f"pieces / {n}") for item in items]
    else:
        located = locate_size_argument(graph, node, out.dim)
        if located is None:
            return
        if isinstance(located, str):
            raise UserError(located, _loc(node), hint="write the sizes out in the call, or use -1 for the split dim")
        path, item = located
        new = [SizeEdit(path, item, n, f"dim {out.dim} / {n}")]
    for edit in new:
        if edit not in site.sizes:
            site.sizes.append(edit)


def _dim_sized_by_a_split_tensor(graph: Graph, node: Node, have: dict[int, Layout]) -> int | None:
    """The output dim of an expand whose size the source reads from a tensor split on the
    matching dim, where the expand broadcasts a dim of size 1 (`mask.expand(x.size())`): at run
    time that size is the local one, so the result is split there even where the plan runs
    the call whole. (Where it does not broadcast, the cautious re-plan keeps x whole:
    plan/whole_sizes.py.)"""
    for span, tid, dim in _size_queries_in(graph, node.span):
        layout = have.get(tid, R)
        if layout.kind != "S" or layout.groups != 1:
            continue
        at = dims_sized_by_read(graph, node, span, len(graph.trace.tensors[tid].shape), dim).get(layout.dim)
        if at is not None and expand_broadcasts(graph, node, at):
            return at
    return None


def _size_queries_in(graph: Graph, span: Span) -> list[tuple[Span, int, int | None]]:
    """The trace's size reads (`x.size(-1)`) inside `span`, in trace order: found by line, as each
    split op asks (a model reads sizes thousands of times)."""
    trace = graph.trace
    index = trace.__dict__.get("_size_queries_by_line")
    if index is None or index[0] != len(trace.size_queries):
        by_line: dict[int, list[int]] = defaultdict(list)
        for k, (read, _, _) in enumerate(trace.size_queries):
            by_line[read.line].append(k)
        index = trace.__dict__["_size_queries_by_line"] = (len(trace.size_queries), by_line)
    found = sorted(k for line in range(span.line, span.end_line + 1) for k in index[1].get(line, ()))
    return [trace.size_queries[k] for k in found if span.contains(trace.size_queries[k][0])]


def _reads_local_size(graph: Graph, node: Node, have: dict[int, Layout]) -> bool:
    for span, tid, dim in _size_queries_in(graph, node.span):
        layout = have.get(tid, R)
        if layout.kind == "S":
            rank = len(graph.trace.tensors[tid].shape)
            if dim is None or dim % rank == layout.dim:
                return True
    return False


def _ctor_dims(graph: Graph, edits: Edits) -> dict[tuple[Span, str], set[tuple]]:
    """Per constructor call and parameter attribute, the constructor arguments its split
    instances divide (more than one: the instances split unalike)."""
    found: dict[tuple[Span, str], set[tuple]] = defaultdict(set)
    for name, info in graph.trace.params.items():
        layout = edits.param_layout.get(name, R)
        rule = graph.rules.ctor_for(info.module_type)
        per_dim = (rule.params.get(info.attr) or rule.params.get("*")) if rule else None
        if layout.kind == "S" and info.ctor_span is not None and per_dim and per_dim != [["*"]] \
                and layout.dim < len(per_dim):
            found[(info.ctor_span, info.attr)].add((tuple(per_dim[layout.dim]), layout.groups))
    return found


def _passed(call: cst.Call, aliases: list[str]) -> cst.BaseExpression | None:
    """The value the call writes for an argument (positional "argN" or keyword names), or None."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for alias in aliases:
        if re.fullmatch(r"arg\d+", alias):
            value = positional[int(alias[3:])].value if int(alias[3:]) < len(positional) else None
        else:
            value = next((a.value for a in call.args if a.keyword and a.keyword.value == alias), None)
        if value is not None:
            return value
    return None


def _writes_arguments(graph: Graph, span: Span, alias_lists: list[list[str]]) -> bool:
    """Whether the constructor call at `span` writes out every argument to divide. A library
    helper building the layer (`create_conv2d(c, c, 3, depthwise=True)` setting groups=c inside)
    leaves one to the helper: no edit of that line can divide it."""
    if graph.sources is None:
        return True
    call = graph.sources.get(span.path).node_at(span.line, span.col, span.end_line, span.end_col)
    return not isinstance(call, cst.Call) or all(
        a[0].startswith("factory:") or _passed(call, a) is not None for a in alias_lists)


def _helper_argument(graph: Graph, info, aliases: list[str]) -> list[str] | None:
    """A layer built in a helper from the helper's own parameter (`def conv3x3(in_planes,
    out_planes): return nn.Conv2d(in_planes, out_planes, 3)`): the helper's parameter, as the
    call one frame up (`conv3x3(inplanes, planes)`) passes it; None when the size is not such a
    parameter passed straight through."""
    if graph.sources is None or info.ctor_caller is None:
        return None
    source = graph.sources.get(info.ctor_span.path)
    span = info.ctor_span
    call = source.node_at(span.line, span.col, span.end_line, span.end_col)
    if not isinstance(call, cst.Call):
        return None
    value = _passed(call, aliases)
    if not isinstance(value, cst.Name):
        return None
    helper = None
    for node in source.functions():       # the innermost function around the constructor call
        where = source.positions[node]
        if (where.start.line, where.start.column) <= (span.line, span.col) and \
                (span.end_line, span.end_col) <= (where.end.line, where.end.column):
            helper = node
    if helper is None or helper.name.value == "__init__":
        return None
    params = [*helper.params.posonly_params, *helper.params.params]
    names = [p.name.value for p in params]
    if value.value in names:
        index = names.index(value.value) - (1 if names and names[0] in ("self", "cls") else 0)
        return [f"arg{index}", value.value] if index >= 0 else None
    if value.value in [p.name.value for p in helper.params.kwonly_params]:
        return [value.value]
    return None


def _ctor_edits(graph: Graph, edits: Edits) -> None:
    """Divide the constructor argument behind each split dim of a parameter. Where the instances
    of one constructor call split unalike and the call sits in a helper that passes its own
    parameter through (torchvision's conv3x3 builds both convs of a block, one split by its
    output, the other by its input), the helper's calls are divided instead. Where no one
    edit of the source serves every instance (one constructor line builds layers split unalike
    or whole, a layer sized from a config object, no [[ctor]] rule), that call is left as it is:
    its layers are built whole and cut to each rank's share right after build()
    (`edits.split_after_build`)."""
    built_whole: set[Span] = set()
    spans = {info.ctor_span for info in graph.trace.params.values() if info.ctor_span is not None}
    while True:
        ctors = _divided_ctors(graph, edits, built_whole)
        if isinstance(ctors, dict):
            break
        # a constructor call inside one built whole is built whole too: the outer call makes its
        # parameters from the inner call's layer (`weight_norm(nn.Conv1d(...))` replaces the conv's
        # weight with its own), so they are cut after build() together
        built_whole |= ctors | {span for span in spans if any(outer.path == span.path and outer.contains(span)
                                                              for outer in ctors)}
    edits.ctors = ctors
    sizes = graph.rules.size_attributes
    for name, info in graph.trace.params.items():
        layout = edits.param_layout.get(name, R)
        if layout.kind == "S" and (info.ctor_span is None or info.ctor_span in built_whole):
            per_dim = sizes(info.module_type).get(info.attr, [])
            attributes = sorted(per_dim[layout.dim]) if layout.dim < len(per_dim) else []
            for alias in info.aliases:
                edits.split_after_build[alias] = (layout.dim, layout.groups, attributes)
            owner = name.rpartition(".")[0]
            for buffer, held in edits.buffer_layout.items():    # its layer's buffers are cut with it
                if buffer.rpartition(".")[0] == owner:
                    edits.split_after_build[buffer] = (held.dim, held.groups, [])


def _divided_ctors(graph: Graph, edits: Edits, built_whole: set[Span]) -> dict[Span, list[CtorEdit]] | set[Span]:
    """The constructor edits of the parameters not built whole (their call in `built_whole`),
    or the constructor calls found that no one edit serves."""
    rules = graph.rules
    ctors: dict[Span, list[CtorEdit]] = {}
    by_span: dict[tuple[Span, str], dict[tuple, int]] = defaultdict(dict)   # (site, attr) -> {sizes: groups}
    unalike = {key for key, found in _ctor_dims(graph, edits).items() if len(found) > 1}
    lifted: dict[Span, set[Span]] = defaultdict(set)    # helper call divided -> the constructor calls inside
    for name, info in graph.trace.params.items():
        layout = edits.param_layout.get(name, R)
        if layout.kind != "S" or info.ctor_span is None or info.ctor_span in built_whole:
            continue
        rule = rules.ctor_for(info.module_type)
        per_dim = (rule.params.get(info.attr) or rule.params.get("*")) if rule is not None else None
        if per_dim is None or (per_dim != [["*"]] and layout.dim >= len(per_dim)):
            return {info.ctor_span}     # no rule says which argument sizes it
        factory = per_dim == [["*"]]
        aliases = [f"factory:{layout.dim}"] if factory else per_dim[layout.dim]
        note = f"dim {layout.dim} / {edits.n}" if factory else \
            f"{'/'.join(a for a in aliases if not a.startswith('arg'))} / {edits.n}"
        if layout.groups > 1:
            note += f", {layout.groups} fused blocks split alike"
        companions = [] if factory else rule.divided_with(aliases)
        # all of them at that size, or none divided: a depthwise conv holds in_channels and groups at
        # its out_channels; a conv whose in_channels only happens to equal out_channels is no such layer
        if not all(_layer_holds(graph, name, other, info.shape[layout.dim]) for other in companions):
            companions = []
        span = info.ctor_span
        if (span, info.attr) in unalike:
            helper = [_helper_argument(graph, info, a) for a in [aliases, *companions]]
            if any(h is None for h in helper) or info.ctor_caller in built_whole:
                return {span}
            span, aliases, companions = info.ctor_caller, helper[0], helper[1:]
            note = f"{aliases[-1]} / {edits.n}"
            lifted[span].add(info.ctor_span)
        if not _writes_arguments(graph, span, [aliases, *companions]):
            return {info.ctor_span, *lifted.get(span, ())}     # built whole, cut after build()
        # one divided size serves every instance, its companions too: a line building depthwise
        # and pointwise convs divides groups and in_channels for the first only
        key = (tuple(aliases), tuple(map(tuple, companions)))
        alike = by_span[(span, info.attr)]
        if alike and alike != {key: layout.groups}:
            return {info.ctor_span, *lifted.get(span, ())}
        alike[key] = layout.groups
        ctor_list = ctors.setdefault(span, [])
        if all(e.aliases != aliases for e in ctor_list):
            ctor_list.append(CtorEdit(aliases, edits.n, note, len(info.shape) if factory else None))
        for other in companions:
            if all(e.aliases != other for e in ctor_list):
                named = "/".join(a for a in other if not a.startswith("arg"))
                ctor_list.append(CtorEdit(other, edits.n, f"{named} / {edits.n} with it"))
    # a constructor used for both split and whole parameters cannot be rewritten in place
    for name, info in graph.trace.params.items():
        if edits.param_layout.get(name, R).kind == "S":
            continue
        if info.ctor_caller in lifted:
            return lifted[info.ctor_caller]
        if info.ctor_span in ctors:
            rule = rules.ctor_for(info.module_type)
            dims = (rule.params.get(info.attr) or rule.params.get("*", [])) if rule else []
            touched = {a for e in ctors[info.ctor_span] for a in e.aliases}
            factory = dims == [["*"]] and any(a.startswith("factory:") for a in touched)
            if factory or any(set(d) & touched for d in dims):
                return {info.ctor_span}
    return ctors


def _check_unrollable(graph: Graph, edits: Edits) -> None:
    """An edit between the layers of an nn.Sequential is written by unrolling its call
    (`self.main[1:](tp_copy(self.main[0](x)))`); a call line that runs unlike modules in different
    instances of its class (an nn.Sequential of other layers, or no nn.Sequential: timm's LowFormer
    ResidualBlock over an MLP, an attention or an MBConv) has no one unrolling. The conversions of
    its input and its result, the same for every call (the planner's _mixed_facts), move onto the
    line itself (`tp_gather(self.block(tp_copy(x)))`); for any other edit, the parameters of the
    layers it runs are named for the plan to be solved again with them whole (rewrite.py)."""
    mixed = _mixed_lines(graph, edits)
    children: dict[Span, list[Span]] = defaultdict(list)
    for span, site in edits.sites.items():
        if span.via and dataclasses.replace(span, via=()) in mixed and \
                (site.result or site.args or site.sizes or site.replace):
            children[dataclasses.replace(span, via=())].append(span)
    if not children:
        return
    ends = mixed_edges(graph, mixed)
    unwritable = []
    for line, spans in sorted(children.items()):
        firsts = {graph.nodes[v].span for v, _ in ends.entries.get(line, [])}
        lasts = {graph.nodes[u].span for u, _ in ends.exits.get(line, [])}
        sites = [edits.sites[span] for span in spans]
        args = [site.args for span, site in zip(spans, sites) if site.args]
        results = [site.result for span, site in zip(spans, sites) if site.result]
        if any(site.sizes or site.replace or site.bias or site.writes for site in sites) \
                or any(site.args and span not in firsts for span, site in zip(spans, sites)) \
                or any(site.result and span not in lasts for span, site in zip(spans, sites)) \
                or any(a != args[0] for a in args) or any(r != results[0] for r in results) \
                or (args and any(len(path) != 2 or path[0] != "pos" for path in args[0])):
            unwritable.append(line)
            continue
        if line in ends.passing or not _own_forwards_converted(graph, edits, line, ends, args[0] if args else {},
                                                               results[0] if results else []):
            # (a passing line's other instances hand their input back: a conversion around the
            # call would convert it there too, which the plan did not ask for)
            unwritable.append(line)
            continue
        around = edits.site(line)
        around.args.update(args[0] if args else {})
        around.result = list(results[0]) if results else []
        _note(around, "conversions around the nn.Sequential, the same for every layer list it runs")
        for span in spans:
            del edits.sites[span]
    if not unwritable:
        return
    span = min(unwritable)
    params = sorted({graph.trace.tensors[tid].param for n in graph.nodes
                     if n.span is not None and n.span.via and dataclasses.replace(n.span, via=()) in unwritable
                     for _, tid in graph.param_operands(n.index)})
    error = UserError("this call runs an nn.Sequential whose layers need collectives between them, and other "
                      "modules in other instances of its class, so no one rewrite of the line serves them all",
                      span.start, hint="call the nn.Sequential's layers on lines of their own")
    error.misshapen_params = params
    raise error


def _own_forwards_converted(graph: Graph, edits: Edits, line: Span, ends, args: dict, result: list) -> bool:
    """Whether the conversions moved onto `line` serve the modules it runs through a forward of
    their own (graph/mixed.py) too: the conversion that forward's own line has planned for the
    line's input, or for its result, must be the one now on the line (it is dropped there, not
    written twice); with nothing on the line, each converts inside as it planned. False where a
    module would get a conversion it did not plan (a whole pooling branch's input under the conv
    branches' tp_copy: its full gradient summed twice)."""
    own = [call for call in ends.own_forward if call.line == line]
    if not own:
        return True
    held = lambda index: any(call.holds(graph, index) for call in own)  # noqa: E731
    if len(args) > 1:
        return False
    drops = []
    for pairs, planned, of_args in ((ends.own_entries.get(line, []), next(iter(args.values()), []), True),
                                    (ends.exits.get(line, []), result, False)):
        if not planned:
            continue                            # the line holds nothing: the modules' own lines convert
        for index, which in pairs:
            if not held(index):
                continue
            span = graph.nodes[index].span
            site = edits.sites.get(span)
            key = graph.nodes[index].operand(which).path if of_args else None
            steps = (site.args.get(key, []) if of_args else site.result) if site is not None else []
            if list(steps) != list(planned) or not all(held(n.index) for n in graph.nodes if n.span == span):
                return False
            drops.append((site, key, of_args))
    for site, key, of_args in drops:
        if of_args:
            site.args.pop(key, None)
        else:
            site.result = []
    return True


def _layer_holds(graph: Graph, param: str, aliases: list[str], size: int) -> bool:
    """Whether the layer holding `param` keeps the argument of `aliases` at `size` (`self.groups`
    of a depthwise conv equals its channels), as the traced call of that layer shows."""
    path = param.rpartition(".")[0]
    for node in graph.nodes:
        replay = graph.trace.replays.get(node.index) if node.callee_path == path else None
        if replay is not None and replay.module is not None:
            return any(getattr(replay.module, a, None) == size for a in aliases if a.isidentifier())
    return False
