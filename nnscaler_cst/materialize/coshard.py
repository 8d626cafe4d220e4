"""Co-shard regions: the statements around a co-sharded op, run as C pieces one after another.

Co-sharding one call saves nothing when its neighbours keep what it made (the softmax's
input and output both stay alive), so the pieces cover a run of statements: from the
statement holding the co-sharded op the region grows over its neighbours in the same block
while every op in them works slice by slice on this device's shard — split on tp (not
summed), with no collective, no local size and no split implementation — or is replicated
and reads nothing split (a mask). The region's inputs are the split tensors it reads by name,
cut along their split dim; its outputs are the names it assigns that later code reads,
joined along their split dim. Decides where; writes no source.
"""
from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ..errors import UserError
from ..graph.graph import Graph
from ..plan.layouts import REPLICATE
from ..plan.search import AxisChoices
from ..source.files import SourceFile, Span
from ..source.names import names_in
from ..trace.records import Node


@dataclass(frozen=True)
class Region:
    block: Span                          # the block holding the statements
    first: int                           # statement indices in the block, inclusive
    last: int
    chunks: int                          # pieces per device
    inputs: tuple[tuple[str, int], ...]  # (name, dim it is cut along)
    outputs: tuple[str, ...]
    out_dim: int
    nodes: tuple[int, ...] = ()          # the graph nodes its statements run (every instance)


def coshard_regions(graph: Graph, plan: AxisChoices, sites: dict, lay, have, devices: int | None = None) -> list[Region]:
    """`sites`: the planned SiteEdits by span; `lay(node)`: its layouts; `have[tid]`: a tensor's layout.
    `devices`: how many devices the pieces spread over (default the axis size); 1 when the plan's
    axis is a stand-in of C ways that only says which dims the pieces cut (co-shard on one device)."""
    regions: dict[tuple, Region] = {}
    # every call of one source line (a block's instances) has the same region, over all of them
    by_line: dict[tuple, Region] = {}
    for index, chunks in sorted(plan.chunks.items()):
        node = graph.nodes[index]
        line = (node.span, node.callee, chunks)
        if line not in by_line:
            by_line[line] = _region(graph, plan, sites, lay, have, node, chunks, plan.n if devices is None else devices)
        region = by_line[line]
        key = (region.block, region.first)
        if regions.setdefault(key, region) != region:
            raise UserError("two co-sharded ops in one region ask for different pieces", node.span.start)
    spans = sorted(regions.values(), key=lambda r: (r.block, r.first))
    for a, b in zip(spans, spans[1:]):
        if a.block == b.block and b.first <= a.last:
            raise UserError("co-shard regions overlap", a.block.start)
    return spans


def _statement_of(source: SourceFile, expr: cst.CSTNode):
    node = expr
    while node is not None and not isinstance(node, cst.SimpleStatementLine):
        node = source.parents.get(node)
    return node


def _region(graph: Graph, plan: AxisChoices, sites: dict, lay, have, anchor: Node, chunks: int,
            devices: int) -> Region:
    where = anchor.span.start
    source = graph.sources.get(anchor.span.path)
    statement = _statement_of(source, graph.source_node(anchor))
    block = source.parents.get(statement) if statement is not None else None
    if not isinstance(block, cst.IndentedBlock):
        raise UserError("a co-sharded op must sit in a statement of a function body", where)
    body = list(block.body)
    spans = [source.span_of(s) for s in body]
    at = body.index(statement)
    members: dict[int, list[Node]] = {}
    first_line, last_line = spans[0].line, spans[-1].end_line
    for node in graph.nodes:
        if node.span is not None and node.span.path == anchor.span.path and \
                first_line <= node.span.line <= last_line:
            for k, span in enumerate(spans):
                if span.contains(node.span):
                    members.setdefault(k, []).append(node)

    def works_slice_by_slice(node: Node) -> bool:
        site = sites.get(node.span)
        if site is not None and (site.args or site.result or site.sizes or site.replace or site.bias):
            return False
        choice = plan.node_choice[node.index]
        if choice == REPLICATE:
            return all(layout.kind == "R" for layout in lay(node).inputs.values())
        dims = graph.dims[node.index]
        if graph.param_operands(node.index):     # a weight split with the op is not cut by slicing inputs
            return False
        return choice not in dims.reduced and choice not in dims.impl and all(
            layout.groups == 1 for layout in [*lay(node).inputs.values(), *lay(node).outputs])

    def executed(a: int, b: int) -> set[int]:
        """Nodes run while statements a..b run, per instance of the block (module path): with those
        made inside functions the statements call (`self.causal_mask(T)`), in trace order."""
        ranges: dict[str, list[int]] = {}
        for k in range(a, b + 1):
            for node in members.get(k, []):
                ranges.setdefault(node.module_path, []).append(node.index)
        return {i for indices in ranges.values() for i in range(min(indices), max(indices) + 1)}

    def fits(k: int) -> bool:
        stmt = body[k]
        return isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(small, (cst.Assign, cst.AugAssign, cst.AnnAssign)) for small in stmt.body) and all(
            works_slice_by_slice(graph.nodes[i]) for i in executed(k, k))

    if not fits(at):
        raise UserError(f"cannot co-shard {anchor.callee}: its statement needs communication, local sizes or a "
                        "split implementation, or is not an assignment", where)

    def cut_evenly(a: int, b: int) -> bool:
        """Every split tensor statements a..b read from before them divides into the pieces: the
        region stops before a statement reading one that does not (grouped-query attention's kv
        heads, fewer than the query heads: the region starts where they are widened)."""
        return _undivided(graph, lay, executed(a, b), devices, chunks) is None

    first = last = at
    while first > 0 and fits(first - 1) and cut_evenly(first - 1, last):
        first -= 1
    while last + 1 < len(body) and fits(last + 1) and cut_evenly(first, last + 1):
        last += 1
    inside = executed(first, last)
    if not all(works_slice_by_slice(graph.nodes[i]) for i in inside):
        raise UserError(f"cannot co-shard {anchor.callee}: code between its statements needs communication", where)
    inputs = _inputs(graph, source, lay, inside, devices, chunks, where)
    if not inputs:
        raise UserError(f"the co-shard region of {anchor.callee} reads no split tensor to cut", where)
    outputs, out_dim = _outputs(graph, source, body, first, last, members, have, where)
    return Region(source.span_of(block), first, last, chunks, inputs, outputs, out_dim, tuple(sorted(inside)))


def _inputs(graph: Graph, source: SourceFile, lay, inside: set[int], n: int, chunks: int,
            where) -> tuple[tuple[str, int], ...]:
    """Split tensors the region reads from before it, each by the name it is read through."""
    tensors = graph.trace.tensors
    found: dict[str, int] = {}
    for node, operand, layout in _split_reads(graph, lay, inside):
        expr = _operand_expr(graph.source_node(node), operand.path)
        if not isinstance(expr, cst.Name):
            shown = cst.Module([]).code_for_node(expr) if expr is not None else "an expression"
            raise UserError(f"the co-shard region reads a split tensor through `{shown}`; assign it to a "
                            "name before the region", node.span.start if node.span else where)
        if found.setdefault(expr.value, layout.dim) != layout.dim:
            raise UserError(f"`{expr.value}` is read split along two dims in the co-shard region", where)
        local = tensors[operand.tid].shape[layout.dim] // n
        if local % chunks:
            raise UserError(f"cannot co-shard into {n}x{chunks} pieces: `{expr.value}` has {local} along dim "
                            f"{layout.dim} on each device", where,
                            hint="choose a number of pieces per device that divides it")
    return tuple(found.items())


def _undivided(graph: Graph, lay, inside: set[int], n: int, chunks: int) -> tuple[Node, int, int] | None:
    """The first split tensor the nodes `inside` read from outside them whose size on each of the
    `n` devices, along its split dim, the `chunks` pieces do not divide: (reader, size, dim)."""
    tensors = graph.trace.tensors
    for node, operand, layout in _split_reads(graph, lay, inside):
        local = tensors[operand.tid].shape[layout.dim] // n
        if local % chunks:
            return node, local, layout.dim
    return None


def _split_reads(graph: Graph, lay, inside: set[int]):
    """(reader, operand, its layout) of each split tensor the nodes `inside` read from outside
    them; tensors whole on every piece are read from the enclosing scope and left out."""
    tensors = graph.trace.tensors
    for index in sorted(inside):
        node = graph.nodes[index]
        for operand in node.operands:
            if operand.tid is None or tensors[operand.tid].producer in inside:
                continue
            layout = lay(node).inputs.get(operand.name)
            if layout is not None and layout.kind != "R":
                yield node, operand, layout


def _operand_expr(call, path):
    if path is None:
        return None
    if isinstance(call, cst.Call):
        if path == ("self",) and isinstance(call.func, cst.Attribute):
            return call.func.value
        if path[0] == "pos":
            positional = [a for a in call.args if a.keyword is None and not a.star]
            return positional[path[1]].value if path[1] < len(positional) else None
        if path[0] == "kw":
            return next((a.value for a in call.args if a.keyword and a.keyword.value == path[1]), None)
    if isinstance(call, cst.BinaryOperation):
        return call.left if path == ("self",) else call.right if path == ("pos", 0) else None
    if isinstance(call, cst.Subscript) and path == ("self",):
        return call.value
    return None


def _read_after(source: SourceFile, body: list, last: int) -> set[str]:
    """Names read after statement `last` of its block: later in the block, after each enclosing
    statement up to the function, and anywhere in an enclosing loop (its next iteration)."""
    read = names_in(body[last + 1:], False)
    node = source.parents.get(body[last])
    while node is not None and not isinstance(node, cst.FunctionDef):
        parent = source.parents.get(node)
        if isinstance(node, (cst.For, cst.While)):
            read |= names_in([node], False)
        if isinstance(parent, (cst.IndentedBlock, cst.Module)) and node in parent.body:
            siblings = list(parent.body)
            read |= names_in(siblings[siblings.index(node) + 1:], False)
        node = parent
    return read


def _outputs(graph: Graph, source: SourceFile, body: list, first: int, last: int, members: dict, have,
             where) -> tuple[tuple[str, ...], int]:
    """Names the region assigns that later statements read, and the one dim they are joined along."""
    outputs = tuple(sorted(names_in(body[first:last + 1], True) & _read_after(source, body, last)))
    if not outputs:
        raise UserError("the co-shard region computes nothing that later code reads", where)
    dims = set()
    for name in outputs:        # the value of the last assignment to each output
        k = max(k for k in range(first, last + 1) if name in names_in([body[k]], True))
        assign = body[k].body[0]
        value = source.span_of(assign.value) if isinstance(assign, (cst.Assign, cst.AnnAssign)) and assign.value \
            else None
        for node in members.get(k, []):
            if node.span is not None and value is not None and (node.span.line, node.span.col, node.span.end_line,
                                                                 node.span.end_col) == (
                    value.line, value.col, value.end_line, value.end_col):
                dims |= {have[t].dim for t in node.outputs if t in have and have[t].kind == "S"}
    if len(dims) != 1:
        raise UserError("the co-shard region's results are not split along one dim", where)
    return outputs, dims.pop()
