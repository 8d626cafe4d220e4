"""`--plan auto --devices N`: one search over every way to run the model on N devices.

The space: tensor parallel size tp (each op's split solved per tp by search.search_axis, once,
as the free search and as Megatron's sequence-parallel table), pipeline stages pp (blocks cut
into contiguous stages the way plan/pipeline.py cuts them), data parallel dp = N / (tp pp),
micro-batches per step, the ZeRO stage of the data-parallel state, and activation recompute
per block. Every configuration is priced with the cost model (plan/cost.py) and the memory
model per device (plan/memory.py) and the fastest one that fits the memory budget wins.

Two levels, as the splits do not depend on the rest: an op's split is chosen once per tp
(and variant); a configuration's step is then arithmetic on per-block sums of what that split
costs, so thousands of configurations cost milliseconds. Repeated blocks are priced once.

The step of a configuration, per micro-batch of B / (dp M) samples on stage s:
  t_s = its ops' forward and backward (compute and tensor-parallel collectives: bandwidth terms
        scale with the micro-batch, latency and per-call overheads do not)
        + with recompute, its blocks' forward again + its sends to the next and previous stage
  step = sum_s t_s + (M - 1) max_s t_s                      (1F1B: fill, steady state, drain)
         (a trunk run in a recycling loop pipelines under 3F1B: t_s holds every pass, the
         no-gradient ones as forwards alone, and the same formula prices it)
         + max_s (gradient sync over dp and of partial tensor-parallel gradients + optimizer)
Memory per device, the worst stage: parameters, gradients and AdamW state of its stage (ZeRO
shards them over dp), plus min(pp - s, M) micro-batches of activations (recompute keeps each
block's inputs only, and rebuilds one block at a time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


from ..errors import UserError
from ..graph.graph import Graph
from ..materialize.conversions import conversion, conversion_time, fused_collectives
from ..sizes import format_bytes
from .batch import batch_labels, batch_split_problem
from .cost import ClusterSpec, DeviceSpec, all_gather_time, all_reduce_time, node_time, node_flops, optimizer_time
from .layouts import REPLICATE, R
from .memory import saved_bytes
from .zero import state_bytes_per_device, units_in_flight
from .search import BYTES_PER_PARAM_STATE, AxisPlan, _layout, _search_cache, from_end, search_axis, site_id
from .tables import Constraint, load_table

VARIANTS = ("auto", "sequence_parallel")     # how each tensor-parallel size is solved
FORWARD_STEPS = {"reduce", "gather", "reduce_scatter", "all_gather"}   # collectives recompute runs again


@dataclass(frozen=True)
class Config:
    tp: int
    dp: int
    pp: int = 1
    micro_batches: int = 1
    zero: int = 0
    recompute: bool = False
    sequence_parallel: bool = False
    # the pipeline's order: 3f1b where the forward runs the trunk several times (recycling)
    schedule: str = "1f1b"

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"dp={self.dp}", f"pp={self.pp}"]
        if self.pp > 1:
            parts.append(f"micro-batches={self.micro_batches}")
            parts += [f"schedule={self.schedule}"] if self.schedule != "1f1b" else []
        parts += [f"zero={self.zero}"] if self.zero else []
        parts += ["recompute"] if self.recompute else []
        parts += ["sequence-parallel"] if self.sequence_parallel else []
        return " ".join(parts)

    def features(self) -> tuple:
        """Tie-break among equally fast plans: the one with less machinery."""
        return (self.pp, self.zero, self.recompute, self.sequence_parallel, self.tp, self.micro_batches)


@dataclass
class Estimate:
    config: Config
    seconds: float = math.inf
    memory: float = math.inf                  # bytes per device, the worst stage
    stage_seconds: list[float] = field(default_factory=list)     # per micro-batch
    stage_memory: list[float] = field(default_factory=list)
    pipeline_seconds: float = 0.0
    sync_seconds: float = 0.0                 # gradient sync and optimizer, the slowest stage
    why_not: str | None = None


@dataclass
class AutoChoice:
    best: Estimate
    tp_plan: AxisPlan | None
    candidates: list[Estimate]                # the best feasible estimate per (tp, pp), and refusals
    evaluated: int                            # configurations priced
    budget: float

    @property
    def config(self) -> Config:
        return self.best.config


def dp_only(graph: Graph, dp: int, cluster: ClusterSpec) -> tuple[float, float]:
    """Step time and memory per device of pure data parallelism."""
    tensors = graph.trace.tensors
    param_bytes = sum(tensors[p.tid].nbytes for p in graph.trace.params.values())
    activations = sum(saved_bytes(n, graph.trace) for n in graph.nodes)
    link = cluster.axis(1, dp)
    seconds = sum(node_time(n, graph.dims.get(n.index), graph.trace, link, dp, dims_of=graph.dims.get)
                  for n in graph.nodes) + (all_reduce_time(param_bytes, dp, link) if dp > 1 else 0.0)
    return seconds, param_bytes // 4 * BYTES_PER_PARAM_STATE + activations / dp


# ---------------------------------------------------------------------------------------------
# Blocks: where each op runs when the model is cut into stages
# ---------------------------------------------------------------------------------------------

@dataclass
class _Blocks:
    """The model's ops by region: 0 the prologue, 1..n the blocks, n + 1 the epilogue (code between
    blocks counts with the block before it), as plan_stages assigns them to stages."""

    count: int                          # blocks; 0 when the model has none to cut
    region: list[int]                   # node index -> region
    flops: list[float]                  # per block, what plan_stages balances
    prologue_flops: float
    epilogue_flops: float
    why_no_blocks: str | None = None
    recompute_problem: str | None = None
    input_bytes: float = 0.0            # a block's tensor inputs that need gradients (the hidden state)
    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # stages -> block ranges
    passes: int = 1                     # how often the forward runs the trunk (recycling: 3F1B)


def _blocks(graph: Graph) -> _Blocks:
    cache = _search_cache(graph)
    if "blocks" in cache:
        return cache["blocks"]
    from .pipeline import find_chain, find_recycle, find_trunk, node_blocks
    from .recompute import block_activations, recompute_site
    n = len(graph.nodes)
    try:
        trunk = find_trunk(graph)
    except UserError as exc:
        cache["blocks"] = _Blocks(0, [0] * n, [], 0.0, 0.0, exc.message, exc.message)
        return cache["blocks"]
    passes = graph.trace.module_runs.get(trunk.blocks[0], 1)
    if passes > 1:                          # a trunk run in a recycling loop pipelines under 3F1B;
        try:                                # one run again otherwise is refused per pp (_stages_problem)
            find_recycle(graph, trunk)
        except UserError:
            passes = 1
    chain = find_chain(graph) if passes == 1 else []     # an encoder's blocks, then a decoder's: one chain
    cut = [b for t in chain for b in t.blocks] if chain else trunk.blocks
    block_of = trunk.statements.block_of if trunk.statements is not None else node_blocks(graph, cut)
    first, last = (min(block_of), max(block_of)) if block_of else (0, 0)
    flops = [0.0] * len(cut)
    pro = epi = 0.0
    region = []
    current = 1
    for node in graph.nodes:
        cost = node_flops(node, graph.dims.get(node.index), graph.trace)
        if node.index in block_of:
            flops[block_of[node.index]] += cost
            current = block_of[node.index] + 1
            region.append(current)
        elif node.index < first:
            pro += cost
            region.append(0)
        elif node.index > last:
            epi += cost
            region.append(len(cut) + 1)
        else:
            region.append(current)
            if chain:                       # between two lists of a chain: with the block before, as
                flops[current - 1] += cost  # plan_stages balances them
    problem = None
    try:
        recompute_site(graph)
    except UserError as exc:
        problem = exc.message
    inputs = float(block_activations(graph).inputs) if problem is None else 0.0
    cache["blocks"] = _Blocks(len(cut), region, flops, pro, epi, None, problem, inputs, passes=passes)
    return cache["blocks"]


def _stage_ranges(blocks: _Blocks, stages: int) -> list[tuple[int, int]]:
    if stages not in blocks.ranges:
        from .pipeline import _balanced
        blocks.ranges[stages] = _balanced(blocks.flops, stages, blocks.prologue_flops, blocks.epilogue_flops)
    return blocks.ranges[stages]


# ---------------------------------------------------------------------------------------------
# What one tensor-parallel split costs, per region
# ---------------------------------------------------------------------------------------------

@dataclass
class _Regions:
    """Sums per region at the traced batch: seconds whose terms scale with the batch (bw) and
    those that do not (fx: latency, per-call overhead), the same for a forward alone (what
    recompute repeats), saved activation bytes per device, and the parameters each region uses
    (canonical name -> elements held by one device)."""

    bw: list[float]
    fx: list[float]
    forward_bw: list[float]
    forward_fx: list[float]
    saved: list[float]
    params: list[dict[str, float]]
    partial_seconds: list[float]        # all-reduce of partial tensor-parallel weight gradients, per step


def _split_devices(device: DeviceSpec) -> tuple[DeviceSpec, DeviceSpec]:
    """The device with only its bandwidth terms, and with only its fixed costs."""
    fast = math.inf
    bandwidth = replace(device, latency=0.0, matmul_overhead=0.0, op_overhead=0.0)
    fixed = replace(device, flops=fast, bandwidth=fast, memory_bandwidth=fast,
                    matmul_rates=tuple((d, fast) for d, _ in device.matmul_rates),
                    optimizer_seconds_per_param=0.0)
    return bandwidth, fixed


@dataclass
class _NodeFacts:
    """What pricing an op needs that no split changes, kept per graph."""

    key: tuple                          # (site, shapes, grad): ops with equal keys cost the same
    saved: float
    grad: bool                          # an output needs a gradient (not a no_grad recycling pass)
    params: list[tuple[str, float]]     # (canonical name, elements)
    operands: list[tuple]               # (name, rank, nbytes, requires_grad, producer node, output k)
    # the same, interned for _regions' keys: `key` and each operand without its producer's choice
    # as small ints (equal ints exactly when the tuples are equal), with the producer node
    key_id: int = 0
    operand_ids: tuple = ()             # per operand: (id, producer node or None)


def _node_facts(graph: Graph) -> list[_NodeFacts]:
    cache = _search_cache(graph)
    if "node_facts" not in cache:
        tensors = graph.trace.tensors
        producer = {tid: (node.index, k) for node in graph.nodes for k, tid in enumerate(node.outputs)}
        sites: dict = {}
        facts = []
        for node in graph.nodes:
            site = sites.setdefault(site_id(graph, node.index), len(sites))
            shapes = (tuple((tensors[t].shape, tensors[t].dtype) for t in node.inputs),
                      tuple(tensors[t].shape for t in node.outputs))
            grad = not node.outputs or any(tensors[t].requires_grad for t in node.outputs)
            operands = []
            for operand in node.operands:
                if operand.tid is None or tensors[operand.tid].param is not None:
                    continue
                info = tensors[operand.tid]
                u, k = producer.get(operand.tid, (None, None))
                operands.append((operand.name, len(info.shape), info.nbytes, info.requires_grad, u, k))
            facts.append(_NodeFacts((site, shapes, grad), saved_bytes(node, graph.trace), grad,
                                    [(tensors[tid].param, tensors[tid].nbytes / 4)
                                     for _, tid in graph.param_operands(node.index)], operands))
        interned: dict[tuple, int] = {}
        for fact in facts:
            fact.key_id = interned.setdefault(("key", fact.key), len(interned))
            fact.operand_ids = tuple(
                (interned.setdefault((o[:4], facts[o[4]].key[0], o[5]), len(interned)), o[4]) if o[4] is not None
                else (interned.setdefault(("input", o), len(interned)), None) for o in fact.operands)
        cache["node_facts"] = facts
        cache["producers"] = producer
    return cache["node_facts"]


def _regions(graph: Graph, blocks: _Blocks, tp_plan: AxisPlan | None, n: int, device: DeviceSpec) -> _Regions:
    trace = graph.trace
    tensors = trace.tensors
    count = blocks.count + 2
    out = _Regions([0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count,
                   [dict() for _ in range(count)], [0.0] * count)
    bw_dev, fx_dev = _split_devices(device)
    choice = tp_plan.node_choice if tp_plan is not None else {}
    layouts = tp_plan.param_layout if tp_plan is not None else {}
    facts = _node_facts(graph)
    priced: dict[tuple, tuple[float, float, float, float]] = {}
    converted: dict[tuple, tuple[float, float, float, float]] = {}
    split = n > 1 and tp_plan is not None

    def convert(have, need, split: bool, grad: bool, nbytes: float) -> tuple[float, float, float, float]:
        key = (have, need, split, grad, nbytes)
        if key not in converted:
            steps = conversion(have, need, consumer_split=split, requires_grad=grad) or []
            forward = [s for s in steps if s.op in FORWARD_STEPS]
            converted[key] = tuple(conversion_time(chosen, nbytes, n, dev)
                                   for chosen in (steps, forward) for dev in (bw_dev, fx_dev))
        return converted[key]

    def price(node, fact: _NodeFacts, label: str, ways: int) -> tuple[float, float, float, float]:
        """The op's compute and the conversions of its operands, forward and backward and forward alone."""
        index = node.index
        dims = graph.dims.get(index)
        total = [node_time(node, dims, trace, dev, ways, dims_of=graph.dims.get, forward_only=fwd)
                 for fwd in (False, True) for dev in (bw_dev, fx_dev)]
        if split:
            wanted = _layout(graph, index, label)
            for name, rank, nbytes, requires_grad, u, k in fact.operands:
                if name not in wanted.inputs:
                    continue
                need = from_end(wanted.inputs[name], rank)
                if u is None:
                    have = R
                else:
                    outs = _layout(graph, u, choice.get(u, REPLICATE)).outputs
                    have = from_end(outs[k], len(tensors[graph.nodes[u].outputs[k]].shape)) if k < len(outs) else R
                for j, cost in enumerate(convert(have, need, wanted.split, requires_grad, nbytes)):
                    total[j] += cost
        return tuple(total)

    bw, fx, forward_bw, forward_fx, saved = out.bw, out.fx, out.forward_bw, out.forward_fx, out.saved
    for node, fact in zip(graph.nodes, facts):
        index = node.index
        region = blocks.region[index]
        label = choice.get(index, REPLICATE)
        ways = n if label != REPLICATE else 1
        # a repeated block's op costs what its first instance cost: same site, shapes, split and producers
        key = (fact.key_id, label, tuple((o, choice.get(u, REPLICATE)) if u is not None else o
                                         for o, u in fact.operand_ids)) if split else (fact.key_id, label)
        costs = priced.get(key)
        if costs is None:
            costs = priced[key] = price(node, fact, label, ways)
        bw[region] += costs[0]
        fx[region] += costs[1]
        # recompute reruns a block for its backward: a no_grad recycling pass is never rerun (masks
        # inside a block, which it does rerun, are cheap and left out too)
        if 0 < region <= blocks.count and fact.grad:
            forward_bw[region] += costs[2]
            forward_fx[region] += costs[3]
        saved[region] += fact.saved / ways
        held = out.params[region]
        for param, elements in fact.params:
            layout = layouts.get(param)
            held[param] = elements / (n if layout is not None and layout.kind == "S" else 1)
    loss = trace.loss
    producer = _search_cache(graph)["producers"] if split and loss is not None else {}
    if loss in producer:
        u, k = producer[loss]
        outs = _layout(graph, u, choice.get(u, REPLICATE)).outputs
        steps = conversion(outs[k] if k < len(outs) else R, R, consumer_split=False, requires_grad=False) or []
        region = blocks.region[u]
        out.bw[region] += conversion_time(steps, tensors[loss].nbytes, n, bw_dev)
        out.fx[region] += conversion_time(steps, tensors[loss].nbytes, n, fx_dev)
    if tp_plan is not None:
        first_use = {}
        for node, fact in zip(graph.nodes, facts):
            for param, _ in fact.params:
                first_use.setdefault(param, blocks.region[node.index])
        for name in tp_plan.partial_grad_params:
            out.partial_seconds[first_use.get(name, 0)] += all_reduce_time(
                tensors[trace.params[name].tid].nbytes, n, device)
    return out


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Fixed:
    """What the user fixed on the command line; the search chooses the rest."""

    pp: int | None = None
    micro_batches: int | None = None
    zero: int | None = None
    recompute: bool | None = None
    sequence_parallel: bool | None = None


def search_auto(graph: Graph, devices: int, cluster: ClusterSpec, constraints: list[Constraint],
                memory_budget: float | None, *, fixed: _Fixed | None = None,
                variants: tuple[str, ...] = VARIANTS) -> AutoChoice:
    """The fastest configuration on `devices` whose every device fits the budget. `constraints`:
    the model's own annotations (tp axis); `fixed`: options the user gave, not searched."""
    fixed = fixed or _Fixed()
    budget = memory_budget if memory_budget is not None else cluster.memory
    batch = graph.trace.batch_size or 1
    mixing = batch_split_problem(graph, "data parallel")
    blocks = _blocks(graph)
    solved: dict[tuple[int, str, int], AxisPlan | UserError | None] = {}
    regions: dict[tuple[int, str, int], _Regions] = {}
    tables: dict[str, list[Constraint]] = {}

    # The split of each tp is solved for the batch sliced devices / tp ways (data parallelism
    # alone); the objective scales with the slicing, so the same split is the cheapest for any
    # other, as long as it still divides the batch. Where it does not (it splits some op's
    # batch dim), the split solved for one sample per micro-batch (no batch split) serves.
    def tp_plan(tp: int, variant: str, slices: int) -> AxisPlan | UserError | None:
        key = (tp, variant, slices)
        if key not in solved:
            if tp == 1:
                solved[key] = None
            else:
                try:
                    if variant not in tables:
                        tables[variant] = [] if variant == "auto" else load_table(variant).for_axis("tp")
                    table = tables[variant]
                    with fused_collectives(variant == "sequence_parallel"):
                        solved[key] = search_axis(graph, "tp", tp, table + constraints, cluster.axis(1, tp),
                                                  data_parallel=slices, explain=False)
                except UserError as exc:
                    solved[key] = exc
        return solved[key]

    def priced(tp: int, variant: str, slices: int) -> _Regions:
        key = (tp, variant, slices)
        if key not in regions:
            regions[key] = _regions(graph, blocks, solved[key], tp, cluster.axis(1, tp))
        return regions[key]

    estimates: list[Estimate] = []
    evaluated = 0
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            order = "3f1b" if pp > 1 and blocks.passes > 1 else "1f1b"
            config = Config(tp, dp, pp, schedule=order)
            why = _refusal(config, batch, mixing, blocks, fixed)
            if why:
                estimates.append(Estimate(config, why_not=why))
                continue
            for variant in (["auto"] if tp == 1 else [v for v in variants if _variant_allowed(v, fixed)]):
                base = math.gcd(devices // tp, batch)
                plan = tp_plan(tp, variant, base)
                if isinstance(plan, UserError):
                    estimates.append(Estimate(replace(config, sequence_parallel=variant == "sequence_parallel"),
                                              why_not=plan.message))
                    continue
                family = []
                for micro in _micro_batch_choices(batch // dp, pp, fixed):
                    if micro > 1 and mixing is not None:
                        continue
                    slices = dp * micro
                    key = (tp, variant, base)
                    if plan is not None and not _valid_for(graph, plan, tp, slices):
                        key = (tp, variant, batch)
                        if isinstance(tp_plan(*key), UserError):
                            continue
                    cost = priced(*key)
                    for zero in _zero_choices(dp, fixed):
                        for recompute in _recompute_choices(blocks, fixed):
                            evaluated += 1
                            family.append(_estimate(Config(tp, dp, pp, micro, zero, recompute,
                                                           variant == "sequence_parallel", order),
                                                    cost, blocks, batch, cluster, budget))
                feasible = [e for e in family if e.why_not is None]
                if feasible:
                    estimates.append(min(feasible, key=lambda e: (e.seconds, e.config.features())))
                elif family:
                    estimates.append(min(family, key=lambda e: (e.memory, e.seconds)))
    while True:
        feasible = [e for e in estimates if e.why_not is None]
        if not feasible:
            tried = sorted((e for e in estimates if e.memory < math.inf), key=lambda e: e.memory)[:4]
            refused = [e for e in estimates if e.memory == math.inf][:4]
            raise UserError(f"no plan on {devices} devices fits {format_bytes(budget)} per device: " +
                            "; ".join(f"{e.config.describe()}: {e.why_not}" for e in [*tried, *refused]),
                            hint="raise --memory-budget or use more devices")
        best = min(feasible, key=lambda e: (e.seconds, e.config.features()))
        problem = _stages_problem(graph, best.config.pp)
        if problem is None:
            break
        for e in estimates:             # the rewrite could not cut the model so: no configuration with this pp
            if e.config.pp == best.config.pp:
                e.why_not = problem
    chosen = best.config
    variant = "sequence_parallel" if chosen.sequence_parallel else "auto"
    plan = solved.get((chosen.tp, variant, math.gcd(devices // chosen.tp, batch))) if chosen.tp > 1 else None
    if plan is not None and not _valid_for(graph, plan, chosen.tp, chosen.dp * chosen.micro_batches):
        plan = solved[(chosen.tp, variant, batch)]
    return AutoChoice(best, plan, estimates, evaluated, budget)


def _stages_problem(graph: Graph, pp: int) -> str | None:
    """Why the rewrite would refuse to cut the model into `pp` stages (plan_stages' own checks:
    module state set in code only some stages run, blocks the forward runs more than once)."""
    if pp == 1:
        return None
    cache = _search_cache(graph).setdefault("stage_problems", {})
    if pp not in cache:
        from .pipeline import plan_stages
        try:
            plan_stages(graph, pp, recycling=_blocks(graph).passes > 1)
            cache[pp] = None
        except UserError as exc:
            cache[pp] = exc.message
    return cache[pp]


def _variant_allowed(variant: str, fixed: _Fixed) -> bool:
    if fixed.sequence_parallel is None:
        return True
    return (variant == "sequence_parallel") == fixed.sequence_parallel


def _refusal(config: Config, batch: int, mixing, blocks: _Blocks, fixed: _Fixed) -> str | None:
    if fixed.pp is not None and config.pp != fixed.pp:
        return f"--pp {fixed.pp} given"
    if fixed.sequence_parallel and config.tp < 2:
        return "--sequence-parallel needs tensor parallelism"
    if fixed.zero and config.dp < 2:
        return f"--zero {fixed.zero} needs data parallelism (dp > 1)"
    if batch % config.dp:
        return f"batch {batch} is not divisible by dp={config.dp}"
    if config.dp > 1 and mixing is not None:
        return f"{mixing.location}: {mixing.message}"
    if config.pp > 1:
        if blocks.why_no_blocks:
            return blocks.why_no_blocks
        if blocks.count < config.pp:
            return f"{blocks.count} blocks cannot fill {config.pp} pipeline stages"
    return None


def _micro_batch_choices(local_batch: int, pp: int, fixed: _Fixed) -> list[int]:
    if pp == 1:
        return [1]
    if fixed.micro_batches is not None:
        return [fixed.micro_batches] if local_batch % fixed.micro_batches == 0 else []
    return divisors(local_batch)


def _zero_choices(dp: int, fixed: _Fixed) -> list[int]:
    if fixed.zero is not None:
        return [fixed.zero]
    return [0, 1, 2, 3] if dp > 1 else [0]


def _recompute_choices(blocks: _Blocks, fixed: _Fixed) -> list[bool]:
    if fixed.recompute is not None:
        return [fixed.recompute] if not (fixed.recompute and blocks.recompute_problem) else []
    return [False, True] if blocks.recompute_problem is None else [False]


def _valid_for(graph: Graph, plan: AxisPlan, n: int, slices: int) -> bool:
    """Whether a split solved for one batch slicing still divides the batch sliced `slices` ways:
    only a split of an op's batch dim depends on it."""
    split = plan.__dict__.get("_batch_splits")
    if split is None:                     # the traced sizes of the batch dims the split divides
        choice = plan.node_choice
        split = plan.__dict__["_batch_splits"] = {size for index, (label, size) in _batch_sizes(graph).items()
                                                  if choice.get(index) == label}
    return all(size is not None and (size // slices) % n == 0 for size in split)


def _batch_sizes(graph: Graph) -> dict[int, tuple[str, int | None]]:
    """Each op's batch label and its traced size."""
    cache = _search_cache(graph)
    if "batch_sizes" not in cache:
        cache["batch_sizes"] = {index: (label, graph.dims[index].sizes().get(label))
                                for index, label in batch_labels(graph).items() if index in graph.dims}
    return cache["batch_sizes"]


@dataclass
class _Stages:
    """Per pipeline stage, sums over its regions (see _Regions), one list entry per stage."""

    bw: list[float]
    fx: list[float]
    forward_bw: list[float]             # its blocks' only
    forward_fx: list[float]
    saved: list[float]
    saved_outside_blocks: list[float]
    blocks: list[int]
    params: list[int]                   # elements one device holds
    partial_seconds: list[float]
    sends: list[int]                    # hand-offs per micro-batch: to the next stage and back to the previous
    after: list[int]                    # stages after this one: 1F1B keeps min(this + 1, M) micro-batches


def _stages(cost: _Regions, blocks: _Blocks, pp: int) -> _Stages:
    cache = cost.__dict__.setdefault("_stages", {})
    if pp in cache:
        return cache[pp]
    last = blocks.count + 1
    if pp == 1:
        layout = [(list(range(blocks.count + 2)), blocks.count)]
    else:
        layout = [(([0] if s == 0 else []) + list(range(a + 1, b + 1)) + ([last] if s == pp - 1 else []), b - a)
                  for s, (a, b) in enumerate(_stage_ranges(blocks, pp))]
    rows = []
    for regions, count in layout:
        inside = [r for r in regions if 0 < r < last]
        params: dict[str, float] = {}
        for r in regions:
            params.update(cost.params[r])
        rows.append((sum(cost.bw[r] for r in regions), sum(cost.fx[r] for r in regions),
                     sum(cost.forward_bw[r] for r in inside), sum(cost.forward_fx[r] for r in inside),
                     sum(cost.saved[r] for r in regions), sum(cost.saved[r] for r in regions if not 0 < r < last),
                     count, int(round(sum(params.values()))), sum(cost.partial_seconds[r] for r in regions)))
    columns = [list(c) for c in zip(*rows)]
    cache[pp] = _Stages(*columns, sends=[int(s < pp - 1) + int(s > 0) for s in range(pp)],
                        after=[pp - s for s in range(pp)])
    return cache[pp]


def _estimate(config: Config, cost: _Regions, blocks: _Blocks, batch: int, cluster: ClusterSpec,
              budget: float) -> Estimate:
    """The step time and peak memory per device of one configuration (the module docstring's
    formulas; the memory is plan/memory.py's device_memory, per stage at once).

    The search prices every (micro-batches, ZeRO, recompute) of a (tp, pp, dp): the per-stage
    time depends on the micro-batches and recompute only, the gradient sync and the state on
    ZeRO only, so each part is computed once and kept on `cost` (the same floating-point
    operations in the same order as pricing each configuration from scratch: same figures)."""
    dp, pp, micro, zero = config.dp, config.pp, config.micro_batches, config.zero
    parts = cost.__dict__.setdefault("_parts", {})
    timed = parts.get(("time", pp, dp, micro, config.recompute))
    if timed is None:
        timed = parts[("time", pp, dp, micro, config.recompute)] = _stage_times(config, cost, blocks, cluster)
    stage_seconds, activations, pipeline = timed
    synced = parts.get(("sync", pp, dp, zero))
    if synced is None:
        synced = parts[("sync", pp, dp, zero)] = _stage_state(config, cost, blocks, cluster)
    state, sync_most, hidden = synced
    if config.recompute:
        block_saved = _block_maxima(cost, blocks)[0]
        fraction = 1.0 / (dp * micro)
        recomputed = fraction * block_saved
        memory = [s + a + recomputed if n > 0 else s + a
                  for s, a, n in zip(state, activations, _stages(cost, blocks, pp).blocks)]
    else:
        memory = [s + a for s, a in zip(state, activations)]
    if zero >= 2:
        block = int(_block_maxima(cost, blocks)[1])
        memory = [m + sum(units_in_flight(zero, root, block))
                  for m, root in zip(memory, _outside_blocks(cost, blocks, pp))]
    stage_memory = [float(m) for m in memory]
    if pp == 1 and cluster.overlap:     # one backward a step: the output issues these from its hooks
        sync_most -= min(hidden, pipeline)
    estimate = Estimate(config, pipeline + sync_most, max(stage_memory), list(stage_seconds), stage_memory, pipeline,
                        sync_most)
    if estimate.memory > budget:
        estimate.why_not = f"needs {format_bytes(estimate.memory)} per device, budget {format_bytes(budget)}"
    return estimate


def _outside_blocks(cost: _Regions, blocks: _Blocks, pp: int) -> list[float]:
    """Per pipeline stage, the parameter elements one device holds outside the blocks (the
    prologue on the first stage, the epilogue on the last): ZeRO's root unit."""
    last = blocks.count + 1
    out = []
    for s in range(pp):
        params: dict[str, float] = {}
        for r in ([0] if s == 0 else []) + ([last] if s == pp - 1 else []):
            params.update(cost.params[r])
        out.append(sum(params.values()))
    return out


def _block_maxima(cost: _Regions, blocks: _Blocks) -> tuple[float, float]:
    """The most activations one block saves, and the most parameter elements one block holds."""
    extra = cost.__dict__.get("_block_maxima")
    if extra is None:
        extra = cost.__dict__["_block_maxima"] = (
            max((cost.saved[r] for r in range(1, blocks.count + 1)), default=0.0),
            max((sum(cost.params[r].values()) for r in range(1, blocks.count + 1)), default=0.0))
    return extra


def _stage_times(config: Config, cost: _Regions, blocks: _Blocks, cluster: ClusterSpec):
    """Per stage, seconds per micro-batch and the activations it keeps (bytes), and the pipeline's
    seconds: what depends on (pp, dp, micro-batches, recompute) alone."""
    tp, dp, pp, micro = config.tp, config.dp, config.pp, config.micro_batches
    fraction = 1.0 / (dp * micro)                 # of the traced batch, per micro-batch
    pp_link = _link(cluster, tp * dp, pp)
    hidden = blocks.input_bytes / (tp if config.sequence_parallel else 1)
    st = _stages(cost, blocks, pp)
    hand_off = pp_link.latency + fraction * hidden / pp_link.bandwidth if pp > 1 else 0.0
    stage_seconds, activations = [], []
    for s in range(pp):
        seconds = fraction * st.bw[s] + st.fx[s]
        if config.recompute:
            seconds += fraction * st.forward_bw[s] + st.forward_fx[s]
            saved = st.saved_outside_blocks[s] + st.blocks[s] * hidden
        else:
            saved = st.saved[s]
        seconds += st.sends[s] * hand_off        # one send each way per neighbour, per micro-batch
        stage_seconds.append(seconds)
        activations.append(fraction * saved * min(st.after[s], micro))
    pipeline = sum(stage_seconds) + (micro - 1) * max(stage_seconds)
    return stage_seconds, activations, pipeline


def _stage_state(config: Config, cost: _Regions, blocks: _Blocks, cluster: ClusterSpec):
    """Per stage, the bytes of parameters, gradients and optimizer state one device holds, and the
    slowest stage's gradient sync and optimizer step: what depends on (pp, dp, ZeRO) alone."""
    tp, dp, pp, zero = config.tp, config.dp, config.pp, config.zero
    device, dp_link = _link(cluster, 1, tp), _link(cluster, tp, dp)
    st = _stages(cost, blocks, pp)
    states, sync_most, hidden = [], 0.0, 0.0
    for s in range(pp):
        params = st.params[s]
        grads = params * 4.0
        sync = st.partial_seconds[s]
        if dp > 1:
            spread = (dp - 1) / dp * grads / dp_link.bandwidth
            if zero:                              # reduce-scatter of gradients, all-gather of parameters
                sync += 2 * (dp_link.latency + spread)
            else:
                sync += dp_link.latency + 2 * spread
            if zero == 3:                         # parameters gathered for backward too
                sync += dp_link.latency + spread
            # issued from the forward's and the backward's hooks (runtime/_comm.py): DP's bucket
            # all-reduces, ZeRO-2's reduce-scatters, ZeRO-3's too and its gathers; ZeRO-1 and 2
            # gather the updated shards after the step, ZeRO-1 reduce-scatters after the backward
            hidden = max(hidden, {0: dp_link.latency + 2 * spread, 1: 0.0, 2: dp_link.latency + spread,
                                  3: 3 * (dp_link.latency + spread)}[zero])
        sync += params / (dp if zero else 1) * device.seconds_per_param
        states.append(state_bytes_per_device(params, zero, dp).total)
        sync_most = max(sync_most, sync)
    return states, sync_most, hidden


_links: dict = {}


def _link(cluster: ClusterSpec, stride: int, size: int) -> DeviceSpec:
    key = (cluster, stride, size)
    if key not in _links:
        if len(_links) > 4096:
            _links.clear()
        _links[key] = cluster.axis(stride, size)
    return _links[key]


def estimate_config(graph: Graph, config: Config, cluster: ClusterSpec, constraints: list[Constraint],
                    memory_budget: float | None = None, *, table: str | None = None) -> Estimate:
    """One configuration priced the way the search prices it, with the tensor-parallel split solved
    under `table` (None: the free search; "megatron", "sequence_parallel": those tables)."""
    budget = memory_budget if memory_budget is not None else cluster.memory
    blocks = _blocks(graph)
    plan = None
    if config.tp > 1:
        rules = load_table(table).for_axis("tp") if table else []
        with fused_collectives(bool(table) and load_table(table).fused_collectives):
            plan = search_axis(graph, "tp", config.tp, rules + constraints, cluster.axis(1, config.tp),
                               data_parallel=config.dp * config.micro_batches)
    cost = _regions(graph, blocks, plan, config.tp, cluster.axis(1, config.tp))
    return _estimate(config, cost, blocks, graph.trace.batch_size or 1, cluster, budget)
