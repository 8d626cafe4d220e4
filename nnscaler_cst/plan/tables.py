"""Plan tables (rules/plans/*.toml) and in-source annotations, as constraints over op-trans.

A constraint selects ops (all, by callee type, by module path pattern, by role: ops holding
a weight matrix, or by the source line it is written next to) and restricts how they may be
split along one mesh axis: `algo` = split | replicate | batch | sequence | a dim label, or `forbid`
partial weight gradients. Each keeps its location so an unsatisfiable set can be reported
line by line.

`n = "C*|tp|"` co-shards: the op is split into C pieces per device (C consecutive pieces on
each device, run one after another and recomputed in backward: less activation memory for
more compute). A number (`2*|tp|`) fixes C; the letter C leaves it to the memory model
(plan/coshard.py). The pieces are cut from the call's tensor arguments, not its weights; the
statements around it that work slice by slice run in pieces with it (materialize/coshard.py).

Source annotation syntax, a comment on the line of a call in the model's own file:

    y = self.attn(x)  # nnscaler: tp=replicate
    h = self.fc1(x)   # nnscaler: tp=split
    a = F.softmax(s)  # nnscaler: coshard=2
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Location, UserError, display_path, toml_error
from ..graph.graph import Graph
from ..graph.kinds import LAYER_KINDS
from ..rules_path import find_rules_file, rules_dirs, rules_files
from .layouts import REPLICATE

ALGOS = {"split", "replicate", "batch", "sequence"}
_ANNOTATION = re.compile(r"#\s*nnscaler:\s*(.+)$")


@dataclass
class Constraint:
    id: str
    location: Location
    axis: str
    select: dict
    algo: str | None = None
    forbid: str | None = None
    chunks: int = 1          # n = chunks * |axis|: pieces per device (co-shard); 0: C, chosen by memory

    def selects(self, graph: Graph, index: int) -> bool:
        node = graph.nodes[index]
        sel = self.select
        if "except_inside" in sel and any(p == m or p.startswith(m + ".") for m in sel["except_inside"]
                                          for p in filter(None, (node.callee_path, node.module_path))):
            return False        # the interlaced pipeline's vocabulary modules: split over the pipeline
        if "except_params" in sel and any(graph.trace.tensors[tid].param in sel["except_params"]
                                          for _, tid in graph.param_operands(index)):
            return False        # parameters the rewrite keeps whole (rewrite.py: _kept_whole)
        if sel.get("all"):
            return True
        if "callee" in sel:
            callees = sel["callee"] if isinstance(sel["callee"], list) else [sel["callee"]]
            if node.callee in callees:
                return True
        if "module" in sel and fnmatch.fnmatchcase(node.module_path, sel["module"]):
            return True
        if sel.get("params") == "matrix":
            # an op whose rule cannot split its weights at all (or that has no rule) is replicated
            # with a warning rather than making the plan unsatisfiable; see weights_left_whole
            return bool(_matrices(graph, index)) and can_split_weights(graph, index)
        if "line" in sel and node.span is not None:
            path, line = sel["line"]
            return node.span.path == path and node.span.line <= line <= node.span.end_line
        if "params" in sel and isinstance(sel["params"], list):     # ops reading these parameters
            return any(graph.trace.tensors[tid].param in sel["params"] for _, tid in graph.param_operands(index))
        if "inside" in sel:     # ops that call or run inside these modules (module paths)
            return any(p == m or p.startswith(m + ".") for p in filter(None, (node.callee_path, node.module_path))
                       for m in sel["inside"])
        return False

    def allows(self, graph: Graph, index: int, label: str) -> bool:
        if self.forbid == "partial-param-grads":
            return not leaves_partial_param_grad(graph, index, label)
        if self.forbid == "splitting-params":      # the selected parameters stay whole, the op may split
            dims = graph.dims.get(index)
            return label == REPLICATE or dims is None or all(
                name not in dims.inputs or dims.inputs[name].where(label) is None
                for name, tid in graph.param_operands(index) if graph.trace.tensors[tid].param in self.select["params"])
        if self.forbid == "splitting-the-residual":      # Megatron's layout: by heads / hidden
            return label != REPLICATE and label not in residual_labels(graph, index) and splits_every_matrix(
                graph, index, label)
        if self.algo in (None, "batch"):
            return True
        if self.algo == "replicate":
            return label == REPLICATE
        if self.algo == "sequence":
            return splits_sequence(graph, index, label)
        if self.chunks != 1 and (label == REPLICATE or not coshardable(graph, index, label)):
            return False
        if self.algo == "split":
            if label == REPLICATE:
                return False
            dims = graph.dims[index]
            return all(len(graph.trace.tensors[tid].shape) < 2 or (
                name in dims.inputs and dims.inputs[name].where(label) is not None)
                for name, tid in graph.param_operands(index))
        return label == self.algo

    def describe(self) -> str:
        what = f"{self.axis}={self.algo}" if self.algo else f"forbid {self.forbid} on {self.axis}"
        if self.chunks != 1:
            what += f", n = {self.chunks or 'C'}*|{self.axis}| (co-shard)"
        return f"{self.id}: {what} for {self.select}"


def splits_sequence(graph: Graph, index: int, label: str) -> bool:
    """Whether `label` splits the op's first tensor input along its sequence: a dim that is
    neither the last (the hidden features) nor, on a (batch, sequence, ...) value, the first.
    Megatron's sequence parallelism runs norms and dropouts so between tensor-parallel regions."""
    dims = graph.dims.get(index)
    node = graph.nodes[index]
    first = next((op for op in node.operands if op.tid is not None and op.name in (dims.inputs if dims else {})),
                 None)
    if dims is None or first is None or label == REPLICATE:
        return False
    where = dims.inputs[first.name].where(label)
    shape = graph.trace.tensors[first.tid].shape
    if where is None or where[0] % len(shape) == len(shape) - 1:
        return False
    batched = len(shape) >= 3 and shape[0] == graph.trace.batch_size
    return not (batched and where[0] % len(shape) == 0)


def coshardable(graph: Graph, index: int, label: str) -> bool:
    """Pieces of a split can run one after another on a device when the label is cut from tensor
    arguments only (no weight holds it) and each piece's result is a slice of the output."""
    dims = graph.dims.get(index)
    if dims is None or label in dims.reduced or not dims.outputs:
        return False
    params = {name for name, _ in graph.param_operands(index)}
    held = [name for name, tensor in dims.inputs.items() if tensor.where(label) is not None]
    return bool(held) and not params & set(held) and all(
        (place := out.where(label)) is not None and place[1] == 1 for out in dims.outputs)


def chunks_for(constraints: list[Constraint], graph: Graph, index: int) -> int:
    """How many pieces per device the constraints selecting this op ask for (1: no co-shard;
    0: co-shard, C left to the memory model; a number named anywhere wins)."""
    asked = [c.chunks for c in constraints if c.chunks != 1 and c.selects(graph, index)]
    return max(asked) if asked else 1


def _matrices(graph: Graph, index: int) -> tuple[str, ...]:
    """The layer weights an op holds: parameters with two or more dims above 1, read by an op
    whose rule names them (a structural kind adding a position table is not a layer; a rule
    derived by the probe names every operand). Kept per graph, as _weight_views: a constraint
    asks per node and label."""
    known = graph.__dict__.setdefault("_matrices", {})
    found = known.get(index)
    if found is None:
        rule = graph.node_rule.get(index)
        views = _weight_views(graph)
        found = known[index] = () if rule is not None and rule.kind is not None and rule.kind not in LAYER_KINDS \
            else tuple(op.name for op in graph.nodes[index].operands if op.tid is not None
                       and (graph.trace.tensors[op.tid].param is not None or op.tid in views)
                       and sum(size > 1 for size in graph.trace.tensors[op.tid].shape) >= 2)
    return found


# Calls that hand on their one tensor operand's values in another layout or dtype
_LAYOUT_KINDS = frozenset({"transpose", "permute"})
_CASTS = frozenset({"Tensor.bfloat16", "Tensor.half", "Tensor.float", "Tensor.double", "Tensor.to",
                    "Tensor.type_as", "Tensor.contiguous"})


def _weight_views(graph: Graph) -> set[int]:
    """Tensors that are a parameter transposed or cast (`w.transpose(-2, -1).bfloat16()`, as an
    expert bank is handed to `torch._grouped_mm`): the op reading one holds that weight as a layer
    does, though no parameter is its operand."""
    cache = graph.__dict__.get("_weight_views")
    if cache is not None:
        return cache
    tensors, views = graph.trace.tensors, set()
    for node in graph.nodes:
        rule = graph.node_rule.get(node.index)
        inputs = node.inputs
        if len(inputs) == 1 and len(node.outputs) == 1 and (tensors[inputs[0]].param is not None or inputs[0] in views) \
                and ((rule is not None and rule.kind in _LAYOUT_KINDS) or node.callee in _CASTS):
            views.add(node.outputs[0])
    graph.__dict__["_weight_views"] = views
    return views


def can_split_weights(graph: Graph, index: int) -> bool:
    """Some label of the op's rule runs through every weight matrix it holds."""
    dims = graph.dims.get(index)
    matrices = _matrices(graph, index)
    return dims is not None and any(
        all(name in dims.inputs and dims.inputs[name].where(label) is not None for name in matrices)
        for label in dims.splittable())


def weights_left_whole(graph: Graph) -> list[str]:
    """Warnings for the sites holding weight matrices that no rule can split: they stay replicated."""
    out = []
    for site in graph.sites.values():
        index = site.nodes[0].index
        if _matrices(graph, index) and not can_split_weights(graph, index):
            why = f"rule {site.rule.name} splits none of its weights" if site.dims is not None else (
                site.problem or "no split rule")
            out.append(f"{site.span.start}: warning: {site.callee} is replicated on every tensor-parallel rank "
                       f"({why}); add a rule to rules/ops/*.toml to split it")
    return out


def splits_every_matrix(graph: Graph, index: int, label: str) -> bool:
    """`label` runs through every weight matrix the op holds."""
    dims = graph.dims.get(index)
    return dims is not None and all(name in dims.inputs and dims.inputs[name].where(label) is not None
                                    for name in _matrices(graph, index))


def residual_labels(graph: Graph, index: int) -> frozenset[str]:
    """For an op holding a weight matrix inside a repeated block: the labels of its weights that its
    activation on the block's residual side carries too (the width of the stream the blocks add to).
    Megatron splits a block's matrices by the other dim of each (heads, hidden): the first matrix
    of a path through the block by its output (column), the last by its input (row), so the block
    needs one collective each way, whatever the shapes. Empty outside blocks."""
    cache = graph.__dict__.get("_residual_labels")
    if cache is None:
        cache = graph.__dict__["_residual_labels"] = _residual_labels(graph)
    return cache.get(index, frozenset())


def _residual_labels(graph: Graph) -> dict[int, frozenset[str]]:
    """The residual side of each block instance: its inputs from outside (not parameters), and
    what ops holding no weight matrix make of them at the same shape (norms, residual sums); and
    backwards from what leaves the block, through such ops, to the operands of that shape."""
    tensors = graph.trace.tensors
    paths = sorted({p for ps in graph.blocks.values() for p in ps}, key=len)
    outermost: dict[str, str | None] = {}      # module path -> the outermost block holding it
    members: dict[str, list[int]] = {}
    for node in graph.nodes:
        where = node.module_path or ""
        if where not in outermost:
            outermost[where] = next((p for p in paths if where == p or where.startswith(p + ".")), None)
        block = outermost[where]
        if block is not None:
            members.setdefault(block, []).append(node.index)
    out: dict[int, frozenset[str]] = {}
    for indices in members.values():
        inside = set(indices)
        matrix = {i for i in inside if _matrices(graph, i)}
        if not matrix:
            continue
        made = {tid for i in inside for tid in graph.nodes[i].outputs}

        def activations(i):
            return [op.tid for op in graph.nodes[i].operands if op.tid is not None and tensors[op.tid].param is None]

        side = {tid for i in inside for tid in activations(i) if tid not in made}      # the block's inputs
        for i in sorted(inside - matrix):
            for tid in activations(i):
                if tid in side:
                    side.update(t for t in graph.nodes[i].outputs if tensors[t].shape == tensors[tid].shape)
        leaving = {tid for tid in made if any(c not in inside for c, _ in graph.consumers.get(tid, ()))}
        for i in sorted(inside - matrix, reverse=True):
            for tid in graph.nodes[i].outputs:
                if tid in leaving:
                    leaving.update(t for t in activations(i) if tensors[t].shape == tensors[tid].shape)
        side |= leaving
        for i in matrix:
            dims = graph.dims.get(i)
            if dims is None:
                continue
            weights = set().union(*(dims.inputs[name].labels() for name in _matrices(graph, i) if name in dims.inputs))
            node = graph.nodes[i]
            carried = [dims.inputs[op.name].labels() for op in node.operands
                       if op.tid in side and tensors[op.tid].param is None and op.name in dims.inputs]
            carried += [dims.outputs[k].labels() for k, tid in enumerate(node.outputs)
                        if tid in side and k < len(dims.outputs)]
            out[i] = frozenset(weights & set().union(*carried)) if carried else frozenset()
    return out


def leaves_partial_param_grad(graph: Graph, index: int, label: str) -> bool:
    """A split that keeps a weight whole leaves each device with part of its gradient."""
    params = graph.param_operands(index)
    if label == REPLICATE or not params:      # (asked for every op and label: most hold no weight)
        return False
    dims = graph.dims[index]
    bias = graph.partial_bias(index) if label in dims.reduced or label in dims.impl else None
    return any(name != bias and (name not in dims.inputs or dims.inputs[name].where(label) is None)
               for name, _ in params)


@dataclass
class PlanTable:
    name: str
    description: str
    axes: list[str]
    constraints: list[Constraint] = field(default_factory=list)
    path: Path | None = None
    fused_collectives: bool = False    # reduce+scatter as one reduce-scatter, gather+copy one all-gather

    def for_axis(self, axis: str) -> list[Constraint]:
        return [c for c in self.constraints if c.axis == axis]


def available_plans(rules_dir: Path | None = None) -> list[str]:
    if rules_dir is not None:
        return sorted(p.stem for p in (rules_dir / "plans").glob("*.toml"))
    return [p.stem for p in rules_files("plans")]


def table_path(name: str, rules_dir: Path | None = None) -> Path:
    """A table by name (plans/NAME.toml in the rules folders) or by path (your own table, anywhere)."""
    if name.endswith(".toml"):
        return Path(name)
    if rules_dir is not None:
        return rules_dir / "plans" / f"{name}.toml"
    return find_rules_file("plans", name) or rules_dirs()[-1] / "plans" / f"{name}.toml"


def load_table(name: str, rules_dir: Path | None = None) -> PlanTable:
    path = table_path(name, rules_dir)
    if not path.is_file():
        where = ", ".join(display_path(d / "plans") for d in ([rules_dir] if rules_dir else rules_dirs()))
        raise UserError(f"unknown plan {name!r}" if not name.endswith(".toml") else f"no plan table {name}",
                        hint=f"plans: {', '.join(available_plans(rules_dir))} (tables in {where}), "
                        "or the path of your own .toml table")
    text = path.read_text()
    shown = display_path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, path, text) from None
    head = data.get("plan", {})
    table = PlanTable(head.get("name", path.stem), head.get("description", ""), head.get("axes", []), path=path,
                      fused_collectives=head.get("fused_collectives") is True)
    if "extends" in head:
        try:
            table.constraints += load_table(head["extends"], rules_dir).constraints
        except UserError as exc:
            if exc.location is not None:
                raise
            line = next((i + 1 for i, l in enumerate(text.splitlines()) if re.match(r"\s*extends\s*=", l)), 1)
            raise UserError(f"extends: {exc.message}", Location(shown, line), hint=exc.hint) from None
    lines = text.splitlines()
    for k, entry in enumerate(data.get("constraint", [])):
        cid = entry.get("id", f"{name}-{k}")
        line = next((i + 1 for i, l in enumerate(lines) if re.match(rf'\s*id\s*=\s*"{re.escape(cid)}"', l)), 1)
        location = Location(shown, line)
        trans = entry.get("op_trans", {})
        axis = trans.get("axis", entry.get("axis", "tp"))
        chunks = pieces_per_device(trans.get("n"), axis, location)
        constraint = Constraint(cid, location, axis, entry.get("select", {}), algo=trans.get("algo"),
                                forbid=entry.get("forbid"), chunks=chunks)
        if constraint.algo is not None and constraint.algo not in ALGOS and not re.fullmatch(r"[\w.]+", constraint.algo):
            raise UserError(f"unknown algo {constraint.algo!r}", location, hint=f"one of {sorted(ALGOS)} or a dim label")
        if not constraint.select:
            raise UserError("a constraint needs `select`", location,
                            hint='select ops, e.g. select = { params = "matrix" }, { all = true }, '
                            '{ callee = "torch.nn.Linear" } or { module = "blocks.*" }')
        assign = entry.get("op_assign", "distinct" if chunks == 1 else "consecutive")
        if assign != ("distinct" if chunks == 1 else "consecutive"):
            raise UserError(f"op_assign = {assign!r} with n = {trans.get('n')!r}: n = |{axis}| puts the pieces on "
                            f"distinct devices (`distinct`), n = C*|{axis}| puts C consecutive pieces on each "
                            "device (`consecutive`)", location,
                            hint=f"op_assign = {'distinct' if chunks == 1 else 'consecutive'!r}, or leave it out")
        table.constraints.append(constraint)
    return table


def pieces_per_device(n: str | None, axis: str, location: Location) -> int:
    """n = |tp| -> 1; n = C*|tp| (or C·|tp|, |tp|*C) with a number C -> C; with the letter C -> 0
    (the memory model chooses)."""
    if n is None:
        return 1
    match = re.fullmatch(rf"\s*(?:(\d+|C)\s*[*·]\s*)?\|{axis}\|\s*(?:\*\s*(\d+|C)\s*)?", str(n))
    if match and "C" in (match.group(1), match.group(2)) and not (match.group(1) and match.group(2)):
        return 0
    chunks = int(match.group(1) or match.group(2) or 1) if match and not (match.group(1) and match.group(2)) else 0
    if chunks < 1:
        raise UserError(f"n = {n!r}: write n = |{axis}| (one piece per device) or n = C*|{axis}| "
                        "(C pieces per device, co-shard; the letter C: chosen by the memory model)", location,
                        hint=f'n = "|{axis}|", n = "2*|{axis}|" or n = "C*|{axis}|"')
    return chunks


def source_annotations(graph: Graph) -> list[Constraint]:
    """`# nnscaler: tp=replicate` comments in the model's own files."""
    out = []
    for path in graph.trace.own_files:
        source = graph.sources.get(path) if graph.sources else None
        if source is None:
            continue
        for number, line in enumerate(source.lines, 1):
            match = _ANNOTATION.search(line)
            if not match:
                continue
            for part in match.group(1).split(","):
                axis, _, algo = part.strip().partition("=")
                location = Location(display_path(path), number, match.start())
                select = {"line": (str(source.path), number)}
                cid = f"annotation {display_path(path)}:{number}"
                if axis == "coshard" and algo.strip().isdigit() and int(algo) > 1:
                    out.append(Constraint(cid, location, "tp", select, algo="split", chunks=int(algo)))
                    continue
                if not algo or axis not in ("tp", "dp"):
                    raise UserError(f"bad annotation {part.strip()!r}", location,
                                    hint="write `# nnscaler: tp=replicate` (or tp=split, tp=<dim label>, "
                                         "coshard=<pieces per device>)")
                out.append(Constraint(cid, location, axis, select, algo=algo.strip()))
    # one constraint per annotated place, even if the file is seen under two spellings
    return list({c.id + c.describe(): c for c in out}.values())
