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

import math

import numpy as np

MAX_TABLE = 1 << 20          # entries of the largest table one elimination may build


class TooWide(Exception):
    """The interaction graph is too dense for elimination within MAX_TABLE."""


def minimize(domains: list[int], unary: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray],
             factors_over: dict[tuple[int, ...], np.ndarray] | None = None) -> tuple[float, list[int]]:
    """(minimum, one minimising assignment) of sum_i unary[i][x_i] + sum_(i,j) pairs[i,j][x_i, x_j]
    (+ any `factors_over` a tuple of sites, axes in that order). Infinite entries are forbidden;
    the minimum is inf when every assignment is forbidden."""
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    of_var: list[set[int]] = [set() for _ in domains]

    counter = iter(range(1 << 62))

    def add(scope: tuple[int, ...], table: np.ndarray) -> None:
        key = next(counter)
        factors[key] = (scope, table)
        for v in scope:
            of_var[v].add(key)

    trail: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    constant = 0
    kind = object if any(np.asarray(t).dtype == object for t in [*unary, *pairs.values()]) else float
    for i, table in enumerate(unary):
        add((i,), np.asarray(table, dtype=kind))
    for (i, j), table in pairs.items():
        table = np.asarray(table, dtype=kind)
        if i == j:
            raise ValueError("a pair factor needs two sites")
        add((i, j) if i < j else (j, i), table if i < j else table.T)
    neighbours = [set() for _ in domains]
    for i, j in pairs:
        neighbours[i].add(j)
        neighbours[j].add(i)
    for scope, table in (factors_over or {}).items():
        order = sorted(range(len(scope)), key=lambda k: scope[k])
        add(tuple(scope[k] for k in order), np.transpose(np.asarray(table, dtype=kind), order))
        for u in scope:
            neighbours[u] |= set(scope) - {u}
    remaining = set(range(len(domains)))
    while remaining:
        v = min(remaining, key=lambda x: (math.prod(domains[u] for u in neighbours[x]), len(neighbours[x]), x))
        scope = tuple(sorted(neighbours[v]))
        if math.prod(domains[u] for u in scope) * domains[v] > MAX_TABLE:
            raise TooWide(f"eliminating site {v} needs a table over {len(scope) + 1} sites")
        axes = (*scope, v)
        total = np.zeros([domains[a] for a in axes], dtype=kind)
        for key in list(of_var[v]):
            fscope, table = factors.pop(key)
            for u in fscope:
                of_var[u].discard(key)
            total = total + _expand(table, fscope, axes)
        best = total.min(axis=-1)
        trail.append((v, scope, total.argmin(axis=-1)))
        if scope:
            add(scope, best)
        else:
            constant += best if kind is object else float(best)
        for u in scope:
            neighbours[u] |= neighbours[v] - {u}
            neighbours[u].discard(v)
        remaining.discard(v)
    if constant == math.inf:
        return math.inf, []
    value = [0] * len(domains)
    for v, scope, arg in reversed(trail):
        value[v] = int(arg[tuple(value[u] for u in scope)]) if scope else int(arg)
    return constant, value


def _expand(table: np.ndarray, scope: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """`table` over `scope` laid out to broadcast over `axes` (scope is a subset of axes)."""
    order = sorted(range(len(scope)), key=lambda k: axes.index(scope[k]))
    table = np.transpose(table, order) if order != list(range(len(scope))) else table
    placed = {scope[k] for k in order}
    shape = [table.shape[[scope[k] for k in order].index(a)] if a in placed else 1 for a in axes]
    return table.reshape(shape)
