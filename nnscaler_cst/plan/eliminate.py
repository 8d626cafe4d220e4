"""Exact minimum of a sum of per-site and per-pair costs, by variable elimination.

The split search's objective is a sum of terms over one site's choice (its compute, its
collectives) or over two sites' choices (the conversion on an edge between them); pairs that
no collective joins, and a tied weight's users that must agree, are infinite pairs. Sites are
per source line, so a model's sites form a short chain with residual edges: eliminating one
site at a time (bucket elimination, Dechter 1999), each step a small table over the site's
remaining neighbours, finds the exact optimum in milliseconds where z3's optimiser takes
seconds. Ties go to the lower option index of the site eliminated (deterministic).

Higher-order facts (an argument fed by several producers) are not pairs; the caller checks
the optimum against them with z3 and falls back to z3's optimiser when it breaks one.
"""
from __future__ import annotations

import itertools
import math

MAX_TABLE = 1 << 16          # entries of the largest table one elimination may build

# A factor: (scope, values). `scope` is a tuple of sites in increasing order; `values` maps an
# assignment of the scope (a tuple of option indices, in scope order) to its cost. Dense tables
# hold every assignment; sparse ones (the caller's no-goods) only their non-zero entries.
Factor = tuple[tuple[int, ...], dict[tuple[int, ...], float]]


class TooWide(Exception):
    """The interaction graph is too dense for elimination within MAX_TABLE."""


def minimize(domains: list[int], unary: list[list[float]], pairs: dict[tuple[int, int], list[list[float]]],
             factors_over: dict[tuple[int, ...], dict[tuple[int, ...], float]] | None = None
             ) -> tuple[float, list[int]]:
    """(minimum, one minimising assignment) of sum_i unary[i][x_i] + sum_(i,j) pairs[i,j][x_i][x_j]
    (+ any `factors_over` a tuple of sites: a sparse map from that tuple's assignments to costs,
    absent entries 0). Infinite entries are forbidden; the minimum is inf when every assignment
    is forbidden. Costs may be Python ints (exact at any size) or floats."""
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
