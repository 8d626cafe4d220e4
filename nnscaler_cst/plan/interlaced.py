"""The interlaced pipeline (nnScaler, OSDI '24): the embedding, and the modules sharing its weight
(an LM head), split on the vocabulary over *all* devices, tp x pp; the blocks form stages.

Op-trans: each vocabulary module's weight is cut on dim 0 into n = tp x pp pieces (the table's
`vocab`: "tied" selects the embeddings whose weight other modules share, with those modules;
"all" every embedding outside the blocks); piece p * tp + t on the device at pipeline index p,
tensor-parallel index t. On the tensor-parallel axis the modules are whole in the split search
(keep_whole_on_tp): the runtime splits them. Op-order: each call of such a module is an SPMD
step of its own ("sEk": the k-th micro-batch's call in stage s's forward, "sGk" in its
backward, "sEkc1" its second call) that every rank runs. The stage that makes the call (the
owner) pauses its step there and runs it (the table's `together`); every other rank runs it
between two of its own steps, or paused at a call of its own, never inside another rank's step.
An embedding's backward gives its input no gradient: the owner keeps its output's gradient and
the call's G runs after the owner's B (`deferred`).

The stages keep their own table order (lock-step 1F1B, ordered by z3 from the table's
constraints); the calls' steps are placed by a walk of one timeline of all ranks (orders). The
deadlock simulator checks the result with the collectives before anything is written.
pipeline_seconds and estimate price it for the planner, from the same walk and simulator.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from ..errors import Location, UserError
from ..graph.graph import Graph
from .cost import node_flops
from .pipeline import StagePlan, cut_blocks
from .tables import Constraint
from .schedules import (Action, Placement, ScheduleTable, VocabSteps, _line, cached_schedule, load_schedule, placement,
                        simulated_seconds)

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
                            "devices (tp x pp) it is split over", where)
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


_RESHAPES = ("Tensor.view", "Tensor.reshape", "Tensor.flatten", "torch.flatten", "torch.reshape",
             "Tensor.contiguous")
_CROSS_ENTROPY = ("torch.nn.functional.cross_entropy", "torch.nn.CrossEntropyLoss")


def fused_losses(graph: Graph, modules: list[str]) -> dict[int, list[int]]:
    """The head calls whose logits only a cross entropy takes (through views: `logits.view(-1, V)`),
    by the loss node's index: head call, the views, the loss. Such a head and its loss run as one
    vocabulary-parallel step (runtime: vocab_cross_entropy): every device its slice of the logits,
    the loss from token-sized all-reduces, no logits moved. Only heads all of whose calls are such;
    a loss given class weights or a third positional argument is left as the source has it."""
    consumers: dict[int, list] = {}
    for node in graph.nodes:
        for tid in set(node.inputs):
            consumers.setdefault(tid, []).append(node)
    chains: dict[str, list[list[int]]] = {}
    unfused: set[str] = set()
    for call in vocab_calls(graph, modules):
        if is_embedding(graph, call):
            continue
        module = call.callee_path if call.callee_kind == "module" else call.module_path
        chain, tid = [call.index], call.outputs[0] if len(call.outputs) == 1 else None
        while tid is not None:
            after = consumers.get(tid, [])
            if len(after) != 1 or after[0].span is None:
                tid = None
            elif after[0].callee in _RESHAPES:
                chain.append(after[0].index)
                tid = after[0].outputs[0] if len(after[0].outputs) == 1 else None
            elif after[0].callee in _CROSS_ENTROPY and _takes_plain_logits(after[0], tid):
                chain.append(after[0].index)
                break
            else:
                tid = None
        if tid is None:
            unfused.add(module)
        else:
            chains.setdefault(module, []).append(chain)
    return {c[-1]: c for module, found in chains.items() if module not in unfused for c in found}


def _takes_plain_logits(node, tid: int) -> bool:
    """A cross entropy of `tid` as its logits (the first argument) and a target, no class weights."""
    operands = {op.name: op.tid for op in node.operands}
    return operands.get("arg0") == tid and operands.get("arg1") is not None and "arg2" not in operands and \
        operands.get("weight") is None


def fused_heads(graph: Graph, modules: list[str]) -> list[str]:
    """The head modules fused_losses fuses with their cross entropy (the runtime's `losses`)."""
    heads = set()
    for chain in fused_losses(graph, modules).values():
        call = graph.nodes[chain[0]]
        heads.add(call.callee_path if call.callee_kind == "module" else call.module_path)
    return sorted(heads)


def is_embedding(graph: Graph, node) -> bool:
    """A vocabulary call that looks rows up (an embedding): its backward returns no gradient to its
    input, so its step runs after the owner's backward step (runtime: `deferred`)."""
    return node.callee == "torch.nn.functional.embedding" or (
        node.callee_kind == "module" and graph.trace.module_types.get(node.callee_path, "").endswith("Embedding"))


def apply(graph: Graph, stages: StagePlan, table: ScheduleTable, tp: int = 1) -> None:
    """Record the vocabulary split on the stage plan: the modules every device holds a piece of
    (n = tp x pp pieces), the stages whose step calls them, where and at what cost (FLOPs, as
    stage_seconds counts them: per device), and the drops and tied groups without them."""
    where = Location(table.location.path, _line(Path(table.location.path), "vocab"))
    if table.virtual_stages != 1 or table.pipelines != 1:
        raise UserError(f"schedule {table.name}: a vocabulary split over the pipeline runs with one stage per "
                        "rank and one pipeline", where, hint="set virtual_stages = 1 and pipelines = 1")
    modules, names = vocab_modules(graph, stages.blocks, stages.ranks * tp, table.vocab, where)
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
    fused = fused_losses(graph, modules)
    stages.vocab_heads, stages.vocab_losses = fused_heads(graph, modules), sorted(fused)
    stages.vocab_steps = steps(graph, stages, modules, stages.ranks * tp)
    for stage, flops in _call_flops(graph, stages, modules).items():
        stages.stage_seconds[stage] -= flops        # the owner's step without its calls: they are steps of their own


def _with_losses(graph: Graph, modules: list[str]) -> dict[int, list[int]]:
    """Per vocabulary call, the nodes its step runs: itself, and a fused head's views and loss."""
    chains = {chain[0]: chain for chain in fused_losses(graph, modules).values()}
    return {node.index: chains.get(node.index, [node.index]) for node in vocab_calls(graph, modules)}


def step_nodes(graph: Graph, modules: list[str]) -> frozenset[int]:
    """Every node the vocabulary steps run: the calls, and a fused head's views and loss."""
    return frozenset(i for chain in _with_losses(graph, modules).values() for i in chain)


def _call_flops(graph: Graph, stages: StagePlan, modules: list[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for call, runs in _with_losses(graph, modules).items():
        stage = stages.node_stage[call]
        out[stage] = out.get(stage, 0.0) + sum(node_flops(graph.nodes[i], graph.dims.get(i), graph.trace) for i in runs)
    return out


def steps(graph: Graph, stages: StagePlan, modules: list[str], pieces: int,
          seconds=None) -> dict[int, VocabSteps]:
    """Per owning stage, where each vocabulary call comes in its forward (the fraction of the
    stage's other work before it, in trace order) and its SPMD step's length: `seconds(node)`
    gives a call's (forward, backward) on one device of the n = `pieces` it is split over
    (default: FLOPs / n, the backward twice the forward, the unit of stage_seconds). A head
    fused with its cross entropy (fused_losses): its views and loss are part of its step."""
    runs = _with_losses(graph, modules)
    calls = set(runs)
    in_step = {i for chain in runs.values() for i in chain[1:]}     # a fused head's views and loss
    out = {}
    for stage in sorted({stages.node_stage[i] for i in calls}):
        work = [(node.index in calls, node, sum(node_flops(graph.nodes[i], graph.dims.get(i), graph.trace)
                                               for i in runs.get(node.index, [node.index])))
                for node in graph.nodes if stages.node_stage.get(node.index) == stage and node.index not in in_step]
        total = sum(f for is_call, _, f in work if not is_call) or 1.0
        at, forward, backward, deferred, before = [], [], [], [], 0.0
        for is_call, node, flops in work:
            if not is_call:
                before += flops
                continue
            at.append(min(before / total, 1.0))
            f, b = seconds(node) if seconds else (flops / pieces, 2 * flops / pieces)
            forward.append(f)
            backward.append(b)
            deferred.append(is_embedding(graph, node))
        out[stage] = VocabSteps(tuple(at), tuple(forward), tuple(backward), tuple(deferred))
    return out


def orders(table: ScheduleTable, ranks: int, micro: int, place: Placement, vocab: dict[int, VocabSteps],
           forward_seconds: list[float] | None = None) -> list[list[Action]]:
    """Every rank's order: its stages' steps in the table's order (z3, as for 1F1B), and the
    vocabulary steps (`vocab`: per owning stage, where its calls come and how long their SPMD
    steps take), one per call, which every rank runs, all ranks in one order. An owner's step
    pauses at each of its calls (the table's `together`: E in a forward F, G in a backward B);
    while paused it takes part in the vocabulary steps that come first, then in its own, then
    goes on. Every other rank runs them between two of its own steps, or paused at a call of its
    own. A walk of one timeline of all ranks places them (list scheduling in the lock-step phases
    of _levels, the times of verify/simulate.py): the next event is the one that can start first;
    at a tie, the step whose first call comes soonest, and a call an owner waits at before a step
    that would run before its own first call; a call waits for the steps already running. (z3's
    optimiser over every step's time took more than a minute at D = 4, M = 4.)"""
    base = cached_schedule(table, ranks, micro)
    if not vocab:
        return [list(order) for order in base]
    _together(table)
    cost = forward_seconds or [1.0] * len(place.ranks)
    position = [0] * ranks
    free = [0.0] * ranks
    finish: dict[Action, float] = {}
    out: list[list[Action]] = [[] for _ in range(ranks)]
    paused: dict[int, tuple[Action, int]] = {}      # rank -> (its step, which of its pausing calls it waits at)
    later: list[tuple[float, Action]] = []          # embeddings' backward steps, from when their owner's B ends

    def needs(action: Action) -> list[Action]:
        if action.kind == "F":
            return [] if place.first(action.stage) else [Action("F", action.stage - 1, action.micro)]
        return [Action("F", action.stage, action.micro)] + \
            ([] if place.last(action.stage) else [Action("B", action.stage + 1, action.micro)])

    def length(action: Action) -> float:
        return cost[action.stage] * (1.0 if action.kind == "F" else 2.0)

    def ended(step: Action, at: float) -> None:
        finish[step] = at
        if step.kind == "B" and step.stage in vocab:
            steps = vocab[step.stage]
            later.extend((at, Action("G", step.stage, step.micro, call=c)) for c in range(steps.calls)
                         if steps.deferred_call(c))

    def run(share: Action) -> None:
        """Every rank takes part, paused at a call or between two steps."""
        end = max(free) + vocab[share.stage].seconds(share.kind, share.call)
        for rank in range(ranks):
            out[rank].append(share)
            free[rank] = end

    def run_later(until: float) -> None:
        """The embeddings' backward steps whose owner's B ended by `until`: right before a call's
        step, when every rank is at it anyway."""
        for item in [item for item in later if item[0] <= until]:      # in the order their B ended
            later.remove(item)
            run(item[1])

    level = _levels(base, needs)
    near = 1e-3 * min(cost)     # times this close are a tie (a head's call after the loss's last tiny ops)
    phase = 0
    while any(position[r] < len(base[r]) for r in range(ranks)) or paused:
        if not paused and all(position[r] == len(base[r]) or level[base[r][position[r]]] > phase
                              for r in range(ranks)):
            phase += 1
            continue
        call_at = min(((free[r], r) for r in paused), default=None)     # the first call an owner waits at
        candidates = []
        for rank in range(ranks):
            if position[rank] == len(base[rank]) or rank in paused:
                continue
            action = base[rank][position[rank]]
            if level[action] != phase or any(n not in finish for n in needs(action)):
                continue
            due = max([free[rank]] + [finish[n] for n in needs(action)])
            # when the rank can next take part in a call's step: at its own first call, or after the step
            pieces = vocab[action.stage].pieces(action.kind) if action.stage in vocab else [1.0]
            candidates.append((due, due + pieces[0] * length(action), rank, action))
        best = None
        if candidates:      # the first to start; at a tie (within `near`), the one that pauses soonest
            first = min(c[0] for c in candidates)
            due, ready, rank, action = min((c for c in candidates if c[0] <= first + near), key=lambda c: c[1:3])
            best = ((due, ready, rank), rank, action)
        # a call's step before a step that starts later, or at once but runs before its own first call
        if call_at is not None and (best is None or call_at[0] < best[0][0] - near or
                                    (call_at[0] <= best[0][0] + near and best[0][1] > best[0][0] + near)):
            owner = call_at[1]
            step, index = paused.pop(owner)
            steps = vocab[step.stage]
            pausing = steps.pausing(step.kind)
            run_later(max(free))
            run(Action("E" if step.kind == "F" else "G", step.stage, step.micro, call=pausing[index]))
            free[owner] += steps.pieces(step.kind)[index + 1] * length(step)
            if index + 1 < len(pausing):
                paused[owner] = (step, index + 1)
            else:
                ended(step, free[owner])
            continue
        if best is None:
            raise UserError(f"schedule {table.name}: the ranks' own orders wait for each other", table.location)
        (due, ready, _), rank, action = best
        out[rank].append(action)
        position[rank] += 1
        free[rank] = ready
        if action.stage in vocab and vocab[action.stage].pausing(action.kind):
            paused[rank] = (action, 0)     # the step pauses at its first call
        else:
            ended(action, ready)
    run_later(max(free))
    return out


def _levels(base: list[list[Action]], needs) -> dict[Action, int]:
    """Lock-step phases: each step in the first phase after its rank's previous step and the steps
    it needs, forwards in even phases, backwards in odd ones. All ranks run the forwards of one
    phase, then the backwards of the next: the owners' calls at the start or the end of a step
    then find every other rank between two steps (1F1B's ranks, each at its own pace, would be
    inside a step at nearly every call)."""
    level: dict[Action, int] = {}
    position = [0] * len(base)
    while any(position[r] < len(base[r]) for r in range(len(base))):
        moved = False
        for rank, order in enumerate(base):
            while position[rank] < len(order):
                action = order[position[rank]]
                if any(n not in level for n in needs(action)):
                    break
                after = max([level[order[position[rank] - 1]] if position[rank] else -1] +
                            [level[n] for n in needs(action)])
                parity = 0 if action.kind == "F" else 1
                level[action] = after + 1 + ((after + 1 - parity) % 2)
                position[rank] += 1
                moved = True
        if not moved:
            raise UserError("the ranks' own pipeline orders wait for each other")
    return level


def _together(table: ScheduleTable) -> None:
    """The table's `together`: a vocabulary step joins its owner's step, E a forward, G a backward."""
    kinds = set()
    for text in table.together:
        match = _TOGETHER.match(text)
        if not match:
            raise UserError(f"cannot read {text!r}", table.location,
                            hint="write `E[k] = F[k]`: a call's step (E forward, G backward) inside the owner's step")
        share, k_expr, kind, j_expr = match.groups()
        if (share == "E") != (kind == "F") or k_expr.strip() != j_expr.strip():
            raise UserError(f"`{text}`: a vocabulary step runs inside its owner's step of the same micro-batch "
                            "(E[k] = F[k], G[k] = B[k])", table.location)
        kinds.add(share)
    if kinds != {"E", "G"}:
        raise UserError("the interlaced table needs `together` for both E (forward) and G (backward) shares",
                        table.location)


# ---------------------------------------------------------------------------------------------
# Pricing: the step of an interlaced pipeline, for the planner (plan/auto.py's Estimate)
# ---------------------------------------------------------------------------------------------

def pipeline_seconds(stage_seconds: list[float], vocab: dict[int, VocabSteps], micro: int,
                     table: ScheduleTable | None = None) -> float:
    """Seconds of the pipeline part of a step: `stage_seconds` per stage and micro-batch, forward
    and backward (B = 2F, as the simulator counts), without the vocabulary calls, which `vocab`
    prices as steps of every rank: the walk's orders on the simulator's timeline, extrapolated
    from 2D and 3D micro-batches (schedules.simulated_seconds)."""
    table = table or load_schedule("interlaced")
    ranks = len(stage_seconds)
    forward = [t / 3.0 for t in stage_seconds]
    place = placement(table, ranks)
    return simulated_seconds(table, stage_seconds, micro,
                             orders_for=lambda m: orders(table, ranks, m, place, vocab, forward), vocab=vocab)


def _without_calls(graph: Graph, calls: list):
    """plan/auto.py's blocks with the FLOPs of `calls` (the vocabulary calls; auto's estimate: every
    node of the vocabulary steps) taken out of their regions (a fresh copy: its stage cuts balance
    the stages without them)."""
    from dataclasses import replace

    from . import auto
    blocks = auto._blocks(graph)
    moved = [0.0] * (blocks.count + 2)
    for node in calls:
        moved[blocks.region[node.index]] += node_flops(node, graph.dims.get(node.index), graph.trace)
    return replace(blocks, flops=[f - moved[r + 1] for r, f in enumerate(blocks.flops)],
                   prologue_flops=blocks.prologue_flops - moved[0], epilogue_flops=blocks.epilogue_flops - moved[-1],
                   ranges={})


def stage_cut(graph: Graph, pp: int, ranks: int) -> list[tuple[int, int]]:
    """The cut `price` uses by default: auto's FLOP balance of the blocks without the vocabulary
    calls (split over `ranks` = tp x pp devices)."""
    from . import auto
    table = load_schedule("interlaced")
    modules, _ = vocab_modules(graph, cut_blocks(graph), ranks, table.vocab, table.location)
    return auto._stage_ranges(_without_calls(graph, vocab_calls(graph, modules)), pp)


def estimate(graph: Graph, config, cluster, constraints: list[Constraint] | None = None,
             memory_budget: float | None = None, *, table: str = "megatron"):
    """One interlaced configuration priced (an auto.Estimate): price's, below."""
    return price(graph, config, cluster, constraints, memory_budget, table=table)[0]


def price(graph: Graph, config, cluster, constraints: list[Constraint] | None = None,
          memory_budget: float | None = None, *, table: str = "megatron", ranges: list[tuple[int, int]] | None = None):
    """(estimate, the vocabulary steps per owning stage, the stages' seconds without them). One interlaced configuration (config.pp > 1) priced as plan/auto.py prices 1F1B: the
    vocabulary modules whole on tp in the tensor-parallel split (`table`'s rules plus
    `constraints`), their weight split over all tp x pp devices; the stages balanced without
    them (or cut at `ranges`: per stage, its blocks a..b - 1 as (a, b)); each call an SPMD step of every rank, its compute 1/(tp x pp) of the op's and its
    collectives (the input broadcast along the pipeline lines, the embedding's all-reduce over
    tp x pp, the head's gather of the logits to the owner's tp peers and its scatter of their
    gradient, its input gradient's all-reduce over tp x pp; a head fused with its cross entropy
    instead the loss's compute / (tp x pp) and two all-reduces of token-sized fp32 values: the row
    maxima, then the exp sums and target logits stacked); the step from
    pipeline_seconds; memory as 1F1B's, less the owners' vocabulary state, plus 1/(tp x pp) of
    it on every device, and the lock-step warm-up's activations (2 (D - 1 - i) + 1 micro-batches
    in flight on stage i instead of D - i); a fused head's loss adds one micro-batch's softmax
    slice and input on every device. Returns an auto.Estimate."""
    from dataclasses import replace

    from ..materialize.conversions import fused_collectives
    from . import auto
    from .cost import _numel, all_gather_time, all_reduce_time, element_bytes, node_time
    from .search import search_axis
    from .tables import load_table
    from .zero import ADAMW_STATE_BYTES, GRAD_BYTES, PARAM_BYTES
    tp, dp, pp, micro = config.tp, config.dp, config.pp, config.micro_batches
    budget = memory_budget if memory_budget is not None else cluster.memory
    schedule_table = load_schedule("interlaced")
    pieces = tp * pp
    modules, names = vocab_modules(graph, cut_blocks(graph), pieces, schedule_table.vocab, schedule_table.location)
    calls = vocab_calls(graph, modules)
    blocks = _without_calls(graph, calls)
    if ranges:
        blocks.ranges[pp] = list(ranges)
    rules = (load_table(table).for_axis("tp") if table else []) + list(constraints or [])
    plan = None
    device = cluster.axis(1, tp)
    if tp > 1:
        with fused_collectives(bool(table) and load_table(table).fused_collectives):
            plan = search_axis(graph, "tp", tp, keep_whole_on_tp(graph, schedule_table, pp, rules), device,
                               data_parallel=dp * micro)
    runs = _with_losses(graph, modules)
    # a fused head's views and loss run in its step, not in a stage's (their memory: `softmax` below)
    losses = frozenset(i for chain in runs.values() for i in chain[1:])
    cost = auto._regions(graph, blocks, plan, tp, device, losses)
    cost = replace(cost, shared=(0.0, 0.0, {}), shared_hidden=[], shared_saved_at={})
    one_f_one_b = replace(config, schedule="1f1b")      # its stage times and memory, priced as 1F1B's
    base = auto._estimate(one_f_one_b, cost, blocks, graph.trace.batch_size or 1, cluster, budget)
    ranges = auto._stage_ranges(blocks, pp)
    stage_of_region = auto._stage_of_region(blocks, pp)
    fraction = 1.0 / (dp * micro)
    pp_line, everyone = cluster.axis(tp * dp, pp), cluster.axis(1, pieces)   # one device per pipeline rank; tp x pp
    owned = [0.0] * pp

    def seconds(node) -> tuple[float, float]:
        """A call's forward and backward steps on one of the tp x pp devices, per micro-batch."""
        whole = ahead = 0.0
        for i in runs[node.index]:      # the call, and a fused head's views and loss
            whole += fraction * node_time(graph.nodes[i], graph.dims.get(i), graph.trace, device, 1,
                                          dims_of=graph.dims.get)
            ahead += fraction * node_time(graph.nodes[i], graph.dims.get(i), graph.trace, device, 1,
                                          dims_of=graph.dims.get, forward_only=True)
            if i == node.index:         # what the stage priced (the loss is apart: `losses`)
                owned[stage_of_region[blocks.region[node.index]]] += whole
        tensors, sizes = graph.trace.tensors, element_bytes(graph.trace, graph.dims.get, device.precision)
        given = fraction * sum(_numel(tensors[t].shape) * sizes[t] for t in node.inputs if tensors[t].param is None)
        made = fraction * sum(_numel(tensors[t].shape) * sizes[t] for t in node.outputs)   # as the step runs them
        # a broadcast along a pipeline line priced as an all-gather of the same bytes (size / bandwidth)
        if is_embedding(graph, node):     # the ids out, the rows' sums over all; the output's gradient out
            f = all_gather_time(given, pp, pp_line) + all_reduce_time(made, pieces, everyone)
            b = all_gather_time(made, pp, pp_line)
        elif len(runs[node.index]) > 1:     # a head fused with its loss (runtime vocab_cross_entropy): its
            # input and targets out, the row maxima all-reduced, then the sums of exp and the target
            # logits (fp32, one value per token each); the loss's gradient out, the input's summed over all
            out = tensors[node.outputs[0]].shape
            tokens = fraction * _numel(out) / out[-1]
            f = all_gather_time(given, pp, pp_line) + all_gather_time(8 * tokens, pp, pp_line) + \
                all_reduce_time(4 * tokens, pieces, everyone) + all_reduce_time(2 * 4 * tokens, pieces, everyone)
            b = all_gather_time(4 * tokens, pp, pp_line) + all_reduce_time(given, pieces, everyone)
        else:   # a head: its input out, the logits' slices gathered along the line to the owner's tp peers,
            # then all-gathered among them; the logits' gradient scattered back, the input's summed over all
            f = all_gather_time(given, pp, pp_line) + all_gather_time(made / tp, pp, pp_line) + \
                all_gather_time(made, tp, device)
            b = all_gather_time(made / tp, pp, pp_line) + all_reduce_time(given, pieces, everyone)
        return ahead / pieces + f, (whole - ahead) / pieces + b

    stages = StagePlan(pp, 1, None, ranges, {n.index: stage_of_region[blocks.region[n.index]] for n in graph.nodes}, {})
    vocab = steps(graph, stages, modules, pieces, seconds)
    stage_seconds = [t - o for t, o in zip(base.stage_seconds, owned)]
    pipeline = pipeline_seconds(stage_seconds, vocab, micro, schedule_table)
    state = PARAM_BYTES + GRAD_BYTES + ADAMW_STATE_BYTES
    held = []       # the vocabulary state 1F1B's pricing puts on each rank's devices (whole on tp: kept whole)
    for s in range(pp):
        params: dict[str, float] = {}
        for r, t in stage_of_region.items():
            if t == s:
                params.update(cost.params[r])
        held.append(sum(e for p, e in params.items() if p in names) * state)
    # what every device holds instead: its 1/(tp x pp) piece of each vocabulary weight (the whole
    # weight's elements, whatever the tensor-parallel split left on one device)
    piece = sum(math.prod(info.shape) for info in graph.trace.params.values() if set(info.aliases) & set(names)) \
        * state / pieces
    # a fused head's step keeps, on every device, its fp32 softmax slice and its input for the
    # step's backward, which follows on the owner's B of the same micro-batch: one micro-batch's
    tensors, sizes = graph.trace.tensors, element_bytes(graph.trace, graph.dims.get, device.precision)
    softmax = sum(fraction * (_numel(tensors[graph.nodes[c].outputs[0]].shape) * 4 / pieces +
                              sum(_numel(tensors[t].shape) * sizes[t] for t in graph.nodes[c].inputs
                                  if tensors[t].param is None))
                  for c, chain in runs.items() if len(chain) > 1)
    activations = auto._stage_times(one_f_one_b, cost, blocks, cluster)[1]
    memory = [m - h + piece + softmax - a + a / min(pp - s, micro) * min(2 * (pp - 1 - s) + 1, micro)
              for s, (m, h, a) in enumerate(zip(base.stage_memory, held, activations))]
    out = replace(base, config=config, seconds=pipeline + base.sync_seconds, memory=max(memory), stage_seconds=stage_seconds,
                  stage_memory=memory, pipeline_seconds=pipeline)
    out.why_not = None if out.memory <= budget else f"needs {out.memory / 2 ** 30:.1f} GiB per device"
    return out, vocab, stage_seconds
