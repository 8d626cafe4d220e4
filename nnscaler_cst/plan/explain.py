"""Which constraints bind: re-solve without each one and compare the cost."""
from __future__ import annotations

from ..errors import UserError
from ..graph.graph import Graph
from .cost import DeviceSpec
from .search import AxisPlan, search_axis
from .tables import Constraint


def binding_constraints(graph: Graph, plan: AxisPlan, constraints: list[Constraint], device: DeviceSpec,
                        *, memory_budget: float | None, data_parallel: int) -> list[dict]:
    report = []
    for cid in dict.fromkeys(c.id for c in constraints):
        rest = [c for c in constraints if c.id != cid]
        first = next(c for c in constraints if c.id == cid)
        try:
            without = search_axis(graph, plan.axis, plan.n, rest, device, memory_budget=memory_budget,
                                  data_parallel=data_parallel).cost
        except UserError:
            without = None
        report.append({"id": cid, "location": str(first.location), "what": first.describe(),
                       "sites": len(plan.restricted.get(cid, [])),
                       "binding": without is not None and without < plan.cost - 1e-12,
                       "seconds_with": plan.cost, "seconds_without": without})
    return report
