"""`--plan auto --devices N`: one search over every way to run the model on N devices.

The space: tensor parallel size tp (each op's split solved per tp by search.search_axis, once,
as the free search and as Megatron's sequence-parallel table), pipeline stages pp (blocks cut
into contiguous stages the way plan/pipeline.py cuts them), data parallel dp = N / (tp pp),
micro-batches per step, the ZeRO stage of the data-parallel state, and activation recompute
per block; and the nnScaler paper's plans: co-shard (rules/plans/coshard.toml) with its factor C
among those dividing the co-sharded ops' split dims per device, and the pipeline's schedule
table (1f1b, interleaved virtual stages, Chimera's two pipelines, the interlaced vocabulary
split; 3f1b alone where the trunk recycles). Every configuration is priced with the cost model
(plan/cost.py) and the memory model per device (plan/memory.py) and the fastest one that fits
the memory budget wins. A pipeline's stages are cut where plan/pipeline.py cuts them (FLOPs
balanced); for the most promising 1F1B and 3F1B configurations the cut is searched too, priced
whole (_search_cuts), and a better one goes to the rewrite as --stages would. Constraints
prune the space before pricing (a dp dividing the batch, ZeRO only with dp, stages no more than
blocks, micro-batches a schedule can order, a vocabulary the pipeline divides, a C dividing the
heads, the smallest fitting C only): `space` counts
the configurations without them.

Two levels, as the splits do not depend on the rest: an op's split is chosen once per tp
(and variant); a configuration's step is then arithmetic on per-block sums of what that split
costs, so thousands of configurations cost milliseconds. Repeated blocks are priced once.

The step of a configuration, per micro-batch of B / (dp M) samples on stage s:
  t_s = its ops' forward and backward (compute and tensor-parallel collectives: bandwidth terms
        scale with the micro-batch, latency and per-call overheads do not)
        + with recompute, its blocks' forward again + its sends to the next and previous stage
  step = sum_s t_s + (M - 1) max_s t_s                      (1F1B: fill, steady state, drain;
                                                             other schedules: _stage_times)
         (a trunk run in a recycling loop pipelines under 3F1B: t_s holds every pass, the
         no-gradient ones as forwards alone; its order is priced by the simulator's timeline,
         schedules.simulated_seconds: a pass waits for the one before to come round the whole
         pipeline, which the formula misses once the stages outnumber the passes)
         + max_s (gradient sync over dp and of partial tensor-parallel gradients + optimizer)
  pp = 1 with M > 1 is gradient accumulation: M t_0, one micro-batch's activations, the sync
  after the last backward (hidden beside none; ZeRO-2/3: each micro-batch's hooks, hidden)
Memory per device, the worst stage: parameters, gradients and AdamW state of its stage (ZeRO
shards them over dp), plus min(pp - s, M) micro-batches of activations (recompute keeps each
block's inputs only, and rebuilds one block at a time).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace


from ..errors import UserError
from ..graph.graph import Graph
from ..materialize.conversions import conversion, conversion_time, fused_collectives
from ..sizes import format_bytes
from .batch import batch_split_problem
from .cost import ClusterSpec, DeviceSpec, all_gather_time, all_reduce_time, node_time, node_flops, optimizer_time
from .layouts import REPLICATE, R
from .memory import saved_bytes
from .zero import state_bytes_per_device, units_in_flight
from .search import (BYTES_PER_PARAM_STATE, AxisPlan, _derivation_inputs, _layout, _search_cache, _search_table,
                     from_end, search_axis, site_id)
from .schedules import simulated_seconds
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
    # the pipeline's schedule table (rules/plans): 1f1b, interleaved, chimera, interlaced; 3f1b where
    # the forward runs the trunk several times (recycling)
    schedule: str = "1f1b"
    coshard: int = 1                    # C: pieces per device of the co-sharded ops (rules/plans/coshard.toml)
    cuts: tuple[int, ...] = ()          # the blocks starting stages 1.. (as --stages); () the FLOP-balanced cut

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"dp={self.dp}", f"pp={self.pp}"]
        if self.pp > 1 or self.micro_batches > 1:     # pp = 1: gradient accumulation
            parts.append(f"micro-batches={self.micro_batches}")
        if self.pp > 1:
            parts += [f"schedule={self.schedule}"] if self.schedule != "1f1b" else []
        parts += [f"co-shard={self.coshard}"] if self.coshard > 1 else []
        parts += [f"zero={self.zero}"] if self.zero else []
        parts += ["recompute"] if self.recompute else []
        parts += ["sequence-parallel"] if self.sequence_parallel else []
        parts += [f"stages={','.join(map(str, self.cuts))}"] if self.cuts else []
        return " ".join(parts)

    @property
    def kind(self) -> str:
        """The plan's kind, as `plan` groups them: co-shard, a pipeline by its schedule, or neither."""
        if self.coshard > 1:
            return "co-shard"
        return self.schedule if self.pp > 1 else "tp x dp"

    def features(self) -> tuple:
        """Tie-break among equally fast plans: the one with less machinery."""
        return (self.pp, self.schedule not in ("1f1b", "3f1b"), self.coshard, self.zero, self.recompute,
                self.sequence_parallel, self.tp, self.micro_batches, bool(self.cuts))


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
    evaluated: int                            # configurations priced: what the constraints leave of the space
    budget: float
    space: int = 0                            # configurations without the constraints (_space_size)

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
    shared_input_bytes: float = 0.0     # ... that every block reads (an encoder's output): kept once,
    shared_readers: frozenset[int] = frozenset()    # by the stages holding these blocks (0-based),
    shared_made: int = 0                # and handed on from the stage of this region (0: the prologue)
    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # stages -> block ranges
    passes: int = 1                     # how often the forward runs the trunk (recycling: 3F1B)
    # the blocks of the other lists --recompute checkpoints (plan/recompute.py other_lists): each op's
    # (list, block), and what each block keeps with recompute (its inputs that need a gradient)
    checkpointed: dict[int, tuple[int, int]] = field(default_factory=dict)
    checkpoint_inputs: dict[tuple[int, int], int] = field(default_factory=dict)
    uncut: frozenset[int] = frozenset()     # blocks no stage may start at (pipeline.uncut_points)
    searched: bool = False              # `ranges` is a cut being searched: prices are not kept (_cut_at)


def _blocks(graph: Graph) -> _Blocks:
    cache = _search_cache(graph)
    if "blocks" in cache:
        return cache["blocks"]
    from .pipeline import between_passes, find_chain, find_recycle, find_trunk, node_blocks, trunk_passes, uncut_points
    from .recompute import block_activations, block_of_other_lists, other_block_inputs, recompute_site
    n = len(graph.nodes)
    try:
        trunk = find_trunk(graph)
    except UserError as exc:
        cache["blocks"] = _Blocks(0, [0] * n, [], 0.0, 0.0, exc.message, exc.message)
        return cache["blocks"]
    passes, recycle = trunk_passes(graph, trunk), None
    if passes > 1:                          # a trunk run in a recycling loop pipelines under 3F1B;
        try:                                # one run again otherwise is refused per pp (_stages_problem)
            recycle = find_recycle(graph, trunk)
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
    callers: dict = {}
    for node in graph.nodes:
        cost = node_flops(node, graph.dims.get(node.index), graph.trace)
        # between two passes of a recycling loop: the next pass's code before the trunk (its inputs, an
        # extra-MSA stack) runs on the first stage, as plan_stages places it, so it is priced there
        if recycle is not None and current == len(cut) and first < node.index < last and \
                node.index not in block_of and between_passes(graph, node, recycle, current, -1, callers) == 0:
            pro += cost
            region.append(0)
            continue
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
    kept = block_activations(graph) if problem is None else None
    others = block_of_other_lists(graph) if problem is None else {}
    shared = kept.shared_tensors if kept else frozenset()
    tensors = graph.trace.tensors
    readers = frozenset(block_of[n.index] for n in graph.nodes if n.index in block_of and shared.intersection(n.inputs))
    made = max((region[tensors[t].producer] for t in shared if tensors[t].producer is not None), default=0)
    cache["blocks"] = _Blocks(len(cut), region, flops, pro, epi, None, problem, float(kept.inputs) if kept else 0.0,
                              float(kept.shared_inputs) if kept else 0.0, readers, made, passes=passes,
                              checkpointed=others, checkpoint_inputs=other_block_inputs(graph) if others else {},
                              uncut=frozenset(uncut_points(graph, chain)))
    return cache["blocks"]


def _stage_ranges(blocks: _Blocks, stages: int) -> list[tuple[int, int]]:
    if stages not in blocks.ranges:
        from .pipeline import _balanced
        blocks.ranges[stages] = _balanced(blocks.flops, stages, blocks.prologue_flops, blocks.epilogue_flops,
                                          blocks.uncut)
    return blocks.ranges[stages]


def _cut_at(blocks: _Blocks, stages: int, points: tuple[int, ...]) -> _Blocks:
    """`blocks` cut into `stages`, stage s + 1 starting at block points[s] (as --stages takes them)."""
    edges = [0, *points, blocks.count]
    return replace(blocks, ranges={stages: [(edges[s], edges[s + 1]) for s in range(stages)]}, searched=True)


# ---------------------------------------------------------------------------------------------
# What one tensor-parallel split costs, per region
# ---------------------------------------------------------------------------------------------

@dataclass
class _Regions:
    """Sums per region at the traced batch: seconds whose terms scale with the batch (bw) and
    those that do not (fx: latency, per-call overhead), the same for a forward alone (what
    recompute repeats), saved activation bytes per device, and the parameters each region uses
    (canonical name -> elements held by one device). The other block lists' blocks (_Blocks.
    checkpointed) in a region: what their ops save, what the blocks keep with recompute, and the
    most one of them saves (what its recompute rebuilds at once)."""

    bw: list[float]
    fx: list[float]
    forward_bw: list[float]
    forward_fx: list[float]
    saved: list[float]
    params: list[dict[str, float]]
    partial_seconds: list[float]        # all-reduce of partial tensor-parallel weight gradients, per step
    # interlaced: the vocabulary steps' ops (the calls, a fused head's views and loss), apart from
    # their regions: every one of the tp x pp devices runs each step on its 1/(tp x pp) of the
    # vocabulary (bw, saved and {param: elements} here are 1/tp of the op's; _stages takes 1/pp)
    # and all-reduces each call's hidden state over those devices
    shared: tuple = field(default_factory=lambda: (0.0, 0.0, {}))      # (bw, fx, {param: elements})
    shared_hidden: list[float] = field(default_factory=list)     # bytes, per vocabulary call
    # what the steps save, per region whose op calls them: a step's tensors live on every device
    # while its owner stage holds that micro-batch (its backward step runs at the owner's B)
    shared_saved_at: dict[int, float] = field(default_factory=dict)
    held_once: float = 0.0              # co-shard: bytes one piece of one block's regions holds while it runs
    checkpointed_saved: list[float] = field(default_factory=list)
    checkpointed_kept: list[float] = field(default_factory=list)
    checkpointed_most: list[float] = field(default_factory=list)


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
    operands_id: int = 0                # the operands' ids together, interned
    producers: object = None            # their producers' labels out of a node -> label dict (None: none)


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
            fact.operands_id = interned.setdefault(("operands", tuple(o for o, _ in fact.operand_ids)), len(interned))
            producers = [u for _, u in fact.operand_ids if u is not None]
            fact.producers = operator.itemgetter(*producers) if producers else None
        cache["node_facts"] = facts
        cache["producers"] = producer
    return cache["node_facts"]


def _regions(graph: Graph, blocks: _Blocks, tp_plan: AxisPlan | None, n: int, device: DeviceSpec,
             apart: frozenset[int] = frozenset()) -> _Regions:
    """`apart`: ops priced into `shared`, not their region (interlaced: the vocabulary ops)."""
    trace = graph.trace
    tensors = trace.tensors
    count = blocks.count + 2
    out = _Regions([0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count,
                   [dict() for _ in range(count)], [0.0] * count, checkpointed_saved=[0.0] * count,
                   checkpointed_kept=[0.0] * count, checkpointed_most=[0.0] * count)
    checkpointed, block_saved = blocks.checkpointed, {}
    bw_dev, fx_dev = _split_devices(device)
    choice = tp_plan.node_choice if tp_plan is not None else {}
    layouts = tp_plan.param_layout if tp_plan is not None else {}
    facts = _node_facts(graph)
    split = n > 1 and tp_plan is not None
    # every op's label, for the producers' labels read at once (a search labels every op)
    labels = choice if len(choice) == len(graph.nodes) else {i: choice.get(i, REPLICATE) for i in range(len(graph.nodes))}
    last_block = blocks.count
    # an op's price is a function of its key below, the axis size and the device: the other
    # splits --plan auto prices at this size ask mostly for the same keys
    priced, converted, own = _search_table(graph, "region_prices").setdefault((n, device, split), ({}, {}, {}))

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
        times = own.get((fact.key_id, label))     # the op's own: whatever its producers' splits
        if times is None:
            dims = graph.dims.get(index)
            times = own[(fact.key_id, label)] = [
                node_time(node, dims, trace, dev, ways, dims_of=graph.dims.get, forward_only=fwd, label=label)
                for fwd in (False, True) for dev in (bw_dev, fx_dev)]
        total = list(times)
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
    for index, (node, fact, region) in enumerate(zip(graph.nodes, facts, blocks.region)):
        label = labels[index]
        ways = n if label != REPLICATE else 1
        # a repeated block's op costs what its first instance cost: same site, shapes, split and producers
        key = (fact.key_id, label, fact.operands_id, fact.producers and fact.producers(labels)) if split \
            else (fact.key_id, label)
        costs = priced.get(key)
        if costs is None:
            costs = priced[key] = price(node, fact, label, ways)
        if apart and index in apart:
            # the runtime splits the step's op on the vocabulary over tp too, whatever its label on
            # tp: its bandwidth terms, what it saves and its weight are 1/n of the whole op's; its
            # per-call fixed cost is paid whole; its hand-offs are the shares (_stage_times)
            whole_bw = node_time(node, graph.dims.get(index), trace, bw_dev, 1, dims_of=graph.dims.get)
            whole_fx = node_time(node, graph.dims.get(index), trace, fx_dev, 1, dims_of=graph.dims.get)
            shared_bw, shared_fx, shared_params = out.shared
            for param, elements in fact.params:
                shared_params[param] = elements / n
            out.shared = (shared_bw + whole_bw / n, shared_fx + whole_fx, shared_params)
            out.shared_saved_at[region] = out.shared_saved_at.get(region, 0.0) + fact.saved / n
            if fact.params:             # a vocabulary call (a fused loss's views and loss read no weight)
                out.shared_hidden.append(_hidden_bytes(node, trace))
            continue
        bw[region] += costs[0]
        fx[region] += costs[1]
        # recompute reruns a block for its backward: a no_grad recycling pass is never rerun (masks
        # inside a block, which it does rerun, are cheap and left out too)
        in_list = checkpointed and index in checkpointed
        if (0 < region <= last_block or in_list) and fact.grad:
            forward_bw[region] += costs[2]
            forward_fx[region] += costs[3]
        saved[region] += fact.saved / ways
        if in_list and fact.grad:
            out.checkpointed_saved[region] += fact.saved / ways
            key = (region, checkpointed[index])
            block_saved[key] = block_saved.get(key, 0.0) + fact.saved / ways
        if fact.params:
            held = out.params[region]
            for param, elements in fact.params:
                layout = layouts.get(param)
                held[param] = elements / (n if layout is not None and layout.kind == "S" else 1)
    loss = trace.loss
    producer = _search_cache(graph)["producers"] if split and loss is not None else {}
    if loss in producer and producer[loss][0] not in apart:     # a loss apart is whole on its step's devices
        u, k = producer[loss]
        outs = _layout(graph, u, choice.get(u, REPLICATE)).outputs
        steps = conversion(outs[k] if k < len(outs) else R, R, consumer_split=False, requires_grad=False) or []
        region = blocks.region[u]
        out.bw[region] += conversion_time(steps, tensors[loss].nbytes, n, bw_dev)
        out.fx[region] += conversion_time(steps, tensors[loss].nbytes, n, fx_dev)
    for (region, block), nbytes in block_saved.items():
        out.checkpointed_kept[region] += blocks.checkpoint_inputs.get(block, 0)
        out.checkpointed_most[region] = max(out.checkpointed_most[region], nbytes)
    for held in out.params:             # a parameter the vocabulary ops share is theirs (tied weights)
        for param in out.shared[2]:
            held.pop(param, None)
    if tp_plan is not None and tp_plan.partial_grad_params:
        first_use = _first_use(graph, blocks, facts)
        for name in tp_plan.partial_grad_params:
            out.partial_seconds[first_use.get(name, 0)] += all_reduce_time(
                tensors[trace.params[name].tid].nbytes, n, device)
    return out


def _first_use(graph: Graph, blocks: _Blocks, facts: list[_NodeFacts]) -> dict[str, int]:
    """Each parameter's region of first use, per graph and regions (where its gradient is ready)."""
    found = _search_table(graph, "first_use").get(id(blocks.region))
    if found is None or found[0] is not blocks.region:
        first_use: dict[str, int] = {}
        for node, fact in zip(graph.nodes, facts):
            for param, _ in fact.params:
                first_use.setdefault(param, blocks.region[node.index])
        found = _search_table(graph, "first_use")[id(blocks.region)] = (blocks.region, first_use)
    return found[1]


def _hidden_bytes(node, trace) -> float:
    """What a vocabulary-split call all-reduces over the pipeline: its hidden state, the smallest
    non-parameter tensor it reads or makes (the embedding's output, the head's input)."""
    tensors = trace.tensors
    sizes = [tensors[t].nbytes for t in (*node.inputs, *node.outputs)
             if tensors[t].param is None and len(tensors[t].shape) > 1]
    return float(min(sizes, default=0))


def _coshard_regions(graph: Graph, blocks: _Blocks, cost: _Regions, plan: AxisPlan, anchors: set[int], chunks: int,
                     n: int, device: DeviceSpec) -> _Regions:
    """`cost` with the ops of the co-shard table's regions co-sharded C ways (plan/coshard.py): what
    they keep for backward freed, one piece of one block's regions held while it runs, and their
    forward run again in backward. A UserError where C does not cut them."""
    from ..materialize.edits import plan_edits
    from .coshard import freed_bytes, region_bytes
    # the regions (which statements run piece by piece) do not depend on C once C divides the
    # co-sharded dims (coshard_factors): cut once per split, at the first C tried
    found = plan.__dict__.setdefault("_coshard_regions", {})
    if not found:
        marked = {i: chunks for i in anchors if plan.node_choice.get(i, REPLICATE) != REPLICATE}
        if not marked:
            raise UserError(f"nothing to co-shard {chunks} ways: the ops the plan co-shards stay whole")
        try:
            # only the regions are read: strict=False skips the gather warnings (a third of its time)
            found["regions"] = plan_edits(graph, replace(plan.choices, chunks=marked), strict=False).regions
        except UserError as exc:
            found["error"] = exc
    if "error" in found:
        raise found["error"]
    regions = found["regions"]
    _, peak = region_bytes(graph, regions, n)
    out = replace(cost, bw=list(cost.bw), fx=list(cost.fx), saved=list(cost.saved), held_once=peak / chunks)
    bw_dev, fx_dev = _split_devices(device)
    freed = freed_bytes(graph, regions)
    for index in sorted(freed):
        node, region = graph.nodes[index], blocks.region[index]
        ways = n if plan.node_choice.get(index, REPLICATE) != REPLICATE else 1
        out.saved[region] -= freed[index] / ways
        for column, dev in ((out.bw, bw_dev), (out.fx, fx_dev)):
            column[region] += node_time(node, graph.dims.get(index), graph.trace, dev, ways,
                                        dims_of=graph.dims.get, forward_only=True)
    return out


def coshard_factors(graph: Graph, plan: AxisPlan, anchors: set[int], n: int) -> list[int]:
    """The C > 1 that could cut the co-sharded ops: those dividing each one's split size per device
    (the heads), up to plan/coshard.py's MAX_PIECES."""
    from .coshard import MAX_PIECES
    sizes = [graph.dims[i].sizes().get(plan.node_choice[i]) for i in anchors
             if plan.node_choice.get(i, REPLICATE) != REPLICATE and i in graph.dims]
    if not sizes or any(s is None for s in sizes):
        return []
    per_device = math.gcd(*sizes) // n
    return [c for c in range(2, min(per_device, MAX_PIECES) + 1) if per_device % c == 0]


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
    schedule: str | None = None
    search_cuts: bool = True            # False: the user gave --stages


# The pipeline schedules searched for a trunk the forward runs once (rules/plans/*.toml); a trunk
# run in a recycling loop pipelines under 3f1b alone
SCHEDULES = ("1f1b", "interleaved", "chimera", "interlaced")
COSHARD = "coshard"                 # the tensor-parallel variant whose table co-shards the attention core
INTERLACED = "interlaced"           # ... whose vocabulary ops stay whole on tp (split over the pipeline)


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
    regions: dict[tuple, _Regions | UserError] = {}
    tables: dict[str, list[Constraint]] = {}
    anchors: set[int] = set()
    vocab: list = []                   # interlaced: the vocabulary steps' nodes, or why there are none
    vocab_blocks: list = []            # interlaced: `blocks` without those nodes' FLOPs (its stage cuts)

    def table_of(variant: str) -> list[Constraint]:
        if variant not in tables:
            if variant == "auto":
                tables[variant] = []
            elif variant == INTERLACED:
                from . import interlaced
                from .schedules import load_schedule
                tables[variant] = interlaced.keep_whole_on_tp(graph, load_schedule(INTERLACED), 1, [])
            else:
                tables[variant] = load_table(variant).for_axis("tp")
                if variant == COSHARD:
                    from .tables import chunks_for
                    anchors.update(i for i in range(len(graph.nodes)) if chunks_for(tables[variant], graph, i) != 1)
        return tables[variant]

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
                    table = table_of(variant)
                    fused = variant != "auto" and variant != INTERLACED and load_table(variant).fused_collectives
                    with fused_collectives(fused):
                        solved[key] = search_axis(graph, "tp", tp, table + constraints, cluster.axis(1, tp),
                                                  data_parallel=slices, explain=False)
                except UserError as exc:
                    solved[key] = exc
        return solved[key]

    def vocab_nodes() -> frozenset[int] | UserError:
        if not vocab:
            from . import interlaced
            from .pipeline import cut_blocks
            from .schedules import load_schedule
            try:
                table = load_schedule(INTERLACED)
                modules, _ = interlaced.vocab_modules(graph, cut_blocks(graph), 1, table.vocab, table.location)
                vocab.append(interlaced.step_nodes(graph, modules))
            except UserError as exc:
                vocab.append(exc)
        return vocab[0]

    def blocks_for(order: str) -> _Blocks:
        """The stages of an interlaced pipeline are balanced without its vocabulary steps' ops."""
        if order != INTERLACED or isinstance(vocab_nodes(), UserError):
            return blocks
        if not vocab_blocks:
            from . import interlaced
            vocab_blocks.append(interlaced._without_calls(graph, [graph.nodes[i] for i in sorted(vocab_nodes())]))
        return vocab_blocks[0]

    def priced(tp: int, variant: str, slices: int, chunks: int = 1) -> _Regions | UserError:
        key = (tp, variant, slices, chunks)
        if key not in regions:
            if chunks > 1:
                base = priced(tp, variant, slices)
                try:
                    regions[key] = _coshard_regions(graph, blocks, base, solved[(tp, variant, slices)], anchors,
                                                    chunks, tp, cluster.axis(1, tp))
                except UserError as exc:
                    regions[key] = exc
            else:
                apart = vocab_nodes() if variant == INTERLACED else frozenset()
                regions[key] = _regions(graph, blocks, solved[(tp, variant, slices)], tp, cluster.axis(1, tp), apart)
        return regions[key]

    estimates: list[Estimate] = []
    twins: dict[int, Estimate] = {}     # id of an estimate at a searched cut -> the same at the FLOP-balanced cut
    cut_families: list[tuple[int, list[Estimate], list[_Regions]]] = []    # (where in estimates, family, costs)
    deferred: list = []                 # co-shard families: (the least time they could take, config, members, C)
    evaluated = 0

    def family_configs(tp: int, dp: int, pp: int, order: str, variant: str, plan):
        """Each (micro-batches, ZeRO, recompute) of a (tp, pp, schedule, variant), with the key of
        the split it prices on."""
        base = math.gcd(devices // tp, batch)
        for micro in _micro_batch_choices(batch // dp, pp, fixed):
            if micro > 1 and mixing is not None or _micro_problem(order, pp, micro):
                continue
            key = (tp, variant, base)
            if plan is not None and not _valid_for(graph, plan, tp, dp * micro):
                key = (tp, variant, batch)
                if isinstance(tp_plan(*key), UserError):
                    continue
            for zero in _zero_choices(dp, fixed, order):
                for recompute in _recompute_choices(blocks, fixed):
                    yield Config(tp, dp, pp, micro, zero, recompute, variant == "sequence_parallel", order), key

    def price_family(members, factors: list[int], search_cut: bool) -> Estimate | None:
        """Price a family's configurations and keep its best (co-shard: the smallest C that fits,
        every C costing the same time); a family whose every split was refused, the refusal."""
        nonlocal evaluated
        family, costs, refused = [], [], None
        for config, key in members:
            for chunks in factors:
                cost = priced(*key, chunks)
                if isinstance(cost, UserError):
                    refused = refused or Estimate(replace(config, coshard=chunks), why_not=cost.message)
                    continue
                evaluated += 1
                estimate = _estimate(replace(config, coshard=chunks), cost, blocks_for(config.schedule), batch,
                                     cluster, budget)
                family.append(estimate)
                costs.append(cost)
                if estimate.why_not is None:
                    break
        if not family:
            if refused is not None:
                estimates.append(refused)
            return None
        if search_cut:
            cut_families.append((len(estimates), family, costs))
        estimates.append(_family_best(family))
        return estimates[-1]
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            for order in _schedule_choices(pp, blocks, fixed):
                config = Config(tp, dp, pp, schedule=order)
                why = _refusal(config, batch, mixing, blocks, fixed)
                if why is None and order == INTERLACED:
                    why = _vocab_refusal(graph, vocab_nodes(), tp * pp)
                if why:
                    estimates.append(Estimate(config, why_not=why))
                    continue
                for variant in _variants(tp, pp, order, fixed, variants):
                    base = math.gcd(devices // tp, batch)
                    if variant == COSHARD and not (table_of(COSHARD) and anchors):
                        estimates.append(Estimate(replace(config, coshard=2), why_not="the co-shard table selects no "
                                                  "op of this model (attention's softmax or sdpa)"))
                        continue
                    plan = tp_plan(tp, variant, base)
                    if isinstance(plan, UserError):
                        estimates.append(Estimate(replace(config, sequence_parallel=variant == "sequence_parallel",
                                                          coshard=2 if variant == COSHARD else 1), why_not=plan.message))
                        continue
                    factors = coshard_factors(graph, plan, anchors, tp) if variant == COSHARD else [1]
                    if not factors:
                        estimates.append(Estimate(replace(config, coshard=2), why_not="no co-shard factor C > 1 "
                                                  "divides the co-sharded ops' split dims per device"))
                        continue
                    members = list(family_configs(tp, dp, pp, order, variant, plan))
                    if variant == COSHARD:
                        # priced after the rest, and only where it could win: co-shard only adds to the
                        # time of its split without it (one more forward of the regions), and pricing
                        # its regions rewrites the model (plan_edits)
                        bound = min((_estimate(replace(c, coshard=factors[0]), priced(*key), blocks, batch, cluster,
                                               math.inf).seconds for c, key in members), default=math.inf)
                        deferred.append((bound, config, members, factors))
                        continue
                    price_family(members, factors, pp > 1 and order in ("1f1b", "3f1b") and fixed.search_cuts)
    fastest = min((e.seconds for e in estimates if e.why_not is None), default=math.inf)
    unpriced: list[tuple[float, Estimate, list, list[int]]] = []     # co-shard families it could not win
    for bound, config, members, factors in sorted(deferred, key=lambda d: d[0]):
        if bound >= fastest:
            unpriced.append((bound, Estimate(replace(config, coshard=factors[0]), seconds=bound, why_not=(
                f"co-shard not priced: without its repeated forward its split takes {bound:.4g} s a step, "
                f"the fastest fitting plan {fastest:.4g} s")), members, factors))
            estimates.append(unpriced[-1][1])
            continue
        best = price_family(members, factors, False)
        if best is not None and best.why_not is None:
            fastest = min(fastest, best.seconds)
    _search_cuts(estimates, cut_families, blocks, batch, cluster, budget, twins)
    while True:
        best = _choose(graph, estimates, blocks, twins)
        # the rewrite refused a cut the bound was measured against: the co-shard families that
        # could now win are priced after all
        late = [u for u in unpriced if best is None or u[0] < best.seconds]
        if not late:
            break
        for u in late:
            unpriced.remove(u)
            estimates[:] = [e for e in estimates if e is not u[1]]
            price_family(u[2], u[3], False)
    if best is None:
        tried = sorted((e for e in estimates if e.memory < math.inf), key=lambda e: e.memory)[:4]
        refused = [e for e in estimates if e.memory == math.inf][:4]
        raise UserError(f"no plan on {devices} devices fits {format_bytes(budget)} per device: " +
                        "; ".join(f"{e.config.describe()}: {e.why_not}" for e in [*tried, *refused]),
                        hint="raise --memory-budget or use more devices")
    chosen = best.config
    variant = _variant_of(chosen)
    plan = solved.get((chosen.tp, variant, math.gcd(devices // chosen.tp, batch))) if chosen.tp > 1 else None
    if plan is not None and not _valid_for(graph, plan, chosen.tp, chosen.dp * chosen.micro_batches):
        plan = solved[(chosen.tp, variant, batch)]
    return AutoChoice(best, plan, estimates, evaluated, budget,
                      space=_space_size(devices, batch, blocks, variants))


def _choose(graph: Graph, estimates: list[Estimate], blocks: _Blocks, twins: dict) -> Estimate | None:
    """The fastest fitting estimate the rewrite can cut and order as priced; None when none fits.
    A refused searched cut gives way to its FLOP-balanced twin; a refused pp, every estimate with it."""
    while True:
        feasible = [e for e in estimates if e.why_not is None]
        if not feasible:
            return None
        best = min(feasible, key=lambda e: (e.seconds, e.config.features()))
        problem = _stages_problem(graph, best.config.pp, best.config.schedule, best.config.cuts)
        if problem is not None and best.config.cuts:     # that cut only: the FLOP-balanced one instead
            best.why_not = problem
            estimates.append(twins[id(best)])
            continue
        if problem is None:
            problem = _order_problem(best.config, blocks)
            if problem is None:
                return best
            best.why_not = problem      # this number of micro-batches only
            continue
        for e in estimates:             # the rewrite could not cut the model so: no configuration with this pp
            if (e.config.pp, e.config.schedule) == (best.config.pp, best.config.schedule):
                e.why_not = problem


def _variant_of(config: Config) -> str:
    if config.coshard > 1:
        return COSHARD
    if config.pp > 1 and config.schedule == INTERLACED:
        return INTERLACED
    return "sequence_parallel" if config.sequence_parallel else "auto"


def _schedule_choices(pp: int, blocks: _Blocks, fixed: _Fixed) -> list[str]:
    if pp == 1:
        return ["1f1b"]
    if blocks.passes > 1:
        return ["3f1b"]
    return [fixed.schedule] if fixed.schedule is not None else list(SCHEDULES)


def _variants(tp: int, pp: int, order: str, fixed: _Fixed, variants: tuple[str, ...]) -> list[str]:
    """How tensor parallelism is solved for this pipeline: the free search and sequence parallelism;
    co-shard where the model runs in one stage; interlaced keeps its vocabulary ops whole on tp."""
    if pp > 1 and order == INTERLACED:
        return [INTERLACED] if fixed.sequence_parallel is not True else []
    if tp == 1:
        return ["auto"]
    out = [v for v in variants if _variant_allowed(v, fixed)]
    if pp == 1 and fixed.sequence_parallel is not True and "auto" in variants:
        out.append(COSHARD)
    return out


def _micro_problem(order: str, pp: int, micro: int) -> bool:
    """Whether the schedule cannot run `micro` micro-batches (plan/schedules.py `schedule`'s checks)."""
    if order == "1f1b" or order == "3f1b" or order == INTERLACED:
        return False
    table = _table(order)
    return (table.virtual_stages > 1 and table.pipelines == 1 and micro % pp != 0) or micro % table.pipelines != 0


def _vocab_refusal(graph: Graph, vocab, devices: int) -> str | None:
    """Why the interlaced pipeline cannot split this model's vocabulary over its tp x pp `devices`."""
    if isinstance(vocab, UserError):
        return vocab.message
    rows = {graph.trace.params[graph.trace.tensors[tid].param].shape[0]
            for i in vocab for _, tid in graph.param_operands(i) if graph.trace.tensors[tid].param is not None}
    bad = sorted(r for r in rows if r % devices)
    return f"a vocabulary of {bad[0]} rows is not divisible by the {devices} devices (tp x pp)" if bad else None


def _space_size(devices: int, batch: int, blocks: _Blocks, variants: tuple[str, ...]) -> int:
    """The configurations without any constraint: every (tp, pp, dp) of the devices, any micro-batch
    count that divides the batch, each ZeRO stage, recompute or not, every tensor-parallel variant
    with every co-shard factor up to MAX_PIECES, and every schedule (the recycling one too)."""
    from .coshard import MAX_PIECES
    splits = len(variants) + (MAX_PIECES - 1)          # free, sequence parallel, co-shard C = 2..64
    micro = len(divisors(batch))
    total = 0
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            total += micro * (len(SCHEDULES) + 1 if pp > 1 else 1) * 4 * 2 * splits
    return total


def _stages_problem(graph: Graph, pp: int, order: str = "1f1b", cuts: tuple[int, ...] = ()) -> str | None:
    """Why the rewrite would refuse to cut the model into `pp` stages under this schedule, at
    `cuts` (() the FLOP-balanced cut): plan_stages' own checks (module state set in code only some
    stages run, blocks the forward runs more than once)."""
    if pp == 1:
        return None
    cache = _search_cache(graph).setdefault("stage_problems", {})
    if (pp, order, cuts) not in cache:
        from .pipeline import checked_stages
        from .schedules import placement
        table = _table(order)
        try:
            checked_stages(graph, pp, table.virtual_stages, list(cuts) or None, placement(table, pp),
                           _blocks(graph).passes > 1)
            cache[(pp, order, cuts)] = None
        except UserError as exc:
            cache[(pp, order, cuts)] = exc.message
    return cache[(pp, order, cuts)]


_orders: dict = {}


def _order_problem(config: Config, blocks: _Blocks) -> str | None:
    """Why the schedule table cannot order this many micro-batches on these ranks (its z3 order
    constraints unsatisfiable), checked for the tables whose orders interleave several stages per
    rank or several pipelines (1F1B's constraints always have a solution)."""
    table = _table(config.schedule)
    if config.pp == 1 or (table.virtual_stages == 1 and table.pipelines == 1):
        return None
    key = (config.schedule, config.pp, config.micro_batches)
    if key not in _orders:
        from .schedules import schedule
        try:
            schedule(table, config.pp, config.micro_batches, blocks.passes)
            _orders[key] = None
        except UserError as exc:
            _orders[key] = f"{exc.message} ({config.micro_batches} micro-batches)"
    return _orders[key]


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
        stages = config.pp * _table(config.schedule).virtual_stages // _table(config.schedule).pipelines
        if blocks.count < stages:
            return f"{blocks.count} blocks cannot fill {stages} pipeline stages"
    return None


def _micro_batch_choices(local_batch: int, pp: int, fixed: _Fixed) -> list[int]:
    """Micro-batches per step: a pipeline's, or without one gradient accumulation's, which trades
    time (per-call overheads M times; a DP sync no longer beside the backward) for activations."""
    if fixed.micro_batches is not None:
        return [fixed.micro_batches] if local_batch % fixed.micro_batches == 0 else []
    return divisors(local_batch)


def _zero_choices(dp: int, fixed: _Fixed, order: str = "1f1b") -> list[int]:
    if _table(order).pipelines > 1:     # replicated pipelines shard no state (plan/zero.py check_zero)
        return [0] if not fixed.zero else []
    if fixed.zero is not None:
        return [fixed.zero]
    return [0, 1, 2, 3] if dp > 1 else [0]


_schedule_tables: dict = {}


def _table(order: str):
    """A schedule table by name, read once per process."""
    if order not in _schedule_tables:
        from .schedules import load_schedule
        _schedule_tables[order] = load_schedule(order)
    return _schedule_tables[order]


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
        try:
            split = {size for label, size, labels_of in _batch_groups(graph) if label in labels_of(choice)}
        except KeyError:                  # a split that does not label every op
            split = {size for index, (label, size) in _batch_sizes(graph).items() if choice.get(index) == label}
        plan.__dict__["_batch_splits"] = split
    return all(size is not None and (size // slices) % n == 0 for size in split)


def _batch_groups(graph: Graph) -> list[tuple[str, int | None, object]]:
    """The ops by batch label and size: (label, size, their labels read out of a node -> label dict)."""
    cache = _search_cache(graph)
    if "batch_groups" not in cache:
        groups: dict[tuple, list[int]] = {}
        for index, key in _batch_sizes(graph).items():
            groups.setdefault(key, []).append(index)
        cache["batch_groups"] = [(label, size, operator.itemgetter(*indices, indices[0]))     # always a tuple
                                 for (label, size), indices in groups.items()]
    return cache["batch_groups"]


def _batch_sizes(graph: Graph) -> dict[int, tuple[str, int | None]]:
    """Each op's batch label and its traced size."""
    cache = _search_cache(graph)
    if "batch_sizes" not in cache:
        cache["batch_sizes"] = {index: (label, graph.dims[index].sizes().get(label))
                                for index, label in _derivation_inputs(graph, False)[0].items() if index in graph.dims}
    return cache["batch_sizes"]


@dataclass
class _Stages:
    """Per model stage (of one pipeline: D·V/P of them), sums over its regions (see _Regions), one
    list entry per stage; interlaced's vocabulary steps on every stage (_Regions.shared)."""

    bw: list[float]
    fx: list[float]
    forward_bw: list[float]             # its blocks' only (and the other lists' blocks, _Regions)
    forward_fx: list[float]
    saved: list[float]
    saved_outside_blocks: list[float]   # with recompute: the other lists' blocks keep their inputs
    rebuilt_outside_blocks: list[float]     # the most one of the other lists' blocks rebuilds
    blocks: list[int]
    params: list[int]                   # elements one device holds
    partial_seconds: list[float]
    outside_params: list[float]         # of those, outside the blocks (ZeRO's root unit)
    sends: list[int]                    # hand-offs per micro-batch: to the next stage and back to the previous
    shared_sends: list[int]             # ... of those, the ones that carry what later blocks read too
    reads_shared: list[bool]            # a block of the stage reads it (_Blocks.shared_readers)


def _stages(cost: _Regions, blocks: _Blocks, pp: int) -> _Stages:
    cache = {} if blocks.searched else cost.__dict__.setdefault("_stages", {})
    if pp in cache:
        return cache[pp]
    last = blocks.count + 1
    if pp == 1:
        layout = [(list(range(blocks.count + 2)), blocks.count)]
    else:
        layout = [(([0] if s == 0 else []) + list(range(a + 1, b + 1)) + ([last] if s == pp - 1 else []), b - a)
                  for s, (a, b) in enumerate(_stage_ranges(blocks, pp))]
    shared_bw, shared_fx, shared_params = cost.shared     # (what the steps save: _stage_times)
    shared_held = sum(shared_params.values()) / pp
    rows = []
    for regions, count in layout:
        params: dict[str, float] = {}
        outside: dict[str, float] = {}
        for r in regions:
            params.update(cost.params[r])
            if not 0 < r < last:
                outside.update(cost.params[r])
        outside_blocks = [r for r in regions if not 0 < r < last]
        rows.append((sum(cost.bw[r] for r in regions) + shared_bw / pp, sum(cost.fx[r] for r in regions) + shared_fx,
                     sum(cost.forward_bw[r] for r in regions), sum(cost.forward_fx[r] for r in regions),
                     sum(cost.saved[r] for r in regions),
                     sum(cost.saved[r] - cost.checkpointed_saved[r] + cost.checkpointed_kept[r]
                         for r in outside_blocks),
                     max((cost.checkpointed_most[r] for r in regions), default=0.0),
                     count, int(round(sum(params.values()) + shared_held)), sum(cost.partial_seconds[r] for r in regions),
                     sum(outside.values()) + shared_held))
    columns = [list(c) for c in zip(*rows)]
    # what every later block reads (an encoder's output) crosses a cut once it is made, while a block
    # after the cut reads it (not between the encoder's stages)
    ranges = [(0, blocks.count)] if pp == 1 else _stage_ranges(blocks, pp)     # blocks a..b-1 on each stage
    reading = blocks.shared_readers
    carries = [s < pp - 1 and blocks.shared_made <= b and any(i >= b for i in reading)
               for s, (_, b) in enumerate(ranges)]
    cache[pp] = _Stages(*columns, sends=[int(s < pp - 1) + int(s > 0) for s in range(pp)],
                        shared_sends=[int(carries[s]) + int(s > 0 and carries[s - 1]) for s in range(pp)],
                        reads_shared=[any(a <= i < b for i in reading) for a, b in ranges])
    return cache[pp]


_placements: dict = {}


def _ranks(order: str, pp: int) -> tuple[list[list[int]], int]:
    """Per pipeline rank, the model stages it runs in its schedule order (op-assign of the table,
    plan/schedules.py `placement`), and the stages of one pipeline."""
    key = (order, pp)
    if key not in _placements:
        from .schedules import placement
        table = _table(order)
        place = placement(table, pp) if pp > 1 else None
        length = place.length if place else 1
        _placements[key] = ([[v % length for v in place.stages_of(r)] for r in range(pp)] if place else [[0]], length)
    return _placements[key]


def _estimate(config: Config, cost: _Regions, blocks: _Blocks, batch: int, cluster: ClusterSpec,
              budget: float) -> Estimate:
    """The step time and peak memory per device of one configuration (the module docstring's
    formulas; the memory is plan/memory.py's device_memory, per pipeline rank at once).

    The search prices every (micro-batches, ZeRO, recompute) of a (tp, pp, dp): the per-rank
    time depends on the micro-batches and recompute only, the gradient sync and the state on
    ZeRO only, so each part is computed once and kept on `cost` (the same floating-point
    operations in the same order as pricing each configuration from scratch: same figures)."""
    dp, pp, micro, zero, order = config.dp, config.pp, config.micro_batches, config.zero, config.schedule
    parts = {} if blocks.searched else cost.__dict__.setdefault("_parts", {})
    timed = parts.get(("time", pp, dp, micro, config.recompute, order))
    if timed is None:
        timed = parts[("time", pp, dp, micro, config.recompute, order)] = _stage_times(config, cost, blocks, cluster)
    stage_seconds, activations, pipeline = timed
    synced = parts.get(("sync", pp, dp, zero, order))
    if synced is None:
        synced = parts[("sync", pp, dp, zero, order)] = _stage_state(config, cost, blocks, cluster)
    state, sync_most, hidden, roots, with_blocks, others, gather_most = synced
    fraction = 1.0 / (dp * micro)
    memory = [s + a for s, a in zip(state, activations)]
    if config.recompute:                # one block rebuilt at once: a cut one, or one of another list
        most = _block_maxima(cost, blocks)[0]
        memory = [m + fraction * max(most if n else 0.0, o) if n or o else m
                  for m, n, o in zip(memory, with_blocks, others)]
    if cost.held_once:                  # co-shard: one piece of one block's regions while it runs
        memory = [m + fraction * cost.held_once for m in memory]
    if zero >= 2:                       # (a pipeline's gradients are whole already: _stage_state)
        block = int(_block_maxima(cost, blocks)[1])
        in_flight = [units_in_flight(zero, root, block) for root in roots]
        memory = [m + params + (grads if pp == 1 else 0.0) for m, (params, grads) in zip(memory, in_flight)]
    stage_memory = [float(m) for m in memory]
    if pp == 1 and micro > 1:           # gradient accumulation (emit/templates.py ACCUMULATE_FORWARD_BACKWARD)
        if zero >= 2:   # every micro-batch's hooks reduce-scatter (ZeRO-3: and gather) again, beside its compute
            sync_most, hidden = sync_most + (micro - 1) * hidden, micro * hidden
        else:           # the gradients add up; finish_backward reduces them once, after the last backward
            hidden = 0.0
    if pp > 1 and zero == 3:
        # a stage's units are gathered for every pass of every micro-batch and for its backward, one
        # after the other in the schedule (no overlap): M x (passes + 1) gathers, two priced above
        sync_most += (micro * (blocks.passes + 1) - 2) * gather_most
    if pp == 1 and cluster.overlap:     # the output issues these from its hooks, beside the backward
        sync_most -= min(hidden, pipeline)
    estimate = Estimate(config, pipeline + sync_most, max(stage_memory), list(stage_seconds), stage_memory, pipeline,
                        sync_most)
    if estimate.memory > budget:
        estimate.why_not = f"needs {format_bytes(estimate.memory)} per device, budget {format_bytes(budget)}"
    return estimate


CUT_TRIES = 48          # stage cuts priced per configuration whose cut is searched (_cut_search)
CUT_SEARCHES = 32       # configurations whose cut is searched, the most promising first (_search_cuts)


def _rank(estimate: Estimate) -> tuple:
    """Fitting before not, then the faster; of two that do not fit, the smaller."""
    return (0, estimate.seconds) if estimate.why_not is None else (1, estimate.memory)


def _cut_search(estimate: Estimate, cost: _Regions, blocks: _Blocks, batch: int, cluster: ClusterSpec,
                budget: float, fitting: tuple[int, ...]) -> Estimate:
    """The configuration at the best stage cut found, from the FLOP-balanced one it was priced at
    (what plan_stages cuts without --stages): FLOPs miss what memory-bound ops cost and what a
    stage holds (an embedding table: bytes, no FLOPs). The seeds `fitting` (_fitting_balanced) and
    the cut balancing the stages' priced seconds, then one cut point at a time moved by 1, 2, 4 or
    8 blocks while that fits where the cut before did not, needs less memory where neither fits, or
    is faster; at most CUT_TRIES cuts priced. A cut other than the FLOP-balanced one is the config's
    `cuts`, handed to the rewrite as --stages would be. (1F1B and 3F1B: one model stage per rank.)"""
    config, length, count = estimate.config, estimate.config.pp, blocks.count

    def price(points: tuple[int, ...]) -> Estimate:
        return _estimate(replace(config, cuts=points), cost, _cut_at(blocks, length, points), batch, cluster, budget)
    default = tuple(b for _, b in _stage_ranges(blocks, length)[:-1])
    tried = {default: estimate}
    best_points, best = default, estimate
    seeds = [fitting, tuple(b for _, b in _time_balanced(config, cost, blocks, length)[:-1])]
    for points in seeds:
        if len(points) == length - 1 and list(points) == sorted(set(points)) and 0 < points[0] and \
                points[-1] < count and not blocks.uncut.intersection(points) and points not in tried:
            tried[points] = price(points)
            if _rank(tried[points]) < _rank(best):
                best_points, best = points, tried[points]
    improved = True
    while improved and len(tried) < CUT_TRIES:
        improved = False
        for i in range(length - 1):
            for step in (1, -1, 2, -2, 4, -4, 8, -8):
                moved = best_points[:i] + (best_points[i] + step,) + best_points[i + 1:]
                edges = [0, *moved, count]
                if moved in tried or len(tried) >= CUT_TRIES or blocks.uncut.intersection(moved) or \
                        any(edges[s + 1] <= edges[s] for s in range(length)):
                    continue
                tried[moved] = price(moved)
                if _rank(tried[moved]) < _rank(best):
                    best_points, best, improved = moved, tried[moved], True
    return estimate if best_points == default else best


def _family_best(family: list[Estimate]) -> Estimate:
    """Of a (tp, pp, schedule, variant)'s configurations, the fastest that fits, else the smallest."""
    feasible = [e for e in family if e.why_not is None]
    if feasible:
        return min(feasible, key=lambda e: (e.seconds, e.config.features()))
    return min(family, key=lambda e: (e.memory, e.seconds))


def _lower_bound(estimate: Estimate) -> float:
    """No stage cut makes the step faster than its micro-batches of the stages' mean seconds."""
    return estimate.config.micro_batches * sum(estimate.stage_seconds) / len(estimate.stage_seconds)


def _search_cuts(estimates: list[Estimate], families: list, blocks: _Blocks, batch: int, cluster: ClusterSpec,
                 budget: float, twins: dict[int, Estimate]) -> None:
    """The stage cut searched (_cut_search) for the pipeline configurations where a cut could win:
    those whose lower bound beats the fastest fitting configuration found so far, most promising
    first, CUT_SEARCHES of them at most; each family's entry in `estimates` replaced by its best after."""
    bound = min((e.seconds for e in estimates if e.why_not is None), default=math.inf)
    members = sorted(((_lower_bound(e), f, i) for f, (_, family, _) in enumerate(families)
                      for i, e in enumerate(family)), key=lambda m: m[0])
    changed, searched = set(), 0
    for lower, f, i in members:
        if lower >= bound or searched == CUT_SEARCHES:
            break
        _, family, costs = families[f]
        fitting = _fitting_balanced(family[i], costs[i], blocks, budget)
        if not fitting and family[i].why_not is not None:
            continue                    # no cut fits by the rough memory either
        searched += 1
        found = _cut_search(family[i], costs[i], blocks, batch, cluster, budget, fitting)
        if found is not family[i]:
            twins[id(found)] = family[i]
            family[i] = found
            changed.add(f)
        if found.why_not is None:
            bound = min(bound, found.seconds)
    for f in changed:
        at, family, _ = families[f]
        estimates[at] = _family_best(family)


def _fitting_balanced(estimate: Estimate, cost: _Regions, blocks: _Blocks, budget: float) -> tuple[int, ...]:
    """The cut whose slowest stage (_time_balanced's seconds) is the fastest among those whose every
    stage fits `budget` by a rough memory: stage s of 1F1B's order keeps min(stages - s, M)
    micro-batches of its regions' activations (with recompute, its blocks' inputs) beside its
    parameters' state, plus what the whole memory model adds to that on stage s at the FLOP-balanced
    cut `estimate` was priced at. A seed for _cut_search, which prices it with the whole model; ()
    where no cut fits by that memory."""
    config, stages, count = estimate.config, estimate.config.pp, blocks.count
    state, kept = _region_memory(config, cost, blocks)
    state_sum, kept_sum = [0.0], [0.0]          # prefix sums over the blocks (regions 1..count)
    for r in range(1, count + 1):
        state_sum.append(state_sum[-1] + state[r])
        kept_sum.append(kept_sum[-1] + kept[r])
    held = [min(stages - s, config.micro_batches) for s in range(stages)]

    def rough(stage: int, start: int, end: int) -> float:
        first, last = stage == 0, stage == stages - 1
        return (state_sum[end] - state_sum[start] + (state[0] if first else 0.0) + (state[-1] if last else 0.0)
                + held[stage] * (kept_sum[end] - kept_sum[start] + (kept[0] if first else 0.0)
                                 + (kept[-1] if last else 0.0)))
    ends_of = _stage_ranges(blocks, stages)
    room = [budget - (estimate.stage_memory[s] - rough(s, *ends_of[s])) for s in range(stages)]
    inf = math.inf
    shortest = next((end for end in range(1, count - stages + 2) if end not in blocks.uncut), None)
    if shortest is None or rough(0, 0, shortest) > room[0]:
        return ()                               # not even the shortest first stage fits
    seconds = _region_seconds(config, cost, blocks)
    time_sum = [0.0]
    for r in range(1, count + 1):
        time_sum.append(time_sum[-1] + seconds[r])
    best = [time_sum[count] - time_sum[start] + seconds[-1] if rough(stages - 1, start, count) <= room[-1] else inf
            for start in range(count + 1)]      # the last stage: blocks start.. and the epilogue
    ends: list[list[int]] = []
    for stage in range(stages - 2, -1, -1):
        if min(best) == inf:                    # the stages after this one fit from no start
            return ()
        here, end_at = [inf] * (count + 1), [0] * (count + 1)
        later = stages - stage - 1
        extra = seconds[0] if stage == 0 else 0.0
        for start in (range(1) if stage == 0 else range(stage, count - later)):
            for end in range(start + 1, count - later + 1):
                if end in blocks.uncut:
                    continue
                if rough(stage, start, end) > room[stage]:
                    break                       # longer stages hold more
                worst = max(time_sum[end] - time_sum[start] + extra, best[end])
                if worst < here[start]:
                    here[start], end_at[start] = worst, end
        best = here
        ends.append(end_at)
    if best[0] == inf:
        return ()
    ends.reverse()
    points, start = [], 0
    for stage in range(stages - 1):
        start = ends[stage][start]
        points.append(start)
    return tuple(points)


def _region_memory(config: Config, cost: _Regions, blocks: _Blocks) -> tuple[list[float], list[float]]:
    """Each region's rough bytes (_fitting_balanced): its parameters' state, and what one micro-batch
    keeps of its activations (with recompute, a block's inputs)."""
    fraction = 1.0 / (config.dp * config.micro_batches)
    per_element = state_bytes_per_device(10 ** 6, config.zero, config.dp).total / 10 ** 6
    elements = cost.__dict__.get("_region_elements")
    if elements is None:
        elements = cost.__dict__["_region_elements"] = [sum(p.values()) for p in cost.params]
    count = blocks.count
    return ([e * per_element for e in elements],
            [fraction * (blocks.input_bytes if config.recompute and 0 < r <= count else cost.saved[r])
             for r in range(count + 2)])


def _region_seconds(config: Config, cost: _Regions, blocks: _Blocks) -> list[float]:
    """Each region's seconds per micro-batch (_stage_times' terms but the hand-offs every stage pays)."""
    fraction = 1.0 / (config.dp * config.micro_batches)
    seconds = [fraction * cost.bw[r] + cost.fx[r] for r in range(blocks.count + 2)]
    if config.recompute:
        seconds = [t + fraction * cost.forward_bw[r] + cost.forward_fx[r] for r, t in enumerate(seconds)]
    return seconds


def _time_balanced(config: Config, cost: _Regions, blocks: _Blocks, stages: int) -> list[tuple[int, int]]:
    """The cut whose stages' priced seconds per micro-batch (_stage_times' per-region terms, without
    the hand-offs every stage pays alike) have the least maximum."""
    seconds = _region_seconds(config, cost, blocks)
    from .pipeline import _balanced
    return _balanced(seconds[1:-1], stages, seconds[0], seconds[-1], blocks.uncut)


def _block_maxima(cost: _Regions, blocks: _Blocks) -> tuple[float, float]:
    """The most activations one block saves, and the most parameter elements one block holds."""
    extra = cost.__dict__.get("_block_maxima")
    if extra is None:
        extra = cost.__dict__["_block_maxima"] = (
            max((cost.saved[r] for r in range(1, blocks.count + 1)), default=0.0),
            max((sum(cost.params[r].values()) for r in range(1, blocks.count + 1)), default=0.0))
    return extra


def _stage_times(config: Config, cost: _Regions, blocks: _Blocks, cluster: ClusterSpec):
    """Per pipeline rank, seconds per micro-batch and the activations it keeps (bytes), and the
    pipeline's seconds: what depends on (pp, dp, micro-batches, recompute, schedule) alone.

    Model stage s takes t_s per micro-batch (forward and backward). A rank's T_r is its stages'
    t_s over the P pipelines; the step is M max_r T_r plus the fill and drain:
      one stage per rank (1F1B, interlaced)       sum_s t_s - max_s t_s        (exact for 1F1B;
                                                  3F1B: the simulated timeline of its order)
      V stages per rank (interleaved)             (D - 1) max_s t_s             (t_s: a 1/V chunk)
      P pipelines (Chimera, P = 2)                (D - P) / P max_s t_s         (its bubble formula)
    Activations: stage s of a pipeline keeps min(D·V/P - s, M/P) micro-batches (1F1B's warm-up);
    interleaved and interlaced keep the forwards their table's warm-up W runs before the first
    backward, W + 1 chunks of 1/V of the rank's stages (interlaced: 2 (D - 1 - s) + 1), and every
    device keeps a vocabulary step's saved tensors as long as the step's owner stage keeps its
    micro-batch. Interlaced: every device runs each vocabulary step (the
    calls, a fused head's loss) on its 1/(tp x pp) of the vocabulary and all-reduces each call's
    hidden state over the tp x pp devices (the analytic price of the steps, as the paper schedules
    them: no rank waits in another's step; plan/interlaced.py `price` walks their order)."""
    tp, dp, pp, micro = config.tp, config.dp, config.pp, config.micro_batches
    table = _table(config.schedule)
    V, P = (table.virtual_stages, table.pipelines) if pp > 1 else (1, 1)
    ranks, length = _ranks(config.schedule, pp)
    fraction = 1.0 / (dp * micro)                 # of the traced batch, per micro-batch
    pp_link = _link(cluster, tp * dp, pp)
    hidden, shared = (b / (tp if config.sequence_parallel else 1) for b in (blocks.input_bytes, blocks.shared_input_bytes))
    st = _stages(cost, blocks, length)
    # a stage hands on the hidden state, and what every later block reads where the next stage reads it
    hand_off = pp_link.latency + fraction * hidden / pp_link.bandwidth if pp > 1 else 0.0
    shared_hand_off = fraction * shared / pp_link.bandwidth if pp > 1 else 0.0
    # each call's hidden state all-reduced over its step's tp x pp devices, whose slowest link is the pipeline's
    shares = sum(all_reduce_time(fraction * h, tp * pp, pp_link) for h in cost.shared_hidden) if pp > 1 else 0.0
    chunk, kept = [], []
    for s in range(length):
        seconds = fraction * st.bw[s] + st.fx[s] + shares
        if config.recompute:
            seconds += fraction * st.forward_bw[s] + st.forward_fx[s]
            saved = st.saved_outside_blocks[s] + st.blocks[s] * hidden + (shared if st.reads_shared[s] else 0.0)
        else:
            saved = st.saved[s]
        seconds += st.sends[s] * hand_off + st.shared_sends[s] * shared_hand_off   # each way, per neighbour
        chunk.append(seconds)
        kept.append(fraction * saved)
    stage_seconds, pipeline = pipeline_seconds(config.schedule, pp, micro, chunk)
    if pp > 1 and V == 1 and P == 1 and config.schedule not in ("1f1b", INTERLACED):
        # 3f1b: each pass waits for the one before to come round the pipeline, which the formula misses
        pipeline = simulated_seconds(table, chunk, micro, blocks.passes)     # the table read once (_table)
    if V == 1 and P == 1 and (config.schedule != INTERLACED or pp == 1):
        activations = [kept[s] * min(pp - s, micro) for s in range(pp)]
    elif P == 1:        # interleaved; interlaced, whose lock-step warm-up is twice 1F1B's
        from .schedules import evaluate
        K = V * micro
        flights = [min(evaluate(table.warmup, {"i": r, "D": pp, "M": micro, "V": V, "P": P, "K": K, "N": 1},
                                table.location) + 1, K) for r in range(pp)]
        activations = [sum(kept[m] for m in mine) / V * flight for mine, flight in zip(ranks, flights)]
        if cost.shared_saved_at and V == 1:
            # the vocabulary steps' saved tensors, on every device, for as long as their owner
            # stage holds the micro-batch (a head on the last stage: one; an embedding on the first: W + 1)
            owner = _stage_of_region(blocks, pp)
            steps = sum(fraction * saved / pp * flights[owner[r]] for r, saved in cost.shared_saved_at.items())
            activations = [a + steps for a in activations]
    else:
        activations = [sum(kept[m] * min(length - m, micro // P) for m in mine) for mine in ranks]
    return stage_seconds, activations, pipeline


def _stage_of_region(blocks: _Blocks, pp: int) -> dict[int, int]:
    """The stage running each region: the prologue the first, the epilogue the last."""
    owner = {0: 0, blocks.count + 1: pp - 1}
    for s, (a, b) in enumerate(_stage_ranges(blocks, pp)):
        owner.update((r, s) for r in range(a + 1, b + 1))
    return owner


def pipeline_seconds(order: str, pp: int, micro: int, chunk: list[float]) -> tuple[list[float], float]:
    """Per rank the seconds per micro-batch, and the step, of `micro` micro-batches through model
    stages taking `chunk[s]` each (forward and backward), ordered by the schedule table `order` on
    `pp` ranks (the formulas of _stage_times' docstring)."""
    table = _table(order)
    V, P = (table.virtual_stages, table.pipelines) if pp > 1 else (1, 1)
    ranks, _ = _ranks(order, pp)
    stage_seconds = [sum(chunk[m] for m in mine) / P for mine in ranks]
    if V == 1 and P == 1:
        return stage_seconds, sum(chunk) + (micro - 1) * max(chunk)
    if P == 1:
        return stage_seconds, micro * max(stage_seconds) + (pp - 1) * max(chunk)
    return stage_seconds, micro * max(stage_seconds) + (pp - P) / P * max(chunk)


def _stage_state(config: Config, cost: _Regions, blocks: _Blocks, cluster: ClusterSpec):
    """Per pipeline rank, the bytes of parameters, gradients and optimizer state one device holds,
    the slowest rank's gradient sync and optimizer step, the sync the output hides, each rank's
    parameters outside the blocks (ZeRO's root unit), whether it runs blocks and the most one block
    of the other lists rebuilds under recompute: what depends
    on (pp, dp, ZeRO, schedule) alone. Replicated pipelines (Chimera) also sum the gradients of
    the two copies of a model stage over the pipeline."""
    tp, dp, pp, zero = config.tp, config.dp, config.pp, config.zero
    device, dp_link = _link(cluster, 1, tp), _link(cluster, tp, dp)
    pp_link = _link(cluster, tp * dp, pp)
    ranks, length = _ranks(config.schedule, pp)
    copies = _table(config.schedule).pipelines if pp > 1 else 1
    st = _stages(cost, blocks, length)
    states, sync_most, hidden, roots, with_blocks, others = [], 0.0, 0.0, [], [], []
    gather_most = 0.0           # ZeRO-3: one all-gather of the rank's parameters
    for mine in ranks:
        held = sorted(set(mine))
        params = sum(st.params[m] for m in held)
        grads = params * 4.0
        sync = sum(st.partial_seconds[m] for m in held)
        sync += sum(all_reduce_time(st.params[m] * 4.0, copies, pp_link) for m in held if mine.count(m) < copies)
        if dp > 1:
            spread = (dp - 1) / dp * grads / dp_link.bandwidth
            if zero:                              # reduce-scatter of gradients, all-gather of parameters
                sync += 2 * (dp_link.latency + spread)
            else:
                sync += dp_link.latency + 2 * spread
            if zero == 3:                         # parameters gathered for backward too
                sync += dp_link.latency + spread
                gather_most = max(gather_most, dp_link.latency + spread)
            # issued from the forward's and the backward's hooks (runtime/_comm.py): DP's bucket
            # all-reduces, ZeRO-2's reduce-scatters, ZeRO-3's too and its gathers; ZeRO-1 and 2
            # gather the updated shards after the step, ZeRO-1 reduce-scatters after the backward
            hidden = max(hidden, {0: dp_link.latency + 2 * spread, 1: 0.0, 2: dp_link.latency + spread,
                                  3: 3 * (dp_link.latency + spread)}[zero])
        sync += params / (dp if zero else 1) * device.seconds_per_param
        state = state_bytes_per_device(params, zero, dp)
        if pp > 1 and zero >= 2:    # a pipeline's gradients add up over its micro-batches whole, and
            # finish_backward reduce-scatters them once (ZeroShards' overlap=False, emit/templates.py)
            state = replace(state, grads=state_bytes_per_device(params, 1, dp).grads)
        states.append(state.total)
        sync_most = max(sync_most, sync)
        roots.append(sum(st.outside_params[m] for m in held))
        with_blocks.append(any(st.blocks[m] for m in held))
        others.append(max(st.rebuilt_outside_blocks[m] for m in held))
    return states, sync_most, hidden, roots, with_blocks, others, gather_most


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
    under `table` (None: the free search; "megatron", "sequence_parallel": those tables; a co-shard
    configuration solves the coshard table, an interlaced one keeps the vocabulary whole on tp)."""
    budget = memory_budget if memory_budget is not None else cluster.memory
    blocks = _blocks(graph)
    variant = _variant_of(config)
    table = COSHARD if variant == COSHARD else table
    apart: frozenset[int] = frozenset()
    rules = load_table(table).for_axis("tp") if table else []
    if variant == INTERLACED:
        from . import interlaced
        from .pipeline import cut_blocks
        schedule = _table(INTERLACED)
        modules, _ = interlaced.vocab_modules(graph, cut_blocks(graph), config.tp * config.pp, schedule.vocab,
                                              schedule.location)
        apart = interlaced.step_nodes(graph, modules)
        blocks = interlaced._without_calls(graph, [graph.nodes[i] for i in sorted(apart)])
        rules = interlaced.keep_whole_on_tp(graph, schedule, config.pp, rules)
    plan = None
    if config.tp > 1:
        with fused_collectives(bool(table) and load_table(table).fused_collectives):
            plan = search_axis(graph, "tp", config.tp, rules + constraints, cluster.axis(1, config.tp),
                               data_parallel=config.dp * config.micro_batches)
    cost = _regions(graph, blocks, plan, config.tp, cluster.axis(1, config.tp), apart)
    if config.coshard > 1:
        from .tables import chunks_for
        anchors = {i for i in range(len(graph.nodes)) if chunks_for(rules, graph, i) != 1}
        cost = _coshard_regions(graph, blocks, cost, plan, anchors, config.coshard, config.tp,
                                cluster.axis(1, config.tp))
    if config.cuts:
        blocks = _cut_at(blocks, _ranks(config.schedule, config.pp)[1], config.cuts)
    return _estimate(config, cost, blocks, graph.trace.batch_size or 1, cluster, budget)
