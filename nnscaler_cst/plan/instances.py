"""Per-instance splits: the instances of one block class that run unlike layers from one line.

A block class built for several kinds of layer (timm's `ConvNormAct` as a depthwise and as a
pointwise conv) calls all of them from one line, `x = self.conv(x)`. Where the instances of
such a line could take no split in common, the instances of the method holding it are grouped
by the splits their calls there could take, and each group's calls of that method are sites of
their own (plan/search.py `site_id`): planned, edited (materialize/edits.py) and written
(emit/variants.py, a subclass per group's rewrite) apart. Repeated blocks of one kind stay one
group, so they still cost one variable (docs/per-instance-splits.md).

Decides only which instances go together; plans, edits and writes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import libcst as cst

from ..graph.graph import Graph
from ..source.files import Span


@dataclass(frozen=True)
class MethodGroups:
    """One method of a block class whose instances split unalike, and its instances, grouped."""

    method: Span                        # the method's `def`
    cls: str                            # the class defining it (every instance's own class)
    name: str                           # the method's name
    groups: tuple[tuple[str, ...], ...]  # module paths, per group; a group is named by its first
    # (group, line, the layers it runs): a line calling nn.Sequentials of unlike layers in unlike
    # instances runs one list per group, cut apart as that group's rewrite needs (emit/rewrite.py)
    layers: tuple[tuple[str, Span, tuple[tuple[str, ...], ...]], ...] = ()


@dataclass
class InstanceGroups:
    methods: list[MethodGroups] = field(default_factory=list)
    of_node: dict[int, str] = field(default_factory=dict)    # node index -> its group's name
    lines: set[Span] = field(default_factory=set)   # lines of unlike nn.Sequentials, alike within each group

    def group_of(self, module_path: str) -> tuple[MethodGroups, str] | None:
        """The method whose calls in `module_path` are grouped, and that instance's group."""
        for method in self.methods:
            for group in method.groups:
                if module_path in group:
                    return method, group[0]
        return None


def instance_groups(graph: Graph) -> InstanceGroups:
    """Per graph, once: the grouped methods and each of their nodes' group. A method is grouped
    where a line of it runs instances whose splits differ (the splits valid at some number of
    devices: the grouping does not change with --tp), each instance running that line as one
    kind, and every instance is of the class defining the method (a subclass's instance would
    lose its own methods to the variant class set on it)."""
    from .search import REPLICATE, _refined, _search_cache, line_candidates, runs_unlike_layers
    cache = _search_cache(graph)
    if "instance_groups" in cache:
        return cache["instance_groups"]
    _refined(graph)
    found = InstanceGroups()
    cache["instance_groups"] = found         # the candidates below are read by line, never by group
    kinds: dict[tuple, dict[str, dict[tuple, frozenset]]] = {}   # method -> instance -> {line: its splits}
    unusable: set[tuple] = set()
    for lid, (nodes, groups) in line_candidates(graph, False).items():
        if len(groups) < 2 or lid[0] == "node" or lid[0].via or runs_unlike_layers(graph, lid[0]) or \
                not all(i in graph.dims for i in nodes):
            continue
        splits = [frozenset(c.signature for c in candidates if c.problem is None and c.label != REPLICATE)
                  for candidates, _ in groups]
        if len(set(splits)) < 2:
            continue
        method = _method_of(graph, lid[0])
        if method is None:
            continue
        for own, (_, members) in zip(splits, groups):
            for i in members:
                seen = kinds.setdefault(method, {}).setdefault(graph.nodes[i].module_path, {})
                if seen.setdefault(lid, own) != own:
                    unusable.add(method)      # one instance runs the line as two kinds: no group serves it
    layer_lists = _layer_lists(graph, kinds)
    for method, by_instance in kinds.items():
        span, cls, name = method
        if method in unusable:
            continue
        inside = _inside(graph, span)
        paths = list(dict.fromkeys(node.module_path for node in inside))
        if not all(graph.trace.module_types.get(p, "").rpartition(".")[2] == cls for p in paths):
            continue
        grouped: dict[tuple, list[str]] = {}
        for path in paths:
            key = tuple(sorted((str(line), tuple(sorted(map(str, own)))) for line, own in by_instance.get(path, {}).items()))
            grouped.setdefault(key, []).append(path)
        if len(grouped) < 2:
            continue
        groups = tuple(tuple(members) for members in grouped.values())
        lines = [line for line in layer_lists if span.contains(line) and line.path == span.path]
        found.methods.append(MethodGroups(span, cls, name, groups, tuple(
            (members[0], line, layer_lists[line][members[0]]) for members in groups for line in lines
            if members[0] in layer_lists[line])))
        found.lines.update(lines)
        name_of = {path: members[0] for members in groups for path in members}
        for node in inside:
            found.of_node[node.index] = name_of[node.module_path]
    return found


def mixed_lines(graph: Graph) -> set[Span]:
    """The lines calling nn.Sequentials of unlike layers (graph/mixed.py) that no grouping of
    their instances makes alike: their layers take conversions only around the call."""
    return graph.trace.mixed_containers - instance_groups(graph).lines


def _inside(graph: Graph, method: Span) -> list:
    return [node for node in graph.nodes if node.span is not None and node.span.path == method.path
            and method.contains(node.span)]


def _layer_lists(graph: Graph, kinds: dict) -> dict[Span, dict[str, tuple[tuple[str, ...], ...]]]:
    """Each line calling nn.Sequentials of unlike layers in unlike instances of a top-level class
    (MobileNet's inverted residuals with and without an expansion conv): per instance, the layers
    its call runs, added to `kinds` (method -> instance -> {line: its kind}) so that instances
    running unlike lists go to different groups. A line one instance of which calls several
    modules (a loop over unlike children), or a module handed in, stays as it is: mixed."""
    trace = graph.trace
    found: dict[Span, dict[str, tuple]] = {}
    for line in sorted(trace.mixed_containers):
        method = _method_of(graph, line)
        if method is None:
            continue
        instances = {node.module_path for node in _inside(graph, method[0])}
        lists: dict[str, tuple] = {}
        own: dict[str, frozenset] = {}
        for path, (span, _) in trace.module_calls.items():
            if span != line or path not in trace.line_layers:
                continue
            caller = max((i for i in instances if path.startswith(i + ".")), key=len, default=None)
            if caller is None or caller in lists:
                break
            layers = trace.line_layers[path]
            lists[caller] = tuple(via for via, _ in layers if via)     # a module of its own forward: none to cut
            own[caller] = frozenset({(path[len(caller) + 1:], tuple(layers))})
        else:
            found[line] = lists
            for caller, kind in own.items():
                kinds.setdefault(method, {}).setdefault(caller, {})[("layers", line)] = kind
    return found


def site_groups(graph: Graph, nodes) -> list[tuple[str, list]]:
    """A line's invocations (`nodes`: trace nodes) by group: ("", all of them) where its method
    is not grouped, else (group name, its invocations) per group, in the order the groups run."""
    of_node = instance_groups(graph).of_node
    out: dict[str, list] = {}
    for node in nodes:
        out.setdefault(of_node.get(node.index, ""), []).append(node)
    return list(out.items())


def _method_of(graph: Graph, span: Span) -> tuple[Span, str, str] | None:
    """The method of a top-level class whose body holds `span` (its `def`, the class's name, its
    name); None for a line in a function outside any such class."""
    if graph.sources is None or span.path not in graph.sources:
        return None
    source = graph.sources.get(span.path)
    best = None
    for function in source.functions():
        where = source.positions[function]
        inside = (where.start.line, where.start.column) <= (span.line, span.col) and \
            (span.end_line, span.end_col) <= (where.end.line, where.end.column)
        body = source.parents.get(function)
        owner = source.parents.get(body) if body is not None else None
        # a class of the module's top level: its variants are written beside it
        if inside and isinstance(owner, cst.ClassDef) and isinstance(source.parents.get(owner), cst.Module):
            best = (dataclasses.replace(source.span_of(function), path=span.path), owner.name.value,
                    function.name.value)
    return best
