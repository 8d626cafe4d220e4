"""The calls of an nn.Sequential from a line whose calls run different layers (blocks built
with and without a norm layer, a conv helper called with and without an activation): each call's
layers in order, and which tensors stay inside one call. The line is one piece of source for all
of them, so a conversion can only go around the call (its input, its result), never between its
layers. Finds these; decides nothing (plan/search.py keeps conversions out of the calls,
materialize/edits.py moves the ones around them onto the line)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..source.files import Span
from .graph import Graph


@dataclass
class MixedCall:
    line: Span                  # the call's line (its span without `via`)
    instance: str               # module path of the nn.Sequential called
    layers: list[int] = field(default_factory=list)     # its layers' nodes, in call order; none: a module
                                                        # with a forward of its own (_own_forward_calls)

    def holds(self, graph: Graph, index: int) -> bool:
        """Whether node `index` runs inside this call: one of its layers, or code of a module under it."""
        node = graph.nodes[index]
        return index in self.layers or node.module_path == self.instance or \
            node.module_path.startswith(self.instance + ".")


@dataclass
class MixedEdges:
    calls: list[MixedCall]
    inside: set[tuple[int, int]]            # (producer, consumer) nodes of one call: no conversion between
    entries: dict[Span, list[tuple[int, str]]]      # line -> (layer node, operand name) taking the call's input
    exits: dict[Span, list[tuple[int, int]]]        # line -> (layer node, output k) handing over its result
    own_forward: list[MixedCall] = field(default_factory=list)  # the lines' other modules (_own_forward_calls)
    # line -> (node, operand name) of those modules taking the line's input: their conversions are
    # written in their own forward, so the planner leaves them free; only one the line holds too
    # must be theirs (materialize/edits.py)
    own_entries: dict[Span, list[tuple[int, str]]] = field(default_factory=dict)
    # lines one of whose calls runs no op (an nn.Identity in the instances without a projection):
    # there the call's result is its input, so a conversion written around the line would convert
    # that input too, which the plan did not ask for; no conversion goes around these lines
    # (materialize/edits.py _check_unrollable: the plan is solved again with their layers whole)
    passing: set[Span] = field(default_factory=set)


def mixed_calls(graph: Graph, mixed: set[Span]) -> list[MixedCall]:
    """The calls from the lines `mixed` (of graph.trace.mixed_containers: those whose instances
    are not planned per group, plan/instances.py mixed_lines)."""
    calls: dict[tuple[Span, str], MixedCall] = {}
    for node in graph.nodes:
        span = node.span
        if span is None or not span.via or node.callee_path is None:
            continue
        line = dataclasses.replace(span, via=())
        if line not in mixed:
            continue
        parts = node.callee_path.split(".")
        if len(parts) <= len(span.via):
            continue
        instance = ".".join(parts[:-len(span.via)])
        calls.setdefault((line, instance), MixedCall(line, instance)).layers.append(node.index)
    return list(calls.values())


def _own_forward_calls(graph: Graph, calls: list[MixedCall]) -> list[MixedCall]:
    """The other modules a line of `calls` runs, each through a forward of its own (deeplabv3's
    ASPP pooling branch beside its conv branches), as calls without layers: their code is their
    own to convert inside, but they hand over the line's result as the layer lists do, whatever
    conversion the line holds."""
    lines = {call.line for call in calls}
    instances = [call.instance for call in calls]
    found = []
    for path, (span, _) in graph.trace.module_calls.items():
        if span in lines and not any(path == i or path.startswith(i + ".") or i.startswith(path + ".")
                                     for i in instances):
            found.append(MixedCall(span, path))
    return found


def mixed_edges(graph: Graph, lines: set[Span]) -> MixedEdges:
    """Every edge touching a layer of a mixed call from `lines`, sorted: inside one call, into
    it, out of it."""
    cache = graph.__dict__.setdefault("_mixed_edges", {})     # per graph: the planner asks per axis and size
    cached = cache.get(frozenset(lines))
    if cached is not None:
        return cached
    tensors = graph.trace.tensors
    calls = mixed_calls(graph, lines)
    result = MixedEdges(calls, set(), {}, {})
    if calls:
        result.own_forward = _own_forward_calls(graph, calls)
        result.passing = {call.line for call in result.own_forward
                          if not any(call.holds(graph, node.index) for node in graph.nodes)}
        for call in [*calls, *result.own_forward]:
            own_forward = not call.layers
            for index in call.layers or [n.index for n in graph.nodes if call.holds(graph, n.index)]:
                node = graph.nodes[index]
                for operand in node.operands:
                    if operand.tid is None or tensors[operand.tid].param is not None or \
                            tensors[operand.tid].buffer is not None:
                        continue        # a layer's own state, not what the call hands it
                    producer = tensors[operand.tid].producer
                    if producer is not None and call.holds(graph, producer):
                        if not own_forward:
                            result.inside.add((producer, index))
                    else:
                        (result.own_entries if own_forward else result.entries).setdefault(call.line, []).append(
                            (index, operand.name))
                for k, tid in enumerate(node.outputs):
                    users = [user for user, _ in graph.consumers.get(tid, ())]   # a list's items (torch.cat) too
                    if not own_forward:
                        result.inside.update((index, user) for user in users if call.holds(graph, user))
                    if tid == graph.trace.loss or any(not call.holds(graph, user) for user in users):
                        result.exits.setdefault(call.line, []).append((index, k))
    cache[frozenset(lines)] = result
    return result
