"""`--plan auto --devices N`: search every dp x tp factorisation of N, each tp axis with z3,
and keep the fastest one whose memory per device fits the budget."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..graph.graph import Graph
from ..sizes import format_bytes
from .batch import batch_split_problem
from .cost import ClusterSpec, all_reduce_time
from .memory import saved_bytes
from .search import BYTES_PER_PARAM_STATE, AxisPlan, search_axis
from .tables import Constraint


@dataclass
class Candidate:
    tp: int
    dp: int
    seconds: float
    memory: float
    tp_plan: AxisPlan | None
    why_not: str | None = None


def dp_only(graph: Graph, dp: int, cluster: ClusterSpec) -> tuple[float, float]:
    """Step time and memory per device of pure data parallelism."""
    tensors = graph.trace.tensors
    from .cost import node_time
    param_bytes = sum(tensors[p.tid].nbytes for p in graph.trace.params.values())
    activations = sum(saved_bytes(n, graph.trace) for n in graph.nodes)
    link = cluster.axis(1, dp)
    seconds = sum(node_time(n, graph.dims.get(n.index), graph.trace, link, dp, dims_of=graph.dims.get)
                  for n in graph.nodes) + (all_reduce_time(param_bytes, dp, link) if dp > 1 else 0.0)
    return seconds, param_bytes // 4 * BYTES_PER_PARAM_STATE + activations / dp


def search_auto(graph: Graph, devices: int, cluster: ClusterSpec, constraints: list[Constraint],
                memory_budget: float | None) -> tuple[Candidate, list[Candidate]]:
    budget = memory_budget if memory_budget is not None else cluster.memory
    batch = graph.trace.batch_size or 1
    mixing = batch_split_problem(graph, "data parallel")
    candidates = []
    for tp in [d for d in range(1, devices + 1) if devices % d == 0]:
        dp = devices // tp
        if batch % dp:
            candidates.append(Candidate(tp, dp, float("inf"), float("inf"), None,
                                        f"batch {batch} is not divisible by dp={dp}"))
            continue
        if dp > 1 and mixing is not None:
            candidates.append(Candidate(tp, dp, float("inf"), float("inf"), None, f"{mixing.location}: {mixing.message}"))
            continue
        if tp == 1:
            seconds, memory = dp_only(graph, dp, cluster)
            why = None if memory <= budget else f"needs {format_bytes(memory)} per device, budget {format_bytes(budget)}"
            candidates.append(Candidate(1, dp, seconds, memory, None, why))
            continue
        try:
            plan = search_axis(graph, "tp", tp, constraints, cluster.axis(1, tp), memory_budget=budget,
                               data_parallel=dp)
        except UserError as exc:
            candidates.append(Candidate(tp, dp, float("inf"), float("inf"), None, exc.message))
            continue
        tensors = graph.trace.tensors
        local_params = sum(tensors[graph.trace.params[p].tid].nbytes / (tp if l.kind == "S" else 1)
                           for p, l in plan.param_layout.items())
        dp_sync = all_reduce_time(local_params, dp, cluster.axis(tp, dp)) if dp > 1 else 0.0
        candidates.append(Candidate(tp, dp, plan.cost + dp_sync, plan.memory, plan))
    feasible = [c for c in candidates if c.why_not is None]
    if not feasible:
        raise UserError(f"no dp x tp plan on {devices} devices fits: " +
                        "; ".join(f"tp={c.tp} dp={c.dp}: {c.why_not}" for c in candidates),
                        hint="raise --memory-budget or use more devices")
    return min(feasible, key=lambda c: (c.seconds, c.tp)), candidates
