"""The rewrite: from an analysed model and the requested mesh to the output files.

plan (op_trans/op_assign per axis) -> edits -> rewritten source -> rendered files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from . import __version__
from .analysis import Analysis
from .emit import templates
from .emit.assemble import add_comm_import, merge_entry, model_files, with_header
from .emit.rewrite import rewrite_module
from .errors import UserError, display_path
from .materialize.edits import Edits, plan_edits
from .plan.ir import OpAssign, OpTrans, Plan
from .plan.layouts import REPLICATE
from .plan.auto import dp_only, search_auto
from .plan.cost import load_cluster
from .plan.search import AxisPlan, search_axis
from .plan.tables import load_table, source_annotations

COMM_SOURCE = Path(__file__).parent / "runtime" / "_comm.py"


@dataclass
class Rewrite:
    plan: Plan
    tp_plan: AxisPlan | None
    edits: Edits | None
    files: dict[str, str]


@dataclass
class PlanRequest:
    """What the user asked for: a plan table and a mesh (or devices to search over)."""

    plan: str | None = None
    tp: int | None = None
    dp: int | None = None
    devices: int | None = None
    cluster: str = "cpu-gloo"
    memory_budget: float | None = None


def _table_names(request: PlanRequest, tp: int, dp: int) -> list[str]:
    """--plan defaults to what the sizes imply: --tp alone megatron, --dp alone dp, both 2-D."""
    name = {"tp": "megatron"}.get(request.plan, request.plan)
    if name is None:
        return (["megatron"] if tp > 1 else []) + (["dp"] if dp > 1 or tp == 1 else [])
    if name == "dp" and tp > 1:
        raise UserError("--plan dp splits no op over --tp; drop --tp or use --plan megatron")
    table = load_table(name)
    if "tp" in table.axes and "dp" not in table.axes and tp == 1:
        raise UserError(f"--plan {name} needs --tp N with N > 1")
    return [name] + (["dp"] if dp > 1 and name != "dp" else [])


def build_plan(analysis: Analysis, request: PlanRequest) -> tuple[Plan, AxisPlan | None]:
    """Solve the plan: each table's constraints, plus the model's own annotations."""
    graph = analysis.graph
    cluster = load_cluster(request.cluster)
    annotations = source_annotations(graph)
    if request.plan == "auto":
        devices = request.devices or (request.tp or 1) * (request.dp or 1)
        if devices < 2:
            raise UserError("--plan auto needs --devices N (N > 1)")
        best, _ = search_auto(graph, devices, cluster, annotations, request.memory_budget)
        tp, dp, tp_plan, name = best.tp, best.dp, best.tp_plan, f"auto(tp={best.tp},dp={best.dp})"
    else:
        tp, dp = request.tp or 1, request.dp or 1
        if tp < 1 or dp < 1:
            raise UserError("--tp and --dp must be at least 1")
        names = _table_names(request, tp, dp)
        tables = [load_table(n) for n in names]
        constraints = [c for t in tables for c in t.for_axis("tp")] + [c for c in annotations if c.axis == "tp"]
        batch = analysis.trace.batch_size or 1
        if dp > 1 and batch % dp:
            raise UserError(f"the batch of {batch} is not divisible by --dp {dp}",
                            next((c.location for t in tables for c in t.for_axis("dp")), None))
        tp_plan = search_axis(graph, "tp", tp, constraints, cluster.axis(1, tp), memory_budget=request.memory_budget,
                              data_parallel=dp) if tp > 1 else None
        name = "+".join(names)
    plan = Plan(name, {"tp": tp, "dp": dp})
    plan.estimated_step_seconds = tp_plan.cost if tp_plan is not None else dp_only(graph, dp, cluster)[0]
    for site in graph.sites.values():
        where = f"{display_path(site.span.path)}:{site.span.line}:{site.span.col + 1}"
        if tp_plan is not None:
            choice = tp_plan.site_choice.get((site.span, site.callee), REPLICATE)
            plan.trans.append(OpTrans(where, site.callee, "tp", choice, tp if choice != REPLICATE else 1))
            if choice != REPLICATE:
                plan.assign += [OpAssign(where, "tp", i, plan.devices_of("tp", i)) for i in range(tp)]
        if dp > 1:
            plan.trans.append(OpTrans(where, site.callee, "dp", "batch", dp))
            plan.assign += [OpAssign(where, "dp", i, plan.devices_of("dp", i)) for i in range(dp)]
    for pname, info in analysis.trace.params.items():
        layout = tp_plan.param_layout.get(pname) if tp_plan else None
        plan.params[pname] = {"aliases": info.aliases, "shape": list(info.shape),
                              "tp": str(layout) if layout else "R", "dp": "R"}
    return plan, tp_plan


def render(analysis: Analysis, plan: Plan, edits: Edits | None, source_label: str) -> dict[str, str]:
    entry = analysis.entry
    model_path, entry_path = model_files(analysis.trace.own_files, entry.path)
    empty = Edits("tp", 1, {}, {}, {}, [])
    main_source = analysis.sources.get(model_path or entry_path)
    module, ctx = rewrite_module(main_source, edits or empty)
    if model_path is not None:
        module = merge_entry(module, model_path, analysis.sources.get(entry_path).module, entry_path)
    module = add_comm_import(module, ctx.used, ctx.needs_torch)
    body = module.code
    files: dict[str, str] = {}
    for rank in range(plan.world_size):
        coords = ", ".join(f"{a} {i}" for a, i in plan.coords(rank).items())
        files[f"model_rank{rank}.py"] = with_header(
            body, f"from {source_label}; plan {plan.describe()}; rank {rank} of {plan.world_size} ({coords})")
    comm = COMM_SOURCE.read_text()
    files["_comm.py"] = with_header(comm, "(named collectives; torch only)")
    tp, dp = plan.mesh["tp"], plan.mesh["dp"]
    splits = ""
    if edits is not None:
        for name, info in analysis.trace.params.items():
            layout = edits.param_layout.get(name)
            if layout is not None and layout.kind == "S":
                splits += "".join(f"    {alias!r}: ({layout.dim}, {layout.groups}),\n" for alias in info.aliases)
    title = f"Parallel version of {source_label}: plan {plan.describe()}."
    files["__init__.py"] = with_header(templates.INIT.format(title=title, world=plan.world_size, tp=tp, dp=dp,
                                                             splits=splits), f"from {source_label}")
    partial = ", ".join(repr(a) for p in (edits.partial_grad_params if edits else [])
                        for a in analysis.trace.params[p].aliases)
    files["train.py"] = with_header(templates.TRAIN.format(source=source_label, plan=plan.describe(),
                                                           world=plan.world_size, folder="<this folder>",
                                                           partial=partial), f"from {source_label}")
    plan_json = {"generated_by": f"nnscaler-rewrite {__version__}", "source": source_label, **plan.to_json()}
    files["plan.json"] = json.dumps(plan_json, indent=1, sort_keys=False) + "\n"
    for name, text in files.items():
        if name.endswith(".py"):
            cst.parse_module(text)   # the output must be valid Python; fail before writing
    return files


def rewrite(analysis: Analysis, request: PlanRequest) -> Rewrite:
    plan, tp_plan = build_plan(analysis, request)
    edits = plan_edits(analysis.graph, tp_plan) if tp_plan is not None else None
    label = display_path(analysis.entry.path)
    return Rewrite(plan, tp_plan, edits, render(analysis, plan, edits, label))
