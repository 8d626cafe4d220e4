"""Can the batch be split? Data parallelism and pipeline micro-batches both run each op on a
slice of the batch, which is right only if no op mixes samples.

The batch dim is followed from the model's inputs through each op's split annotation: an op
whose batch label is fixed (BatchNorm's statistics), or that has no annotation at all, cannot
run on a slice. Reducing over the batch is what a loss does (DP averages the gradients), but a
batch-reduced value that meets the batch again (`x - x.mean(0)`), or another such value in a
product (a load-balancing loss's `p.mean() * f.mean()`), would mix samples. Checks;
decides nothing, except how the loss combines the samples (`loss_reduction`).
"""
from __future__ import annotations

import re

from ..errors import UserError
from ..graph.graph import Graph
from ..trace.records import Node, TensorList


def check_batch_split(graph: Graph, what: str, across_ranks: bool = True) -> None:
    problem = batch_split_problem(graph, what, across_ranks)
    if problem is not None:
        raise problem


def batch_split_problem(graph: Graph, what: str, across_ranks: bool = True) -> UserError | None:
    """The error, at the op's source position, if the model's batch cannot be sliced for `what`.
    `across_ranks`: the slices run at once on data-parallel ranks, which can sum an op's
    statistics over the batch (BatchNorm: `dp_batch_norm`); micro-batches, run one after
    another, cannot."""
    found = _first_mixing_op(graph, across_ranks=across_ranks, locate=True)
    if found is None:
        return None
    node, why = found
    synced = any(data_parallel_impl(graph.dims.get(node.index), label) for label in graph.dims[node.index].fixed) \
        if node.index in graph.dims else False
    hint = "data-parallel ranks sum its statistics (--dp); micro-batches, run one after another, cannot: use " \
        "--micro-batches 1" if synced else "run it on the whole batch (no --dp, --micro-batches 1), or change the model"
    return UserError(f"{node.callee} {why}, so {what} would not match the single-device run",
                     node.span.start if node.span is not None else None, hint=hint)


def micro_batch_statistics(graph: Graph, what: str) -> list[Node]:
    """Under micro-batches (a pipeline), the ops that normalise by statistics over the batch
    (BatchNorm): each micro-batch is normalised by its own, as GPipe and torch.distributed.pipelining
    do, which is what one device computes accumulating gradients over the same micro-batches (the
    output says so, and verify compares with that). Any other op mixing the samples is refused at
    its line; [] when none mixes them."""
    check_batch_split(graph, what)      # an op mixing samples that is no batch statistic
    return batch_statistics(graph)


def batch_statistics(graph: Graph) -> list[Node]:
    """The ops that normalise by statistics over the batch (BatchNorm)."""
    return [graph.nodes[index] for index, label in batch_labels(graph).items()
            if index in graph.dims and label in graph.dims[index].fixed
            and data_parallel_impl(graph.dims[index], label) is not None]


def buffers_written(graph: Graph) -> dict[int, list[str]]:
    """Per node, the buffers its calls write in place in the forward (spectral norm's power
    iteration, a step counter, an EMA codebook; BatchNorm's statistics are
    micro_batch_statistics'): under micro-batches they are written once per micro-batch, as one
    device accumulating gradients over the same micro-batches writes them (verify compares with
    that). A buffer written twice in a forward is followed through its first write's result."""
    names = {tid: info.buffer for tid, info in graph.trace.tensors.items() if info.buffer is not None}
    found: dict[int, list[str]] = {}
    for op in graph.trace.ops:
        for before, after in op.writes:
            name = names.get(before)
            if name is not None:
                if after is not None:
                    names[after] = name
                if name not in found.setdefault(op.node, []):
                    found[op.node].append(name)
    return found


def buffer_write_warnings(graph: Graph, written: dict[int, list[str]], micro: int) -> list[str]:
    """One warning per source line of the nodes buffers_written found."""
    lines: dict = {}
    for index in written:
        span = graph.nodes[index].span
        if span is not None:
            lines.setdefault(span, []).append(index)
    return [f"{span.start}: warning: this call writes {'the buffers' if len(written[calls[0]]) > 1 else 'the buffer'} "
            f"{', '.join(written[calls[0]])} in the forward, once for each of the {micro} micro-batches: a step "
            f"computes what one device computes accumulating gradients over {micro} micro-batches, and verify "
            f"compares with that" + (f" (so do its {len(calls) - 1} more calls from this line)" if len(calls) > 1 else "")
            for span, calls in lines.items()]


def statistics_warnings(nodes: list[Node], micro: int) -> list[str]:
    """One warning per source line of the ops micro_batch_statistics found."""
    lines: dict = {}
    for node in nodes:
        if node.span is not None:
            lines.setdefault(node.span, []).append(node)
    return [f"{span.start}: warning: {calls[0].callee} normalises each of the {micro} micro-batches by its own "
            f"batch statistics (as GPipe and torch.distributed.pipelining do): a step computes what one device "
            f"computes accumulating gradients over {micro} micro-batches, and verify compares with that"
            + (f" (so do its {len(calls) - 1} more calls from this line)" if len(calls) > 1 else "")
            for span, calls in lines.items()]


def _batched_operands(node: Node, batched: dict[int, int]):
    """(operand name as the rule names it, tensor) for each operand that carries the batch."""
    for operand in node.operands:
        listed = isinstance(operand.value, TensorList)
        for k, tid in enumerate(operand.value if listed else [operand.tid]):
            if tid in batched:
                yield f"{operand.name}[{k}]" if listed else operand.name, tid


def batch_labels(graph: Graph) -> dict[int, str]:
    """Each op's label for the batch dim, as followed from the inputs (for a model whose batch
    can be split: a split by that label divides the local batch, not the traced one)."""
    labels: dict[int, str] = {}
    _first_mixing_op(graph, labels)
    return labels


def loss_reduction(graph: Graph) -> str:
    """"sum" when the loss adds up its samples (`x.sum()`, a loss function's reduction="sum"),
    else "mean". Data-parallel and micro-batch shares of the loss, and their gradients, are
    summed for a sum and averaged for a mean; a mean is the usual case and the default."""
    kinds: dict[int, str] = {}
    _first_mixing_op(graph, kinds=kinds)
    return kinds.get(graph.trace.loss, "mean")


def batch_factors(graph: Graph) -> dict[int, set[str]]:
    """Per op, the labels of its factors that are the batch, for a model whose batch can be split.
    An op's own batch label (followed from the inputs) is one; others are found across tensors
    whose producer and consumer label a dim factor by factor: `alibi.repeat(batch_size, 1, 1)`
    builds (batch heads) from no batched operand, and its (batch heads) is the batch of the
    baddbmm that reads it. Each device holds its slice of the batch, so a dim (batch heads) split
    by heads is in `batch / slices` groups there, whatever the traced batch was."""
    parent: dict[tuple[int, str], tuple[int, str]] = {}

    def find(key):
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    produced: dict[int, tuple[int, object]] = {}
    for index, dims in graph.dims.items():
        for tensor in dims.outputs:
            produced.setdefault(tensor.tid, (index, tensor))
    for index, dims in graph.dims.items():
        for tensor in dims.inputs.values():
            source = produced.get(tensor.tid)
            if source is None or len(source[1].dims) != len(tensor.dims):
                continue
            for mine, theirs in zip(tensor.dims, source[1].dims):
                if [f.size for f in mine] != [f.size for f in theirs]:
                    continue
                for a, b in zip(mine, theirs):
                    if not a.label[0].isdigit() and not b.label[0].isdigit():
                        parent[find((index, a.label))] = find((source[0], b.label))
    batch = {find((index, label)) for index, label in batch_labels(graph).items()}
    found: dict[int, set[str]] = {}
    for key in list(parent) + list(batch_labels(graph).items()):
        if find(key) in batch:
            found.setdefault(key[0], set()).add(key[1])
    return found


def data_parallel_impl(dims, label: str) -> str | None:
    """The template that runs an op needing the whole batch on data-parallel slices of it."""
    template = dims.impl.get(label) if dims is not None else None
    return template if template is not None and re.search(r"\bDP\b", template) else None


def _first_mixing_op(graph: Graph, labels: dict[int, str] | None = None, kinds: dict[int, str] | None = None,
                     across_ranks: bool = True, locate: bool = False) -> tuple[Node, str] | None:
    """The op that mixes the samples, and why. `locate`: an op whose rule cannot say how it
    treats the batch (a MoE's `torch.where` dispatch) may well keep the samples apart, so the
    scan goes on past it for an op that surely mixes them (two batch means multiplied in a
    load-balancing loss), named in its place; failing one, the first such op is named."""
    unsure = None
    trace = graph.trace
    batch = trace.batch_size
    if not batch:
        return None
    batched = {tid: 0 for tid in trace.inputs.values()
               if trace.tensors[tid].shape and trace.tensors[tid].shape[0] == batch}
    reduced: dict[int, str] = {}       # values computed across the batch: "sum" or "mean" of the samples
    shaped: set[int] = set()           # values shaped like the batch but not made of it (`empty_like(x)`)
    resume = 0                         # nodes before it ran inside a module found to keep samples apart
    for node in graph.nodes:
        if node.index < resume:
            continue
        problem = _mixing(graph, node, batched, reduced, shaped, labels, across_ranks)
        if problem is None:
            continue
        claim = _enclosing_module_kept_apart(graph, node)
        if claim is None:
            if not locate or problem.startswith(_SURELY_MIXES):
                return node, problem
            unsure = unsure or (node, problem)   # its results are followed no further
            continue
        outputs, resume = claim
        batched.update(outputs)
        for tid in outputs:
            reduced.pop(tid, None)
    if kinds is not None:
        kinds.update(reduced)
    return unsure


def _mixing(graph: Graph, node: Node, batched: dict[int, int], reduced: dict[int, str], shaped: set[int],
            labels: dict[int, str] | None, across_ranks: bool) -> str | None:
    """Why `node` mixes the samples, or None; follows the batch dim (`batched`), the values
    reduced over the batch (`reduced`) and those that only take the batch's shape (`shaped`)
    through it."""
    trace = graph.trace
    tensors = trace.tensors
    inputs = list(_batched_operands(node, batched))
    mixes = any(t in reduced for t in node.inputs)
    _follow_shape(graph, node, batched, shaped)
    if not inputs:
        # `torch.empty_like(scores).exponential_()`: the draw fills a tensor that only has the
        # batch's shape, and is the op to name (not a later op reading the numbers)
        if _draws(trace, node, _DRAWS - _KEEP_MASKS) and shaped.intersection(node.inputs):
            return _DRAWS_PER_SAMPLE
        if mixes and _multiplies_reduced(node, reduced, trace):
            return _PRODUCT_OF_REDUCED
        if mixes:
            reduced.update(dict.fromkeys(node.produced, _combined_kind(node, reduced, trace.batch_size, trace)))
        return None
    if _dead(node):
        return None
    if mixes:
        return _REDUCED_MEETS_BATCH
    if all(not tensors[t].shape for t in node.outputs or node.produced):   # a loss or metric: DP averages it
        reduced.update(dict.fromkeys(node.produced, _reducer_kind(node, trace)))
        return None
    if _draws(trace, node):
        return _DRAWS_PER_SAMPLE
    dims = graph.dims.get(node.index)
    problem = _leaked_inside_value(graph, node, dims, [tid for _, tid in inputs])
    if problem is not None:
        return problem
    if dims is None:
        problem = f"has no split rule ({graph.problems.get(node.index) or 'no annotation'})"
    else:
        for operand, tid in inputs:
            tensor = dims.inputs.get(operand)
            dim = batched[tid]
            if operand not in dims.shape_only and not (tensor is not None and dim < len(tensor.dims)
                                                       and tensor.dims[dim]):
                problem = f"cannot split its operand {operand} on the batch dim (dim {dim})"
                break
    if problem is not None:
        kept = graph.batch_kept_apart(node)   # its own arguments at half the batch (`x.as_strided(x.size())`)
        if kept is None:
            return problem
        batched.update(kept)
        return None
    for operand, tid in inputs:
        if operand in dims.shape_only:
            continue
        tensor = dims.inputs.get(operand)
        dim = batched[tid]
        label = tensor.dims[dim][0].label
        if labels is not None:
            labels[node.index] = label
        if label in dims.fixed and not (across_ranks and data_parallel_impl(dims, label)):
            return f"{_NEEDS_WHOLE_BATCH}: dim {dim} of {operand} is fixed in its rule"
        if label in dims.reduced:
            reduced.update(dict.fromkeys(node.produced, _reducer_kind(node, trace)))
            continue
        for out in dims.outputs:
            place = out.where(label)
            if place is not None and place[1] == 1:
                batched[out.tid] = place[0]
    return None


def _follow_shape(graph: Graph, node: Node, batched: dict[int, int], shaped: set[int]) -> None:
    """An op that reads only the shape of a batched value (`empty_like`, an in-place fill)
    returns a value shaped like the batch: no sample's data, but a draw into it is per sample."""
    dims = graph.dims.get(node.index)
    if dims is None or not dims.shape_only:
        return
    if any(o.name in dims.shape_only and (o.tid in batched or o.tid in shaped) for o in node.operands):
        shaped.update(t for t in node.produced if t not in batched)


def _enclosing_module_kept_apart(graph: Graph, node: Node) -> tuple[dict[int, int], int] | None:
    """({output tensor: batch dim}, the first node after the call) of the innermost module around
    `node` whose call as a whole keeps the samples apart (graph/batch_probe.py): a MoE layer
    sorting all tokens by expert, then putting each result back in its token's place. Its
    inside is then no concern of the batch; a value computed inside that later code reads
    (other than what the call returns) leaves the question open."""
    path = node.module_path
    while path:
        kept = graph.module_kept_apart(path)
        if kept is not None:
            inside = _nodes_inside(graph, node, path)
            returned = set(graph.trace.module_replays[path].outputs)
            leaked = any(consumer not in inside for n in inside for tid in graph.nodes[n].produced
                         if tid not in returned for consumer, _ in graph.consumers.get(tid, ()))
            # a random draw inside: the probe's half batch draws the first half of the same numbers,
            # which another rank or micro-batch does not (PhiMoE's Gumbel routing)
            if leaked or any(_draws(graph.trace, graph.nodes[n]) for n in inside):
                return None
            return kept, max(inside) + 1
        path = path.rpartition(".")[0]
    return None


def _nodes_inside(graph: Graph, node: Node, path: str) -> set[int]:
    """The run of nodes around `node` that the module at `path` (or a module under it) made."""
    def under(n: int) -> bool:
        module = graph.nodes[n].module_path
        return module == path or module.startswith(path + ".")
    first = last = node.index
    while first > 0 and under(first - 1):
        first -= 1
    while last + 1 < len(graph.nodes) and under(last + 1):
        last += 1
    return set(range(first, last + 1))


def _leaked_inside_value(graph: Graph, node: Node, dims, batched_inputs: list[int]) -> str | None:
    """A call's rule covers the results it returns: a value computed inside it from the batch
    that later code reads all the same (a library stashing its experts' token order in a
    global) could mix the samples, and nothing says how."""
    trace = graph.trace
    replay = trace.replays.get(node.index)
    returned = replay.outputs if replay is not None and replay.outputs is not None else node.outputs
    covered = {tensor.tid for tensor in dims.outputs} if dims is not None else set(returned)
    leaked = [tid for tid in node.outputs if tid not in covered and graph.consumers.get(tid)]
    if not leaked:
        return None
    from_batch = set(batched_inputs)
    for op in (trace.ops[i] for i in node.ops):
        if from_batch.intersection(op.inputs):
            from_batch.update(op.outputs)
    for tid in leaked:
        if tid in from_batch:
            later = graph.nodes[graph.consumers[tid][0][0]]
            where = f" at {later.span.start}" if later.span else ""
            return f"computes a value inside the call that the code after it reads ({later.callee}{where}), " \
                "and no rule says how it depends on the batch"
    return None


_REDUCED_MEETS_BATCH = "combines a value reduced over the batch with the batch itself"
_PRODUCT_OF_REDUCED = "multiplies values each reduced over the whole batch (the product of the batch's means " \
    "is not the mean of each slice's product)"
_NEEDS_WHOLE_BATCH = "needs the whole batch"
# a random draw shaped by the batch (PhiMoE's Gumbel sampling of experts, `rand_like(scores)`): one
# generator fills the whole batch on one device, so a slice of it draws other numbers for its
# samples. Dropout is not one of these: verify turns it off in both runs.
_DRAWS = {"rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_", "multinomial", "exponential_",
          "uniform_", "normal_", "random_", "geometric_", "cauchy_", "log_normal_", "poisson"}
_DRAWS_PER_SAMPLE = "draws random numbers for the samples of the batch (a slice draws other numbers for its " \
    "samples than one device gives them)"
_SURELY_MIXES = (_REDUCED_MEETS_BATCH, _PRODUCT_OF_REDUCED, _NEEDS_WHOLE_BATCH, _DRAWS_PER_SAMPLE)


# stochastic depth's per-sample keep mask (timm's `x.new_empty((b, 1)).bernoulli_(keep)`): a
# dropout, switched off in both runs of a verify (verify/worker.py: switch_off_dropout)
_KEEP_MASKS = {"bernoulli", "bernoulli_"}


def _draws(trace, node: Node, draws: set[str] = _DRAWS) -> bool:
    return any(trace.ops[i].func.rsplit(".", 1)[-1] in draws for i in node.ops)


def _multiplies_reduced(node: Node, reduced: dict[int, str], trace) -> bool:
    """`probs.mean(0) * counts.mean(0)` (a MoE's load-balancing loss): a product of two values
    reduced over the batch is no sum over the samples, so no sum over the ranks gives it. A
    reduced value divided by another (a loss sum by its token count) is taken for a mean."""
    names = {trace.ops[i].func.rsplit(".", 1)[-1] for i in node.ops}
    return bool(names & _MULTIPLIES) and len({t for t in node.inputs if t in reduced}) > 1


_SUMS = {"sum", "nansum"}
_DIVIDES = {"div", "div_", "true_divide", "__truediv__", "__itruediv__", "divide"}
_MULTIPLIES = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "multiply"}


def _reducer_kind(node: Node, trace) -> str:
    """Whether the op that reduces the batch sums its samples: its last reducing torch call is a
    sum, or a loss function called with reduction="sum", and no arithmetic follows it."""
    for op in reversed([trace.ops[i] for i in node.ops]):
        name = op.func.rsplit(".", 1)[-1]
        if name in _SUMS:
            return "sum"
        if op.reduction is not None:
            return "sum" if op.reduction == "sum" else "mean"
        if name in _DIVIDES or name in _MULTIPLIES or name in ("mean", "nanmean"):
            return "mean"
    return "mean"


def _combined_kind(node: Node, reduced: dict[int, str], batch: int, trace) -> str:
    """The kind of a value computed from batch-reduced values only. A sum divided by another
    batch-reduced value (a count of tokens) or scaled by a multiple of the batch size
    (`loss.sum() / x.shape[0]`) is a mean; sums added to sums stay a sum; any other mix, a mean."""
    kinds = {reduced[t] for t in node.inputs if t in reduced}
    names = {trace.ops[i].func.rsplit(".", 1)[-1] for i in node.ops}
    if names & (_DIVIDES | _MULTIPLIES):
        by_reduced = len([t for t in node.inputs if t in reduced]) > 1
        by_batch = any(isinstance(o.value, int) and not isinstance(o.value, bool) and o.value and o.value % batch == 0
                       for o in node.operands)
        if by_reduced or by_batch:
            return "mean"
    return kinds.pop() if len(kinds) == 1 else "mean"


def _dead(node: Node) -> bool:
    """A result nothing reads (a pooler output a masked LM computes and drops) cannot mix the
    samples of anything that matters. Writes in place are read through the tensor they change."""
    name = node.callee.rsplit(".", 1)[-1]
    return bool(node.produced) and not node.outputs and not (name.endswith("_") or name.startswith("__set"))

