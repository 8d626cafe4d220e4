"""The rewrite: from an analysed model and the requested mesh to the output files.

plan (op_trans/op_assign per axis) -> edits -> rewritten source -> rendered files.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import libcst as cst

from . import __version__
from .analysis import Analysis
from .emit import templates
from .emit.assemble import (add_comm_import, built_by_code_kept, content_hash, instance_classes_section,
                            merge_entry, merge_entry_mirrored, model_files, module_name_of,
                            split_after_build_section, with_header)
from .emit.mirrors import library_decorated, plan_mirrors, render_mirror, statement_lines
from .emit.variants import insert_variants
from .emit.output import generated_json
from .emit.programs import programs
from .emit.rewrite import StageSplit, rewrite_module
from .errors import Location, UserError, display_path
from .source.files import resolved
from .materialize.conversions import fused_collectives
from .materialize.edits import Edits, data_parallel_edits, one_device_edits, plan_edits, vocab_loss_edits
from .materialize.state_keys import hooked_key_splits
from .plan.ir import OpAssign, OpOrder, OpTrans, Plan
from .plan.pipeline import StagePlan, stages_to_rewrite
from .plan.recompute import recompute_seconds, recompute_site, recompute_sites, restored_buffers
from .plan import interlaced
from .plan.schedules import Action, Placement, load_schedule, placement, schedule, to_csv
from .plan.zero import check_zero
from .verify.simulate import simulate
from .verify.dry_run import dry_run
from .plan.layouts import REPLICATE
from .plan.auto import AutoChoice, dp_only, search_auto
from .plan.auto import _Fixed as Fixed
from .plan.batch import (buffer_write_warnings, buffers_written, check_batch_split, loss_reduction,
                         micro_batch_statistics, statistics_warnings)
from .plan.choices import choices_from_plan, site_keys
from .plan.coshard import CoshardChoice, plan_coshard, repeated_forward as coshard_repeated_forward
from .plan.cost import check_precision, load_cluster, node_time, optimizer_time
from .plan.instances import instance_groups, mixed_lines, site_groups
from .plan.search import AxisPlan, params_kept_whole, search_axis
from .plan.whole_sizes import splits_a_read_size
from .plan.tables import Constraint, load_table, source_annotations, weights_left_whole

COMM_SOURCE = Path(__file__).parent / "runtime" / "_comm.py"


@dataclass
class Rewrite:
    plan: Plan
    tp_plan: AxisPlan | None
    edits: Edits | None
    files: dict[str, str]
    stages: StagePlan | None = None
    orders: list[list[Action]] | None = None
    # mirrored file -> (its source file, the same definitions before the rewrite): what --diff shows
    mirror_bases: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)


@dataclass
class PlanRequest:
    """What the user asked for: a plan table and a mesh (or devices to search over)."""

    plan: str | None = None
    tp: int | None = None
    dp: int | None = None
    devices: int | None = None
    cluster: str = "cpu-gloo"
    memory_budget: float | None = None
    pp: int = 1
    micro_batches: int | None = None
    schedule: str = "1f1b"
    stage_cuts: list[int] | None = None
    recompute: bool = False          # every repeated block under torch.utils.checkpoint
    sequence_parallel: bool = False  # Megatron's sequence parallelism: rules/plans/sequence_parallel.toml
    precision: str | None = None     # contractions' compute dtype for the cost model; None: the traced dtypes
    zero: int = 0                    # ZeRO stage of the data-parallel state (0: replicated)
    auto: AutoChoice | None = None   # --plan auto: what the search chose (resolve_auto fills it in)


def resolve_auto(analysis: Analysis, request: PlanRequest) -> PlanRequest:
    """--plan auto: search tp x pp x dp, micro-batches, ZeRO, recompute, sequence parallelism,
    co-shard and the pipeline schedule (plan/auto.py) and return the request with the chosen
    configuration filled in, so that every later step emits what was chosen. Options the user
    gave (--pp, --micro-batches, --zero, --recompute, --sequence-parallel, --schedule other than
    1f1b) are kept, not searched. Other requests pass."""
    if request.plan != "auto" or request.auto is not None:
        return request
    devices = request.devices or (request.tp or 1) * (request.dp or 1)
    if devices < 2:
        raise UserError("--plan auto needs --devices N (N > 1)")
    cluster = load_cluster(request.cluster).with_precision(check_precision(request.precision))
    annotations = [c for c in source_annotations(analysis.graph) if c.axis == "tp"]
    fixed = Fixed(pp=request.pp if request.pp > 1 else None, micro_batches=request.micro_batches,
                  zero=request.zero or None, recompute=True if request.recompute else None,
                  sequence_parallel=True if request.sequence_parallel else None,
                  schedule=request.schedule if request.schedule != "1f1b" else None,
                  search_cuts=request.stage_cuts is None)
    choice = search_auto(analysis.graph, devices, cluster, annotations, request.memory_budget, fixed=fixed)
    config = choice.config
    return replace(request, tp=config.tp, dp=config.dp, pp=config.pp, schedule=config.schedule,
                   micro_batches=config.micro_batches if config.pp > 1 or config.micro_batches > 1 else None,
                   zero=config.zero,
                   recompute=config.recompute, sequence_parallel=config.sequence_parallel,
                   stage_cuts=list(config.cuts) if config.cuts else request.stage_cuts, auto=choice)


def _refuse_sequence_parallel_that_moves_nothing(graph, constraints) -> None:
    """--sequence-parallel whose table moves no norm of this model to sequence slices would
    write what plain --tp writes: refused, at the table's rule, saying which callees it moves."""
    moving = [c for c in constraints if c.algo == "sequence"]
    if not moving or any(c.selects(graph, node.index) for c in moving for node in graph.nodes):
        return
    callees = sorted({callee for c in moving for callee in c.select.get("callee", [])})
    own = sorted({t.rsplit(".", 1)[-1] for t in graph.trace.module_types.values()
                  if "norm" in t.rsplit(".", 1)[-1].lower() and not t.startswith("torch.")})
    raise UserError("--sequence-parallel moves no norm of this model to sequence slices: it splits the calls of "
                    + ", ".join(callees) + ", and the model makes none"
                    + (f" (its own {', '.join(own)} computes the norm in ops of its own)" if own else ""),
                    moving[0].location,
                    hint="call torch.nn.RMSNorm / F.rms_norm or torch.nn.LayerNorm in the model, or drop "
                         "--sequence-parallel (it would write what --tp alone writes)")


def _table_names(request: PlanRequest, tp: int, dp: int) -> list[str]:
    """--plan defaults to what the sizes imply: --tp alone megatron, --dp alone dp, both 2-D."""
    name = {"tp": "megatron"}.get(request.plan, request.plan)
    if request.sequence_parallel:
        if name not in (None, "megatron", "sequence_parallel"):
            raise UserError(f"--sequence-parallel is Megatron's tensor parallelism; it does not go with --plan {name}",
                            hint="drop --plan, or use --plan sequence_parallel")
        if tp < 2:
            raise UserError("--sequence-parallel needs --tp N with N > 1", hint="e.g. --tp 2 --sequence-parallel")
        name = "sequence_parallel"
    if name is None:
        return (["megatron"] if tp > 1 else []) + (["dp"] if dp > 1 else [])
    if name == "dp" and tp > 1:
        raise UserError("--plan dp splits no op over --tp; drop --tp or use --plan megatron")
    table = load_table(name)
    coshards = any(c.chunks != 1 for c in table.for_axis("tp"))   # C pieces run on one device as well
    if "tp" in table.axes and "dp" not in table.axes and tp == 1 and not coshards:
        raise UserError(f"--plan {name} needs --tp N with N > 1", hint=f"e.g. --plan {name} --tp 2")
    return [name] + (["dp"] if dp > 1 and name != "dp" else [])


def _inputs_location(analysis: Analysis) -> Location | None:
    """Where the entry file defines example_inputs(), whose batch the sizes must divide."""
    code = getattr(analysis.entry.example_inputs, "__code__", None)
    if code is None:
        return None
    return Location(display_path(code.co_filename), code.co_firstlineno)


def _local_params(graph, tp_plan: AxisPlan | None, tp: int) -> float:
    """Parameters one device holds and steps the optimizer over: split ones by 1/tp."""
    total = 0.0
    for name, info in graph.trace.params.items():
        layout = tp_plan.param_layout.get(name) if tp_plan is not None else None
        total += math.prod(info.shape) / (tp if layout is not None and layout.kind == "S" else 1)
    return total


def _choose_coshard(analysis: Analysis, request: PlanRequest, constraints: list, tp: int, dp: int,
                    tp_plan: AxisPlan | None, cluster, every_size_read: bool) -> CoshardChoice:
    """C pieces per device for the co-sharded ops; with --tp 1 also the C-way stand-in plan."""
    graph = analysis.graph
    base = tp_plan.memory if tp_plan is not None else dp_only(graph, dp, cluster)[1]

    def search(ways: int) -> AxisPlan:
        # the stand-in's pieces share one device and cannot communicate: priced with every
        # collective dear, it keeps the co-sharded op's split dim through its neighbours (priced
        # as a real axis, tiny layers may split `att @ v` by another dim and end the region early)
        device = dataclasses.replace(cluster.axis(1, ways), bandwidth=1.0, latency=1.0)
        return search_axis(graph, "tp", ways, constraints, device, data_parallel=dp,
                           micro_batches=_micro_batches(request), every_size_read=every_size_read)

    # --plan auto chose C with the budget checked against recompute, ZeRO and the pipeline together
    budget = None if request.auto is not None else request.memory_budget
    return plan_coshard(graph, constraints, tp, tp_plan, base, budget, search)


def build_plan(analysis: Analysis, request: PlanRequest, every_size_read: bool = False,
               whole_params: tuple[str, ...] = ()) -> tuple[Plan, AxisPlan | None]:
    """Solve the plan: each table's constraints, plus the model's own annotations.
    `whole_params`: parameters kept whole on the tensor-parallel axis (see rewrite)."""
    graph = analysis.graph
    cluster = load_cluster(request.cluster).with_precision(check_precision(request.precision))
    annotations = source_annotations(graph)
    if request.plan == "auto":
        request = resolve_auto(analysis, request)
        tp, dp, tp_plan = request.tp, request.dp, request.auto.tp_plan
        name = f"auto({request.auto.config.describe().replace(' ', ',')})"
        constraints = [c for c in annotations if c.axis == "tp"]
        if request.sequence_parallel:
            constraints = load_table("sequence_parallel").for_axis("tp") + constraints
        chunks = request.auto.config.coshard
        if chunks > 1:                  # the co-shard table, with the C the search chose
            constraints = [dataclasses.replace(c, chunks=chunks) if c.chunks != 1 else c
                           for c in load_table("coshard").for_axis("tp")] + constraints
        if request.pp > 1 and tp > 1 and load_schedule(request.schedule).vocab:   # interlaced: split over pp
            constraints = interlaced.keep_whole_on_tp(graph, load_schedule(request.schedule), request.pp, constraints)
        constraints = _kept_whole(analysis, whole_params, constraints)
        if tp_plan is not None and (every_size_read or whole_params):   # the first plan's dry run failed
            with fused_collectives(request.sequence_parallel or chunks > 1):
                tp_plan = search_axis(graph, "tp", tp, constraints, cluster.axis(1, tp), data_parallel=dp,
                                      micro_batches=_micro_batches(request), every_size_read=True)
    else:
        tp, dp = request.tp or 1, request.dp or 1
        if tp < 1 or dp < 1:
            raise UserError("--tp and --dp must be at least 1")
        names = _table_names(request, tp, dp)
        tables = [load_table(n) for n in names]
        constraints = [c for t in tables for c in t.for_axis("tp")] + [c for c in annotations if c.axis == "tp"]
        if request.pp > 1 and tp > 1 and load_schedule(request.schedule).vocab:   # interlaced: split over pp
            constraints = interlaced.keep_whole_on_tp(graph, load_schedule(request.schedule), request.pp, constraints)
        constraints = _kept_whole(analysis, whole_params, constraints)
        batch = analysis.trace.batch_size or 1
        if dp > 1 and batch % dp:
            table_line = next((c.location for t in tables for c in t.for_axis("dp")), None)
            raise UserError(f"the batch of {batch} is not divisible by --dp {dp}", _inputs_location(analysis),
                            hint=f"use a --dp that divides {batch}, or change the batch example_inputs() returns",
                            related=[(table_line, "the dp table splits every op on the batch dim")]
                            if table_line else None)
        if dp > 1:
            check_batch_split(graph, f"data parallel (--dp {dp})")
        coshards = any(c.chunks != 1 for c in constraints)
        with fused_collectives(any(t.fused_collectives for t in tables)):
            # with co-shard the budget is met by choosing C (below), after the search
            tp_plan = search_axis(graph, "tp", tp, constraints, cluster.axis(1, tp),
                                  memory_budget=None if coshards else request.memory_budget, data_parallel=dp,
                                  micro_batches=_micro_batches(request),
                                  every_size_read=every_size_read) if tp > 1 else None
        if request.sequence_parallel:
            _refuse_sequence_parallel_that_moves_nothing(graph, constraints)
        name = "+".join(names) or "single"
    auto = request.auto if request.plan == "auto" else None
    if request.zero:
        check_zero(request.zero, dp, request.pp, searched=request.plan == "auto",
                   pipelines=load_schedule(request.schedule).pipelines if request.pp > 1 else 1)
        name += f"+zero{request.zero}" if auto is None else ""
    coshard = _choose_coshard(analysis, request, constraints, tp, dp, tp_plan, cluster, every_size_read) \
        if any(c.chunks != 1 for c in constraints) else None
    plan = Plan(name, {"tp": tp, "dp": dp, "pp": request.pp})
    plan.auto = auto
    plan.warnings = weights_left_whole(graph) if tp > 1 else []
    plan.warnings += tp_plan.left_whole if tp_plan is not None else []
    plan.warnings += params_kept_whole(graph, tp_plan.param_layout) if tp_plan is not None else []
    plan.estimated_step_seconds = tp_plan.cost if tp_plan is not None else dp_only(graph, dp, cluster)[0]
    stepped = _local_params(graph, tp_plan, tp) / (dp if request.zero else 1)   # ZeRO: each dp rank steps its shard
    plan.estimated_step_seconds += optimizer_time(stepped, cluster.axis(1, tp))
    if request.recompute:
        recompute_site(graph)           # refused here, before solving anything else, when it cannot apply
        plan.name += "+recompute" if auto is None else ""
        plan.estimated_step_seconds += recompute_seconds(graph, tp * dp, cluster.axis(1, tp))
    if coshard is not None:
        plan.name += f"(C={coshard.chunks})"
        plan.estimated_step_seconds += coshard_repeated_forward(graph, coshard, tp, cluster.axis(1, tp))
        plan.coshard_stand_in = coshard.stand_in if tp_plan is None else None
        plan.coshard_memory = coshard.memory
    if auto is not None:                # the search's estimate: pipeline, recompute and ZeRO priced together
        plan.estimated_step_seconds = auto.best.seconds
    keys = site_keys(graph)
    chosen = tp_plan or (coshard.searched if coshard is not None else None)
    for site, group, nodes in ((site, group, nodes) for site in graph.sites.values()
                               for group, nodes in (site_groups(graph, site.nodes) if chosen is not None
                                                    else [("", site.nodes)])):
        where = keys[site.span]
        sid = (site.span, site.callee, group) if group else (site.span, site.callee)
        choice = chosen.site_choice.get(sid, REPLICATE) if chosen is not None else REPLICATE
        chunks = coshard.chunks if coshard is not None and choice != REPLICATE and nodes[0].index in \
            coshard.anchors else 1
        # on one device (--tp 1) only the co-sharded ops are split: into C pieces, all on it
        if tp_plan is not None or chunks > 1:
            plan.trans.append(OpTrans(where, site.callee, "tp", choice, tp * chunks if choice != REPLICATE else 1,
                                      group))
            if choice != REPLICATE:     # co-shard: C consecutive pieces per device, one after another
                plan.assign += [OpAssign(where, "tp", i, plan.devices_of("tp", i // chunks))
                                for i in range(tp * chunks)]
                plan.order += [OpOrder(f"{where}#{i}", f"{where}#{i + 1}", device)
                               for i in range(tp * chunks - 1) if i % chunks < chunks - 1
                               for device in plan.devices_of("tp", i // chunks)]
        if dp > 1:
            plan.trans.append(OpTrans(where, site.callee, "dp", "batch", dp, group))
            plan.assign += [OpAssign(where, "dp", i, plan.devices_of("dp", i)) for i in range(dp)]
    for pname, info in analysis.trace.params.items():
        layout = tp_plan.param_layout.get(pname) if tp_plan else None
        plan.params[pname] = {"aliases": info.aliases, "shape": list(info.shape),
                              "tp": str(layout) if layout else "R", "dp": "R"}
    return plan, tp_plan


def _pipeline_section(stages: StagePlan, orders: list[list[Action]], pp_rank: int, table: str) -> str:
    mine = stages.stages_of(pp_rank)
    replicas = Placement(tuple(stages.rank_of(s) for s in range(stages.stages)), stages.per_pipeline).replica_groups()
    tied = sorted({alias for group in stages.tied for alias in group})
    shared = sorted({alias for group in stages.shared for alias in group})
    deferred = {s: [c for c in range(v.calls) if v.deferred_call(c)] for s, v in stages.vocab_steps.items()}
    if stages.chain:
        blocks = [f"PIPELINE_BLOCKS = {[t.container for t in stages.chain]}  # the block lists cut as one chain, "
                  "in call order",
                  f"STAGE_BLOCKS = {{{', '.join(f'{s}: {stages.local_ranges(s)}' for s in mine)}}}  "
                  "# per stage, the blocks of each list it holds",
                  f"STAGE_TRUNKS = {{{', '.join(f'{s}: {_roles(stages, s)}' for s in mine)}}}  # per stage, its "
                  "part in the loop over each list (owner: role, first block, stop, hands on after its blocks)"]
        iterated = {t.container: len(t.blocks) for t in stages.chain if t.iterations}
        if iterated:
            blocks.append(f"PIPELINE_ITERATIONS = {iterated}  # lists whose loop runs one block per iteration: each "
                          "stage keeps the whole list (the others' blocks hollow) and runs the iterations of its own")
    elif stages.trunk.statements is not None:
        runs = _statement_lines(stages)
        blocks = [f'PIPELINE_BLOCKS = "{stages.trunk.container}"  # a chain of statements, cut between them',
                  f"STAGE_BLOCKS = {{{', '.join(f'{s}: {{}}' for s in mine)}}}  # no block list: STAGE_DROPS says "
                  f"what each stage holds; its statements of {stages.trunk.container}: "
                  + ", ".join(f"stage {s} lines {runs[s][0]}-{runs[s][1]}" for s in mine)]
    elif len(set(stages.trunk.blocks)) == 1:      # one layer the loop calls in every iteration
        blocks = [f'PIPELINE_BLOCKS = "{stages.trunk.container}"  # one layer a loop calls again and again, its '
                  "weights shared: every stage holds it (SHARED_PARAMETERS)",
                  f"STAGE_BLOCKS = {{{', '.join(f'{s}: {stages.block_ranges[s]}' for s in mine)}}}  "
                  f"# per stage, the iterations of that loop it runs",
                  f"PIPELINE_ITERATIONS = {len(stages.trunk.blocks)}  # the loop's iterations in all"]
    else:
        blocks = [f'PIPELINE_BLOCKS = "{stages.trunk.container}"',
                  f"STAGE_BLOCKS = {{{', '.join(f'{s}: {stages.block_ranges[s]}' for s in mine)}}}  "
                  f"# blocks of {stages.trunk.container} per stage"]
        if stages.trunk.iterations:
            blocks.append(f"PIPELINE_ITERATIONS = {len(stages.trunk.blocks)}  # the loop runs one block of "
                          f"{stages.trunk.container} per iteration: each stage keeps the whole list (the others' "
                          "blocks hollow) and runs the iterations of its own")
    lines = ["", "", f"# --- pipeline: what this rank runs ({table}; stages balanced by the cost model) ---",
             blocks[0],
             f"PIPELINE_STAGE_COUNT = {stages.stages}",
             f"PIPELINE_LENGTH = {stages.per_pipeline}  # stages of one pipeline; stage s runs model stage "
             f"s % {stages.per_pipeline}",
             f"STAGE_RANKS = {[stages.rank_of(s) for s in range(stages.stages)]}  # the pipeline rank of each stage",
             f"PIPELINE_REPLICAS = {replicas}  # pipeline ranks holding the same model stages: gradients summed",
             f"PIPELINE_STAGES = {mine}  # the stages this rank runs",
             *blocks[1:],
             f"STAGE_DROPS = {{{', '.join(f'{s}: {stages.drop[s]}' for s in mine)}}}  # modules other stages hold",
             f"TIED_PARAMETERS = {tied}  # held by the first and last stage; gradients summed"
             if not stages.tied_ranks else f"TIED_PARAMETERS = {tied}  # held by several stages; gradients summed",
             *([f"TIED_RANKS = {stages.tied_ranks}  # the pipeline ranks holding them"] if stages.tied_ranks else []),
             *([f'PIPELINE_CUT_OWNER = "{stages.trunk.owner}"  # whose call of the cut function is cut; its '
                "class's other calls run whole"] if stages.trunk.owner is not None and not stages.chain else []),
             *([f"STAGE_SHADOWS = {{{', '.join(f'{s}: {stages.shadow[s]}' for s in mine)}}}  "
                "# run by code above the cut function on every stage; trained on the stage that owns them"]
               if any(stages.shadow.get(s) for s in mine) else []),
             *([f"SHARED_PARAMETERS = {shared}  # of modules every stage runs and computes with: trained "
                "on every stage, gradients summed over the pipeline"] if shared else []),
             *([f"PIPELINE_PASSES = {stages.trunk.recycle.passes}  # forwards per micro-batch (recycling): "
                "all but the last without gradient, SFMrC = pass C"] if stages.trunk.recycle is not None else []),
             *([f"VOCAB_MODULES = {stages.vocab_modules}  # split on the vocabulary over every tp x pp device",
                f"VOCAB_STAGES = {stages.vocab_stages}  # stages calling them: each call is a step of every rank "
                "(sEk, sGk)",
                f"VOCAB_CALLS = {stages.vocab_calls}  # their calls in one step of each such stage",
                f"VOCAB_DEFERRED = {deferred}  # backward calls (embeddings) whose steps run after the B, "
                "from the output gradient it keeps"]
               if stages.vocab_modules else []),
             *([f"VOCAB_LOSSES = {stages.vocab_heads}  # heads whose step is their cross entropy's "
                "(vocab_cross_entropy): no logits formed or moved"] if stages.vocab_heads else []),
             f'SCHEDULE = "{" ".join(map(str, orders[pp_rank]))}"  # this rank\'s order']
    return "\n".join(lines) + "\n"


def _statement_lines(stages: StagePlan) -> dict[int, tuple[int, int]]:
    """Per stage, the first and last line of the statements it runs (a chain of statements)."""
    labels = [int(b.rpartition(":")[2]) for b in stages.trunk.blocks]
    end = stages.trunk.function_span.end_line
    return {s: (labels[a], labels[b] - 1 if b < len(labels) else end)
            for s, (a, b) in enumerate(stages.block_ranges)}


def _roles(stages: StagePlan, stage: int) -> dict:
    return {owner: (r.role, r.first, r.stop, r.hands_on) for owner, r in stages.roles[stage].items()}


def _schedule_comment(orders: list[list[Action]], table: str, micro: int) -> str:
    lines = [f"# Pipeline schedule {table}: {len(orders)} ranks x {micro} micro-batches; "
             "SF M = stage S forward (F) or backward (B) of micro-batch M"]
    if any(a.cycle is not None for order in orders for a in order):
        lines[0] += "; SFMrC = its pass C of the recycling loop, without gradient (F alone: the last pass)"
    if any(a.kind in "EG" for order in orders for a in order):
        lines[0] += ("; SEM / SGM = the vocabulary step (every rank: its rows of the vocabulary) of the first call of "
                     "a vocabulary-split module in stage S's forward / backward of micro-batch M, SEMcC of its call C; "
                     "the owner runs it inside its SFM / SBM, where the step makes the call")
    lines += [f"#   rank {r}: {' '.join(map(str, order))}" for r, order in enumerate(orders)]
    return "\n".join(lines) + "\n"


def render(analysis: Analysis, plan: Plan, edits: Edits | None, source_label: str,
           stages: StagePlan | None = None, orders: list[list[Action]] | None = None,
           request: PlanRequest | None = None, mirror_bases: dict[str, tuple[str, str]] | None = None
           ) -> dict[str, str]:
    """The output's files by path. A model in several files also fills `mirror_bases`."""
    entry = analysis.entry
    entry_path = entry.path
    model_paths = model_files(analysis.trace.own_files, entry_path)
    empty = Edits("tp", 1, {}, {}, {}, [])
    split, chain = None, ()
    if stages is not None and stages.chain:
        chain = tuple({t.function_span: StageSplit(t.function_span, t.loop_index, t.handoff, t.container,
                                                   unset=tuple(t.unset), chained=True, iterations=t.iterations)
                       for t in stages.chain}.values())     # T5: one stack class's method loops over both lists
    elif stages is not None:
        trunk = stages.trunk
        split = StageSplit(trunk.function_span, trunk.loop_index, trunk.handoff, trunk.container, trunk.owner is not None,
                           trunk.recycle.loop if trunk.recycle else None,
                           tuple(trunk.recycle.carried) if trunk.recycle else (), tuple(trunk.unset),
                           tuple(trunk.replays),
                           recycle_after=trunk.recycle is not None and trunk.recycle.after is not None,
                           hoist=trunk.hoist, iterations=trunk.iterations)
        if trunk.statements is not None:    # the body indices where stages 1, 2, ... start, what crosses each
            cuts = [trunk.statements.starts[a] for a, _ in stages.block_ranges[1:stages.per_pipeline]]
            split.cuts = tuple((k, tuple(trunk.statements.crossing[k])) for k in cuts)
            branch = trunk.statements.branch
            if branch is not None:      # its `if`, by file and line, for the guard's error
                where = analysis.sources.get(trunk.function_span.path).span_of(trunk.function.body.body[branch.index])
                split.branch, split.branch_at = branch, f"{Path(where.path).name}:{where.line}"
    loops = [c.function for c in chain] + ([split.function] if split is not None else [])
    files_read = {str(analysis.sources.get(p).path) for p in [*model_paths, entry_path]}
    outside = next((span for span in loops if span.path not in files_read), None)
    if outside is not None:
        raise UserError("the loop over the blocks is in none of the model's files", outside.start,
                        hint="pipelines cut the file that holds the block loop")
    recompute = restored_buffers(analysis.graph, recompute_sites(analysis.graph)) \
        if request is not None and request.recompute else {}

    grouped = tuple(instance_groups(analysis.graph).methods) if edits is not None and edits.groups else ()
    classes: dict[str, str] = {}        # instance -> its variant class (emit/variants.py)

    def rewritten(path, in_program=True):
        module, ctx = rewrite_module(analysis.sources.get(path), edits or empty, split, analysis.trace.containers,
                                     recompute, chain, in_program,
                                     mixed_lines(analysis.graph) if grouped else analysis.trace.mixed_containers,
                                     analysis.trace.unsliceable_containers, grouped)
        classes.update(ctx.instance_classes)
        return module, ctx

    mirrored: dict[str, str] = {}
    traced_library = any(module_name_of(p) in analysis.rules.traced_module_names for p in model_paths)
    variant_imports: dict[str, list[str]] = {}      # mirror module -> the variant classes it defines
    if len(model_paths) > 1 or traced_library:  # a model in several files: mirrors, the entry as the program
        module, ctx = rewritten(entry_path)
        module = insert_variants(module, ctx.variants)
        module, mirrored, bases = _mirrored(analysis, module, {str(p): rewritten(p, False) for p in model_paths},
                                            variant_imports)
        if mirror_bases is not None:
            mirror_bases.update(bases)
    else:
        module, ctx = rewritten(model_paths[0] if model_paths else entry_path)
        if model_paths:     # the entry's own classes (a model around imported blocks) are rewritten too;
            # the block loop may be theirs
            name, source = module_name_of(model_paths[0]), analysis.sources.get(model_paths[0])
            imported = []
            if name is not None:
                module, imported = library_decorated(source.module, module, name)
            module = insert_variants(module, ctx.variants)
            kept = {resolved(str(source.path)): [statement_lines(source, stmt) for index, stmt in enumerate(source.module.body)
                                                 if index not in imported]}
            entry_module, entry_ctx = rewritten(entry_path)
            entry_module = insert_variants(entry_module, entry_ctx.variants)
            ctx.used |= entry_ctx.used
            ctx.needs_torch |= entry_ctx.needs_torch
            module = merge_entry(module, model_paths[0], entry_module, entry_path, analysis.entry,
                                 built_by_code_kept(kept, set(kept), analysis.sources))
        else:
            module = insert_variants(module, ctx.variants)
    after_build = edits.split_after_build if edits is not None else {}
    if after_build:
        ctx.used |= {"split_after_build", edits.axis.upper()}
    if classes:
        ctx.used.add("instance_classes")
    module = add_comm_import(module, ctx.used, ctx.needs_torch)
    built_at = sorted({f"{display_path(info.ctor_span.path)}:{info.ctor_span.line}"
                       for name, info in analysis.trace.params.items()
                       if name in after_build and info.ctor_span is not None})
    body = module.code + split_after_build_section(after_build, built_at, edits.axis.upper() if edits else "") + \
        instance_classes_section(classes, variant_imports)
    files: dict[str, str] = {}
    micro = len([a for a in orders[0] if a.kind == "F" and a.cycle is None]) * (stages.stages // stages.per_pipeline) // stages.virtual \
        if orders else 0     # each micro-batch runs through one of the pipelines
    for program in programs(plan, stages):     # peers running the same code share one file
        text = body
        if stages is not None:
            table = request.schedule if request else "schedule"
            text = _schedule_comment(orders, table, micro) + body + _pipeline_section(
                stages, orders, program.pp_rank, table)
        files[program.file] = with_header(
            text, f"from {source_label}; plan {plan.describe()}; {program.describe(plan.world_size)}")
    for name, text in mirrored.items():
        files[name] = with_header(text, f"from {source_label}; plan {plan.describe()}; mirror of {name}")
    if orders is not None:
        files["schedule.csv"] = to_csv(orders)
    comm = COMM_SOURCE.read_text()
    files["_comm.py"] = with_header(comm, "(named collectives; torch only)")
    tp, dp, pp = plan.mesh["tp"], plan.mesh["dp"], plan.mesh.get("pp", 1)
    splits = ""
    if edits is not None:
        for name, info in analysis.trace.params.items():
            layout = edits.param_layout.get(name)
            if layout is not None and layout.kind == "S":
                splits += "".join(f"    {alias!r}: ({layout.dim}, {layout.groups}),\n" for alias in info.aliases)
        for name, layout in edits.buffer_layout.items():
            splits += f"    {name!r}: ({layout.dim}, {layout.groups}),\n"
        # keys a module's state_dict() hooks save in place of its parameters (a fused wqkv as wq, wk, wv)
        for key, (dim, groups) in hooked_key_splits(analysis, edits.param_layout, edits.n).items():
            splits += f"    {key!r}: ({dim}, {groups}),\n"
    aliases = "".join(f"    {alias!r}: {sorted(info.aliases)!r},\n" for info in analysis.trace.params.values()
                      if len(info.aliases) > 1 for alias in sorted(info.aliases))
    title = f"Parallel version of {source_label}: plan {plan.describe()}."
    partial = ", ".join(repr(a) for p in (edits.partial_grad_params if edits else [])
                        for a in analysis.trace.params[p].aliases)
    training = templates.training_api(partial=partial, loss=loss_reduction(analysis.graph),
                                      zero=request.zero if request else 0, micro=micro if stages is not None else None,
                                      precision=request.precision if request else None,
                                      micro_statistics=bool(stages.micro_statistics if stages is not None
                                                            else plan.micro_statistics),
                                      accumulate=_micro_batches(request) if request and stages is None else 1)
    files["__init__.py"] = with_header(templates.INIT.format(title=title, world=plan.world_size, tp=tp, dp=dp,
                                                             pp=pp, splits=splits, aliases=aliases,
                                                             vocab_splits=stages.vocab_params if stages else [],
                                                             programs=[p.name for p in programs(plan, stages)],
                                                             training=training),
                                       f"from {source_label}")
    files["train.py"] = with_header(templates.TRAIN.format(source=source_label, plan=plan.describe(),
                                                           world=plan.world_size, folder="<this folder>"),
                                    f"from {source_label}")
    plan_json = {"generated_by": f"nnscaler-rewrite {__version__}", "source": source_label, **plan.to_json(),
                 "file_hashes": {n: content_hash(t) for n, t in files.items() if not n.endswith(".py")}}
    files["plan.json"] = generated_json(plan_json)
    for name, text in files.items():
        if name.endswith(".py"):
            cst.parse_module(text)   # the output must be valid Python; fail before writing
    return files


def _mirrored(analysis: Analysis, entry_module: cst.Module,
              rewritten: dict[str, tuple[cst.Module, object]], variant_imports: dict[str, list[str]]
              ) -> tuple[cst.Module, dict[str, str], dict[str, tuple[str, str]]]:
    """A model in several files: the entry's code as the program, importing from the mirrors; the
    mirrors of its files (emit/mirrors.py) and the package files between them, by output path;
    and per mirror, its source file and the same definitions before the rewrite (for --diff).
    Fills `variant_imports`: per mirror module, the variant classes (emit/variants.py) it defines."""
    sources = {resolved(p): (analysis.sources.get(p), module) for p, (module, _) in rewritten.items()}
    contexts = {resolved(p): ctx for p, (_, ctx) in rewritten.items()}
    model_classes = {construction.cls for construction in analysis.entry.constructions.values()}
    # lines that ran: traced ops, the calls that built the modules and the calls on the way to them
    # (a helper that calls a rewritten constructor helper must be the mirror's too)
    traced: dict[str, set[int]] = {}
    for node in analysis.trace.nodes:
        if node.span is not None:
            traced.setdefault(resolved(node.span.path), set()).add(node.span.line)
    for construction in analysis.entry.constructions.values():
        if construction.file is not None:
            traced.setdefault(resolved(construction.file), set()).add(construction.line)
        for file, line in construction.route:
            traced.setdefault(file, set()).add(line)
    mirrors = plan_mirrors(sources, model_classes, traced)
    files: dict[str, str] = {}
    bases: dict[str, tuple[str, str]] = {}
    defined: dict[str, tuple[object, str, str]] = {}
    kept_lines: dict[str, list[tuple[int, int]]] = {}
    for mirror in mirrors:
        path = resolved(str(mirror.source.path))
        ctx = contexts[path]
        files[mirror.out_name] = render_mirror(mirror, mirrors, ctx.used, ctx.needs_torch, variants=ctx.variants)
        kept_classes = {mirror.source.module.body[i].name.value for i in mirror.members
                        if isinstance(mirror.source.module.body[i], cst.ClassDef)}
        for cls, classes in ctx.variants.items():
            if cls in kept_classes:
                variant_imports.setdefault("." + mirror.out_name[:-3].replace("/", "."), []).extend(
                    c.name.value for c in classes)
        bases[mirror.out_name] = (display_path(mirror.source.path), render_mirror(mirror, mirrors, set(), False,
                                                                                  original=True))
        library = sys.modules[mirror.module_name]
        for index in mirror.members:
            stmt = mirror.source.module.body[index]
            kept_lines.setdefault(path, []).append(statement_lines(mirror.source, stmt))
            if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and stmt.name.value not in defined:
                obj = getattr(library, stmt.name.value, None)
                if obj is not None:
                    defined[stmt.name.value] = (obj, "." + mirror.out_name[:-3].replace("/", "."), mirror.out_name)
        folder = Path(mirror.out_name).parent
        while str(folder) != ".":
            files.setdefault(f"{folder.as_posix()}/__init__.py",
                             f'"""The package of the mirrored files below {folder.as_posix()}/ (see model.py)."""\n')
            folder = folder.parent

    program = merge_entry_mirrored(entry_module, analysis.entry.path, analysis.entry, defined,
                                   built_by_code_kept(kept_lines, set(sources), analysis.sources))
    return program, files, bases


def _micro_batches(request: PlanRequest) -> int:
    """How many pieces each data-parallel rank's batch runs in (without a pipeline: gradient
    accumulation's, 1 unless --micro-batches)."""
    if request.pp < 2:
        return request.micro_batches or 1
    return request.micro_batches or request.pp * load_schedule(request.schedule).virtual_stages


def _split_micro_batches(analysis: Analysis, plan: Plan, micro: int) -> bool:
    """`micro` micro-batches must divide each data-parallel rank's batch; BatchNorm then normalises
    each by its own statistics, and a buffer the forward writes is written once per micro-batch
    (warned; verify compares with a single device accumulating alike). Whether any does."""
    batch = (analysis.trace.batch_size or 1) // plan.mesh["dp"]
    if batch % micro:
        raise UserError(f"a batch of {batch} per data-parallel rank does not split into {micro} micro-batches",
                        _inputs_location(analysis), hint="choose --micro-batches dividing the batch")
    if micro < 2:
        return False
    normalising = micro_batch_statistics(analysis.graph, f"{micro} micro-batches")
    statistics = {node.index for node in normalising}     # (BatchNorm's count of batches: warned above)
    written = {index: names for index, names in buffers_written(analysis.graph).items() if index not in statistics}
    plan.warnings += statistics_warnings(normalising, micro) + buffer_write_warnings(analysis.graph, written, micro)
    return bool(normalising or written)


def plan_accumulation(analysis: Analysis, plan: Plan, request: PlanRequest) -> None:
    """Gradient accumulation (--micro-batches M, no pipeline), micro-batches as a pipeline's."""
    plan.micro_statistics = _split_micro_batches(analysis, plan, _micro_batches(request))


def plan_pipeline(analysis: Analysis, plan: Plan, request: PlanRequest) -> tuple[StagePlan, list[list[Action]]]:
    """Stages as op_assign, the schedule as op_order; simulated before anything is written."""
    table = load_schedule(request.schedule)
    place = placement(table, request.pp)
    stages = stages_to_rewrite(analysis.graph, request.pp, table.virtual_stages, request.stage_cuts, place,
                               table.recycling)
    passes = stages.trunk.recycle.passes if stages.trunk.recycle is not None else 1
    micro = _micro_batches(request)
    stages.micro_statistics = _split_micro_batches(analysis, plan, micro)
    tp = plan.mesh.get("tp", 1)
    if table.vocab:       # interlaced: the embedding split over all tp x pp devices, its calls steps of their own
        interlaced.apply(analysis.graph, stages, table, tp)
        orders = interlaced.orders(table, request.pp, micro, place, stages.vocab_steps, stages.stage_seconds)
    else:
        orders = schedule(table, request.pp, micro, passes)
    simulate(orders, stages.stages, placement=place, passes=passes, vocab=stages.vocab_steps)
    plan.name += f"+{table.name}"
    plan.mesh["pp"] = request.pp
    for index, model_stage in stages.node_stage.items():
        node = analysis.graph.nodes[index]
        if node.span is not None:
            where = node.span.label
            for stage in stages.replicas(model_stage):     # one piece per pipeline holding it
                assign = OpAssign(where, "pp", stage, plan.devices_of("pp", stages.rank_of(stage)))
                if assign not in plan.assign:
                    plan.assign.append(assign)
    for rank, order in enumerate(orders):
        for before, after in zip(order, order[1:]):
            plan.order.append(OpOrder(str(before), str(after), rank))
    for node in interlaced.vocab_calls(analysis.graph, stages.vocab_modules):   # interlaced: n = |D| pieces
        trans = OpTrans(node.span.label, node.callee, "tp*pp", "vocab", request.pp * tp) if node.span else None
        if trans is not None and trans not in plan.trans:
            plan.trans.append(trans)      # piece p * tp + t on the device at pipeline index p, tp index t
            plan.assign += [OpAssign(node.span.label, "tp*pp", p * tp + t,
                                     tuple(sorted(set(plan.devices_of("pp", p)) & set(plan.devices_of("tp", t)))))
                            for p in range(request.pp) for t in range(tp)]
    for name in stages.vocab_params:
        for pname, info in analysis.trace.params.items():
            if name in info.aliases and pname in plan.params:
                plan.params[pname]["pp"] = "S0"        # rows of the vocabulary, one share per device of tp x pp
    return stages, orders


def rewrite(analysis: Analysis, request: PlanRequest, every_size_read: bool = False,
            whole_params: tuple[str, ...] = (), replan: bool = True) -> Rewrite:
    """Plan, edit, render, and dry-run. A size the source reads into a name (`B, T, C = x.shape`)
    is taken as local where it is used, which holds for most models; when the dry run of that
    plan fails, the plan is solved again with every such tensor dim kept whole. Parameters the
    plan splits but the source cannot build split (library code at construction pads a tied
    bias to its weight's whole vocabulary; one constructor call builds layers split unalike)
    are kept whole in a plan solved again, once, with a warning."""
    request = resolve_auto(analysis, request)
    plan, tp_plan = build_plan(analysis, request, every_size_read, whole_params)
    stages = orders = None
    if request.pp > 1:
        stages, orders = plan_pipeline(analysis, plan, request)
    else:
        plan_accumulation(analysis, plan, request)
    choices = choices_from_plan(analysis.graph, plan, "tp",     # the rewrite reads the plan IR only
                                batch_slices=plan.mesh["dp"] * _micro_batches(request),
                                every_size_read=every_size_read)
    fused = request.sequence_parallel if request.plan == "auto" else any(
        load_table(name).fused_collectives for name in _table_names(request, plan.mesh["tp"], plan.mesh["dp"]))
    with fused_collectives(fused):
        try:
            edits = plan_edits(analysis.graph, choices, strict=not plan.name.startswith("auto")) \
                if choices is not None else None
        except UserError as error:
            if not replan or not getattr(error, "misshapen_params", None):
                raise
            return _planned_again(analysis, request, every_size_read, error)
    if choices is None and plan.coshard_stand_in is not None:      # --tp 1: C pieces on the one device
        edits = one_device_edits(analysis.graph, plan.coshard_stand_in)
    if plan.mesh["dp"] > 1:
        edits = data_parallel_edits(analysis.graph, edits)
    if stages is not None and stages.vocab_losses:     # interlaced: a head fused with its cross entropy
        edits = vocab_loss_edits(analysis.graph, stages.vocab_losses, edits)
    if edits is not None:
        plan.warnings += edits.warnings
    label = display_path(analysis.entry.path)
    mirror_bases: dict[str, tuple[str, str]] = {}
    files = render(analysis, plan, edits, label, stages, orders, request, mirror_bases)
    try:
        plan.warnings += dry_run(analysis, files).warnings    # ladder step 2: the emitted code runs, unwritten
    except UserError as error:
        # parameters whose constructor the edits did divide, and something else resized; or whose
        # layer-building helper's call they divided, in code the installed library ran instead
        # (a method of a class build() constructs by a route the output cannot name)
        misshapen = [name for name in getattr(error, "misshapen_params", ())
                     if edits is not None and ({analysis.trace.params[name].ctor_span,
                                                analysis.trace.params[name].ctor_caller} & set(edits.ctors))]
        if not misshapen and getattr(error, "in_build", False) and edits is not None and edits.split_after_build:
            # build() ran the model (a lazy layer's first call, a warm-up) while the layers cut
            # after build() were still whole
            misshapen = sorted(name for name in edits.split_after_build if name in analysis.trace.params)
            error.why_whole = ("build() runs the model, before the layers it builds whole (torch's lazy layers, "
                               "sized by their first call) are cut to each rank's share")
        if misshapen:
            error.misshapen_params = misshapen
            if not replan:
                raise
            return _planned_again(analysis, request, every_size_read, error)
        if every_size_read or choices is None or not splits_a_read_size(analysis.graph, choices.node_choice):
            raise
        return rewrite(analysis, request, every_size_read=True, whole_params=whole_params, replan=replan)
    return Rewrite(plan, tp_plan, edits, files, stages, orders, mirror_bases)


MAX_REPLANS = 4   # plans solved again, each keeping whole what the last one's failure named


def _planned_again(analysis: Analysis, request: PlanRequest, every_size_read: bool, error: UserError) -> Rewrite:
    """The rewrite with the parameters `error` names (misshapen_params: built at another size than
    the plan's, or by one constructor call the plan splits unalike) kept whole, each with the
    others its constructor call builds (a Linear's bias whole means its weight's rows whole);
    a plan solved so may fail on the next such parameter (one initializer after another), up to
    MAX_REPLANS times. `error`, the first failure, where no plan keeps them whole."""
    params = analysis.trace.params
    kept: set[str] = set()
    failure = error
    for _ in range(MAX_REPLANS):
        calls = {(params[n].ctor_span, n.rpartition(".")[0]) for n in getattr(failure, "misshapen_params", ())}
        named = {n for n, info in params.items() if (info.ctor_span, n.rpartition(".")[0]) in calls}
        if named <= kept:
            break
        kept |= named
        try:
            again = rewrite(analysis, request, every_size_read, whole_params=tuple(sorted(kept)), replan=False)
        except UserError as later:
            failure = later
            continue
        first = sorted(kept)[0]
        more = f" (and {len(kept) - 1} more)" if len(kept) > 1 else ""
        why = getattr(failure, "why_whole", None) or getattr(error, "why_whole", None) or error.message
        again.plan.warnings.append(f"{error.location}: warning: {first}{more} stays whole on every tensor-parallel "
                                   f"rank: the plan that split it could not be written ({why})")
        return again
    raise error


def _kept_whole(analysis: Analysis, params: tuple[str, ...], constraints: list[Constraint]) -> list[Constraint]:
    """op-trans on the tensor-parallel axis: ops reading these parameters do not split them, and
    the other constraints (a table's "split every matrix") leave those ops be."""
    if not params:
        return constraints
    info = analysis.trace.params[params[0]]
    where = info.ctor_span.start if info.ctor_span is not None else Location(display_path(analysis.entry.path))
    others = [dataclasses.replace(c, select={**c.select, "except_params": list(params)}) for c in constraints]
    return others + [Constraint("built-whole", where, "tp", {"params": list(params)}, forbid="splitting-params")]
