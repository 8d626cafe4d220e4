"""The op graph: traced invocations annotated with split rules, grouped by source site.

A *site* is one place in the model's source where it calls something (`self.c_attn(x)` at
line 47). Every instance of a class runs the same source, so a site is also the unit of
every rewrite decision: the 12 blocks of a GPT share the sites of one Block. Repeated
blocks are recognised as module paths of the same class under one container.

Builds and summarises; decides nothing.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import libcst as cst

from ..source.files import SourceSet, Span
from ..trace.records import Node, Trace
from ..errors import Location
from .batch_probe import batch_kept_apart, half_batch_trace, module_kept_apart
from .derive import derive, handed_back
from .dims import OpDims
from .oprules import OpRule, RuleSet, annotate

SiteKey = tuple[Span, str]      # (span, callee)


@dataclass
class Site:
    key: SiteKey
    nodes: list[Node]
    rule: OpRule | None
    dims: OpDims | None          # the first invocation's labels
    problem: str | None

    @property
    def span(self) -> Span:
        return self.key[0]

    @property
    def callee(self) -> str:
        return self.key[1]


@dataclass
class Graph:
    trace: Trace
    rules: RuleSet
    dims: dict[int, OpDims]                     # node index -> labels
    node_rule: dict[int, OpRule]
    problems: dict[int, str]
    sites: dict[SiteKey, Site]
    consumers: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # tid -> [(node, operand)]
    blocks: dict[str, list[str]] = field(default_factory=dict)  # block class -> module paths
    sources: SourceSet | None = None
    # traces the model again on 1/k of its batch (analysis.py sets it): see batch_kept_apart
    retrace: Callable[[int], Trace] | None = None
    _half: list = field(default_factory=list)                   # [the half-batch trace or None], once made
    _kept: dict[int | str, dict[int, int] | None] = field(default_factory=dict)
    _param_operands: dict[int, list[tuple[str, int]]] = field(default_factory=dict)

    def batch_kept_apart(self, node: Node) -> dict[int, int] | None:
        """For a call whose split rule has no batch dim: {output tensor: batch dim} when the call,
        made with its own arguments at half the batch, gives each half of its whole result
        (graph/batch_probe.py); None when it does not or cannot be told."""
        if node.index not in self._kept:
            half = self._half_trace()
            self._kept[node.index] = batch_kept_apart(node, self.trace, half) if half is not None else None
        return self._kept[node.index]

    def module_kept_apart(self, path: str) -> dict[int, int] | None:
        """The same for the first call of the module at `path`, as a whole."""
        if path not in self._kept:
            half = self._half_trace()
            self._kept[path] = module_kept_apart(path, self.trace, half) if half is not None else None
        return self._kept[path]

    def _half_trace(self) -> Trace | None:
        if not self._half:
            self._half.append(half_batch_trace(self.retrace) if self.retrace is not None else None)
        return self._half[0]

    def source_node(self, node: Node):
        """The LibCST node of a traced invocation's call site."""
        if node.span is None or self.sources is None:
            return None
        span = node.span
        return self.sources.get(span.path).node_at(span.line, span.col, span.end_line, span.end_col)

    def result_wrappable(self, node: Node) -> bool:
        """A producer's result can carry a conversion when it is one tensor used whole, and is not
        stored in an attribute: `self.pe = tp_scatter(self.pe.to(x.dtype), ...)` would keep the
        slice, and the next call would slice the slice; its uses are converted instead."""
        if not (node.mapped and node.span is not None and len(node.outputs) == 1) or \
                node.callee == "Tensor.__setitem__":
            return False    # `x[i] = v` is a statement: its result is x, read where it is used next
        call = self.source_node(node)
        source = self.sources.get(node.span.path) if call is not None else None
        if source is None or source.value_is_stored(call):
            return False
        return source.value_is_whole(call) or self._indexed_as_tensor(node, source.parents.get(call))

    def _indexed_as_tensor(self, node: Node, parent) -> bool:
        """`self.proj(t)[:, :, None, None]` and `q, k, v = t.view(...).permute(...)`: the call's
        one result is the tensor indexed or unpacked there (a Tensor.__getitem__ at that
        subscript, the unpacking's Tensor.unbind, reads it), not a tuple's element
        (`self.lstm(x)[0]`, `out, state = self.rnn(x)`), so a conversion wrapping the call
        converts that tensor."""
        consumers = [self.nodes[index] for index, name in self.consumers.get(node.outputs[0], ()) if name == "arg0"]
        if isinstance(parent, cst.Subscript):
            return any(c.callee == "Tensor.__getitem__" and self.source_node(c) is parent for c in consumers)
        if isinstance(parent, cst.Assign):
            return any(c.index in self.unpackings and self._unpacked(c) is parent.value for c in consumers)
        return False

    @cached_property
    def passed_through(self) -> dict[int, int]:
        """Node index -> the operand the call hands back as its one result, unmodified
        (`x.contiguous()` of a contiguous tensor, `.float()` of a float one): one object under two
        tensor ids. Every later read of the object (`skips[-1]`, kept from before the call) is
        traced as a read of the result, so the rewrite converts nothing at such a call and
        converts reads under either name as reads of the operand (materialize/edits.py). A
        parameter handed back keeps its own split."""
        found = {}
        for node in self.nodes:
            if len(node.outputs) != 1:
                continue
            names = defaultdict(list)
            for operand in node.operands:
                if operand.tid is not None:
                    names[operand.tid].append(operand.name)
            tid = handed_back(node.outputs[0], node, self.trace, names)
            if tid is not None and self.trace.tensors[tid].param is None:
                found[node.index] = tid
        return found

    @cached_property
    def unpackings(self) -> set[int]:
        """The nodes that unpack a tensor (`q, k, v = t`: Tensor.unbind, traced at the target).
        No call is written there: the op is split as its input arrives, each result a target."""
        return {node.index for node in self.nodes if not node.mapped and self._unpacked(node) is not None}

    def _unpacked(self, node: Node):
        """The value an op traced at the target of `a, b = value` reads, or None."""
        if node.span is None or self.sources is None:
            return None
        span = node.span
        return self.sources.get(span.path).unpacked_value(span.line, span.col, span.end_line, span.end_col)

    @property
    def nodes(self) -> list[Node]:
        return self.trace.nodes

    def partial_bias(self, index: int) -> str | None:
        """The operand a split on a summed label adds once after the reduction (a bias); under a
        split implementation (impl), the operand it adds once after its own reduction."""
        rule = self.node_rule.get(index)
        return rule.partial.get("bias") if rule and rule.partial else None

    def param_operands(self, index: int) -> list[tuple[str, int]]:
        # asked per node and candidate split by the search (AlphaFold2's 14,592 nodes: 190k times)
        known = self._param_operands.get(index)
        if known is None:
            tensors = self.trace.tensors
            known = self._param_operands[index] = [(op.name, op.tid) for op in self.nodes[index].operands
                                                   if op.tid is not None and tensors[op.tid].param is not None]
        return known

    def summary(self) -> dict[str, int]:
        ops = self.trace.ops
        annotated = sum(len(n.ops) for n in self.nodes if n.index in self.dims)
        return {
            "compute_ops": len(ops),
            "mapped": sum(1 for op in ops if op.mapped),
            "annotated": annotated,
            "sites": len(self.sites),
            "nodes": len(self.nodes),
            "unannotated_sites": sum(1 for s in self.sites.values() if s.dims is None),
            "block_kinds": len(self.blocks),
        }


def build_graph(trace: Trace, rules: RuleSet, sources: SourceSet | None = None) -> Graph:
    dims, node_rule, problems = {}, {}, {}
    probed: dict = {}
    seen: dict = {}
    for node in trace.nodes:
        rule, node_dims, problem = annotate(node, trace, rules, seen)
        if node_dims is None:
            derived = derive(node, trace, probed, rules.size_attributes)
            if derived.dims is not None:
                rule, node_dims = derived_rule(node), derived.dims
            elif rule is None:
                problem = derived.problem
        if rule is not None:
            node_rule[node.index] = rule
        if node_dims is not None:
            dims[node.index] = node_dims
        else:
            problems[node.index] = problem
    grouped: dict[SiteKey, list[Node]] = defaultdict(list)
    for node in trace.nodes:
        if node.span is not None:
            grouped[(node.span, node.callee)].append(node)
    sites = {}
    for key, nodes in grouped.items():
        first = nodes[0].index
        sites[key] = Site(key, nodes, node_rule.get(first), dims.get(first), problems.get(first))
    consumers: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for node in trace.nodes:
        for operand in node.operands:
            if operand.tid is not None:
                consumers[operand.tid].append((node.index, operand.name))
            elif isinstance(operand.value, tuple) and type(operand.value).__name__ == "TensorList":
                for k, tid in enumerate(operand.value):
                    consumers[tid].append((node.index, f"{operand.name}[{k}]"))
    return Graph(trace, rules, dims, node_rule, problems, sites, dict(consumers), repeated_blocks(trace), sources)


def derived_rule(node: Node) -> OpRule:
    """The rule a probe derived for a call (graph/derive.py); it sits at the call itself."""
    where = node.span.start if node.span is not None else Location("<trace>")
    return OpRule(name="derived", callees=[node.callee], location=where)


def repeated_blocks(trace: Trace) -> dict[str, list[str]]:
    """Classes instantiated at several indices of one container (h.0, h.1, ...)."""
    by_pattern: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path, cls in trace.module_types.items():
        match = re.fullmatch(r"(.*)\.(\d+)", path)
        if match:
            by_pattern[(match.group(1), cls)].append(path)
    return {f"{cls.rsplit('.', 1)[-1]} ({container}.*)": paths
            for (container, cls), paths in by_pattern.items() if len(paths) > 1}
