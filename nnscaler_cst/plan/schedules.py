"""Pipeline schedules as op_order constraint tables (rules/plans/*.toml [schedule]), ordered by z3.

A table states order constraints between one rank's forward steps F[k] and backward steps
B[k] (k = 0..K-1), with expressions over k, the rank's pipeline index i, the ranks D, the
micro-batches M, the stages per rank V, the pipelines P, K = V*M/P and the warm-up W. A
constraint may hold only `when` a condition does. A table with `recycling = true` (3f1b) orders
N forward passes per micro-batch, F{c}[k] for c = 1..N (F[k] is pass N, the only one with a
backward); a constraint naming c holds for every pass. z3 finds positions satisfying all of them;
a new schedule is a new table, not new code.

Placement (op-assign) is a table's too: the D*V stages form P pipelines of D*V/P stages each
(every micro-batch runs through one pipeline), and `stage_rank` says which rank runs stage v
(default v % D: interleaving deals stages round-robin). Pipelines are replicas of one model cut
into D*V/P stages: stage v runs model stage v % (D*V/P), and the ranks holding replicas of a
model stage sum their gradients. Chimera: P = 2, `stage_rank = "v if v < D else 2*D - 1 - v"`.
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import z3

from ..errors import Location, UserError, display_path, toml_error
from ..rules_path import find_rules_file, rules_files

# `F[k] < B[k]`, and with recycling `F{c}[k] < F{c + 1}[k]`: the forward of pass c (1..N)
_CONSTRAINT = re.compile(r"^\s*([FB])(?:\{(.+?)\})?\[(.+?)\]\s*<\s*([FB])(?:\{(.+?)\})?\[(.+?)\]\s*(?:when\s+(.+))?$")


@dataclass(frozen=True)
class Action:
    # "F" or "B"; interlaced: "E" / "G", the SPMD step (every rank takes part) of one call of a
    # vocabulary-split module in stage `stage`'s forward / backward of micro-batch `micro`
    kind: str
    stage: int         # global (virtual) stage
    micro: int
    # recycling (NF1B): the pass of a forward without gradient, 0..N-2; None for the forward
    # that keeps its activations for the backward (the last pass, or the only one)
    cycle: int | None = None
    call: int = 0      # E / G: which vocabulary call of that step (in the order the step makes them)

    def __hash__(self) -> int:
        # the dataclass's own hash (of the fields), computed once: the simulator looks each action
        # up many times per timeline, and the planner simulates hundreds of timelines
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.kind, self.stage, self.micro, self.cycle, self.call))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self):            # a hash is per process (string hashing is salted)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __str__(self) -> str:          # torch.distributed.pipelining's action grammar (+ "c<call>", "r<pass>")
        return f"{self.stage}{self.kind}{self.micro}" + (f"c{self.call}" if self.call else "") + \
            (f"r{self.cycle}" if self.cycle is not None else "")


_ACTION = re.compile(r"^(\d+)([FBEG])(\d+)(?:c(\d+))?(?:r(\d+))?$")


def parse_action(text: str) -> Action:
    """"1F3" -> the forward of stage 1 on micro-batch 3; "0F2r1" -> its no-grad pass 1 (recycling);
    "1E3" / "1G3c1" -> the vocabulary step of that forward's first call / that backward's second
    (interlaced)."""
    match = _ACTION.match(text)
    if not match:
        raise UserError(f"cannot read the pipeline action {text!r}",
                        hint="actions are STAGE F|B MICRO, e.g. 0F1, 1B0, 0F1r0 for a no-grad pass, "
                             "0E1 / 0G1c1 for the vocabulary steps of stage 0's calls of vocabulary-split modules")
    stage, kind, micro, call, cycle = match.groups()
    return Action(kind, int(stage), int(micro), int(cycle) if cycle is not None else None, int(call or 0))


@dataclass(frozen=True)
class VocabSteps:
    """Interlaced: the calls of vocabulary-split modules in one step of a stage, each an SPMD step of
    its own that every rank takes part in. `at`: where each call comes in the stage's forward, as a
    fraction of its forward time (ascending); `forward` / `backward`: each call's step in seconds,
    in forward call order. The backward meets the calls in reverse order, at 1 - `at`, and pauses
    at those not `deferred`: an embedding's backward returns no gradient to its input, so the
    owner keeps its output's gradient and the call's backward step runs after the owner's step."""
    at: tuple[float, ...]
    forward: tuple[float, ...] = ()
    backward: tuple[float, ...] = ()
    deferred: tuple[bool, ...] = ()

    @property
    def calls(self) -> int:
        return len(self.at)

    def deferred_call(self, call: int) -> bool:
        """Whether backward call `call` (counted in the backward's order) runs after the step."""
        return bool(self.deferred) and self.deferred[self.calls - 1 - call]

    def pausing(self, kind: str) -> list[int]:
        """The calls (in the step's own order) at which the owner's F or B pauses."""
        return list(range(self.calls)) if kind == "F" else \
            [c for c in range(self.calls) if not self.deferred_call(c)]

    def pieces(self, kind: str) -> list[float]:
        """The owner's step cut at its pausing calls: fractions of its F or B before the first,
        between two, after the last (one more than the pausing calls)."""
        marks = list(self.at) if kind == "F" else [1.0 - self.at[self.calls - 1 - c] for c in self.pausing("B")]
        return [b - a for a, b in zip([0.0] + marks, marks + [1.0])]

    def seconds(self, kind: str, call: int) -> float:
        """The SPMD step of call `call` (counted in the step's own order: a backward's first is
        the forward's last)."""
        times = self.forward if kind == "E" else tuple(reversed(self.backward))
        return times[call] if call < len(times) else 0.0


@dataclass
class ScheduleTable:
    name: str
    description: str
    virtual_stages: int
    warmup: str
    order: list[str]
    forward_chunk: str
    backward_chunk: str
    micro_batch: str
    location: Location
    pipelines: int = 1
    stage_rank: str = "v % D"
    bubble: tuple[str, str] | None = None      # the bubble's formula: numerator, denominator
    # recycling (NF1B): the table orders N forward passes per micro-batch, F{1}..F{N}, the first
    # N-1 without gradient; N is how often the model runs its trunk (the trace counts it)
    recycling: bool = False
    # interlaced (plan/interlaced.py): which embeddings every pipeline rank holds a vocabulary
    # piece of ("tied", "all"), and at which owner's step each rank runs its share (`E[k] = F[k]`)
    vocab: str | None = None
    together: tuple[str, ...] = ()

    def formula(self, ranks: int, micro: int) -> tuple[str, float] | None:
        """The table's bubble formula, written out, and its value for D ranks and M micro-batches."""
        if not self.bubble:
            return None
        env = {"D": ranks, "M": micro, "V": self.virtual_stages, "P": self.pipelines}
        top, bottom = (evaluate(e, env, self.location) for e in self.bubble)
        return f"({self.bubble[0]})/({self.bubble[1]})", top / bottom if bottom else 0.0


@dataclass(frozen=True)
class Placement:
    """Where each stage runs: `ranks[v]` is the pipeline rank of stage v; stages v and v + 1 of
    one pipeline hand over, stages `length` apart are replicas of one model stage."""
    ranks: tuple[int, ...]
    length: int                        # stages per pipeline

    def stages_of(self, rank: int) -> list[int]:
        return [v for v, r in enumerate(self.ranks) if r == rank]

    def first(self, stage: int) -> bool:
        return stage % self.length == 0

    def last(self, stage: int) -> bool:
        return stage % self.length == self.length - 1

    def replica_groups(self) -> list[list[int]]:
        """Ranks holding replicas of one model stage, joined where they overlap: the groups whose
        gradients are summed (one group per rank; a rank alone when nothing is replicated)."""
        groups: list[set[int]] = [{r} for r in sorted(set(self.ranks))]
        for model_stage in range(self.length):
            holders = {self.ranks[v] for v in range(model_stage, len(self.ranks), self.length)}
            joined = set(holders).union(*[g for g in groups if g & holders])
            groups = [g for g in groups if not g & holders] + [joined]
        return sorted(sorted(g) for g in groups)


def load_schedule(name: str) -> ScheduleTable:
    """A schedule by name (plans/NAME.toml in the rules folders) or by path to your own table."""
    path = Path(name) if name.endswith(".toml") else find_rules_file("plans", name)
    if path is None or not path.is_file():
        known = [p.stem for p in rules_files("plans") if "[schedule]" in p.read_text()]
        raise UserError(f"unknown schedule {name!r}" if not name.endswith(".toml") else f"no schedule table {name}",
                        hint=f"schedules: {', '.join(known)}, or the path of your own .toml table")
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, path, text) from None
    if "schedule" not in data:
        raise UserError(f"{name} is a plan table, not a schedule", Location(display_path(path)),
                        hint="--schedule takes a table with a [schedule] header (gpipe, 1f1b, interleaved, chimera, 3f1b); "
                        "give plan tables to --plan")
    head = data["schedule"]
    return ScheduleTable(head.get("name", name), head.get("description", ""), int(head.get("virtual_stages", 1)),
                         head.get("warmup", "0"), head.get("order", []), head.get("forward_chunk", "0"),
                         head.get("backward_chunk", "0"), head.get("micro_batch", "k"),
                         Location(display_path(path), _line(path, "order")), int(head.get("pipelines", 1)),
                         head.get("stage_rank", "v % D"), tuple(head["bubble"]) if "bubble" in head else None,
                         bool(head.get("recycling", False)), head.get("vocab"),
                         tuple(head.get("together", ())))


def placement(table: ScheduleTable, ranks: int) -> Placement:
    """The table's op-assign of stages to ranks, checked: each rank runs V stages."""
    V, P = table.virtual_stages, table.pipelines
    where = Location(table.location.path, _line(Path(table.location.path), "stage_rank"))
    if P < 1 or (ranks * V) % P:
        raise UserError(f"schedule {table.name}: {ranks * V} stages do not form {P} pipelines", where)
    env = {"D": ranks, "V": V, "P": P}
    placed = tuple(evaluate(table.stage_rank, {**env, "v": v}, where) for v in range(ranks * V))
    for rank in range(ranks):
        held = [v for v, r in enumerate(placed) if r == rank]
        if len(held) != V:
            raise UserError(f"schedule {table.name}: stage_rank gives rank {rank} the stages {held}, not {V}",
                            where, hint="every rank runs V stages: stage_rank must map D*V stages onto 0..D-1")
    return Placement(placed, ranks * V // P)


def _line(path, key: str) -> int:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith(key):
            return number
    return 1


_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp, ast.Name, ast.Constant, ast.Call,
            ast.Load, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.Eq, ast.NotEq, ast.Lt,
            ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or, ast.Not)


def evaluate(expression: str, env: dict[str, int], where: Location) -> int:
    """Integer arithmetic over the table's names (min/max, `a if c else b`); nothing else is evaluated."""
    code = _compiled.get((expression, frozenset(env)))
    if code is None:
        code = _compile(expression, env, where)
    return eval(code, {"__builtins__": {}, "min": min, "max": max}, dict(env))


# an order's constraints evaluate the same few expressions for every step of every rank: each is
# checked and compiled once per set of names
_compiled: dict[tuple[str, frozenset], object] = {}


def _compile(expression: str, env: dict[str, int], where: Location):
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise UserError(f"cannot read the expression {expression!r}", where) from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED) or (isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in ("min", "max"))):
            raise UserError(f"{expression!r}: only integer arithmetic, comparisons, min, max and `a if c else b`",
                            where)
        if isinstance(node, ast.Name) and node.id not in env and node.id not in ("min", "max"):
            raise UserError(f"{expression!r}: unknown name {node.id}", where, hint="names: " + ", ".join(env))
    code = _compiled[(expression, frozenset(env))] = compile(tree, "<schedule>", "eval")
    return code


_SAFE = {"__builtins__": {}, "min": min, "max": max}


def _evaluator(where: Location):
    """evaluate() for many envs with the same names (an order's steps): each expression looked up
    once, evaluated on the env as given (expressions cannot assign), not on a copy."""
    codes: dict[str, object] = {}

    def value(expression: str, env: dict[str, int]) -> int:
        code = codes.get(expression)
        if code is None:
            code = codes[expression] = _compiled.get((expression, frozenset(env))) or _compile(expression, env, where)
        return eval(code, _SAFE, env)
    return value


def _names(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", text))


def rank_order(table: ScheduleTable, rank: int, ranks: int, micro: int, passes: int = 1) -> list[Action]:
    """One rank's actions in the order the table's constraints allow (z3). `passes`: forwards per
    micro-batch (recycling, NF1B): F{1}..F{N}, of which only F{N} (= F) has a backward."""
    V, P, N = table.virtual_stages, table.pipelines, passes
    K = V * micro // P               # each micro-batch runs through one of the P pipelines
    env = {"i": rank, "D": ranks, "M": micro, "V": V, "P": P, "K": K, "N": N}
    mine = placement(table, ranks).stages_of(rank)
    warmup_at = Location(table.location.path, _line(Path(table.location.path), "warmup"))
    env["W"] = evaluate(table.warmup, env, warmup_at)
    steps_of = [("F", c) for c in range(1, N + 1)] + [("B", N)]
    keys = [(kind, c, k) for kind, c in steps_of for k in range(K)]
    edges: list[tuple[tuple, tuple]] = []       # (before, after), in the order z3 is given them
    for text in table.order:
        match = _CONSTRAINT.match(text)
        if not match:
            raise UserError(f"cannot read the order constraint {text!r}", table.location,
                            hint="write `F[k] < B[k]`, optionally followed by `when i == 0` "
                                 "(with recycling, `F{c}[k] < F{c + 1}[k]`: pass c of 1..N)")
        a_kind, a_pass, a_index, b_kind, b_pass, b_index, when = match.groups()
        # a constraint naming j relates every pair of steps (k, j): an order by a computed key;
        # one naming c holds for every forward pass c = 1..N
        named = _names(text)
        value = _evaluator(table.location)      # this constraint's names: the same for every step
        for c in (range(1, N + 1) if "c" in named else [None]):
            for k in range(K):
                for j in (range(K) if "j" in named else [None]):
                    local = {**env, "k": k}
                    if j is not None:
                        local["j"] = j
                    if c is not None:
                        local["c"] = c
                    if when and not value(when, local):
                        continue
                    a, b = value(a_index, local), value(b_index, local)
                    pa = value(a_pass, local) if a_pass and a_kind == "F" else N
                    pb = value(b_pass, local) if b_pass and b_kind == "F" else N
                    if 0 <= a < K and 0 <= b < K and 1 <= pa <= N and 1 <= pb <= N \
                            and (a_kind, pa, a) != (b_kind, pb, b):
                        edges.append(((a_kind, pa, a), (b_kind, pb, b)))
    # the tables' constraints usually fix a total order: then it is the only one z3 could pick,
    # found by a topological sort in milliseconds instead of a z3 solve (most of --plan auto's time)
    steps = _only_order(keys, edges)
    if steps is None:
        steps = _z3_order(table, rank, N, keys, edges)
    out = []
    value = _evaluator(table.location)
    for kind, c, k in steps:
        local = {**env, "k": k}
        chunk = value(table.forward_chunk if kind == "F" else table.backward_chunk, local)
        m = value(table.micro_batch, local)
        if not 0 <= chunk < V:
            raise UserError(f"schedule {table.name}: step {kind}[{k}] of rank {rank} runs chunk {chunk}, not one of "
                            f"its {V} stages", table.location)
        out.append(Action(kind, mine[chunk], m, c - 1 if kind == "F" and c < N else None))
    return out


def _only_order(keys: list[tuple], edges: list[tuple[tuple, tuple]]) -> list[tuple] | None:
    """The steps in the one order the constraints `edges` allow, or None where they allow several
    or none (a cycle: z3 then reports them contradictory). Kahn's sort: the order is the only one
    exactly when a single step is free at every point."""
    after: dict[tuple, set] = {key: set() for key in keys}
    for a, b in edges:
        after[a].add(b)
    before = dict.fromkeys(keys, 0)
    for a in after:
        for b in after[a]:
            before[b] += 1
    free = [key for key in keys if not before[key]]
    order = []
    while len(free) == 1:
        key = free.pop()
        order.append(key)
        for b in after[key]:
            before[b] -= 1
            if not before[b]:
                free.append(b)
    return order if len(order) == len(keys) else None


# z3's orders by problem: ranks whose warm-up covers all their micro-batches state the same
# constraints (for any number of ranks), and z3 answers the same problem the same way
_Z3_ORDERS: dict[tuple, list[tuple]] = {}


def _z3_order(table: ScheduleTable, rank: int, N: int, keys: list[tuple], edges: list[tuple[tuple, tuple]]) -> list[tuple]:
    """The steps ordered by positions z3 finds for the constraints `edges`."""
    problem = (N, tuple(keys), tuple(edges))
    if problem not in _Z3_ORDERS:
        _Z3_ORDERS[problem] = _z3_solve(table, rank, N, keys, edges)
    return list(_Z3_ORDERS[problem])


def _z3_solve(table: ScheduleTable, rank: int, N: int, keys: list[tuple], edges: list[tuple[tuple, tuple]]) -> list[tuple]:
    # a fresh context each time: where the constraints leave a choice, z3's pick then depends on
    # the table and the sizes only, not on what this process solved before (same output each run)
    ctx = z3.Context()
    pos = {(kind, c, k): z3.Int(f"{kind}{k}" if c == N else f"{kind}{c}_{k}", ctx) for kind, c, k in keys}
    solver = z3.Solver(ctx=ctx)
    solver.add(z3.Distinct(*pos.values()))
    for value in pos.values():
        solver.add(value >= 0, value < len(pos))
    for a, b in edges:
        solver.add(pos[a] < pos[b])
    if solver.check() != z3.sat:
        raise UserError(f"the order constraints of schedule {table.name} contradict each other on rank {rank}",
                        table.location)
    model = solver.model()
    return sorted(pos, key=lambda key: model.eval(pos[key]).as_long())


def schedule(table: ScheduleTable, ranks: int, micro: int, passes: int = 1) -> list[list[Action]]:
    """Every rank's order. `passes` > 1 (a trunk run N times, recycling) needs a table that
    orders the no-grad passes (`recycling = true`, 3f1b)."""
    if passes > 1 and not table.recycling:
        raise UserError(f"schedule {table.name} runs each micro-batch's forward once; this model runs its trunk "
                        f"{passes} times (recycling)", table.location,
                        hint="--schedule 3f1b pipelines the no-grad passes of later micro-batches into the bubbles")
    if table.virtual_stages > 1 and table.pipelines == 1 and micro % ranks:
        raise UserError(f"schedule {table.name} needs the micro-batches ({micro}) to be a multiple of the "
                        f"pipeline ranks ({ranks})", table.location)
    if micro % table.pipelines:
        raise UserError(f"schedule {table.name} needs the micro-batches ({micro}) to be a multiple of its "
                        f"{table.pipelines} pipelines", table.location,
                        hint=f"e.g. --micro-batches {max(table.pipelines, micro + table.pipelines - micro % table.pipelines)}")
    return [rank_order(table, r, ranks, micro, passes) for r in range(ranks)]


_ORDERS: dict = {}


def cached_schedule(table: ScheduleTable, ranks: int, micro: int, passes: int = 1) -> list[list[Action]]:
    """schedule(), kept per table and sizes for the planner, which prices many configurations of
    a few sizes (z3 orders 3F1B's 8 ranks x 24 micro-batches in about 15 s). Do not modify."""
    key = (table.location.path, table.name, tuple(table.order), table.warmup, ranks, micro, passes)
    if key not in _ORDERS:
        _ORDERS[key] = schedule(table, ranks, micro, passes)
    return _ORDERS[key]


def to_csv(orders: list[list[Action]]) -> str:
    """One row per rank, one column per step: torch.distributed.pipelining's `0F0,1B3` grammar."""
    return "\n".join(",".join(str(a) for a in order) for order in orders) + "\n"


_TIMELINES: dict = {}    # simulated_seconds: the Timeline of each set of orders _ORDERS keeps

STEADY_WITHIN = 12       # simulated_seconds: the most multiples of D·V·P it waits for a steady period


def simulated_seconds(table: ScheduleTable, stage_seconds: list[float], micro: int, passes: int = 1,
                      orders_for=None, vocab=None) -> float:
    """The pipeline's seconds per step under the table's order: the simulator's timeline
    (verify/simulate.py) over `stage_seconds` (per stage and micro-batch, all its passes: a
    forward per pass, the backward twice a forward). `orders_for(m)`: the ranks' orders for m
    micro-batches (default: the table's). A schedule repeats once every rank is in its steady
    state, so the step grows by the same period per D·V·P micro-batches from then on: the spans
    at 2, 3, 4 ... times D·V·P micro-batches until two successive periods agree, extrapolated
    from there (z3 orders a few D, not thousands). How soon the period settles depends on the
    table and the stages' imbalance: 3F1B's diagonals of N passes with a heavier first stage
    take more than 2D micro-batches to fill, and a period measured before then is short. No step
    is shorter than its busiest rank's work, M times its stages' seconds per micro-batch (a
    bound the extrapolation is held to; the vocabulary steps only add to it)."""
    from ..verify.simulate import Timeline, simulate
    ranks = len(stage_seconds)
    forward = [t / (passes + 2.0) for t in stage_seconds]
    place = placement(table, ranks)
    kept = orders_for is None            # the table's own orders, kept per size: so is their timeline
    orders_for = orders_for or (lambda m: cached_schedule(table, ranks, m, passes))

    def span(m: int) -> float:
        orders = orders_for(m)
        if vocab:
            events = simulate(orders, len(place.ranks), forward_seconds=forward, placement=place, passes=passes,
                              vocab=vocab)
            return max(e.end for e in events)
        if not kept:
            return Timeline(orders, len(place.ranks), place, passes).span(forward)
        key = (id(orders), place, passes)
        if key not in _TIMELINES:
            _TIMELINES[key] = Timeline(orders, len(place.ranks), place, passes)
        return _TIMELINES[key].span(forward)

    busiest = max(sum(stage_seconds[v] for v in place.stages_of(r)) for r in range(max(place.ranks) + 1))
    step = ranks * table.virtual_stages * table.pipelines     # micro-batch counts the table accepts
    if micro <= 3 * step:
        return max(span(micro), micro * busiest)
    spans = [span(2 * step), span(3 * step)]
    k = 3
    while (k + 1) * step < micro and k < STEADY_WITHIN:
        k += 1
        spans.append(span(k * step))
        if abs((spans[-1] - spans[-2]) - (spans[-2] - spans[-3])) <= 1e-9 * spans[-1]:
            break
    else:
        if (k + 1) * step >= micro:           # not settled before `micro`: the whole timeline
            return max(span(micro), micro * busiest)
    period = max((spans[-1] - spans[-2]) / step, busiest)
    return max(spans[-1] + (micro - k * step) * period, micro * busiest)
