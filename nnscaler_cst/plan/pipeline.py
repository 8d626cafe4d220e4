"""Pipeline stages as op_assign: the loop over a model's repeated blocks is cut into stages.

The function that loops over the blocks (found from where the trace saw each block called)
splits into a prologue (before the loop: embeddings, masks), the loop, and an epilogue
(after it: final norm, head, loss). Stage 0 runs the prologue, every stage runs its own
contiguous range of blocks, the last stage runs the epilogue; the variables the prologue and
the loop define and later code reads are handed from stage to stage. Blocks are balanced by
the cost model, or cut where the user says (--stages). Decides; rewrites nothing.
"""
from __future__ import annotations

import bisect
import copy
import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import libcst as cst

from ..errors import UserError
from ..graph.graph import Graph
from ..source.files import Span
from ..source.names import bound_on_every_path, exposed_reads, names_in
from ..trace.records import TensorList
from .cost import node_flops


@dataclass
class Trunk:
    container: str                 # module path of the blocks' container: transformer.h
    blocks: list[str]              # block module paths, in call order
    function: cst.FunctionDef      # the function holding the loop
    function_span: Span
    loop_index: int                # position of the loop in the function body
    handoff: list[str]             # variables handed from stage to stage
    # the module whose method holds the loop, when that method also loops over other blocks
    # (T5's one stack class runs the encoder's and the decoder's): only its call is cut
    owner: str | None = None
    recycle: "Recycle | None" = None     # the loop running the trunk N times (3F1B), when it has one
    # hand-off variables the first stage may reach the hand-off without (set before the loop only
    # under a condition: MVP's `if self.use_prompt: self_attn_prompt = ...`): bound to None first
    unset: list[str] = field(default_factory=list)
    # calls in the code before the loop (`self.set_attention_type("original_full")`) that change the
    # state of modules later stages hold: the first stage notes each one it runs, and every later
    # stage runs it too, before its blocks (pp_replayed / pp_replay)
    replays: list[Span] = field(default_factory=list)
    # a forward written as a chain of statements, cut between them (no block list): see Statements
    statements: "Statements | None" = None
    # the call of an nn.Sequential of stages moved out of its statement (`return self.stages(x)`): the
    # name it reads, which it then assigns (`x = self.stages(x)`, then `return x`)
    hoist: str | None = None
    # the blocks are lists of modules (`ModuleList([norm, block, residual])` per layer) that the
    # loop's iterations run, one block per iteration: every stage keeps the whole list (the other
    # stages' blocks hollow) and runs the iterations of its own blocks, so that the sequences zipped
    # with the blocks and the layer index stay those of the whole model (also when code after the
    # loop reads the list: DiT's `self.transformer_blocks[0].norm1.emb`, held by the last stage too)
    iterations: bool = False


@dataclass
class Statements:
    """A function written as a chain of statements (`x = self.layer1(x)`, `x = self.layer2(x)`, ...:
    ResNet's layers, DLA's levels, a UNet's down and up blocks): the stages cut it between top-level
    statements of its body. Its blocks are runs of statements ("units") that a cut may separate;
    each stage runs its units, what the statements before a cut set and the statements after it
    read is handed on, and a stage holds the modules its statements call."""
    starts: list[int]                    # per unit, the index in the function's body of its first statement
    crossing: dict[int, list[str]]       # body index of a unit's start -> the names handed on there
    block_of: dict[int, int]             # node index -> unit
    # the chain runs in a branch of an `if` of the body: the indices above count the body with that
    # `if` replaced by the branch's statements (branch_body)
    branch: "Branch | None" = None


@dataclass(frozen=True)
class Branch:
    """The `if` of a function's body whose branch the trace took holds the chain of statements the
    stages cut (timm's ResNet: `if self.grad_checkpointing: checkpoint_seq([...], x)`, else the
    stage calls one by one). Its condition reads configuration only, so the trace's branch is the
    one every step takes; each stage running some of the branch's statements first checks that it
    still is (a stage holds only its modules: no stage could run another branch)."""
    index: int          # the `if`'s index in the function's body
    taken: int          # the branch the trace took: 0 the `if`, then each `elif`, then the `else`


@dataclass
class Recycle:
    """The loop that runs the trunk N times (recycling): each pass but the last without gradient,
    its outputs fed back as the next pass's inputs. With the 3F1B schedule every pipeline action
    runs one pass of it: the first stage takes the carried values from the last stage."""
    loop: Span                     # the `for` statement
    function: Span                 # the function holding it
    carried: list[str]             # names the body reads before setting them and sets again
    passes: int                    # N: how often the trunk runs in one forward
    call: Span | None = None       # the call of the cut function in it
    # the last pass written after the loop (`for _ in range(n - 1): ...` under no_grad, then the
    # pass with gradient): its call of the cut function; the loop runs the N - 1 before it
    after: Span | None = None


@dataclass(frozen=True)
class ChainRole:
    """What one stage does in one trunk of a chain (runtime: the module's `pp_trunk`).
    enter: it runs the code before the trunk's blocks (the first stage, or the one that ran the
    previous trunk's last block); receive: it starts there, from the previous stage's hand-off;
    skip: it starts after the trunk, whose return value came with the hand-off. A stage that ends
    before a trunk has no role in it. first/stop: its blocks, counted within the trunk."""
    role: str
    first: int
    stop: int
    hands_on: bool                 # its blocks end inside this trunk: it hands on after them


@dataclass
class StagePlan:
    ranks: int                     # pipeline ranks D
    virtual: int                   # stages per rank V (interleaving)
    trunk: Trunk
    block_ranges: list[tuple[int, int]]          # per stage s = 0..D*V-1: blocks [a, b)
    node_stage: dict[int, int]
    drop: dict[int, list[str]]                   # stage -> modules it does not hold
    shadow: dict[int, list[str]] = field(default_factory=dict)   # stage -> modules it holds, frozen, only
    # because code outside the cut function runs them on every stage (an embedding called above the
    # block loop, whose output a later stage reads for its shape only); the owning stage trains them
    tied: list[list[str]] = field(default_factory=list)   # params held by several stages
    # params of shadows whose output a later stage computes with (a position bias made once above
    # the cut function and read by every block): trained on every stage, gradients summed over the
    # pipeline, so each stage's contribution reaches them and every copy stays equal
    shared: list[list[str]] = field(default_factory=list)
    # chained trunks: the pipeline ranks holding the tied parameters (an embedding the encoder, the
    # decoder and the head share may sit on a middle stage too); their gradients are summed there
    tied_ranks: list[int] = field(default_factory=list)
    stage_seconds: list[float] = field(default_factory=list)
    # op-assign of the schedule table: the rank of each stage (default s % ranks), and the stages
    # of one pipeline (fewer than all when pipelines are replicas: Chimera); node_stage and tied
    # then count model stages, 0..length-1, and stage s runs model stage s % length
    placement: tuple[int, ...] = ()
    length: int = 0
    # interlaced (plan/interlaced.py): modules split on the vocabulary over all pipeline ranks,
    # every name of the parameters they split, and the stages whose steps call them
    vocab_modules: list[str] = field(default_factory=list)
    vocab_params: list[str] = field(default_factory=list)
    vocab_stages: list[int] = field(default_factory=list)
    vocab_calls: dict[int, int] = field(default_factory=dict)   # stage -> their calls in one step
    vocab_heads: list[str] = field(default_factory=list)     # heads fused with their cross entropy
    vocab_losses: list[int] = field(default_factory=list)    # those cross entropies' nodes
    vocab_steps: dict = field(default_factory=dict)   # stage -> VocabSteps: where its calls come, how long
    # chained trunks (an encoder's blocks, then a decoder's): every trunk in call order, the blocks
    # counted over all of them; per stage, the part each trunk plays there (ChainRole)
    chain: list[Trunk] = field(default_factory=list)
    roles: dict[int, dict[str, "ChainRole"]] = field(default_factory=dict)
    # BatchNorm normalises each micro-batch by its own statistics (plan/batch.py micro_batch_statistics)
    micro_statistics: bool = False

    @property
    def trunks(self) -> list[Trunk]:
        return self.chain or [self.trunk]

    @property
    def blocks(self) -> list[str]:
        """Every block the stages cut, in call order (of all chained trunks)."""
        return [b for t in self.trunks for b in t.blocks]

    def local_ranges(self, stage: int) -> dict[str, tuple[int, int]]:
        """Per block list, the blocks of it this stage holds, counted within the list."""
        if not self.chain:
            return {self.trunk.container: self.block_ranges[stage]}
        return {t.container: (role.first, role.stop) if role else (0, 0)
                for t in self.chain for role in [self.roles[stage].get(t.owner)]}

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    @property
    def per_pipeline(self) -> int:
        return self.length or self.stages

    def rank_of(self, stage: int) -> int:
        return self.placement[stage] if self.placement else stage % self.ranks

    def replicas(self, model_stage: int) -> list[int]:
        """The stages running one model stage: itself, or one per pipeline."""
        return list(range(model_stage, self.stages, self.per_pipeline))

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if self.rank_of(s) == rank]


def _once_per_graph(find):
    """`find(graph)` computed once per graph (plan_stages, cut_blocks, recompute and auto all ask;
    each answer is a pass over the nodes and the source), its UserError raised again each time.
    Each caller gets its own copies of the trunks: plan_stages sets per-plan fields on them."""
    @functools.wraps(find)
    def cached(graph: Graph):
        cache = graph.__dict__.setdefault("_pipeline_finds", {})
        if find.__name__ not in cache:
            try:
                cache[find.__name__] = (find(graph), None)
            except UserError as exc:
                cache[find.__name__] = (None, exc)
        found, error = cache[find.__name__]
        if error is not None:
            raise error
        return [copy.copy(t) for t in found] if isinstance(found, list) else copy.copy(found)
    return cached


@_once_per_graph
def find_trunk(graph: Graph) -> Trunk:
    """The blocks the stages cut: a group of repeated blocks called in a loop or through an
    nn.Sequential of them; failing one, the stages of an nn.Sequential called once, whatever
    their classes (a CNN's stages of different widths, a stem before them)."""
    calls = graph.trace.module_calls
    try:
        if not graph.blocks:
            raise _no_blocks(graph)
        # blocks called as modules, or lists of modules a loop runs one per iteration, first (Funnel's
        # encoder holds ModuleLists of layers, never called themselves, whose layers are the blocks),
        # then a loop that calls no other blocks, then the longest, then the one holding more weights
        # (two lists of equal length: the trunk, not a stack beside it built first)
        paths = max(graph.blocks.values(), key=lambda group: (
            sum(p in calls for p in group) >= 2 or _lists_of_modules(graph, group),
            _loop_runs_once(group, calls), len(group), _weights(graph, group)))
        trunk = _trunk_of(graph, paths)
        turns = _runs_in_turn(graph, trunk)
        if turns is not None:       # the stages divide the iterations, the blocks kept whole
            trunk.blocks, trunk.iterations = turns, True
        _check_work_above_cut(graph, trunk)
        if not trunk.iterations:        # those stages keep the whole list: code after the loop may read it
            _check_epilogue_reads_blocks(graph, trunk)      # (and may cut this loop so too)
        return trunk
    except UserError as error:
        stages = _sequential_stages(graph)
        if stages:
            return _trunk_of(graph, stages)
        # one layer a loop calls again and again, its weights shared (ALBERT, a universal transformer):
        # the stages divide the loop's iterations; without repeated blocks, or with blocks no cut can
        # divide (a UNet's blocks run late, under the down path every stage would compute again): the
        # statements of a function; a layer called again and again outside a loop no stage can split
        shared = _shared_layer(graph) if not graph.blocks else None
        if shared is not None and shared[0] in calls and _enclosing_loop(graph, shared[2]) is not None:
            trunk = _shared_trunk(graph, shared[0], shared[1])
            _check_work_above_cut(graph, trunk)
            return trunk
        if error.message.startswith(_SHARED_LAYER):
            raise error
        try:
            chain = _statement_chain(graph, _DIVIDES if graph.blocks else 1.0)
        except UserError as refused:
            if not graph.blocks or refused.message.startswith(_BRANCH_CUT):    # (says why a branch's chain is not cut)
                raise
            chain = None            # the blocks' refusal says more than why no statement can be cut
        if chain is None:
            raise error
        return chain


def _weights(graph: Graph, group: list[str]) -> int:
    """Parameter elements the blocks of `group` hold."""
    prefixes = tuple(p + "." for p in group)
    return sum(math.prod(info.shape) for info in graph.trace.params.values()
               if any(alias.startswith(prefixes) for alias in info.aliases))


def _lists_of_modules(graph: Graph, group: list[str]) -> bool:
    """Whether the blocks of `group` are lists of modules, never called themselves, whose modules
    are called and hold no other group's blocks (x-transformers' `ModuleList([norms, block,
    residual])` per layer, run by one loop; not Funnel's lists of layers, whose layers are blocks)."""
    calls = graph.trace.module_calls
    members = set(group)
    return not any(p in calls for p in group) and all(any(c.startswith(p + ".") for c in calls) for p in group) \
        and not any(other is not group and any(q.rpartition(".")[0] in members for q in other)
                    for other in graph.blocks.values())


def _sequential_stages(graph: Graph) -> list[str]:
    """The children of the nn.Sequential, called once as a statement of the model's own code, whose
    children run the most of the model's work, at least half of it (the stages a CNN runs one after
    the other, not a stem of conv, norm and activation): the module paths of its children, numbered
    0, 1, ... as nn.Sequential numbers them. [] if none."""
    trace = graph.trace
    calls, runs = trace.module_calls, trace.module_runs
    work = [(n.callee_path or n.module_path or "", node_flops(n, graph.dims.get(n.index), trace)) for n in graph.nodes]
    best, best_flops, half = [], 0.0, sum(f for _, f in work) / 2
    for path, (span, _) in calls.items():
        if span not in trace.containers or runs.get(path, 1) != 1:
            continue
        children = _sequential_children(trace, path)
        if len(children) < 2 or any(c not in calls or runs.get(c, 1) != 1 for c in children):
            continue
        flops = sum(f for m, f in work if m == path or m.startswith(path + "."))
        if flops >= half and flops > best_flops:
            best, best_flops = children, flops
    return best


# blocks no cut can divide give way to a cut between statements only where it divides the work: its
# busier stage runs at most this share of it (a stage left nearly idle is no pipeline)
_DIVIDES = 0.9


def _statement_chain(graph: Graph, most: float = 1.0) -> Trunk | None:
    """The function written as a chain of statements whose best cut in two leaves the least work
    on the busier side, counting the code run before the function on every stage (DLA's
    `forward_features`: `x = self.level0(x)`, `x = self.level1(x)`, ...): its trunk, the units
    between the statements where a cut is valid (_valid_cuts). Candidates are the functions
    holding a call of a module; each must run once per step. None if none has a cut whose busier
    side runs at most `most` of the work."""
    trace = graph.trace
    work = [node_flops(n, graph.dims.get(n.index), trace) for n in graph.nodes]
    total = sum(work)
    frames = [_own_frames(trace, node) for node in graph.nodes]
    best, best_key, blocked, refused = None, None, None, None
    for path, function in _calling_functions(graph):
        source = graph.sources.get(path)
        span = source.span_of(function)
        written = list(function.body.body) if isinstance(function.body, cst.IndentedBlock) else []
        sites = {}          # node index -> where this function's code ran it
        for node, own in zip(graph.nodes, frames):
            site = next((f for f in own if f.path == span.path and span.contains(f)), None)
            if site is not None:
                sites[node.index] = site
        as_written = _statement_of(source, written, sites)
        # the body as written, and with an `if` replaced by the branch holding its work (a chain there)
        for branch in [None, *_taken_branches(source, written, as_written, sites)]:
            body = written if branch is None else branch_body(written, branch)
            statement_of = as_written if branch is None else _statement_of(source, body, sites)
            order = [statement_of[i] for i in sorted(statement_of)]
            if len(set(order)) < 2 or order != sorted(order):     # one statement, or run more than once
                continue
            cuts, unsendable = _valid_cuts(body, statement_of)
            if not cuts:
                blocked = blocked or (unsendable and (path, function, body, unsendable))
                continue
            starts = [1 if body and _docstring(body[0]) else 0, *cuts]
            first, last = min(statement_of), max(statement_of)
            block_of, unit = {}, 0
            for index in range(first, last + 1):
                if index in statement_of:
                    unit = sum(1 for start in starts[1:] if start <= statement_of[index])
                block_of[index] = unit
            # the busier side of the best cut; the code that runs before the function is called (the code
            # above it) runs on every stage, so a function called late (a UNet's up block) cuts little
            before = sum(work[:first])
            # a stage holding no parameter would leave its rank's optimizer nothing to train
            trained = {u for i, u in block_of.items() if graph.param_operands(i)}
            inside = [sum(work[i] for i, u in block_of.items() if u < k) for k in range(1, len(starts))
                      if min(trained, default=k) < k <= max(trained, default=k - 1)]
            if not inside:
                continue
            key = before + min(max(a, total - before - a) for a in inside)
            if key <= most * total and (best_key is None or key < best_key):
                refusal = _branch_refusal(source, function, branch, sites) if branch is not None else None
                if refusal is not None:     # said only when no other cut qualifies
                    refused = refused or refusal
                    continue
                crossing = {start: _crossing(body, start) for start in cuts}
                best_key, best = key, (path, function, span, starts, crossing, block_of, body, branch)
    if best is None and refused:
        raise refused
    if best is None and blocked:
        path, function, body, (k, name) = blocked
        source = graph.sources.get(path)
        binding = next(stmt for stmt in reversed(body[:k]) if name in _not_values([stmt]))
        raise UserError(f"pipelining cuts {function.name.value} between its statements, and a cut here hands "
                        f"`{name}` on to the next stage: a function, class or module, bound here, which a stage "
                        "cannot send (a hand-off carries tensors, lists and tuples of them, and plain values)",
                        source.span_of(binding).start,
                        hint=f"define `{name}` outside the function (a method, or at module level)")
    if best is None:
        return None
    path, function, span, starts, crossing, block_of, body, branch = best
    name = function.name.value
    owner = _class_of(graph.sources.get(path), function)
    container = f"{owner.name.value}.{name}" if owner is not None else name
    source = graph.sources.get(path)
    blocks = [f"{container}:{source.span_of(body[k]).line}" for k in starts]
    return Trunk(container, blocks, function, span, starts[0], [],
                 statements=Statements(starts, crossing, block_of, branch))


def _statement_of(source, body: list, sites: dict[int, Span]) -> dict[int, int]:
    """Node index -> the index of the statement of `body` that ran it (a def's body runs elsewhere)."""
    spans = [source.span_of(stmt) for stmt in body]
    found = {}
    for index, site in sites.items():
        k = next((k for k, stmt in enumerate(spans) if stmt.contains(site)
                  and not isinstance(body[k], (cst.FunctionDef, cst.ClassDef))), None)
        if k is not None:
            found[index] = k
    return found


def if_branches(statement: cst.If) -> list[tuple[cst.BaseExpression | None, cst.BaseSuite]]:
    """The branches of an `if`/`elif`/`else` statement in order: (its condition, None for the
    `else`; its block)."""
    found, node = [], statement
    while isinstance(node, cst.If):
        found.append((node.test, node.body))
        node = node.orelse
    if isinstance(node, cst.Else):
        found.append((None, node.body))
    return found


def branch_body(body: list, branch: Branch) -> list:
    """The function's body with the `if` replaced by the statements of the branch the trace took."""
    _, block = if_branches(body[branch.index])[branch.taken]
    return [*body[:branch.index], *block.body, *body[branch.index + 1:]]


def _taken_branches(source, body: list, statement_of: dict[int, int], sites: dict[int, Span]) -> list[Branch]:
    """The `if`s of the body with a branch of two statements or more that ran all the work the
    `if` ran outside its conditions (what a chain of stage calls there looks like), as Branches."""
    found = []
    for k, statement in enumerate(body):
        ran = [sites[i] for i, j in statement_of.items() if j == k]
        if not isinstance(statement, cst.If) or not ran:
            continue
        branches = if_branches(statement)
        tests = [source.span_of(test) for test, _ in branches if test is not None]
        work = [site for site in ran if not any(test.contains(site) for test in tests)]
        blocks = [source.span_of(block) for _, block in branches]
        taken = next((b for b, block in enumerate(blocks) if work and all(block.contains(s) for s in work)), None)
        if taken is not None and isinstance(branches[taken][1], cst.IndentedBlock) \
                and len(branches[taken][1].body) >= 2:
            found.append(Branch(k, taken))
    return found


def _branch_refusal(source, function: cst.FunctionDef, branch: Branch,
                    sites: dict[int, Span]) -> UserError | None:
    """Why the stages cannot cut the chain in the branch the trace took, or None. The conditions
    that choose it must read configuration only (attributes of `self`, module-level names,
    constants: `torch.jit.is_scripting()`), never a tensor or other value of the forward, so that
    every step takes the branch the trace took; and every other branch must run the same modules
    (timm's `checkpoint_seq([self.layer1, ...], x)`), or the cut would drop what it does."""
    statement = function.body.body[branch.index]
    branches = if_branches(statement)
    chosen = [test for test, _ in branches[:branch.taken + 1] if test is not None]
    local = _local_names(function) - {"self"}
    for test in chosen:
        name = next((n for n in _read_names(test) if n.value in local), None)
        span = source.span_of(test)
        op = next((site for site in sites.values() if span.contains(site)), None)
        if name is not None or op is not None:
            what = f"`{name.value}`, a value of the forward" if name is not None else "a tensor"
            return UserError(f"{_BRANCH_CUT}, but its condition reads {what}, not configuration: a later step may "
                             "choose another branch", source.span_of(name).start if name is not None else op.start,
                             hint="choose the branch by attributes of the module or constants only (the branch is "
                                  "fixed when the model is built), or write the chain in the function's body")
    _, taken = branches[branch.taken]
    modules = _self_attributes(taken)
    for b, (test, block) in enumerate(branches):
        if b != branch.taken and _self_attributes(block) != modules:
            return UserError(f"{_BRANCH_CUT}, and another branch does something other than run the same modules "
                             f"({', '.join(f'self.{m}' for m in sorted(modules))}), which no stage could run",
                             source.span_of(block.body[0] if isinstance(block, cst.IndentedBlock) else block).start,
                             hint="every other branch of the `if` must run the same modules (checkpointed, say), "
                                  "or write the chain in the function's body")
    if branches[-1][0] is not None:
        return UserError(f"{_BRANCH_CUT}, and the `if` has no `else`: when its condition is false the chain does not run, which no stage could follow",
                         source.span_of(statement).start,
                         hint="write the chain in the function's body, or give the `if` an `else` running the same "
                              "modules")
    return None


_BRANCH_CUT = "the stages would cut the chain of statements in the branch of this `if` the trace took"


def _local_names(function: cst.FunctionDef) -> set[str]:
    """The function's parameters and the names its body binds."""
    params = function.params
    found = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    found |= {star.name.value for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)}
    return found | names_in(list(function.body.body), True)


def _read_names(node: cst.CSTNode):
    """The names an expression reads, in order (`self.a.b` reads self; a keyword's name is no read)."""
    if isinstance(node, cst.Name):
        yield node
    elif isinstance(node, cst.Attribute):
        yield from _read_names(node.value)
    elif isinstance(node, cst.Arg):
        yield from _read_names(node.value)
    else:
        for child in node.children:
            yield from _read_names(child)


def _self_attributes(block: cst.CSTNode) -> set[str]:
    """The attributes of `self` a block reads (`self.layer1`, `self.layer2`)."""
    return {node.attr.value for node in _attributes(block)
            if isinstance(node.value, cst.Name) and node.value.value == "self"}


def _own_frames(trace, node) -> list[Span]:
    """The model's own call sites a node ran under, innermost first: its own, then the call of each
    module around it (a module is taken as called from its parent's code)."""
    frames = [node.span] if node.span is not None else []
    module = node.module_path
    while module:
        call = trace.module_calls.get(module)
        if call is not None:
            frames.append(call[0])
        module = module.rpartition(".")[0]
    return frames


def _calling_functions(graph: Graph) -> list[tuple[str, cst.FunctionDef]]:
    """The functions of the model's files that call a module (by their innermost definition)."""
    found, seen, defined = [], set(), {}
    for span, _ in graph.trace.module_calls.values():
        source = graph.sources.get(span.path)
        if source is None:
            continue
        if span.path not in defined:
            defined[span.path] = [(source.span_of(f), f) for f in source.functions()]
        holding = [f for where, f in defined[span.path] if where.contains(span)]
        if holding and (span.path, id(holding[-1])) not in seen:
            seen.add((span.path, id(holding[-1])))
            found.append((span.path, holding[-1]))
    return found


def _valid_cuts(body: list, statement_of: dict[int, int]) -> tuple[list[int], tuple[int, str] | None]:
    """Indices k of the body where a stage may start: statements before k and from k on both ran
    ops, with no op between the last of the former and the first of the latter that no statement
    claims (a helper's code the trace cannot place), none of the statements before k returns, and
    every name handed on across k can be handed on (no function, class or module bound there).
    With them, the first cut left out for such a name only: (k, the name)."""
    by_statement: dict[int, list[int]] = {}
    for index, k in statement_of.items():
        by_statement.setdefault(k, []).append(index)
    cuts, unsendable = [], None
    for k in range(1, len(body)):
        before = [i for j, nodes in by_statement.items() if j < k for i in nodes]
        after = [i for j, nodes in by_statement.items() if j >= k for i in nodes]
        if not before or not after or min(after) != max(before) + 1:
            continue
        if any(_returns(stmt) for stmt in body[:k]):
            break
        objects = [name for name in _crossing(body, k) if name in _not_values(body[:k])]
        if not objects:
            cuts.append(k)
        elif unsendable is None:
            unsendable = (k, objects[0])
    return cuts, unsendable


def _crossing(body: list, k: int) -> list[str]:
    """The names the statements before k set and those from k on read first: handed on at k."""
    read = exposed_reads(body[k:])
    order = []
    for stmt in body[:k]:
        for name in sorted(names_in([stmt], True) | _not_values([stmt])):
            if name in read and name not in order:
                order.append(name)
    return order


def _not_values(statements) -> set[str]:
    """Names the statements bind to what a hand-off cannot carry: functions, classes, modules."""
    found = set()
    for stmt in statements:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            found.add(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                    found.update(cst.Module([]).code_for_node(a.asname.name if a.asname else a.name).split(".")[0]
                                 for a in small.names)
                elif isinstance(small, cst.Assign) and isinstance(small.value, cst.Lambda):
                    found.update(names_in([small], True))
    return found


def _returns(statement: cst.CSTNode) -> bool:
    """Whether the statement may return or yield (not counting functions defined in it)."""
    found = []

    class Returns(cst.CSTVisitor):
        def visit_Return(self, node) -> None:
            found.append(node)

        def visit_Yield(self, node) -> None:
            found.append(node)

        def visit_FunctionDef(self, node) -> bool:
            return False

        def visit_Lambda(self, node) -> bool:
            return False

        def visit_ClassDef(self, node) -> bool:
            return False
    statement.visit(Returns())
    return bool(found)


def _docstring(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1 and isinstance(
        statement.body[0], cst.Expr) and isinstance(statement.body[0].value,
                                                    (cst.SimpleString, cst.ConcatenatedString))


def _sequential_children(trace, container: str) -> list[str]:
    """The direct children of an nn.Sequential, in order, when it numbers them (0, 1, ...)."""
    prefix = container + "."
    children = [p for p in trace.module_types if p.startswith(prefix) and "." not in p[len(prefix):]]
    if not children or not all(p[len(prefix):].isdigit() for p in children):
        return []
    return sorted(children, key=lambda p: int(p[len(prefix):]))


def cut_blocks(graph: Graph) -> list[str]:
    """The blocks pipeline stages cut: of every trunk of a chain, or of the one trunk."""
    chain = find_chain(graph)
    return [b for t in chain for b in t.blocks] if chain else find_trunk(graph).blocks


def _trunk_of(graph: Graph, paths: list[str]) -> Trunk:
    """The loop over one group of blocks, where the trace saw them called."""
    calls = graph.trace.module_calls
    container = paths[0].rsplit(".", 1)[0]
    blocks = sorted((p for p in paths if p in calls), key=lambda p: calls[p][1])
    iterated = _iterated_blocks(graph, paths) if len(blocks) < 2 else None
    if iterated is not None:
        blocks, (span, first) = iterated
    elif len(blocks) < 2:
        trace = graph.trace
        reading = next((n.span.start for n in graph.nodes if n.span is not None and any(   # the first block's weights
            alias.startswith(paths[0] + ".") for _, tid in graph.param_operands(n.index)
            for alias in trace.params[trace.tensors[tid].param].aliases)), None)
        raise UserError(f"the blocks of {container} are not called as modules from the model's own code", reading,
                        hint="pipelining cuts the calls the trace sees, `block(x)`; `block.forward(x)` bypasses them")
    else:
        # `for layer in self.layers[:-1]:` then `self.layers[-1](x)`: the stages cut the blocks of
        # the line calling the most of them (the loop's); one called elsewhere runs where its line runs
        lines = Counter(calls[p][0] for p in blocks)
        loop_line, count = lines.most_common(1)[0]
        if len(lines) > 1 and count >= 2:
            blocks = [p for p in blocks if calls[p][0] == loop_line]
        span, first = calls[blocks[0]]
    source = graph.sources.get(span.path)
    node = source.node_at(span.line, span.col, span.end_line, span.end_col)
    hoist = None
    naming = _named_iteration(source, node)
    looped = _children_loop(graph, span, paths) if iterated is None else None
    if looped is not None and _calls_module(node, looped[0].rpartition(".")[0]):
        looped = None       # `x = self.blocks(x)` on an nn.Sequential: cut below, by slicing it
    if looped is not None and (naming is not None or set(looped) != set(paths)):
        # the loop runs a module's children, other layers than the blocks among them, or picks its
        # outputs by their names: the stages cut between the children, by the loop's iterations
        blocks, container = looped, looped[0].rpartition(".")[0]
        first = calls[blocks[0]][1]
    else:
        looped = None
        if naming is not None:
            raise UserError(f"the loop calling the blocks of {container} iterates over their names "
                            f"(`{cst.Module([]).code_for_node(naming[1])}`), and each pipeline stage holds only its "
                            "blocks, renamed from the first", source.span_of(naming[0]).start,
                            hint="pipelining cuts a loop over the blocks themselves (`for block in self.blocks:`), "
                                 "or over all the children of one module, each called once; or use --tp or --dp "
                                 "for this model")
    # `x = self.blocks(x)` on an nn.Sequential of the blocks (not `x = block(x)` in a loop over
    # blocks that are each an nn.Sequential: there the line calls no module holding the blocks)
    if iterated is None and looped is None and span in graph.trace.containers and any(
            s == span and (p == container or container.startswith(p + "."))
            for p, (s, _) in graph.trace.module_calls.items()):
        outer = _enclosing_sequential(graph.trace, span, container)
        if outer is not None:
            return _trunk_of(graph, outer)
        children = _sequential_children(graph.trace, container)
        if len(children) != len(paths) and len(children) >= 2 and all(c in calls for c in children):
            # it holds other stages too (a stem, a stage of another class): the stages cut its children
            blocks = sorted(children, key=lambda p: calls[p][1])
        elif len(children) != len(paths):
            raise UserError(f"{container} is an nn.Sequential holding more than its {len(paths)} blocks", span.start,
                            hint="pipelining cuts an nn.Sequential whose children are numbered and each called "
                                 "once")
        loop = node
        while loop is not None and not isinstance(loop, cst.SimpleStatementLine):
            loop = source.parents.get(loop)
        statement = loop.body[0] if loop is not None and len(loop.body) == 1 else None
        single = isinstance(statement, cst.Assign) and statement.value is node and len(node.args) == 1 and len(
            statement.targets) == 1 and statement.targets[0].target.deep_equals(node.args[0].value)
        if not single:      # `return self.stages(x)`: cut as `x = self.stages(x)`, then the statement
            hoist = _hoisted_input(source, loop, node, container, span)
    else:
        loop = node
        while loop is not None and not isinstance(loop, cst.For):
            loop = source.parents.get(loop)
    function = source.parents.get(loop) if loop is not None else None
    while function is not None and not isinstance(function, cst.FunctionDef):
        function = source.parents.get(function)
    if loop is None or function is None:
        raise UserError(f"the blocks of {container} are not called in a `for` loop", span.start,
                        hint="pipelining cuts the loop over the blocks (or the nn.Sequential call) into stages")
    body = list(function.body.body)
    if loop not in body:
        loop = _branches_over_blocks(source, loop, body, container)
    index = body.index(loop)
    function_span = source.span_of(function)
    if hoist is not None:   # the call runs as `x = self.stages(x)` of its own, the statement after it
        if hoist in exposed_reads(body[index + 1:]):
            raise UserError(f"pipelining cuts the call of {container} into stages, and the code after it reads "
                            f"`{hoist}`, its input, which the stages hand on as its output", span.start,
                            hint=f"assign its output first: `{hoist} = self.{container.rpartition('.')[2]}"
                                 f"({hoist})`, then use it")
        split = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(hoist))], node)])
        rest = body[index].deep_replace(node, cst.Name(hoist))
        handoff = handoff_variables(function.with_changes(body=function.body.with_changes(
            body=[*body[:index], split, rest, *body[index + 1:]])), index)
    else:
        handoff = handoff_variables(function, index)
    if (iterated is not None or looped is not None) and not isinstance(loop, cst.For):
        raise UserError("the loop over the blocks must be a statement of the function's body, not nested",
                        span.start, hint=f"pipelining cuts a loop over self.{container.rpartition('.')[2]} "
                                         "in the function's body")
    return Trunk(container, blocks, function, function_span, index, handoff,
                 _shared_loop_owner(graph, blocks, function, function_span, span, first),
                 unset=maybe_unset(function, index, handoff), hoist=hoist,
                 iterations=iterated is not None or looped is not None or _zipped_in_order(loop, blocks))


def _enclosing_sequential(trace, span: Span, container: str) -> list[str] | None:
    """The children of the nn.Sequential the line at `span` calls, when it holds the nn.Sequential
    of the blocks among its children (torchvision's ConvNeXt and Swin: `x = self.features(x)` over a
    stem, nn.Sequential groups of blocks and the downsampling layers between them). Cutting the
    blocks' own nn.Sequential would leave each stage running the whole outer one, the layers of the
    other stages included: the stages cut the outer one's children instead. None otherwise."""
    calls, runs = trace.module_calls, trace.module_runs
    called = [p for p, (s, _) in calls.items() if s == span and container.startswith(p + ".")]
    if not called:
        return None
    children = _sequential_children(trace, min(called, key=len))
    if len(children) < 2 or any(c not in calls or runs.get(c, 1) != 1 for c in children):
        return None
    return children


def _calls_module(node: cst.CSTNode, path: str) -> bool:
    """Is `node` a call of the module at `path` by its attribute (`self.blocks(x)`)?"""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) \
        and node.func.attr.value == path.rpartition(".")[2]


def _children_loop(graph: Graph, span: Span, paths: list[str]) -> list[str] | None:
    """The children of one module, in call order, when the line at `span` calls each of them once
    and nothing else, and the blocks `paths` are among them or inside them (torchvision's
    IntermediateLayerGetter: `for name, module in self.items(): x = module(x)`, which keeps the
    outputs it names, over a stem, then nn.Sequential stages of blocks). The stages cut between
    these children, by the loop's iterations (Trunk.iterations): every stage keeps the container
    whole, the other stages' children hollow, so the names and positions the loop reads, and
    what it collects from earlier iterations, stay the whole model's. None otherwise."""
    trace = graph.trace
    calls, runs = trace.module_calls, trace.module_runs
    here = {p for p, (s, _) in calls.items() if s == span}
    top = [p for p in here if p.rpartition(".")[0] not in here]     # (an nn.Sequential's blocks share its line)
    parent = top[0].rpartition(".")[0] if top else ""
    if len(top) < 2 or not parent or any(p.rpartition(".")[0] != parent for p in top):
        return None
    prefix = parent + "."
    owned = {p for p in trace.module_types if p.startswith(prefix) and "." not in p[len(prefix):]}
    if owned != set(top) or any(runs.get(p, 1) != 1 for p in top) \
            or not all(p in owned or any(a in owned for a in _ancestors(p)) for p in paths):
        return None
    return sorted(top, key=lambda p: calls[p][1])


def _zipped_in_order(loop: cst.CSTNode, blocks: list[str]) -> bool:
    """Whether a `for` loop calls the blocks zipped with other sequences (`for embed, layers in
    zip(self.embeddings, self.stages)`: a hierarchical model's downsampling layers beside its lists
    of blocks), one block per iteration in the order they are numbered: its stages run the loop's
    iterations of their own blocks (Trunk.iterations), so that the sequences zipped with the blocks
    stay the whole model's; a stage holding only its blocks, renumbered from 0, would pair them with
    the first entries of the others."""
    if not isinstance(loop, cst.For) or not any(isinstance(c.func, cst.Name) and c.func.value == "zip"
                                               for c in _calls_in(loop.iter)):
        return False
    return _numbered_in_order(blocks)


def _hoisted_input(source, statement: cst.SimpleStatementLine, call: cst.Call, container: str, span: Span) -> str:
    """The name the call of an nn.Sequential of stages reads and, cut out of its statement, assigns
    (`return self.stages(x)` runs as `x = self.stages(x)`, then `return x`): each stage runs its children
    on what the previous one handed on under that name. Refused where moving the call first could
    change what the statement computes: other calls evaluated before it, a call under a condition, or
    an input that is not one name the statement reads nowhere else."""
    attr = container.rpartition(".")[2]
    refuse = UserError(f"pipelining cuts the call of {container} into stages, so it must be a statement of its own "
                       "or one the cut can move out of its statement", span.start,
                       hint=f"assign its output first: `x = self.{attr}(x)`")
    args = call.args
    if len(statement.body) != 1 or len(args) != 1 or args[0].keyword is not None or args[0].star \
            or not isinstance(args[0].value, cst.Name):
        raise refuse
    name = args[0].value.value
    small = statement.body[0]
    if isinstance(small, cst.Assign):
        root, earlier = small.value, []
    elif isinstance(small, (cst.Return, cst.Expr)) and small.value is not None:
        root, earlier = small.value, []
    else:
        raise refuse
    node = call
    while node is not root:          # what the statement evaluates before the call: no calls
        parent = source.parents.get(node)
        if isinstance(parent, (cst.IfExp, cst.BooleanOperation, cst.Lambda, cst.BaseComp, cst.Await)):
            raise refuse
        children = list(parent.children)
        earlier += children[:children.index(node)]
        node = parent
    calls = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, found) -> None:
            calls.append(found)
    for part in earlier:
        part.visit(Calls())
    if calls or _mentions(small, name) > _mentions(call, name) or (
            isinstance(small, cst.Assign) and name in names_in([small], True)):
        raise refuse
    return name


def _mentions(node: cst.CSTNode, name: str) -> int:
    """How often the code names the variable `name` (`self.name` is no mention)."""
    count = 0

    class Count(cst.CSTVisitor):
        def visit_Name(self, found: cst.Name) -> None:
            nonlocal count
            count += found.value == name

        def visit_Attribute(self, attribute: cst.Attribute) -> bool:
            attribute.value.visit(self)
            return False
    node.visit(Count())
    return count


def _check_epilogue_reads_blocks(graph: Graph, trunk: Trunk) -> None:
    """Code after the block loop that reads the block list (DiT's `self.transformer_blocks[0].norm1.emb(...)`
    for the output's conditioning) runs on the last stage. A `for` loop over the blocks numbered in
    order is then cut by its iterations: every stage keeps the whole list, numbered as the model's,
    and the last stage holds what it reads of another stage's block (tied: its gradients summed,
    see _ownership). Refused otherwise: the last stage would hold only its own blocks, numbered
    from 0, and read another block."""
    attr = trunk.container.rpartition(".")[2]
    source = graph.sources.get(trunk.function_span.path)
    for statement in trunk.function.body.body[trunk.loop_index + 1:]:
        for node in _attributes(statement):
            if isinstance(node.value, cst.Name) and node.value.value == "self" and node.attr.value == attr:
                if _numbered_in_order(trunk.blocks) and isinstance(trunk.function.body.body[trunk.loop_index],
                                                                   cst.For):
                    trunk.iterations = True
                    return
                raise UserError(f"the code after the loop over the blocks of {trunk.container} reads the block "
                                f"list (`{cst.Module([]).code_for_node(source.parents.get(node) or node)}`); it runs "
                                "on the last pipeline stage, which holds only its own blocks, numbered from its first",
                                source.span_of(node).start,
                                hint="loop over the blocks with `for block in self.blocks:`; or keep what the code "
                                     "after the blocks reads in a module of its own, outside the block list; or use "
                                     "--tp or --dp for this model")


def _numbered_in_order(blocks: list[str]) -> bool:
    """Whether the blocks are a list's entries 0, 1, ..., in the order they run."""
    numbers = [p.rpartition(".")[2] for p in blocks]
    return all(n.isdigit() for n in numbers) and [int(n) for n in numbers] == list(range(len(blocks)))


def _check_work_above_cut(graph: Graph, trunk: Trunk) -> None:
    """Refuse blocks whose cut would leave more of the model's work to every stage than it divides:
    the code above the cut function runs on every stage up to its call (only the cut function's
    own variables are handed on; a UNet's down path, whose skip connections its up path reads after
    the cut function returns, is computed again on each stage). Chained trunks hand on between
    their functions and are not asked."""
    trace, blocks, function_span = graph.trace, trunk.blocks, trunk.function_span
    first = min(index for path, (_, index) in trace.module_calls.items()    # a list of modules: its first call
                if path == blocks[0] or path.startswith(blocks[0] + "."))
    above = {n.index for n in graph.nodes[:first] if n.span is not None and _above_cut(graph, n, [function_span])}
    work = {n.index: node_flops(n, graph.dims.get(n.index), trace) for n in graph.nodes}
    repeated = sum(work[i] for i in above)
    divided = sum(work[i] for i in node_blocks(graph, blocks))
    if repeated <= divided:
        return
    where = graph.nodes[min(above)]
    modules = sorted({m.split(".")[0] for i in above if (m := graph.nodes[i].callee_path or graph.nodes[i].module_path)})
    total = sum(work.values()) or 1.0
    raise UserError(f"pipeline stages would cut the blocks of {trunk.container}, in {trunk.function.name.value}(), "
                    f"and every stage would also run the code above it ({', '.join(modules) or 'the model'}: "
                    f"{repeated / total:.0%} of the model's work, more than the {divided / total:.0%} its blocks "
                    "divide): it is not handed on but computed again on each stage", where.span.start,
                    hint="pipelining cuts the block loop of the function that computes what later stages read; "
                         "or use --tp or --dp for this model")


_NAMING = ("items", "named_children")


def _named_iteration(source, node: cst.CSTNode) -> tuple[cst.For, cst.Call] | None:
    """The `for` loop around `node` and its call naming the modules (`for name, module in
    self.items(): ...`, torchvision's IntermediateLayerGetter picking its outputs by name) when the
    loop body reads the names; None otherwise (DenseNet's dense block leaves them unread)."""
    loop = node
    while loop is not None and not isinstance(loop, (cst.For, cst.FunctionDef)):
        loop = source.parents.get(loop)
    if not isinstance(loop, cst.For):
        return None
    calls = [n for n in _calls_in(loop.iter) if isinstance(n.func, cst.Attribute) and n.func.attr.value in _NAMING]
    target = loop.target
    name = target.elements[0].value if isinstance(target, (cst.Tuple, cst.List)) and target.elements else None
    if calls and isinstance(name, cst.Name) and name.value in names_in(list(loop.body.body), False):
        return loop, calls[0]
    return None


def _calls_in(node: cst.CSTNode):
    if isinstance(node, cst.Call):
        yield node
    for child in node.children:
        yield from _calls_in(child)


def _iterated_blocks(graph: Graph, paths: list[str]) -> tuple[list[str], tuple[Span, int]] | None:
    """Blocks that are lists of modules, never called themselves (x-transformers' `ModuleList([norms,
    block, residual])` per layer), whose modules one `for` loop calls, one block per iteration, in
    the blocks' order: the blocks, and the span and op index of the first call inside them. None when
    the blocks' modules are not called so; refused when the loop runs them in another order, or interleaved."""
    calls = graph.trace.module_calls
    if any(p in calls for p in paths) or not all(p.rpartition(".")[2].isdigit() for p in paths):
        return None
    firsts = {}
    for path in paths:
        inner = [calls[c] for c in calls if c.startswith(path + ".")]
        if not inner:
            return None
        firsts[path] = min(inner, key=lambda call: call[1])
    blocks = sorted(paths, key=lambda p: int(p.rpartition(".")[2]))
    span = firsts[blocks[0]][0]
    source = graph.sources.get(span.path)
    node = source.node_at(span.line, span.col, span.end_line, span.end_col)
    while node is not None and not isinstance(node, cst.For):
        node = source.parents.get(node)
    if node is None:
        return None
    loop = source.span_of(node)
    container = blocks[0].rpartition(".")[0]
    ran = sorted(blocks, key=lambda p: firsts[p][1])
    order = [b for b, _ in sorted(node_blocks(graph, blocks).items())]
    if ran != blocks or order != sorted(order) or not all(loop.contains(firsts[p][0]) for p in blocks):
        raise UserError(f"the blocks of {container} are lists of modules whose modules this loop calls, but not "
                        "one block per iteration in their order (pipeline stages run the iterations of their "
                        "own blocks)", loop.start,
                        hint="run the layers in the order they are numbered, one per iteration, "
                             "or use --tp or --dp for this model")
    return blocks, firsts[blocks[0]]


def _branches_over_blocks(source, loop: cst.CSTNode, body: list, container: str) -> cst.If:
    """The `if` statement of the function's body whose branches each run the blocks in one way,
    the traced `loop` among them (timm: `for blk in self.blocks: ...` with a mask, else
    `checkpoint_seq(self.blocks, x)`, else `x = self.blocks(x)`): each stage holds only its
    blocks, so every branch runs this stage's. A branch's `for i, blk in enumerate(self.blocks)`
    (timm's EVA reading per-block embeddings `rope[i]`) counts from the stage's first block, as a
    loop of the body does. Refused when a branch does anything else, or counts the blocks another
    way, which a stage would count from 0."""
    statement = loop
    while statement is not None and statement not in body:
        statement = source.parents.get(statement)
    attr = container.rpartition(".")[2]

    def branches(node):
        while isinstance(node, cst.If):
            yield node.body
            node = node.orelse
        if isinstance(node, cst.Else):
            yield node.body

    def runs_blocks(block) -> bool:
        if len(block.body) != 1:
            return False
        statement = block.body[0]
        counted = _counting_loop(statement)
        text = cst.Module([]).code_for_node(counted.iter.args[0] if counted is not None else statement)
        return f"self.{attr}" in text and "enumerate(" not in text

    wrong = next((block for block in branches(statement) if not runs_blocks(block)), None) \
        if isinstance(statement, cst.If) else loop
    if isinstance(wrong, cst.IndentedBlock) and len(wrong.body) > 1:
        # timm's ResNet, where _statement_chain found no cut in the branch (it cuts one, when it can)
        raise UserError(f"the stages of blocks (self.{attr} and the calls after it) run as a chain of "
                        f"{len(wrong.body)} statements inside a branch of an `if`, and no cut between those "
                        "statements divides the model's work (each must run once, in order)",
                        source.span_of(wrong.body[0]).start,
                        hint="write the chain of stage calls in the function's body (as torchvision's ResNet "
                             "does), or run the stages in one statement in each branch")
    if wrong is not None:
        raise UserError("the loop over the blocks must be a statement of the function's body, not nested",
                        source.span_of(wrong.body[0] if isinstance(wrong, cst.IndentedBlock) else wrong).start,
                        hint=f"pipelining cuts a loop over self.{attr} in the function's body, or an `if` whose "
                             f"branches each run self.{attr} in one statement")
    return statement


def _counting_loop(statement: cst.CSTNode) -> cst.For | None:
    """`for i, blk in enumerate(BLOCKS):` (the emitter counts it from the stage's first block), else None."""
    iterable = statement.iter if isinstance(statement, cst.For) else None
    if isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name) and iterable.func.value == "enumerate" \
            and iterable.args and iterable.args[0].keyword is None and not iterable.args[0].star:
        return statement
    return None


@_once_per_graph
def find_chain(graph: Graph) -> list[Trunk]:
    """Block lists run one after the other, each by a loop in a method of the module holding it,
    that module called once (an encoder's layers, then a decoder's, both called from the model's
    forward): the stages cut them as one chain, blocks counted over all of them, so that stages
    balance across both. [] when fewer than two lists qualify (one trunk is cut, as before)."""
    calls, runs = graph.trace.module_calls, graph.trace.module_runs
    groups = []
    members = {p for paths in graph.blocks.values() for p in paths}
    for paths in graph.blocks.values():
        if any(a in members for a in _ancestors(paths[0])):
            continue                                    # inside another group's blocks: part of them
        called = sorted((p for p in paths if p in calls), key=lambda p: calls[p][1])
        first = calls[called[0]][1] if called else None
        if not called and _lists_of_modules(graph, paths):      # lists of modules, one per iteration
            try:
                called, (_, first) = _iterated_blocks(graph, paths) or ([], (None, None))
            except UserError:
                continue
        owner = paths[0].rsplit(".", 1)[0].rpartition(".")[0]
        if len(called) < 2 or len(called) != len(paths) or not owner or owner not in calls \
                or any(runs.get(p, 1) != 1 for p in (*called, owner)):
            continue
        groups.append((first, called, owner))
    groups.sort()
    owners = [owner for _, _, owner in groups]
    # (owners may be called from one line: one wrapper class around the encoder's and the decoder's)
    if len(groups) < 2 or any(a.startswith(b + ".") for a in owners for b in owners):
        return []
    chain, last_op = [], -1
    for _, paths, owner in groups:
        block_of = node_blocks(graph, paths)
        if not block_of or min(block_of) <= last_op or _called_in_loop(graph, calls[owner][0]):
            return []                                   # interleaved with another list, or run per pass of a loop
        last_op = max(block_of)
        try:
            trunk = _trunk_of(graph, paths)
        except UserError:
            return []
        if any(t.container == trunk.container for t in chain):
            continue                                    # one loop over the children holding both lists
        attr = trunk.container.rpartition(".")[2]
        loop = trunk.function.body.body[trunk.loop_index]
        params = trunk.function.params.params
        if not isinstance(loop, cst.For) or not params or params[0].name.value != "self" or not (
                trunk.iterations or f"self.{attr}" in cst.Module([]).code_for_node(loop.iter)):
            return []                                   # the loop is not a method's over its own list
        trunk.owner = owner
        trunk.unset = maybe_unset(trunk.function, trunk.loop_index, trunk.handoff, one_pass=False)
        chain.append(trunk)
    return chain if len(chain) >= 2 else []


def _called_in_loop(graph: Graph, span: Span) -> bool:
    """Whether the call at `span` sits in a `for` or `while` of its function (a stack per pass)."""
    return _enclosing_loop(graph, span) is not None


def _enclosing_loop(graph: Graph, span: Span) -> Span | None:
    """The span of the innermost `for` or `while` of its function around the call at `span`."""
    source = graph.sources.get(span.path) if graph.sources is not None else None
    node = source.node_at(span.line, span.col, span.end_line, span.end_col) if source is not None else None
    while node is not None and not isinstance(node, cst.FunctionDef):
        if isinstance(node, (cst.For, cst.While)):
            return source.span_of(node)
        node = source.parents.get(node)
    return None


def _chain_roles(chain: list[Trunk], ranges: list[tuple[int, int]]) -> dict[int, dict[str, ChainRole]]:
    """Per stage, per trunk (by owner): its ChainRole. A stage whose blocks end where a trunk starts
    runs that trunk's prologue and hands on before its first block."""
    roles: dict[int, dict[str, ChainRole]] = {}
    for stage, (a, b) in enumerate(ranges):
        mine, offset = {}, 0
        for trunk in chain:
            o, n = offset, len(trunk.blocks)
            offset += n
            if a >= o + n:
                mine[trunk.owner] = ChainRole("skip", 0, 0, False)
                continue
            if b < o:
                continue                                # handed on before reaching it
            role = "enter" if (a < o <= b) or (o == a == 0) else "receive"
            mine[trunk.owner] = ChainRole(role, max(a, o) - o, min(b, o + n) - o, b < o + n)
        roles[stage] = mine
    return roles


def _shared_loop_owner(graph: Graph, blocks: list[str], function: cst.FunctionDef, function_span: Span,
                       span: Span, first: int) -> str | None:
    """When the loop's call site also calls blocks of another container (one stack class for the
    encoder and the decoder), the module path of the trunk's caller, whose method it is: the
    stages cut that call only, and the other container's call runs whole. None otherwise."""
    calls = graph.trace.module_calls
    container = blocks[0].rsplit(".", 1)[0]
    if not any(s == span and path != container and not path.startswith(container + ".")
               for path, (s, _) in calls.items()):      # (an nn.Sequential's own call shares the span)
        return None
    # the self of that call: the module running the function's last op before the first block, an
    # ancestor of the container (the encoder stack, for encoder.block)
    before = [n for n in graph.nodes[:first] if n.span is not None and function_span.contains(n.span)
              and (n.module_path == "" or container.startswith(n.module_path + "."))]
    # (no op before it: the module holding the container, when it is called itself)
    parent = container.rpartition(".")[0]
    caller = before[-1].module_path if before else parent if parent in calls else None
    params = function.params.params
    if caller is None or not params or params[0].name.value != "self":
        raise UserError(f"the loop over {container} also runs other blocks, and its function is not a method of "
                        "the module holding them, so the stages cannot tell its calls apart", span.start,
                        hint="pipelining cuts a loop whose function runs once per step for these blocks")
    return caller


_SHARED_LAYER = "pipeline stages need repeated blocks"


def _shared_layer(graph: Graph) -> tuple[str, int, Span] | None:
    """The module the model calls most often that reads weights, when more than once (a model
    whose layers share one set of weights, like ALBERT's): the outermost module run as often that
    holds it, where the model's code calls it (ALBERT's layer group, in the encoder's loop, not the
    layer inside), with its runs and its call site. Only a call reading weights counts: an
    activation called twice (DLA's relu) shares none."""
    calls: dict[str, list] = {}
    for node in graph.nodes:
        if node.callee_path is not None and node.span is not None and graph.param_operands(node.index):
            calls.setdefault(node.callee_path, []).append(node)
    path, nodes = max(calls.items(), key=lambda item: len(item[1]), default=(None, []))
    if len(nodes) < 2:
        return None
    runs, module_calls = graph.trace.module_runs, graph.trace.module_calls
    outer = next((a for a in (*_ancestors(path), path) if a in module_calls and runs.get(a, 0) >= len(nodes)), None)
    if outer is None:
        return path, len(nodes), nodes[0].span
    return outer, runs[outer], module_calls[outer][0]


def _no_blocks(graph: Graph) -> UserError:
    """No repeated blocks to cut: say where, pointing at a layer called more than once outside a
    loop when there is one."""
    shared = _shared_layer(graph)
    if shared is not None:
        path, count, call = shared
        return UserError(f"{_SHARED_LAYER}; this model calls {path} {count} times "
                         "(its layers share one set of weights), so no stage could hold its own layers", call.start,
                         hint="pipelining cuts a ModuleList of one block class, called in a loop, into stages, "
                              "or the iterations of a `for` loop calling one layer")
    first = next((n.span.start for n in graph.nodes if n.span is not None and n.mapped), None)
    return UserError("pipeline stages need a model built from repeated blocks (a ModuleList of one block "
                     "class called in a loop), an nn.Sequential called once whose children run most of its "
                     "work, or a function written as a chain of statements (`x = self.layer1(x)`, "
                     "`x = self.layer2(x)`) with a place between two of them to cut; this model has none of these",
                     first, hint="put the stages in an nn.Sequential called once, or write the forward as a chain of "
                                 "statements each calling a layer")


def _shared_trunk(graph: Graph, module: str, runs: int) -> Trunk:
    """A `for` loop whose every iteration calls one module (a universal transformer's one layer,
    ALBERT's layer group): the blocks are the loop's iterations, block k the module's k-th run.
    Every stage holds the module and runs its own range of the iterations (Trunk.iterations:
    `pp_iterations`); the module's parameters are summed over the stages (StagePlan.shared)."""
    span = graph.trace.module_calls[module][0]
    if not _called_once_per_iteration(graph, span):
        raise UserError(f"{_SHARED_LAYER}; the model calls {module} {runs} times, one module whose weights every "
                        "call shares, and pipeline stages divide the iterations of a `for` loop calling it once "
                        "per iteration", span.start,
                        hint="call the shared layer once in the body of a `for` loop of the function "
                             "(`for _ in range(n): x = self.layer(x)`), or run it without --pp")
    others = sorted(p for p, (s, _) in graph.trace.module_calls.items()
                    if s == span and p != module and not p.startswith(module + "."))
    if others:      # ALBERT with several layer groups: `self.albert_layer_groups[group_idx](...)`
        raise UserError(f"{_SHARED_LAYER}; the loop calls {module} {runs} times and, from the same line, "
                        f"{', '.join(others)}: pipeline stages divide the iterations of a loop calling one "
                        "layer whose weights every iteration shares", span.start,
                        hint="call one shared layer in the loop, or give each iteration its own layer (a "
                             "ModuleList of one block class, called in a loop); or run it without --pp")
    _runs(graph, module, runs)          # each iteration runs the same ops: refused otherwise
    trunk = _trunk_of(graph, [module] * runs)
    trunk.container, trunk.iterations = module, True
    return trunk


def _called_once_per_iteration(graph: Graph, span: Span) -> bool:
    """Whether the call at `span` is the only call of its callee (`self.layer`, `self.groups[i]`)
    in the innermost `for` loop around it, outside any loop nested in that one: each iteration
    then runs it once."""
    source = graph.sources.get(span.path)
    call = source.node_at(span.line, span.col, span.end_line, span.end_col)
    if not isinstance(call, cst.Call):
        return False
    loop = source.parents.get(call)
    while loop is not None and not isinstance(loop, cst.For):
        if isinstance(loop, (cst.While, cst.FunctionDef, cst.BaseComp)):
            return False
        loop = source.parents.get(loop)
    callee = cst.Module([]).code_for_node(call.func)
    return loop is not None and [c for c in _calls_in(loop) if cst.Module([]).code_for_node(c.func) == callee] == [call]


def _runs_in_turn(graph: Graph, trunk: Trunk) -> list[str] | None:
    """The blocks one per iteration when the trunk's loop runs each block for several iterations
    in a row, calling it once per iteration (ALBERT's layer groups: `self.albert_layer_groups[
    int(i / per_group)](x)`): each block listed for each of its runs, in order. None when the
    blocks run once, or not in turns (their loop run again as a whole: recycling). (Some may run
    once: 5 layers over 3 groups.)"""
    runs = graph.trace.module_runs
    if trunk.statements is not None or trunk.hoist is not None or all(runs.get(b, 1) < 2 for b in trunk.blocks) \
            or not isinstance(trunk.function.body.body[trunk.loop_index], cst.For) \
            or not _called_once_per_iteration(graph, graph.trace.module_calls[trunk.blocks[0]][0]):
        return None
    try:
        order = [b for _, b in sorted((run[0], b) for b in trunk.blocks for run in _runs(graph, b, runs[b]))]
    except UserError:
        return None
    if any(order[k] != order[k - 1] and order[k] in order[:k] for k in range(1, len(order))):
        return None
    return order


def _runs(graph: Graph, module: str, count: int) -> list[list[int]]:
    """The node indices of each of the `count` runs of one module (ALBERT's shared layer group),
    in order: its ops from its first call on, in `count` equal runs that start at one call site.
    Refused when its runs differ (a branch on the iteration inside it)."""
    start = graph.trace.module_calls[module][1]
    within = _nodes_within(graph).get(module, [])
    inside = within[bisect.bisect_left(within, start):]
    size, rest = divmod(len(inside), count)
    runs = [inside[k * size:(k + 1) * size] for k in range(count)]
    if rest or not size or len({graph.nodes[run[0]].span for run in runs}) != 1:
        span = graph.trace.module_calls[module][0]
        raise UserError(f"{_SHARED_LAYER}; the loop calls {module} {count} times, one module whose weights every "
                        f"iteration shares, and its runs do not all run the same ops ({len(inside)} ops in "
                        f"{count} runs), so the stages cannot tell its iterations apart", span.start,
                        hint="run the same code in every iteration of the shared layer, or run it without --pp")
    return runs


def _nodes_within(graph: Graph) -> dict[str, list[int]]:
    """Per module path, the ops run in it or in a module inside it (their module or callee path is
    it or below it), in order; once per graph (each block of a trunk asks)."""
    found = graph.__dict__.get("_nodes_within")
    if found is None:
        found = graph.__dict__["_nodes_within"] = {}
        for node in graph.nodes:
            for path in {node.module_path, node.callee_path or ""} - {""}:
                parts = path.split(".")
                for k in range(1, len(parts) + 1):
                    held = found.setdefault(".".join(parts[:k]), [])
                    if not held or held[-1] != node.index:
                        held.append(node.index)
    return found


def _loop_runs_once(group: list[str], calls: dict) -> bool:
    """Whether the code calling these blocks calls no others: a loop inside a function that runs
    once per stage of an outer loop (BiT's layers in each of its stages) cannot be cut alone."""
    spans = {calls[p][0] for p in group if p in calls}
    container = group[0].rsplit(".", 1)[0]
    return not any(span in spans and path not in group and path != container for path, (span, _) in calls.items())


def maybe_unset(function: cst.FunctionDef, loop_index: int, handoff: list[str], one_pass: bool = True) -> list[str]:
    """The hand-off variables that may be unbound where the first stage hands them on: not
    parameters of the function, nor bound on every path through the code before the loop and one
    pass of the loop (each stage runs at least one block; `one_pass` False: a stage of a chain may
    run none of this trunk's blocks)."""
    params = function.params
    bound = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            bound.add(star.name.value)
    body = list(function.body.body)
    after = bound_on_every_path(body[:loop_index], bound)
    if after is None:
        return []
    loop = body[loop_index]
    if one_pass and isinstance(loop, cst.For):
        inside = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else [cst.SimpleStatementLine(loop.body.body)]
        after = bound_on_every_path(inside, after | names_in([loop.target], True))
    elif one_pass:
        after = bound_on_every_path([loop], after)
    if after is None:
        return []
    return [name for name in handoff if name not in after]


def handoff_variables(function: cst.FunctionDef, loop_index: int) -> list[str]:
    """Variables set before or in the loop and read in it or after it, in first-set order."""
    body = list(function.body.body)
    prologue, loop, epilogue = body[:loop_index], body[loop_index], body[loop_index + 1:]
    if isinstance(loop, cst.For):
        stored = names_in(prologue, True) | (names_in([loop], True) - names_in([loop.target], False))
        # a name the body sets before reading it in the same pass (`p = torch.rand([])` under
        # `if self.training:`) is not handed on: it may never have been set on the stage before
        body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else [cst.SimpleStatementLine(loop.body.body)]
        read = exposed_reads(body) | names_in([loop.iter], False) | names_in(epilogue, False)
    else:                                  # one statement calling an nn.Sequential of the blocks
        stored = names_in(prologue, True) | names_in([loop], True)
        read = names_in([loop], False) | names_in(epilogue, False)
    order = []
    for stmt in [*prologue, loop]:
        for name in sorted(names_in([stmt], True)):
            if name in stored and name in read and name not in order:
                order.append(name)
    return order


def checked_stages(graph: Graph, ranks: int, virtual: int, cuts: list[int] | None, placement,
                   recycling: bool) -> None:
    """plan_stages, for its checks (a UserError when the rewrite could not cut so); the plan is
    kept for `stages_to_rewrite`: --plan auto checks the cut it chooses, and the rewrite then cuts it
    (AlphaFold2: 3 s each)."""
    kept = graph.__dict__.setdefault("_checked_stages", {})
    kept[(ranks, virtual, tuple(cuts or ()), placement, recycling)] = plan_stages(graph, ranks, virtual, cuts,
                                                                                    placement, recycling)


def stages_to_rewrite(graph: Graph, ranks: int, virtual: int, cuts: list[int] | None, placement,
                      recycling: bool) -> StagePlan:
    """plan_stages, or the plan `checked_stages` made of the same arguments (handed over once: the
    rewrite fills it in)."""
    kept = graph.__dict__.get("_checked_stages", {}).pop((ranks, virtual, tuple(cuts or ()), placement, recycling), None)
    return kept if kept is not None else plan_stages(graph, ranks, virtual, cuts, placement, recycling)


def plan_stages(graph: Graph, ranks: int, virtual: int = 1, cuts: list[int] | None = None,
                placement=None, recycling: bool = False) -> StagePlan:
    """`placement` (plan.schedules.Placement): the schedule table's op-assign; with replicated
    pipelines the model is cut into the stages of one pipeline, and every replica of a model
    stage holds its blocks. `recycling`: the schedule pipelines a trunk the forward runs several
    times (3F1B); otherwise such a trunk is refused."""
    if placement is not None and placement.length < ranks * virtual:
        plan = plan_stages(graph, placement.length, 1, cuts)
        copies = ranks * virtual // placement.length
        plan.ranks, plan.virtual = ranks, virtual
        plan.placement, plan.length = tuple(placement.ranks), placement.length
        plan.block_ranges = plan.block_ranges * copies
        plan.stage_seconds = plan.stage_seconds * copies
        for stage in range(placement.length, ranks * virtual):
            plan.drop[stage] = plan.drop[stage % placement.length]
            plan.shadow[stage] = plan.shadow.get(stage % placement.length, [])
            if plan.chain:
                plan.roles[stage] = plan.roles[stage % placement.length]
        return plan
    chain = [] if recycling else find_chain(graph)
    trunk = chain[0] if chain else find_trunk(graph)
    if recycling and trunk_passes(graph, trunk) > 1:
        trunk.recycle = find_recycle(graph, trunk)
    else:
        _check_blocks_run_once(graph, trunk)
    stages = ranks * virtual
    blocks = [b for t in chain for b in t.blocks] if chain else trunk.blocks
    n_blocks = len(blocks)
    if n_blocks < stages:
        what = f"{n_blocks} blocks" if trunk.statements is None else (
            f"the chain of statements of {trunk.container}, cut at {n_blocks - 1} place(s) at most,")
        raise UserError(f"{what} cannot fill {stages} pipeline stages", trunk.function_span.start,
                        hint=f"use fewer stages: --pp {max(n_blocks // virtual, 1)} or less"
                        + (f", or a schedule with fewer virtual stages per rank than {virtual} (--schedule 1f1b)"
                           if virtual > 1 else ""))
    block_of = trunk.statements.block_of if trunk.statements is not None else _within_runs(
        graph, blocks, node_blocks(graph, blocks))
    first = min(block_of) if block_of else 0
    last = max(block_of) if block_of else 0
    cost = [0.0] * n_blocks
    pro = epi = 0.0
    previous = 0
    callers: dict = {}
    for node in graph.nodes:
        flops = node_flops(node, graph.dims.get(node.index), graph.trace)
        if node.index in block_of:
            previous = block_of[node.index]
            cost[previous] += flops
        elif node.index < first or (trunk.recycle is not None and previous == n_blocks - 1 and node.index < last
                                    and between_passes(graph, node, trunk.recycle, 1, -1, callers) == 0):
            pro += flops            # (recycling: every pass's code before the trunk runs on the first stage)
        elif node.index > last:
            epi += flops
        elif chain:                # between two trunks: on the stage of the block before
            cost[previous] += flops
    uncut = uncut_points(graph, chain)
    if cuts:
        bounds = [0, *cuts, n_blocks]
        if len(bounds) != stages + 1 or bounds != sorted(set(bounds)):
            raise UserError(f"--stages needs {stages - 1} increasing block indices between 1 and {n_blocks - 1}")
        for cut in cuts:
            if cut in uncut:
                raise UserError(f"--stages cuts at block {cut}, the first of {chain_container(chain, cut)}, whose "
                                "code before its loop reads its blocks here: the stage running it must hold one",
                                uncut[cut], hint=f"cut at block {cut - 1} or {cut + 1}")
        ranges = list(zip(bounds[:-1], bounds[1:]))
    else:
        ranges = _balanced(cost, stages, pro, epi, set(uncut))
        if len(ranges) != stages or any(a >= b for a, b in ranges):
            cut, where = next(iter(uncut.items()))
            raise UserError(f"{stages} pipeline stages cannot be cut without a cut at block {cut}, the first of "
                            f"{chain_container(chain, cut)}, whose code before its loop reads its blocks here",
                            where, hint="use fewer stages, or more blocks")
    stage_of_block = {b: s for s, (a, z) in enumerate(ranges) for b in range(a, z)}
    # recycling: the passes before the last run the same ops; what lies between the blocks of two
    # passes (the recycled values' norms and sums) runs, with gradient, before the last pass's
    # first block, on the first stage
    last_pass = first
    if trunk.recycle is not None:
        starts = [n for n, b in block_of.items() if b == 0]
        before = max((n for n, b in block_of.items() if b == n_blocks - 1 and n < max(starts)), default=-1)
        last_pass = min(n for n in starts if n > before)
    node_stage = {}
    current = 0
    callers: dict = {}
    for node in graph.nodes:
        if node.index in block_of:
            current = stage_of_block[block_of[node.index]]
        elif node.index > last:
            current = stages - 1
        elif trunk.recycle is not None and node.index < last_pass:   # between two passes: before the
            # trunk's call or after it
            current = between_passes(graph, node, trunk.recycle, current, stages - 1, callers)
        node_stage[node.index] = current if node.index >= first else 0
    seconds = [0.0] * stages
    for node in graph.nodes:
        seconds[node_stage[node.index]] += node_flops(node, graph.dims.get(node.index), graph.trace)
    plan = StagePlan(ranks, virtual, trunk, ranges, node_stage, {}, stage_seconds=seconds,
                     placement=tuple(placement.ranks) if placement is not None else (), chain=chain,
                     roles=_chain_roles(chain, ranges) if chain else {})
    _ownership(graph, plan)
    _check_reads_held(graph, plan, first)
    _check_state_writes(graph, plan)
    return plan


def _check_reads_held(graph: Graph, plan: StagePlan, first: int) -> None:
    """Refuse a stage whose code, from the first block on, reads a parameter of a block that the
    stage holds under none of its names: a list cut apart is renumbered on each stage, so the read
    would take another block's parameter, or a hollow block's, and no run would say so."""
    blocks, trace = set(plan.blocks), graph.trace
    for node in graph.nodes[first:]:
        stage = plan.node_stage[node.index]
        read = {trace.tensors[o.tid].param for o in node.operands if o.tid is not None} | {
            trace.tensors[t].param for o in node.operands if isinstance(o.value, TensorList) for t in o.value}
        for param in sorted(filter(None, read)):
            owners = [alias.rpartition(".")[0] for alias in trace.params[param].aliases]
            if not all(any(m in blocks for m in (owner, *_ancestors(owner))) for owner in owners):
                continue        # also held outside the blocks
            holders = set().union(*(_holders(plan, owner) for owner in owners))
            if stage not in holders:
                raise UserError(f"pipeline stage {stage} reads {param}, which "
                                f"{'stage' if len(holders) == 1 else 'stages'} "
                                f"{', '.join(map(str, sorted(holders)))} hold{'s' if len(holders) == 1 else ''}: "
                                "each stage holds only its own blocks, numbered from its first",
                                node.span.start if node.span is not None else trunk_location(graph, plan),
                                hint="read a block's modules only from its own forward (or in a `for` loop over "
                                     "the blocks); keep what other code reads in a module outside the block "
                                     "list; or use --tp or --dp for this model")


def find_recycle(graph: Graph, trunk: Trunk) -> Recycle:
    """The `for` loop that calls the function holding the block loop (recycling: AlphaFold2 runs
    its trunk N times). The call is `self.NAME(...)` of the cut method, or, when the cut function
    is a module's forward, that module's call; the nearest `for` around it is the loop. One more
    call, after the loop in the same function, may run the last pass (the one with gradient)."""
    runs = graph.trace.module_runs.get(trunk.blocks[0], 1)
    span = trunk.function_span
    source = graph.sources.get(span.path)
    name = trunk.function.name.value
    func, scope = cst.Attribute(cst.Name("self"), cst.Name(name)), source.module
    if name == "forward":
        owner = trunk.owner if trunk.owner is not None else trunk.container.rpartition(".")[0]
        site = graph.trace.module_calls.get(owner)
        node = source.node_at(site[0].line, site[0].col, site[0].end_line, site[0].end_col) if (
            site is not None and site[0].path == span.path) else None
        func, scope = (node.func, source.parents.get(node)) if isinstance(node, cst.Call) else (None, None)
        while scope is not None and not isinstance(scope, cst.FunctionDef):    # the module's other calls
            scope = source.parents.get(scope)                                   # there: `self.stack(...)`
    calls = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if call.func.deep_equals(func):
                calls.append(call)
    if scope is not None:
        scope.visit(Calls())
    hint = ("3F1B pipelines a trunk run in a `for` loop (recycling): `for cycle in range(n): ... x = "
            f"self.{name}(x) ...` in the model's main file, the last pass in the loop or after it")
    looped, straight = [], []
    for call in calls:
        around = source.parents.get(call)
        while around is not None and not isinstance(around, (cst.For, cst.While, cst.If, cst.Try, cst.FunctionDef)):
            around = source.parents.get(around)
        (looped if isinstance(around, cst.For) else straight).append((call, around))
    loops = [loop for _, loop in looped]
    if len(loops) != 1:
        what = "no `for` loop calls it" if not loops else f"{len(loops)} loops call it"
        raise UserError(f"the blocks of {trunk.container} run {runs} times in one forward, and {what}, so the "
                        "3F1B schedule cannot tell which loop recycles them",
                        graph.trace.module_calls[trunk.blocks[0]][0].start, hint=hint)
    call, loop = looped[0]
    loop_span = source.span_of(loop)
    after = None
    for other, around in straight:
        if _class_of(source, other) is not _class_of(source, loop):     # another class's `self.NAME`
            continue
        span = source.span_of(other)
        # a pass outside the loop is the last one: written once after the loop, in the same function,
        # run on every forward (no `if`, no other loop around it)
        if after is not None or not isinstance(around, cst.FunctionDef) or (span.line, span.col) < (
                loop_span.end_line, loop_span.end_col) or not source.span_of(around).contains(loop_span):
            raise UserError(f"the blocks of {trunk.container} run {runs} times in one forward: in the loop at "
                            f"line {loop_span.line} and here, which 3F1B cannot run as one pass per pipeline "
                            "action", span.start, hint=hint)
        after = span
    function = source.parents.get(loop)
    while function is not None and not isinstance(function, cst.FunctionDef):
        function = source.parents.get(function)
    body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else [cst.SimpleStatementLine(loop.body.body)]
    carried = sorted((exposed_reads(body) & names_in(body, True)) - names_in([loop.target], False))
    return Recycle(loop_span, source.span_of(function), carried, runs, source.span_of(call), after)


def _class_of(source, node: cst.CSTNode) -> cst.ClassDef | None:
    while node is not None and not isinstance(node, cst.ClassDef):
        node = source.parents.get(node)
    return node


def between_passes(graph: Graph, node, recycle: Recycle, current: int, last: int, callers: dict) -> int:
    """The stage of an op run between two passes of the recycling loop: the loop's code after the
    trunk's call runs on the last stage (which ends the pass), the code before it (the next pass's
    inputs) on the first, and so does the code between the loop and a last pass written after it.
    An op inside a function that code calls (`m, z = self.embed(msa)`) goes where the calls of that
    function are; one whose function is called in both places, or elsewhere, stays with the op before.
    An op of a module is placed by the innermost call around it in that function, else by the
    outermost one (a block list the loop runs through a helper, `z = self.extra_stack(e, z)`)."""
    frames = _own_frames(graph.trace, node)
    if not frames:
        return current
    span = next((f for f in frames if recycle.function.contains(f)), frames[-1])
    if not recycle.function.contains(span):
        if span not in callers:
            callers[span] = {_recycling_stage(call, recycle, last) for call in _calls_of_function(graph, span, recycle)}
        stages = callers[span] - {None}
        return stages.pop() if len(stages) == 1 and None not in callers[span] else current
    past_loop = recycle.after is not None and (span.line, span.col) >= (recycle.loop.end_line, recycle.loop.end_col)
    if not recycle.loop.contains(span) and not past_loop:
        return current
    return _recycling_stage(span, recycle, last)


def _recycling_stage(span: Span, recycle: Recycle, last: int) -> int | None:
    """First or last stage for code of the function holding the recycling loop, by where it lies:
    before the loop or a pass's trunk call on the first, after one on the last."""
    if not recycle.function.contains(span):
        return None
    start, end = (span.line, span.col), (span.end_line, span.end_col)
    if start < (recycle.loop.line, recycle.loop.col):
        return 0
    if recycle.after is not None and (recycle.loop.end_line, recycle.loop.end_col) <= start:
        return 0 if end <= (recycle.after.line, recycle.after.col) else last
    if not recycle.loop.contains(span):
        return last
    call = recycle.call
    return last if call is not None and (span.line, span.col) >= (call.end_line, call.end_col) else 0


def _calls_of_function(graph: Graph, span: Span, recycle: Recycle) -> list[Span]:
    """The calls, in the function holding the recycling loop, of the function whose code `span` is
    (`self.embed(...)` or `embed(...)`)."""
    source = graph.sources.get(span.path)
    inner = source.node_at(span.line, span.col, span.end_line, span.end_col)
    while inner is not None and not isinstance(inner, cst.FunctionDef):
        inner = source.parents.get(inner)
    if inner is None:
        return []
    # every op of a function asks (an Evoformer's embedding: thousands of ops): one walk per function
    walked = graph.__dict__.setdefault("_calls_of_function", {})
    key = (span.path, source.span_of(inner), recycle.function)
    if key not in walked:
        walked[key] = _loop_function_calls(graph, inner.name.value, recycle)
    return walked[key]


def _loop_function_calls(graph: Graph, name: str, recycle: Recycle) -> list[Span]:
    """The calls of `name` (`self.name(...)` or `name(...)`) in the function holding the loop."""
    holder = graph.sources.get(recycle.function.path)
    calls = []

    class Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            func = call.func
            if (isinstance(func, cst.Name) and func.value == name) or (
                    isinstance(func, cst.Attribute) and func.attr.value == name):
                calls.append(holder.span_of(call))
    holder.module.visit(Calls())
    return [call for call in calls if recycle.function.contains(call)]


def _check_blocks_run_once(graph: Graph, trunk: Trunk) -> None:
    """Each stage runs its blocks once per micro-batch, then hands on: a trunk the forward runs
    again (recycling) would need its last stage to hand back to its first."""
    runs = trunk_passes(graph, trunk)
    if runs > 1:
        raise UserError(f"the blocks of {trunk.container} run {runs} times in one forward (the loop over them is "
                        "itself run again: recycling, or a trunk called in a loop), and pipeline stages run "
                        "their blocks once per micro-batch", graph.trace.module_calls[trunk.blocks[0]][0].start,
                        hint="--schedule 3f1b pipelines a trunk run again in a loop (recycling); "
                             "or use --tp or --dp for this model")


def trunk_passes(graph: Graph, trunk: Trunk) -> int:
    """How often one forward runs the trunk's loop: its first block's runs, over the iterations
    that run that block (a loop calling one shared layer runs it once per iteration)."""
    return graph.trace.module_runs.get(trunk.blocks[0], 1) // trunk.blocks.count(trunk.blocks[0])


def chain_container(chain: list[Trunk], block: int) -> str:
    """The container of the chained trunk that block `block` (counted over the chain) belongs to."""
    for trunk in chain:
        if block < len(trunk.blocks):
            return trunk.container
        block -= len(trunk.blocks)
    return chain[-1].container


def uncut_points(graph: Graph, chain: list[Trunk]) -> dict:
    """Block indices no stage may start at, each with where the reason lies: a trunk of the chain
    whose code before its loop reads its own blocks (`self.layers[0].self_attn.batch_first` in
    nn.TransformerDecoder) runs that code on a stage holding its first block."""
    return {sum(len(t.blocks) for t in chain[:i]): reads for i, t in enumerate(chain)
            if i and (reads := _prologue_reads_blocks(graph, t)) is not None}


def _prologue_reads_blocks(graph: Graph, trunk: Trunk):
    """Where the code before the trunk's loop reads the trunk's own block list (`self.layers[0]`,
    `len(self.layers)`), as a Location, or None."""
    attr = trunk.container.rpartition(".")[2]
    source = graph.sources.get(trunk.function_span.path)
    for statement in trunk.function.body.body[:trunk.loop_index]:
        for node in _attributes(statement):
            if isinstance(node.value, cst.Name) and node.value.value == "self" and node.attr.value == attr:
                return source.span_of(node).start
    return None


def _attributes(node: cst.CSTNode):
    if isinstance(node, cst.Attribute):
        yield node
    for child in node.children:
        yield from _attributes(child)


def _balanced(cost: list[float], stages: int, pro: float, epi: float,
              uncut: set[int] = frozenset()) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the most expensive stage (prologue on 0, epilogue on last),
    never ending a range at a block index in `uncut` (an empty range where no cut fits).

    Dynamic programming from the last stage back: best[start] is the least bottleneck of blocks
    start.. on the remaining stages, and the first (smallest) end reaching it is kept; the same
    sums and comparisons, in the same order, as solving each (start, stage) top-down, in loops
    rather than a call per state (96 blocks on 48 stages are 200 k states)."""
    n = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # the last stage takes every block from start on
    best = [prefix[n] - prefix[start] + (pro if stages == 1 else 0.0) + epi for start in range(n + 1)]
    cut_at: list[list[int]] = []            # per stage, per start: where its range ends
    for stage in range(stages - 2, -1, -1):
        extra = pro if stage == 0 else 0.0
        here_best, here_end = [inf] * (n + 1), [0] * (n + 1)
        later = stages - stage - 1          # stages after this one, each needs a block
        for start in (range(1) if stage == 0 else range(stage, n - later)):
            least, chosen, base = inf, 0, prefix[start]
            for end in range(start + 1, n - later + 1):
                if end in uncut:
                    continue
                here = prefix[end] - base + extra
                rest = best[end]
                worst = here if here > rest else rest
                if worst < least:
                    least, chosen = worst, end
            here_best[start], here_end[start] = least, chosen
        best = here_best
        cut_at.append(here_end)
    cut_at.reverse()
    ranges, start = [], 0
    for stage in range(stages - 1):
        end = cut_at[stage][start]
        ranges.append((start, end))
        start = end
    ranges.append((start, n))
    return ranges


def node_blocks(graph: Graph, blocks: list[str]) -> dict[int, int]:
    """Node index -> the block it belongs to: a block's own ops, or the call of a leaf block
    (nn.Linear); the last block in order when both its module and its callee are blocks; of a
    module listed for several blocks (one layer a loop runs again and again), its k-th run's ops.
    Ops traced before a block is first called are not its own: the prologue may reach into the
    blocks through a method (BigBird's set_attention_type rebuilds each layer's attention) and
    such ops run where the prologue runs, not on the block's stage."""
    repeated = {path for path in blocks if blocks.count(path) > 1}
    index = {path: b for b, path in enumerate(blocks) if path not in repeated}
    calls = graph.trace.module_calls
    first_op = {path: calls[path][1] if path in calls else 0 for path in blocks}
    block_of: dict[int, int] = {}
    for node in graph.nodes:
        found = [index[m] for path in (node.module_path, node.callee_path or "") if path
                 for m in (path, *_ancestors(path)) if m in index and node.index >= first_op[m]]
        if found:
            block_of[node.index] = max(found)
    for path in sorted(repeated):       # one module the loop's iterations run: its k-th run, block k
        positions = [b for b, p in enumerate(blocks) if p == path]
        for b, run in zip(positions, _runs(graph, path, len(positions))):
            block_of.update(dict.fromkeys(run, b))
    return block_of


def _within_runs(graph: Graph, blocks: list[str], block_of: dict[int, int]) -> dict[int, int]:
    """`block_of` less the ops of a block's modules that run after the next block began (blocks
    called once, in order): the code after the loop calling one (DiT's output conditioning runs
    `self.transformer_blocks[0].norm1.emb` again) runs on the stage that runs that code, not on
    the block's."""
    calls, runs = graph.trace.module_calls, graph.trace.module_runs
    starts = [calls[path][1] if path in calls else None for path in blocks]
    stop = {b: starts[b + 1] for b in range(len(blocks) - 1)
            if None not in (starts[b], starts[b + 1]) and starts[b] < starts[b + 1]
            and runs.get(blocks[b], 1) == 1 and runs.get(blocks[b + 1], 1) == 1}
    return {index: b for index, b in block_of.items() if b not in stop or index < stop[b]}


def _ancestors(path: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]: the modules a path lies strictly inside."""
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _ownership(graph: Graph, plan: StagePlan) -> None:
    """Which modules each stage drops (those it never calls), and which parameters several
    stages hold (tied weights: the embedding on the first stage, the LM head on the last).
    "Inside a module" tests go through each path's ancestors and set lookups, not through every
    pair of paths: a 96-block model has thousands of paths (linear, not quadratic)."""
    trace = graph.trace
    used: dict[str, set[int]] = {}          # module -> stages running it or anything inside it
    for node in graph.nodes:
        for path in filter(None, (node.module_path, node.callee_path, *_read_owners(graph, node))):
            for module in (path, *_ancestors(path)):
                used.setdefault(module, set()).add(plan.node_stage[node.index])
        if "" in _read_owners(graph, node):     # the model's own parameter (a cls_token) read here
            used.setdefault("", set()).add(plan.node_stage[node.index])
    for name, others in trace.module_aliases.items():    # one object: a stage running it holds every name
        for other in others:
            used.setdefault(other, set()).update(used.get(name, ()))

    everywhere = set()                      # modules running, or holding something that runs, on every stage
    every_stage = {node.index for node in graph.nodes if _runs_on_every_stage(graph, plan, node)}
    for node in graph.nodes:
        if node.index in every_stage:
            for path in filter(None, (node.module_path, node.callee_path)):
                everywhere.update((path, *_ancestors(path)))
            if "" in _read_owners(graph, node):     # the model's own parameter (ViT's pos_embedding) read
                everywhere.add("")                  # above the cut function: each stage keeps a copy

    blocks = plan.blocks
    block_set = set(blocks)
    every_owner = sorted({alias.rpartition(".")[0] for info in trace.params.values() for alias in info.aliases})
    owners = [m for m in every_owner if not (m in block_set or any(a in block_set for a in _ancestors(m)))]
    for stage in range(plan.stages):
        drop, shadow = [], []
        dropped: set[str] = set()
        for module in owners:
            if stage not in used.get(module, ()) and not any(a in dropped for a in _ancestors(module)):
                if module in everywhere:
                    shadow.append(module)
                else:
                    drop.append(module)
                    dropped.add(module)
        for trunk in plan.trunks:      # lists of modules: the whole list stays, the others' blocks hollow
            if trunk.iterations:
                first, stop = plan.local_ranges(stage)[trunk.container]
                for k, block in enumerate(trunk.blocks):
                    if not first <= k < stop:
                        drop += [m for m in _unused_parts(block, stage, used, every_owner) if m not in drop]
        plan.drop[stage], plan.shadow[stage] = drop, shadow
    _hold_unused(plan, owners, used)
    # a block of a list each stage keeps whole is held where it is not hollow: its own stage, and a
    # stage whose code reads some of it (tied); one of a list cut apart, on its own stage only
    cut_apart = {b for trunk in plan.trunks if not trunk.iterations for b in trunk.blocks}
    not_held = [set(plan.drop[s]) | set(plan.shadow[s]) | cut_apart for s in range(plan.stages)]
    live = _computed_on_later_stages(graph, plan, {m for s in plan.shadow.values() for m in s}, every_stage)
    tied_ranks = None       # the pipeline ranks holding the tied parameters: one group for all of them
    # a module several iterations of the loop run (one layer whose weights they share): every stage
    # holding it computes with it, like a shadow read by later stages
    looped = {b for trunk in plan.trunks for b in trunk.blocks if trunk.blocks.count(b) > 1}
    for info in trace.params.values():
        if any(a in live for alias in info.aliases for a in _ancestors(alias)):
            plan.shared.append(sorted(info.aliases))    # every stage holds it: summed over all of them
            continue
        # a parameter of the model itself (ViT's cls_token) is dropped with the module "" that owns it
        holders = {s for inside in ((*_ancestors(a), *([""] if "." not in a else [])) for a in info.aliases)
                   for s in range(plan.stages) if not any(a in not_held[s] for a in inside)}
        if len(holders) == plan.stages and any(a in looped for alias in info.aliases for a in _ancestors(alias)):
            plan.shared.append(sorted(info.aliases))
            continue
        if len(holders) > 1:
            plan.tied.append(sorted(info.aliases))
            ranks = sorted({plan.rank_of(s) for s in holders})
            names = ", ".join(info.aliases)
            if len(ranks) < len(holders):
                raise UserError(f"parameters tied across pipeline stages ({names}) are held by two stages of one "
                                f"rank (stages {sorted(holders)} on ranks {ranks}); their gradients are summed "
                                "between ranks", trunk_location(graph, plan),
                                hint="use another number of stages (--pp), or cut them with --stages")
            if tied_ranks is not None and ranks != tied_ranks:
                raise UserError(f"parameters tied across pipeline stages are held by different stages ({names} on "
                                f"ranks {ranks}, others on {tied_ranks}); their gradients are summed over one "
                                "group of ranks", trunk_location(graph, plan),
                    hint="use fewer stages (--pp), or cut them with --stages so one set of stages holds them")
            tied_ranks = ranks
            if plan.chain or ranks != [0, plan.ranks - 1]:    # not the default: the first and the last
                plan.tied_ranks = ranks


def _hold_unused(plan: StagePlan, owners: list[str], used: dict[str, set[int]]) -> None:
    """Keep each module that no stage runs (a VLM's vision tower under a text-only forward) on
    the first stage whose program holds its parent: dropped by every stage, its parameters would
    be missing from the merged state dict and from every checkpoint. It has no gradient, so the
    stage holding it only carries it. `owners` is sorted: a module comes before those inside it,
    which come back with it."""
    for module in owners:
        if used.get(module):
            continue
        held = [s for s in range(plan.stages)
                if module not in plan.drop[s] and not any(a in plan.drop[s] for a in _ancestors(module))]
        keeper = next((s for s in range(plan.stages)
                       if not any(a in plan.drop[s] for a in _ancestors(module))), None)
        if not held and keeper is not None:
            plan.drop[keeper].remove(module)


def _unused_parts(block: str, stage: int, used: dict[str, set[int]], owners: list[str]) -> list[str]:
    """What a stage drops of another stage's block: all of it, or, when its code reads some of it
    (DiT's last stage runs block 0's `norm1.emb` after the loop), the modules under it holding
    parameters that the stage does not run."""
    if stage not in used.get(block, ()):
        return [block]
    dropped: list[str] = []
    for module in owners:
        if module.startswith(block + ".") and stage not in used.get(module, ()) \
                and not any(a in dropped for a in _ancestors(module)):
            dropped.append(module)
    return dropped


def trunk_location(graph: Graph, plan: StagePlan):
    if plan.trunk.statements is not None:
        return plan.trunk.function_span.start
    return graph.trace.module_calls[plan.trunk.blocks[0]][0].start


def _read_owners(graph: Graph, node) -> list[str]:
    """Modules whose parameters the op reads without calling them (ProphetNet's decoder indexes
    `self.ngram_embeddings.weight`): the stage running it must hold them. Of a tied parameter's
    names, those under the module whose code reads it (all, when none is); when the op is the
    call of a module holding it, the names under that module alone (the embedding's call does
    not need the tied LM head; a weight-normed conv's call needs the parametrization module
    inside it that holds its `original0` and `original1`)."""
    trace = graph.trace
    owners = []
    read = [o.tid for o in node.operands if o.tid is not None] + [   # `torch.cat([w.t(), self.dense.weight])`
        t for o in node.operands if isinstance(o.value, TensorList) for t in o.value]
    for tid in read:
        if trace.tensors[tid].param is None:
            continue
        aliases = trace.params[trace.tensors[tid].param].aliases
        called = [a for a in aliases if node.callee_path and a.startswith(node.callee_path + ".")]
        if called:
            owners += [a.rpartition(".")[0] for a in called]
            continue
        inside = [a for a in aliases if not node.module_path or a.startswith(node.module_path + ".")]
        owners += [a.rpartition(".")[0] for a in inside or aliases]
    return owners


def _computed_on_later_stages(graph: Graph, plan: StagePlan, shadows: set[str], every_stage: set[int]) -> set[str]:
    """The shadow modules whose output a stage after the first computes with: a value made by
    code above the cut function (which every stage runs), flowing through more such code into a
    call another stage runs (CpmAnt's position bias, read by every block). Each stage's copy then
    takes part in the loss, and its gradient counts. A shadow read for its shape only (the
    embedding a later stage replaces by the value it receives) has no such consumer. `every_stage`:
    the ops _runs_on_every_stage."""
    if not shadows:
        return set()
    consumers = graph.consumers
    tensors = graph.trace.tensors
    inside: dict[str, dict] = {module: {} for module in shadows}      # the first stage's nodes in each, by index
    for n in graph.nodes:
        if plan.node_stage[n.index] == 0:
            for path in {n.module_path, n.callee_path or ""}:
                for module in (path, *_ancestors(path)):
                    if module in inside:
                        inside[module][n.index] = n
    live = set()
    for module in sorted(shadows):
        frontier = [t for n in inside[module].values() for t in n.outputs]
        seen = set(frontier)
        while frontier and module not in live:
            tid = frontier.pop()
            if not tensors[tid].requires_grad:
                continue
            for index, _ in consumers.get(tid, ()):
                node = graph.nodes[index]
                if plan.node_stage[index] != 0:
                    live.add(module)
                    break
                if index in every_stage:
                    fresh = [t for t in node.outputs if t not in seen]
                    seen.update(fresh)
                    frontier.extend(fresh)
    return live


def _holders(plan: StagePlan, module: str) -> set[int]:
    """The stages whose program holds this module (a block of a list cut apart: its own stage only;
    of a list every stage keeps whole: where it is not hollow)."""
    cut_apart = {b for trunk in plan.trunks if not trunk.iterations for b in trunk.blocks}
    for b, block in enumerate(plan.blocks):
        if block in cut_apart and (module == block or module.startswith(block + ".")):
            return {s for s, (a, z) in enumerate(plan.block_ranges) if a <= b < z}
    return {s for s in range(plan.stages)
            if not any(module == d or module.startswith(d + ".") for d in plan.drop.get(s, []))}


def _check_state_writes(graph: Graph, plan: StagePlan) -> None:
    """Refuse a cut after which a stage would miss a change of module state: the forward sets a
    plain attribute (`self.attention_type = "original_full"`) in code only some stages run (the
    cut function's prologue runs on the first stage, a block on its own, the epilogue on the
    last), on a module another stage holds and runs with the old value. Code above the cut
    function runs on every stage and is never the cause."""
    for trunk in plan.trunks:
        _check_trunk_state_writes(graph, plan, trunk)


def _check_trunk_state_writes(graph: Graph, plan: StagePlan, trunk: Trunk) -> None:
    cut = trunk.function_span
    source = graph.sources.get(cut.path)
    body = list(trunk.function.body.body)
    prologue = [source.span_of(stmt) for stmt in body[:trunk.loop_index]]
    loop = source.span_of(body[trunk.loop_index])
    last = plan.stages - 1
    enters = 0
    if plan.chain:      # the stages that run this trunk's prologue and its epilogue
        plays = {s: plan.roles[s][trunk.owner].role for s in range(plan.stages) if trunk.owner in plan.roles[s]}
        enters = min(s for s, role in plays.items() if role == "enter")
        last = max(s for s, role in plays.items() if role != "skip")
    n = len(graph.nodes)
    replays: set[Span] = set()
    for write in graph.trace.state_writes:
        inside = next((span for span in write.stack if span.path == cut.path and cut.contains(span)), None)
        if inside is None:
            continue
        if trunk.statements is not None:     # a chain of statements: the stage running the write's statement
            writers, part = {plan.node_stage.get(min(write.node + 1, n - 1), 0)}, "its chain of statements"
        elif any(stmt.contains(inside) for stmt in prologue):
            writers, part = {enters}, "the code before the block loop"
        elif loop.contains(inside):
            after = min(write.node + 1, n - 1)
            writers, part = {plan.node_stage.get(after, 0)}, "the block loop"
        else:
            writers, part = {last}, "the code after the block loop"
        missing = sorted(_holders(plan, write.module) - writers - _skipping(plan, write.module))
        if not missing:
            continue
        if writers == {0} and not plan.chain and part.endswith("before the block loop") and (
                inside in replays or _replayable(source, trunk.function, inside)):
            replays.add(inside)     # later stages run the call too: they see the change
            continue
        where = f"{write.module}.{write.attr}" if write.module else f"the model's {write.attr}"
        stage = "stages " + ", ".join(map(str, missing)) if len(missing) > 1 else f"stage {missing[0]}"
        ran = ", ".join(map(str, sorted(writers)))
        raise UserError(
            f"the forward sets {where} in {trunk.container}'s pipeline cut ({part}, at {inside.label}), which only "
            f"stage {ran} runs; {stage} also hold{'s' if len(missing) == 1 else ''} that module and would run with "
            "the attribute's old value", write.stack[0].start,
            hint="pipelining needs module state set in the constructor (or outside the function whose block loop "
                 "is cut), or, before the block loop, by a call of a method of `self` (`self.set_mode(...)`), which "
                 "every later stage then runs too; not in other code that only one stage runs")
    trunk.replays = sorted(replays, key=lambda span: (span.line, span.col))


def _skipping(plan: StagePlan, module: str) -> set[int]:
    """Chained trunks: the stages that never run `module`'s code because it lies in a trunk's owner
    they skip or stop before (BigBird-Pegasus's encoder switching its own attention type)."""
    for trunk in plan.chain:
        if module == trunk.owner or module.startswith(trunk.owner + "."):
            return {s for s in range(plan.stages)
                    if plan.roles[s].get(trunk.owner, ChainRole("skip", 0, 0, False)).role == "skip"}
    return set()


def _replayable(source, function: cst.FunctionDef, span: Span) -> bool:
    """Whether the write happened inside a call the later stages can run again on their own copy
    of the module: a statement of its own calling a method of the cut function's `self`
    (`self.set_attention_type("original_full")`, `self.encoder.set_mode(m)`), whose result is not used."""
    params = function.params.params
    if not params or params[0].name.value != "self":
        return False
    node = source.node_at(span.line, span.col, span.end_line, span.end_col)
    if not isinstance(node, cst.Call) or any(arg.star for arg in node.args):
        return False
    parent = source.parents.get(node)
    if not isinstance(parent, cst.Expr):
        return False
    func = node.func
    if not isinstance(func, cst.Attribute):
        return False
    target = func.value
    while isinstance(target, cst.Attribute):
        target = target.value
    return isinstance(target, cst.Name) and target.value == "self"


def _runs_on_every_stage(graph: Graph, plan: StagePlan, node) -> bool:
    """Whether a call before the blocks runs on every stage: it is reached from code above the
    cut function (which every stage runs up to its call), not from the cut function's prologue
    (which only the first stage runs). Chained trunks: code above the cut functions between two
    trunks runs on its stage and every later one."""
    stage = plan.node_stage[node.index]
    if node.span is None or (stage != 0 and not (plan.chain and stage < plan.stages - 1)):
        return False
    blocks = plan.trunk.__dict__.get("_block_set")
    if blocks is None:
        blocks = plan.trunk.__dict__["_block_set"] = set(plan.blocks)
    if any(m in blocks for m in (node.module_path, *_ancestors(node.module_path))):
        return False
    return _above_cut(graph, node, [t.function_span for t in plan.trunks])


def _above_cut(graph: Graph, node, cuts: list[Span]) -> bool:
    """Whether the op runs in code above the cut functions: reached from the model's forward
    through calls none of which lies in one of them."""
    return _reached_above(graph, node.span, node.module_path, cuts, set())


def _reached_above(graph: Graph, span: Span | None, module: str, cuts: list[Span], seen: set[str]) -> bool:
    while span is not None and module not in seen:
        if any(span.path == cut.path and cut.contains(span) for cut in cuts):
            return False
        if not module:
            return True
        seen.add(module)
        call = graph.trace.module_calls.get(module)
        span = call[0] if call else None
        names = [module, *graph.trace.module_aliases.get(module, ())]
        if len(names) > 1:      # one object under several names (CoaT's shared cpe): which holder called
            # it is unknown, so it runs above the cut only if it does under every name
            return all(_reached_above(graph, span, _holder(graph, name), cuts, seen | set(names)) for name in names)
        module = _holder(graph, module)
    return False


def _holder(graph: Graph, module: str) -> str:
    """The nearest called module holding `module` (a ModuleList, never called: its children run
    from its holder's code)."""
    module = module.rpartition(".")[0]
    while module and module not in graph.trace.module_calls:
        module = module.rpartition(".")[0]
    return module
