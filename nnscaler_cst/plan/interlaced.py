"""The interlaced pipeline (nnScaler, OSDI '24): the embedding, and the modules sharing its weight
(an LM head), split on the vocabulary over *all* ranks of the pipeline; the blocks form stages.

Op-trans: each vocabulary module's weight is cut on dim 0 into n = |D| pieces (the table's
`vocab`: "tied" selects the embeddings whose weight other modules share, with those modules;
"all" every embedding outside the blocks). Op-assign: piece r on pipeline rank r. Op-order: the
stage that calls such a module (the owner: the encoder's first stage for the input embedding,
the stage that runs the decoder for its embedding and the head) runs it inside its own step;
every other rank runs its piece at the same step ("sEk": its share of stage s's forward of
micro-batch k, "sGk" of the backward), because the op is collective over all ranks. The
table's `together` constraints say which step a share joins (`E[k] = F[k]`, `G[k] = B[k]`).

The stages keep their own table order (1F1B, ordered by z3 from the table's constraints); the
shares are placed by a walk of one timeline of all ranks: a share at the same time as its
owner's step, each forward after the one it receives from, each backward after the one it
receives gradients from, every rank's own order kept. The deadlock simulator checks the result
with the collectives before anything is written.

A share serves the owner's calls of one step (VOCAB_CALLS, counted in the trace) and ends with
the last: the other ranks wait from the step they join the owner's to its last vocabulary op.
The walk counts a share as long as the owner's whole step (an upper bound; measured on gloo, a
share of a step whose vocabulary op comes last lasts that whole step: BENCH_PIPELINE.md part 4).
verify/simulate.py gives a share no length: its rank waits for the owner to start, not to end,
so simulate() can be optimistic for interlaced orders.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import Location, UserError
from ..graph.graph import Graph
from .pipeline import StagePlan, cut_blocks
from .tables import Constraint
from .schedules import Action, Placement, ScheduleTable, _line, evaluate, schedule

_TOGETHER = re.compile(r"^\s*([EG])\[(.+?)\]\s*=\s*([FB])\[(.+?)\]\s*$")


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def vocab_modules(graph: Graph, blocks: list[str], ranks: int, mode: str,
                  where: Location) -> tuple[list[str], list[str]]:
    """The modules split on the vocabulary and every name of the parameters they split."""
    trace = graph.trace
    embeddings = set()
    for node in graph.nodes:
        if node.callee == "torch.nn.functional.embedding" and node.module_path:
            embeddings.add(node.module_path)
        elif node.callee_kind == "module" and node.callee_path and \
                trace.module_types.get(node.callee_path, "").endswith(".Embedding"):
            embeddings.add(node.callee_path)
    embeddings = {m for m in embeddings if not any(_inside(m, b) for b in blocks)}
    params = [info for info in trace.params.values()
              if info.attr == "weight" and any(a.rpartition(".")[0] in embeddings for a in info.aliases)
              and (mode == "all" or len(info.aliases) > 1)]
    if not params:
        raise UserError("the interlaced pipeline found no embedding to split on the vocabulary"
                        + (" whose weight another module shares" if mode == "tied" else ""), where,
                        hint='set `vocab = "all"` in the table to split every embedding outside the blocks'
                        if mode == "tied" else "interlacing splits the embeddings that precede the blocks")
    modules, names = [], []
    for info in params:
        for alias in sorted(info.aliases):
            module = alias.rpartition(".")[0]
            kind = trace.module_type(module)
            linear = kind == "torch.nn.modules.linear.Linear"
            if not (module in embeddings or linear or kind.endswith("Embedding")):
                raise UserError(f"{alias} is shared with a {kind.rpartition('.')[2] or 'module'}: interlacing "
                                "splits embeddings and the linear heads that share their weight", where)
            if linear and f"{module}.bias" in {a for p in trace.params.values() for a in p.aliases}:
                raise UserError(f"{module} has a bias: a vocabulary-split head takes none yet", where)
            modules.append(module)
            names.append(alias)
        if info.shape[0] % ranks:
            raise UserError(f"{info.name} has {info.shape[0]} rows, not divisible by the {ranks} "
                            "pipeline ranks it is split over", where)
    return sorted(set(modules)), sorted(set(names))


def keep_whole_on_tp(graph: Graph, table: ScheduleTable, ranks: int, constraints: list[Constraint]) -> list[Constraint]:
    """op-trans on the tensor-parallel axis: the vocabulary modules stay whole there (their split
    is the pipeline's), as if the table said `op_trans = { axis = "tp", algo = "replicate" }`; the
    plan's other constraints select the rest."""
    where = Location(table.location.path, _line(Path(table.location.path), "vocab"))
    modules, _ = vocab_modules(graph, cut_blocks(graph), ranks, table.vocab, where)
    others = [dataclasses.replace(c, select={**c.select, "except_inside": modules}) for c in constraints]
    return others + [Constraint("interlaced-vocab", where, "tp", {"inside": modules}, algo="replicate")]


def vocab_calls(graph: Graph, modules: list[str]) -> list:
    """The trace's calls of the vocabulary modules (a module call, or the embedding/linear inside
    a subclass's forward)."""
    return [node for node in graph.nodes if (node.callee_kind == "module" and node.callee_path in modules) or (
        node.callee in ("torch.nn.functional.embedding", "torch.nn.functional.linear") and node.module_path in modules)]


def apply(graph: Graph, stages: StagePlan, table: ScheduleTable) -> None:
    """Record the vocabulary split on the stage plan: the modules every stage holds (a piece of),
    the stages whose step calls them, and the drops and tied groups without them."""
    where = Location(table.location.path, _line(Path(table.location.path), "vocab"))
    if table.virtual_stages != 1 or table.pipelines != 1:
        raise UserError(f"schedule {table.name}: a vocabulary split over the pipeline runs with one stage per "
                        "rank and one pipeline", where, hint="set virtual_stages = 1 and pipelines = 1")
    modules, names = vocab_modules(graph, stages.blocks, stages.ranks, table.vocab, where)
    calls: dict[int, int] = {}      # stage -> calls of vocabulary modules in one of its steps
    for node in vocab_calls(graph, modules):
        for stage in stages.replicas(stages.node_stage[node.index]):
            calls[stage] = calls.get(stage, 0) + 1
    owners = set(calls)
    owner_paths = sorted({a.rpartition(".")[0] for info in graph.trace.params.values() for a in info.aliases})
    for stage, drops in stages.drop.items():
        kept = []
        for drop in drops:
            if any(_inside(m, drop) for m in modules):      # an ancestor of a vocabulary module: its other parts
                kept += [p for p in owner_paths if _inside(p, drop) and not any(_inside(p, m) or _inside(m, p)
                                                                                 for m in modules)]
            else:
                kept.append(drop)
        stages.drop[stage] = sorted(set(kept))
    for stage, shadows in stages.shadow.items():
        stages.shadow[stage] = [s for s in shadows if s not in modules]
    stages.tied = [group for group in stages.tied if not set(group) & set(names)]
    stages.shared = [group for group in stages.shared if not set(group) & set(names)]
    stages.vocab_modules, stages.vocab_params, stages.vocab_stages = modules, names, sorted(owners)
    stages.vocab_calls = dict(sorted(calls.items()))


def orders(table: ScheduleTable, ranks: int, micro: int, place: Placement, owners: list[int]) -> list[list[Action]]:
    """Every rank's order: its stages' steps in the table's order (z3, as for 1F1B), and its shares
    of the owners' steps, each joined when the owner's step is due (`together` maps a share to the
    owner's step). The shares are placed by a walk of the timeline (a forward takes 1, a backward 2,
    a collective step the owner's time on every rank): the next step to start is the one that could
    start first, and a rank free when an owner's step is due joins it before starting anything
    else. (z3's optimiser over every step's time took more than a minute at D = 4, M = 4.)"""
    base = schedule(table, ranks, micro)
    if not owners:
        return base
    share_of: dict[tuple[str, int], tuple[str, int]] = {}    # owner's (kind, micro) -> share's
    together = []
    for text in table.together:
        match = _TOGETHER.match(text)
        if not match:
            raise UserError(f"cannot read {text!r}", table.location,
                            hint="write `E[k] = F[k]`: a share (E forward, G backward) at the step of the owner's")
        together.append(match.groups())
    if {g[0] for g in together} != {"E", "G"}:
        raise UserError("the interlaced table needs `together` for both E (forward) and G (backward) shares",
                        table.location)
    for share, k_expr, kind, j_expr in together:
        for k in range(micro):
            env = {"k": k, "D": ranks, "M": micro}
            a, b = evaluate(k_expr, env, table.location), evaluate(j_expr, env, table.location)
            if (share == "E") != (kind == "F"):
                raise UserError(f"`{share}[{k_expr}] = {kind}[{j_expr}]`: E joins a forward (F), G a backward (B)",
                                table.location)
            share_of.setdefault((kind, b), (share, a))
    shared = set(owners)
    position = [0] * ranks
    free = [0.0] * ranks
    finish: dict[Action, float] = {}
    out: list[list[Action]] = [[] for _ in range(ranks)]

    def needs(action: Action) -> list[Action]:
        if action.kind == "F":
            return [] if place.first(action.stage) else [Action("F", action.stage - 1, action.micro)]
        return [Action("F", action.stage, action.micro)] + \
            ([] if place.last(action.stage) else [Action("B", action.stage + 1, action.micro)])

    while any(position[r] < len(base[r]) for r in range(ranks)):
        best = None
        for rank in range(ranks):
            if position[rank] == len(base[rank]):
                continue
            action = base[rank][position[rank]]
            if any(n not in finish for n in needs(action)):
                continue
            due = max([free[rank]] + [finish[n] for n in needs(action)])
            # a collective step starts when every rank is free; it is due when the owner is ready
            key = (due, action.stage not in shared, rank)
            if best is None or key < best[0]:
                best = (key, rank, action)
        if best is None:
            raise UserError(f"schedule {table.name}: the ranks' own orders wait for each other", table.location)
        (due, _, _), rank, action = best
        length = 1.0 if action.kind == "F" else 2.0
        if action.stage in shared:
            begin = max([due] + free)
            for other in range(ranks):
                if other != rank and (action.kind, action.micro) in share_of:
                    kind, m = share_of[(action.kind, action.micro)]
                    out[other].append(Action(kind, action.stage, m))
                free[other] = begin + length
        else:
            begin = due
        out[rank].append(action)
        free[rank] = finish[action] = begin + length
        position[rank] += 1
    return out
