"""Exact minimum of a sum of per-site and per-pair costs, by variable elimination.

The split search's objective is a sum of terms over one site's choice (its compute, its
collectives) or over two sites' choices (the conversion on an edge between them); pairs that
no collective joins, and a tied weight's users that must agree, are infinite pairs. Sites are
per source line, so a model's sites form a short chain with residual edges: eliminating one
site at a time (bucket elimination, Dechter 1999), each step a small table over the site's
remaining neighbours, finds the exact optimum in milliseconds where z3's optimiser takes
seconds. Ties go to the lower option index of the site eliminated (deterministic).

Higher-order facts (an argument fed by several producers) are not pairs; the caller checks
each optimum against them with z3, and `minimize_avoiding` rules out each combination z3 names,
by a factor over its sites while the tables stay narrow, else by branching on it.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable

MAX_TABLE = 1 << 16          # entries of the largest table one elimination may build

# A factor: (scope, values). `scope` is a tuple of sites in increasing order; `values` maps an
# assignment of the scope (a tuple of option indices, in scope order) to its cost. Dense tables
# hold every assignment; sparse ones (the caller's no-goods) only their non-zero entries.
Factor = tuple[tuple[int, ...], dict[tuple[int, ...], float]]


class TooWide(Exception):
    """The interaction graph is too dense for elimination within MAX_TABLE."""


class GaveUp(Exception):
    """`minimize_avoiding` solved `max_solves` subproblems without an acceptable optimum."""


# A combination to rule out: (sites, the option of each).
Combination = tuple[tuple[int, ...], tuple[int, ...]]


def minimize_avoiding(domains: list[int], unary: list[list[float]], pairs: dict[tuple[int, int], list[list[float]]],
                      conflict: Callable[[list[int]], Combination | None], max_solves: int = 256,
                      known: list[Combination] = ()) -> tuple[float, list[int]]:
    """`minimize`, over the assignments `conflict` accepts. `conflict(assignment)` is None for an
    acceptable assignment, else a combination it holds that no acceptable one may hold.

    Each combination named is first ruled out by a factor over its sites, and the whole problem
    eliminated again. When those factors make the tables too wide (a combination spans sites
    far apart in the chain), the search goes on best first by branching instead: a subproblem
    is the pairwise problem with some options ruled out (unary rows set to inf); its optimum,
    when it holds a named combination (s1=v1, ..., sk=vk), is replaced by k children that split
    what remains without it (child j fixes s1..s(j-1) to v1..v(j-1) and rules out vj at sj). A
    child's optimum is at least its parent's, so the first acceptable optimum popped is the
    least acceptable assignment. Raises GaveUp after `max_solves` eliminations. `known`:
    combinations the caller already knows `conflict` refuses, ruled out from the first solve."""
    inf = math.inf
    known = list(known)
    solves = 0

    def counted() -> None:
        nonlocal solves
        solves += 1
        if solves > max_solves:
            raise GaveUp(f"{max_solves} subproblems without an acceptable optimum")

    def named(assignment: list[int]) -> Combination | None:
        held = next((c for c in known if all(assignment[s] == v for s, v in zip(*c))), None)
        if held is None:
            held = conflict(assignment)
            if held is not None:
                known.append(held)
        return held

    while True:                      # factors, while they keep the tables narrow
        counted()
        factors: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}
        for sites, values in known:
            factors.setdefault(sites, {})[values] = inf
        try:
            value, assignment = minimize(domains, unary, pairs, factors)
        except TooWide:
            break
        if not math.isfinite(value) or named(assignment) is None:
            return value, assignment

    counter = itertools.count()
    heap: list = []

    def solve(rows) -> None:
        counted()
        value, assignment = minimize(domains, rows, pairs)
        if math.isfinite(value):
            heapq.heappush(heap, (value, next(counter), rows, assignment))

    solve(unary)
    while heap:
        value, _, rows, assignment = heapq.heappop(heap)
        held = named(assignment)
        if held is None:
            return value, assignment
        sites, values = held
        for j, site in enumerate(sites):
            child = list(rows)
            for fixed, keep in zip(sites[:j], values[:j]):
                child[fixed] = [w if x == keep else inf for x, w in enumerate(rows[fixed])]
            child[site] = [inf if x == values[j] else w for x, w in enumerate(rows[site])]
            solve(child)
    return inf, []


def minimize(domains: list[int], unary: list[list[float]], pairs: dict[tuple[int, int], list[list[float]]],
             factors_over: dict[tuple[int, ...], dict[tuple[int, ...], float]] | None = None
             ) -> tuple[float, list[int]]:
    """(minimum, one minimising assignment) of sum_i unary[i][x_i] + sum_(i,j) pairs[i,j][x_i][x_j]
    (+ any `factors_over` a tuple of sites: a sparse map from that tuple's assignments to costs,
    absent entries 0). Infinite entries are forbidden; the minimum is inf when every assignment
    is forbidden. Costs may be Python ints (exact at any size) or floats.

    Options whose unary cost is inf are dropped first, and a site left with one option becomes
    part of its neighbours' unary costs: the tables then span only what is still open (a
    subproblem of `minimize_avoiding` fixes sites far apart, which would otherwise stay wide)."""
    inf = math.inf
    keep = [[x for x, w in enumerate(row) if w != inf] for row in unary]
    if any(not options for options in keep):
        return inf, []
    if all(len(options) == d for options, d in zip(keep, domains)):
        return _eliminate(domains, unary, pairs, factors_over)
    small_unary = [[unary[i][x] for x in options] for i, options in enumerate(keep)]
    small_pairs: dict[tuple[int, int], list[list[float]]] = {}
    for (i, j), grid in pairs.items():
        sub = [[grid[a][b] for b in keep[j]] for a in keep[i]]
        if len(keep[i]) == 1:          # i is settled: the pair is a cost of j's options alone
            small_unary[j] = [w + t for w, t in zip(small_unary[j], sub[0])]
        elif len(keep[j]) == 1:
            small_unary[i] = [w + row[0] for w, row in zip(small_unary[i], sub)]
        else:
            small_pairs[(i, j)] = sub
    position = [{x: k for k, x in enumerate(options)} for options in keep]
    small_factors = {scope: {tuple(position[v][x] for v, x in zip(scope, key)): w for key, w in values.items()
                             if all(x in position[v] for v, x in zip(scope, key))}
                     for scope, values in (factors_over or {}).items()}
    value, small = _eliminate([len(options) for options in keep], small_unary, small_pairs, small_factors)
    return value, ([keep[i][x] for i, x in enumerate(small)] if small else [])


def _eliminate(domains: list[int], unary: list[list[float]], pairs: dict[tuple[int, int], list[list[float]]],
               factors_over: dict[tuple[int, ...], dict[tuple[int, ...], float]] | None = None
               ) -> tuple[float, list[int]]:
    """Bucket elimination itself (see `minimize`)."""
    factors: dict[int, Factor] = {}
    of_var: list[set[int]] = [set() for _ in domains]
    counter = itertools.count()

    def add(scope: tuple[int, ...], values: dict) -> None:
        key = next(counter)
        factors[key] = (scope, values)
        for v in scope:
            of_var[v].add(key)

    neighbours: list[set[int]] = [set() for _ in domains]
    for i, row in enumerate(unary):
        add((i,), {(a,): w for a, w in enumerate(row)})
    for (i, j), grid in pairs.items():
        if i == j:
            raise ValueError("a pair factor needs two sites")
        add((min(i, j), max(i, j)), {((a, b) if i < j else (b, a)): w
                                     for a, row in enumerate(grid) for b, w in enumerate(row)})
        neighbours[i].add(j)
        neighbours[j].add(i)
    for scope, values in (factors_over or {}).items():
        order = sorted(range(len(scope)), key=lambda k: scope[k])
        add(tuple(scope[k] for k in order), {tuple(key[k] for k in order): w for key, w in values.items()})
        for u in scope:
            neighbours[u] |= set(scope) - {u}

    trail: list[tuple[int, tuple[int, ...], dict[tuple[int, ...], int]]] = []
    constant = 0
    remaining = set(range(len(domains)))
    while remaining:
        v = min(remaining, key=lambda x: (math.prod(domains[u] for u in neighbours[x]), len(neighbours[x]), x))
        scope = tuple(sorted(neighbours[v]))
        if math.prod(domains[u] for u in scope) * domains[v] > MAX_TABLE:
            raise TooWide(f"eliminating site {v} needs a table over {len(scope) + 1} sites")
        terms = []
        for key in list(of_var[v]):
            fscope, values = factors.pop(key)
            for u in fscope:
                of_var[u].discard(key)
            # where each of the factor's sites sits in (scope..., v)
            at = tuple(len(scope) if u == v else scope.index(u) for u in fscope)
            terms.append((at, values, len(values) == math.prod(domains[u] for u in fscope)))
        best: dict[tuple[int, ...], float] = {}
        argbest: dict[tuple[int, ...], int] = {}
        # Per term, the row over v's options for one outer assignment, summed term by term in
        # the same order for every x (the same totals as summing per point, built without a
        # tuple per point and term): a term over v alone has one row whatever the outer choice.
        xs = range(domains[v])
        own = len(scope)
        plans = []
        for at, values, dense in terms:
            if at == (own,):
                row = [values[(x,)] for x in xs] if dense else [values.get((x,), 0) for x in xs]
                plans.append((None, row, None, None))
            else:
                plans.append((at, values, dense, at.index(own)))
        for outer in itertools.product(*(range(domains[u]) for u in scope)):
            totals = [0] * len(xs)
            for at, values, dense, where in plans:
                if at is None:
                    totals = [t + w for t, w in zip(totals, values)]
                    continue
                sub = [outer[k] if k != own else 0 for k in at]
                get = values.__getitem__ if dense else (lambda key, values=values: values.get(key, 0))
                for x in xs:
                    sub[where] = x
                    totals[x] += get(tuple(sub))
            low, low_at = math.inf, 0
            for x in xs:
                if totals[x] < low:
                    low, low_at = totals[x], x
            best[outer], argbest[outer] = low, low_at
        trail.append((v, scope, argbest))
        if scope:
            add(scope, best)
        else:
            constant += best[()]
        for u in scope:
            neighbours[u] |= neighbours[v] - {u}
            neighbours[u].discard(v)
        remaining.discard(v)
    if constant == math.inf:
        return math.inf, []
    value = [0] * len(domains)
    for v, scope, argbest in reversed(trail):
        value[v] = argbest[tuple(value[u] for u in scope)]
    return constant, value
