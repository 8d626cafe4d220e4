"""`plan` / `explain`: the chosen split of every op, the cost per device, and which
constraints bind (dropping them would let the search find a cheaper plan)."""
from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..graph.graph import Graph
from ..plan.choices import site_keys
from ..plan.ir import Plan
from ..plan.layouts import REPLICATE, layouts_for
from ..plan.search import AxisPlan


def plan_rows(graph: Graph, plan: Plan, tp_plan: AxisPlan | None) -> list[dict[str, Any]]:
    rows = []
    pieces = {(t.site, t.callee): t.n for t in plan.trans if t.axis == "tp"}
    keys = site_keys(graph)
    for site in graph.sites.values():
        node = site.nodes[0]
        where = keys[site.span]
        choice = tp_plan.node_choice.get(node.index, REPLICATE) if tp_plan else REPLICATE
        outs = layouts_for(graph.dims.get(node.index), choice, []).outputs if tp_plan else []
        n = pieces.get((where, site.callee), 1) if choice != REPLICATE else 1
        per_device = max(n // plan.mesh["tp"], 1)       # > 1: co-shard
        rows.append({
            "site": where, "callee": site.callee, "instances": len(site.nodes),
            "tp": choice, "n": n,
            "output_layout": [str(l) for l in outs],
            "devices": [list(plan.devices_of("tp", i // per_device)) for i in range(n)] if choice != REPLICATE else
            [list(range(plan.world_size))],
            "dp": "batch" if plan.mesh["dp"] > 1 else "-",
        })
    return rows


def plan_json(graph: Graph, plan: Plan, tp_plan: AxisPlan | None, binding: list[dict] | None) -> dict:
    per_device = [{"rank": r, "coords": plan.coords(r), "seconds": plan.estimated_step_seconds,
                   "memory_bytes": tp_plan.memory if tp_plan else None} for r in range(plan.world_size)]
    out = {"plan": plan.name, "mesh": plan.mesh, "ops": plan_rows(graph, plan, tp_plan), "devices": per_device}
    if binding is not None:
        out["binding_constraints"] = binding
    return out


def plan_table(graph: Graph, plan: Plan, tp_plan: AxisPlan | None, binding: list[dict] | None) -> Group:
    ops = Table(header_style="bold", title=f"plan {plan.describe()}")
    ops.add_column("site", no_wrap=True)
    for column in ("callee", "tp split", "n", "output", "tp devices", "dp"):
        ops.add_column(column, overflow="fold")
    for row in plan_rows(graph, plan, tp_plan):
        if row["tp"] == REPLICATE and row["dp"] == "-":
            continue
        ops.add_row(row["site"], row["callee"].replace("torch.nn.functional.", "F."), row["tp"], str(row["n"]),
                    " ".join(row["output_layout"]), " | ".join(",".join(map(str, d)) for d in row["devices"]),
                    row["dp"])
    devices = Table(header_style="bold", title="per device (cost model)")
    for column in ("rank", "coords", "est. step (ms)", "est. memory (MB)"):
        devices.add_column(column, justify="right")
    memory = f"{tp_plan.memory / 1e6:.2f}" if tp_plan else "-"
    for r in range(plan.world_size):
        coords = " ".join(f"{a}{i}" for a, i in plan.coords(r).items())
        devices.add_row(str(r), coords, f"{plan.estimated_step_seconds * 1e3:.3f}", memory)
    parts = [ops, devices]
    if binding is not None:
        table = Table(header_style="bold", title="constraints (binding: dropping it lowers the cost)")
        table.add_column("constraint", overflow="fold")
        table.add_column("where", no_wrap=True)
        for column in ("sites narrowed", "binding", "cost without it (ms)"):
            table.add_column(column, overflow="fold")
        for item in binding:
            table.add_row(item["id"], item["location"], str(item["sites"]), "yes" if item["binding"] else "no",
                          "-" if item["seconds_without"] is None else f"{item['seconds_without'] * 1e3:.3f}")
        parts.append(table)
    parts.append(Text(f"replicated sites not shown; {len(graph.sites)} sites in all"))
    return Group(*parts)
