"""`plan` / `explain`: the chosen split of every op, the cost per device, and which
constraints bind (dropping them would let the search find a cheaper plan)."""
from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..errors import package_path
from ..graph.graph import Graph
from ..plan.choices import site_keys
from ..plan.instances import site_groups
from ..plan.ir import Plan
from ..plan.layouts import REPLICATE, layouts_for
from ..plan.search import AxisPlan


def plan_rows(graph: Graph, plan: Plan, tp_plan: AxisPlan | None) -> list[dict[str, Any]]:
    return [row for _, row in _site_rows(graph, plan, tp_plan)]


def _site_rows(graph: Graph, plan: Plan, tp_plan: AxisPlan | None) -> list[tuple[Any, dict[str, Any]]]:
    """Per site (per group of instances where a block class's instances split unalike), its row."""
    rows = []
    pieces = {(t.site, t.callee, t.group): t.n for t in plan.trans if t.axis == "tp"}
    keys = site_keys(graph)
    for site, group, nodes in ((site, group, nodes) for site in graph.sites.values()
                               for group, nodes in (site_groups(graph, site.nodes) if tp_plan is not None
                                                    else [("", site.nodes)])):
        node = nodes[0]
        where = keys[site.span]
        choice = tp_plan.node_choice.get(node.index, REPLICATE) if tp_plan else REPLICATE
        outs = layouts_for(graph.dims.get(node.index), choice, []).outputs if tp_plan else []
        n = pieces.get((where, site.callee, group), 1) if choice != REPLICATE else 1
        per_device = max(n // plan.mesh["tp"], 1)       # > 1: co-shard
        rows.append((site, {
            "site": where, "callee": site.callee, "instances": len(nodes),
            **({"group": group} if group else {}),
            "tp": choice, "n": n,
            "output_layout": [str(l) for l in outs],
            "devices": [list(plan.devices_of("tp", i // per_device)) for i in range(n)] if choice != REPLICATE else
            [list(range(plan.world_size))],
            "dp": "batch" if plan.mesh["dp"] > 1 else "-",
        }))
    return rows


def _memory_of(plan: Plan, tp_plan: AxisPlan | None, rank: int) -> float | None:
    """A rank's memory per the model: under --plan auto its pipeline stage's, else the split's."""
    if plan.auto is not None:
        return plan.auto.best.stage_memory[plan.coords(rank).get("pp", 0)]
    if plan.coshard_memory is not None:     # the split's, less what co-shard no longer keeps
        return plan.coshard_memory
    return tp_plan.memory if tp_plan else None


def search_json(plan: Plan) -> dict | None:
    """--plan auto: the configuration chosen, and the best configuration of each (tp, pp)."""
    auto = plan.auto
    if auto is None:
        return None

    def one(e) -> dict:
        c = e.config
        return {"tp": c.tp, "dp": c.dp, "pp": c.pp, "micro_batches": c.micro_batches, "zero": c.zero,
                "recompute": c.recompute, "sequence_parallel": c.sequence_parallel, "schedule": c.schedule,
                "coshard": c.coshard, "kind": c.kind,
                "seconds": e.seconds if e.why_not is None or e.memory < float("inf") else None,
                "memory_bytes": e.memory if e.memory < float("inf") else None, "why_not": e.why_not}
    return {"chosen": {**one(auto.best), "stage_seconds": auto.best.stage_seconds,
                       "stage_memory_bytes": auto.best.stage_memory},
            "memory_budget_bytes": auto.budget, "configurations_priced": auto.evaluated,
            "configurations_unconstrained": auto.space,
            "best_of_each_kind": {kind: one(e) for kind, e in best_of_each_kind(auto).items()},
            "candidates": [one(e) for e in sorted(auto.candidates, key=lambda e: (e.why_not is not None, e.seconds))]}


def plan_json(graph: Graph, plan: Plan, tp_plan: AxisPlan | None, binding: list[dict] | None) -> dict:
    per_device = [{"rank": r, "coords": plan.coords(r), "seconds": plan.estimated_step_seconds,
                   "memory_bytes": _memory_of(plan, tp_plan, r)} for r in range(plan.world_size)]
    out = {"plan": plan.name, "mesh": plan.mesh, "ops": plan_rows(graph, plan, tp_plan), "devices": per_device}
    search = search_json(plan)
    if search is not None:
        out["search"] = search
    if binding is not None:
        out["binding_constraints"] = binding
    return out


def best_of_each_kind(auto) -> dict:
    """The fastest fitting configuration of each kind of plan (tp x dp, co-shard, each pipeline
    schedule); a kind with none that fits, its least-memory try or its refusal."""
    kinds: dict = {}
    for e in auto.candidates:
        kept = kinds.get(e.config.kind)
        rank = (e.why_not is not None, e.memory == float("inf"), e.seconds if e.why_not is None else e.memory)
        if kept is None or rank < (kept.why_not is not None, kept.memory == float("inf"),
                                   kept.seconds if kept.why_not is None else kept.memory):
            kinds[e.config.kind] = e
    return kinds


def search_lines(plan: Plan, shown: int = 6) -> list[str]:
    """--plan auto in words: what was chosen, why, and the runners-up."""
    auto = plan.auto
    best = auto.best
    lines = [f"--plan auto chose {best.config.describe()}: est. step {best.seconds * 1e3:.1f} ms, "
             f"{_gib(best.memory)} per device at most (budget {_gib(auto.budget)}); "
             f"{auto.evaluated} configurations priced of {auto.space} without the constraints "
             f"({auto.space / max(auto.evaluated, 1):.1f}x fewer)"]
    if best.config.pp > 1:
        lines.append("  per stage: " + ", ".join(f"{t * 1e3:.2f} ms/micro-batch {_gib(m)}"
                                                  for t, m in zip(best.stage_seconds, best.stage_memory)))
    lines.append("  best of each kind:")
    for kind, e in best_of_each_kind(auto).items():
        cost = f"{e.seconds * 1e3:.1f} ms, {_gib(e.memory)}" if e.memory < float("inf") else "-"
        mark = "chosen" if e.config == best.config else f"{e.seconds / best.seconds:.2f}x" if e.why_not is None else ""
        lines.append(f"    {kind:<12} {e.config.describe()}: {cost}" + (f" {mark}" if mark else "")
                     + (f" ({e.why_not})" if e.why_not else ""))
    lines.append("  runners-up:")
    ranked = sorted((e for e in auto.candidates if e.config != best.config),
                    key=lambda e: (e.why_not is not None, e.seconds, e.memory))
    for e in ranked[:shown]:
        cost = f"{e.seconds * 1e3:.1f} ms, {_gib(e.memory)}" if e.memory < float("inf") else "-"
        lines.append(f"  {e.config.describe()}: {cost}" + (f" ({e.why_not})" if e.why_not else ""))
    return lines


def _devices_text(pieces: list[list[int]]) -> str:
    """Each piece's devices; at scale, the first pieces and the first devices of each."""
    def one(devices: list[int]) -> str:
        if len(devices) <= 6:
            return ",".join(map(str, devices))
        return f"{devices[0]},{devices[1]},..,{devices[-1]} ({len(devices)})"
    shown = [one(d) for d in pieces[:4]]
    return " | ".join(shown + ([f".. ({len(pieces)} pieces)"] if len(pieces) > 4 else []))


def _callee(name: str) -> str:
    return name.replace("torch.nn.functional.", "F.").replace("torch.nn.", "nn.")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def plan_table(graph: Graph, plan: Plan, tp_plan: AxisPlan | None, binding: list[dict] | None) -> Group:
    shown = [(site, row) for site, row in _site_rows(graph, plan, tp_plan)
             if not (row["tp"] == REPLICATE and row["dp"] == "-")]
    by_file: dict[str, list] = {}
    for site, row in shown:
        by_file.setdefault(package_path(site.span.path), []).append((site, row))
    # one table per source file, titled by its package-relative path, so that the rows fit 80
    # columns; a callee is never cut shorter than its whole name
    widest = max((len(_callee(row["callee"])) for _, row in shown), default=6)
    parts: list = [Text(f"plan {plan.describe()}", style="bold")]
    for path, rows in by_file.items():
        ops = Table(header_style="bold", title=path, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                    collapse_padding=True)
        ops.add_column("line", no_wrap=True)
        ops.add_column("callee", overflow="fold", min_width=min(widest, 32))
        for column in ("tp split", "n", "output", "tp devices", "dp"):
            ops.add_column(column, overflow="fold", no_wrap=column in ("n", "dp"))
        for site, row in rows:
            # a block class's instances split unalike: each group's row names its first instance
            callee = _callee(row["callee"]) + (f" in {row['group']}" if "group" in row else "")
            ops.add_row(f"{site.span.line}:{site.span.col + 1}", callee, row["tp"], str(row["n"]),
                        " ".join(row["output_layout"]), _devices_text(row["devices"]), row["dp"])
        parts.append(ops)
    devices = Table(header_style="bold", title="per device (cost model)")
    for column in ("rank", "coords", "est. step (ms)", "est. memory (MB)"):
        devices.add_column(column, justify="right")
    rows: list[tuple[list[int], str]] = []        # ranks alike (same stage) share a row when there are many
    for r in range(plan.world_size):
        coords = " ".join(f"{a}{i}" for a, i in plan.coords(r).items())
        if plan.world_size > 16:
            coords = f"pp{plan.coords(r).get('pp', 0)}"
        if rows and rows[-1][1] == coords and plan.world_size > 16:
            rows[-1][0].append(r)
        else:
            rows.append(([r], coords))
    for ranks, coords in rows:
        memory = _memory_of(plan, tp_plan, ranks[0])
        devices.add_row(str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}",
                        coords if len(ranks) == 1 else f"{coords} (all)", f"{plan.estimated_step_seconds * 1e3:.3f}",
                        f"{memory / 1e6:.2f}" if memory is not None else "-")
    parts.append(devices)
    if plan.auto is not None:
        parts += [Text(line) for line in search_lines(plan)]
    if binding is not None:
        table = Table(header_style="bold", title="constraints (binding: dropping it lowers the cost)")
        table.add_column("constraint", overflow="fold")
        table.add_column("where", no_wrap=True)
        for column in ("sites narrowed", "binding", "cost with it (ms)", "cost without it (ms)"):
            table.add_column(column, overflow="fold")
        for item in binding:
            table.add_row(item["id"], item["location"], str(item["sites"]), "yes" if item["binding"] else "no",
                          f"{item['seconds_with'] * 1e3:.3f}",
                          "-" if item["seconds_without"] is None else f"{item['seconds_without'] * 1e3:.3f}")
        parts.append(table)
    parts.append(Text(f"replicated sites not shown; {len(graph.sites)} sites in all"))
    return Group(*parts)
