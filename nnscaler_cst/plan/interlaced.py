"""The interlaced pipeline (nnScaler, OSDI'23): the embedding, and the modules sharing its weight
(an LM head), split on the vocabulary over *all* ranks of the pipeline; the blocks form stages.

Op-trans: each vocabulary module's weight is cut on dim 0 into n = |D| pieces (the table's
`vocab`: "tied" selects the embeddings whose weight other modules share, with those modules;
"all" every embedding outside the blocks). Op-assign: piece r on pipeline rank r. Op-order: the
stage that calls such a module (the owner: the encoder's first stage for the input embedding,
the stage that runs the decoder for its embedding and the head) runs it inside its own step;
every other rank runs its piece at the same step ("sEk": its share of stage s's forward of
micro-batch k, "sGk" of the backward), because the op is collective over all ranks. The
table's `together` constraints say which step a share joins (`E[k] = F[k]`, `G[k] = B[k]`).

The stages keep their own table order (1F1B); z3 places every rank's shares on one timeline
of all ranks: equal times for the steps of one collective, each forward after the one it
receives from, each backward after the one it receives gradients from, every rank's own order
kept. Executed in time order, no rank waits for a step that comes later (the deadlock
simulator checks the result again, with the collectives).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import z3

from ..errors import Location, UserError
from ..graph.graph import Graph
from .pipeline import StagePlan, find_trunk
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
            kind = trace.module_types.get(module, "")
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
    modules, _ = vocab_modules(graph, find_trunk(graph).blocks, ranks, table.vocab, where)
    others = [dataclasses.replace(c, select={**c.select, "except_inside": modules}) for c in constraints]
    return others + [Constraint("interlaced-vocab", where, "tp", {"inside": modules}, algo="replicate")]


def apply(graph: Graph, stages: StagePlan, table: ScheduleTable) -> None:
    """Record the vocabulary split on the stage plan: the modules every stage holds (a piece of),
    the stages whose step calls them, and the drops and tied groups without them."""
    where = Location(table.location.path, _line(Path(table.location.path), "vocab"))
    modules, names = vocab_modules(graph, stages.trunk.blocks, stages.ranks, table.vocab, where)
    owners = set()
    for node in graph.nodes:
        if any(_inside(p, m) for p in filter(None, (node.module_path, node.callee_path)) for m in modules):
            owners.update(stages.replicas(stages.node_stage[node.index]))
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
    stages.vocab_modules, stages.vocab_params, stages.vocab_stages = modules, names, sorted(owners)


def orders(table: ScheduleTable, ranks: int, micro: int, place: Placement, owners: list[int]) -> list[list[Action]]:
    """Every rank's order: its stages' steps in the table's order, and its shares of the owners'
    steps, at the same time as the owner's step (one timeline of all ranks, solved by z3)."""
    base = schedule(table, ranks, micro)
    if not owners:
        return base
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
    ctx = z3.Context()
    time: dict[tuple[int, Action], z3.ArithRef] = {}
    solver = z3.Optimize(ctx=ctx)
    shares: list[list[Action]] = [[] for _ in range(ranks)]
    for rank, order in enumerate(base):
        for action in order:
            time[(rank, action)] = z3.Int(f"r{rank}_{action}", ctx)
        for a, b in zip(order, order[1:]):
            solver.add(time[(rank, a)] < time[(rank, b)])
    for rank in range(ranks):
        for stage in owners:
            if place.ranks[stage] == rank:
                continue
            for share, k_expr, kind, j_expr in together:
                for k in range(micro):
                    env = {"k": k, "i": rank, "D": ranks, "M": micro}
                    a, b = evaluate(k_expr, env, table.location), evaluate(j_expr, env, table.location)
                    step = Action(share, stage, a)
                    shares[rank].append(step)
                    time[(rank, step)] = z3.Int(f"r{rank}_{step}", ctx)
                    solver.add(time[(rank, step)] == time[(place.ranks[stage], Action(kind, stage, b))])
    for rank in range(ranks):
        mine = [t for (r, _), t in time.items() if r == rank]
        solver.add(z3.Distinct(*mine))
        for t in mine:
            solver.add(t >= 0)
    for (rank, action), t in time.items():       # receives after their sends
        if action.kind == "F" and not place.first(action.stage):
            before = Action("F", action.stage - 1, action.micro)
            solver.add(time[(place.ranks[before.stage], before)] < t)
        if action.kind == "B":
            solver.add(time[(rank, Action("F", action.stage, action.micro))] < t)
            if not place.last(action.stage):
                after = Action("B", action.stage + 1, action.micro)
                solver.add(time[(place.ranks[after.stage], after)] < t)
    solver.minimize(z3.Sum(*time.values()))
    if solver.check() != z3.sat:
        raise UserError(f"schedule {table.name}: no order of all ranks runs every share of the vocabulary "
                        "ops at its owner's step", table.location)
    model = solver.model()
    out = []
    for rank in range(ranks):
        steps = [a for (r, a) in time if r == rank]
        out.append(sorted(steps, key=lambda a: model.eval(time[(rank, a)]).as_long()))
    return out
