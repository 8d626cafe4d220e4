"""The co-shard factor C (pieces per device), and co-shard on one device.

A table's `n = "C*|tp|"` leaves C to the memory model: the smallest C whose activation
memory fits --memory-budget (C = 2 without a budget). Co-sharding frees what autograd keeps of
the storages the region's statements make (the probabilities, the copies a matmul takes of its
operands: every block's, for the whole step; what they keep of tensors made outside the region
stays) and holds instead one piece's worth of them while that piece runs or is recomputed:

    memory(C) = memory without co-shard - sum(region) / n + max(region of one block) / (n * C)

With --tp 1 there is no axis to split: the plan is solved as if over p devices (the same
tables; p the smallest prime factor of C), only to learn which dims the pieces cut and which
statements work piece by piece; the C pieces then run one after another on the one device
(the `stand-in`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import UserError
from ..graph.graph import Graph
from ..materialize.edits import plan_edits
from ..sizes import format_bytes
from .layouts import REPLICATE
from .memory import saved_bytes
from .search import AxisChoices, AxisPlan
from .tables import Constraint, chunks_for

MAX_PIECES = 64


@dataclass
class CoshardChoice:
    chunks: int                      # C
    memory: float                    # bytes per device with it
    saved: float                     # bytes the regions no longer keep (all blocks)
    peak: float                      # bytes one piece holds while it runs
    regions: list                    # materialize.coshard.Region
    anchors: set[int] = field(default_factory=set)     # the co-sharded ops (graph nodes)
    searched: AxisPlan | None = None     # --tp 1: the C-way plan standing in for the cut dims
    stand_in: AxisChoices | None = None  # ... its choices, the co-sharded ops marked C pieces


def repeated_forward(graph: Graph, choice: CoshardChoice, tp: int, device) -> float:
    """Seconds of one device's repeated forward: backward recomputes every statement of every
    co-shard region (the scores' matmul, mask, softmax, `att @ v`), not only the co-sharded op."""
    from .cost import node_time
    nodes = sorted({index for region in choice.regions for index in region.nodes})
    return sum(node_time(graph.nodes[i], graph.dims.get(i), graph.trace, device, tp, dims_of=graph.dims.get,
                         forward_only=True) for i in nodes)


def freed_bytes(graph: Graph, regions: list) -> dict[int, float]:
    """What co-shard frees, by region statement, before any split: what autograd keeps of the
    storages the statement makes, less the storages of its inputs that only the pieces'
    checkpoints keep (q, k, v: views of a projection's output that no op saved), each counted
    at the first statement reading it."""
    trace = graph.trace
    freed: dict[int, float] = {}
    held: set[int] = set()
    for region in regions:
        mine = set(region.nodes)
        for index in region.nodes:
            freed[index] = saved_bytes(graph.nodes[index], trace)
            for tid in graph.nodes[index].inputs:
                storage = trace.tensors[tid].storage
                if trace.tensors[tid].producer not in mine and storage and \
                        storage[0] not in trace.kept_storages and storage[0] not in held:
                    held.add(storage[0])
                    freed[index] -= storage[1]
    return freed


def region_bytes(graph: Graph, regions: list, n: int) -> tuple[float, float]:
    """What co-shard frees on one device (freed_bytes), in all; and what the largest single
    instance of the regions (one block's) keeps of the storages its statements make: what one
    piece's run holds C times over."""
    per_instance: dict[tuple, float] = {}
    for k, region in enumerate(regions):
        for index in region.nodes:
            key = (k, graph.nodes[index].module_path)
            per_instance[key] = per_instance.get(key, 0.0) + saved_bytes(graph.nodes[index], graph.trace) / n
    return sum(freed_bytes(graph, regions).values()) / n, max(per_instance.values(), default=0.0)


def choose_chunks(graph: Graph, n: int, base_memory: float, budget: float | None,
                  regions_for: Callable[[int], list], fixed: int | None = None) -> CoshardChoice:
    """The smallest C whose memory fits `budget` (C = `fixed` when the table or an annotation
    names it), among those the regions can be cut into. `regions_for(C)`: the co-shard regions
    with C pieces per device, or a UserError when C does not divide what they cut; when no C
    can be cut, the smallest one's reason is the error."""
    tried: list[str] = []
    refused: dict[str, tuple[int, UserError]] = {}      # each distinct reason, at the smallest C giving it
    for chunks in ([fixed] if fixed else range(2, MAX_PIECES + 1)):
        try:
            regions = regions_for(chunks)
        except UserError as exc:
            if fixed:
                raise
            refused.setdefault(exc.message.partition(": ")[2] or exc.message, (chunks, exc))
            continue
        saved, peak = region_bytes(graph, regions, n)
        memory = base_memory - saved + peak / chunks
        if budget is None or memory <= budget:
            return CoshardChoice(chunks, memory, saved, peak, regions)
        tried.append(f"C={chunks}: {format_bytes(memory)}")
    if not tried and refused:       # no C can be cut: the smallest one's reason, the others' as notes
        (_, first), *others = refused.values()
        notes = [(exc.location or first.location, f"C={chunks}: {exc.message}") for chunks, exc in others[:3]]
        raise UserError(first.message, first.location, first.hint, [*first.related, *notes])
    raise UserError(f"no co-shard factor fits the memory budget of {format_bytes(budget)} per device "
                    f"({'; '.join(tried)})", hint="raise --memory-budget, or use more devices")


def plan_coshard(graph: Graph, constraints: list[Constraint], tp: int, tp_plan: AxisPlan | None,
                 base_memory: float, budget: float | None, search: Callable[[int], AxisPlan]) -> CoshardChoice:
    """C for the ops the constraints co-shard. `tp_plan`: the solved tensor-parallel axis (None
    with --tp 1); `search(C)`: the same tables solved over C devices, the stand-in on one."""
    asked = {i: chunks_for(constraints, graph, i) for i in range(len(graph.nodes))}
    anchors = {i for i, c in asked.items() if c != 1}
    fixed = max(asked.values()) if any(c > 1 for c in asked.values()) else None
    stand_ins: dict[int, tuple[AxisPlan, AxisChoices]] = {}

    searches: dict[int, AxisPlan] = {}

    def regions_for(chunks: int) -> list:
        # the stand-in splits as few ways as can cut C pieces: its smallest prime factor (a 4-way
        # plan of tiny layers may split `att @ v` by another dim than the heads; 2 ways keep them)
        ways = next(p for p in range(2, chunks + 1) if chunks % p == 0)
        if tp_plan is None and ways not in searches:
            searches[ways] = search(ways)
        plan = tp_plan if tp_plan is not None else searches[ways]
        marked = {i: chunks for i in anchors if plan.node_choice.get(i, REPLICATE) != REPLICATE}
        if not marked:
            raise UserError(f"nothing to co-shard {chunks} ways: the ops the plan co-shards stay whole",
                            hint="co-shard an op whose split dim divides (attention heads)")
        choices = replace(plan.choices, chunks=marked)
        if tp_plan is None:
            stand_ins[chunks] = (plan, choices)
            return plan_edits(graph, choices, coshard_devices=1).regions
        return plan_edits(graph, choices).regions

    choice = choose_chunks(graph, tp, base_memory, budget, regions_for, fixed)
    choice.anchors = anchors
    if tp_plan is None:
        choice.searched, choice.stand_in = stand_ins[choice.chunks]
    return choice
