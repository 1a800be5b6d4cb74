"""Exact solve: a mixed-integer program (HiGHS, through scipy.optimize.milp).

x[n, s] = 1 picks strategy s for node n. Each edge gets continuous variables y[p, q] over
the distinct rows p and columns q of its cost matrix, tied to x by marginal constraints
(sum_q y[p, q] = x mass of row class p, sum_p y[p, q] = mass of column class q); with
binary x they are exact, and their LP relaxation is tight on tree-like graphs.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from .problem import Problem


def solve(problem: Problem, budget: float | None) -> list[int]:
    """The strategy index per node minimizing predicted time with memory <= budget."""
    offsets = np.cumsum([0] + [len(s) for s in problem.strategies])
    n_x = int(offsets[-1])
    c = [np.concatenate(problem.time)]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add_row(entries, low, high):
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        r += 1

    for n in range(len(problem.strategies)):
        add_row([(offsets[n] + s, 1.0) for s in range(len(problem.strategies[n]))], 1, 1)
    n_var = n_x
    for e in problem.edges:
        row_keys, row_of = np.unique(e.cost, axis=0, return_inverse=True)
        col_keys, col_of = np.unique(e.cost.T, axis=0, return_inverse=True)
        row_of, col_of = row_of.ravel(), col_of.ravel()
        if len(col_keys) == 1:  # the cost depends on the producer's choice only
            c[0][offsets[e.src]:offsets[e.src + 1]] += e.cost[:, 0]
            continue
        if len(row_keys) == 1:  # ... or on the consumer's only
            c[0][offsets[e.dst]:offsets[e.dst + 1]] += e.cost[0, :]
            continue
        block = row_keys[:, [np.flatnonzero(col_of == q)[0] for q in range(len(col_keys))]]
        n_p, n_q = block.shape
        y0 = n_var
        n_var += n_p * n_q
        c.append(block.ravel())
        for p in range(n_p):
            entries = [(y0 + p * n_q + q, 1.0) for q in range(n_q)]
            entries += [(offsets[e.src] + s, -1.0) for s in np.flatnonzero(row_of == p)]
            add_row(entries, 0, 0)
        for q in range(n_q):
            entries = [(y0 + p * n_q + q, 1.0) for p in range(n_p)]
            entries += [(offsets[e.dst] + t, -1.0) for t in np.flatnonzero(col_of == q)]
            add_row(entries, 0, 0)
    if budget is not None:
        add_row([(i, m) for i, m in enumerate(np.concatenate(problem.memory))], -np.inf, budget)
    objective = np.concatenate(c)
    matrix = coo_matrix((vals, (rows, cols)), shape=(r, n_var)).tocsr()
    integrality = np.concatenate([np.ones(n_x), np.zeros(n_var - n_x)])
    result = milp(objective, constraints=LinearConstraint(matrix, lo, hi),
                  integrality=integrality, bounds=Bounds(0, 1))
    if result.status != 0 or result.x is None:
        return []
    x = result.x[:n_x]
    return [int(np.argmax(x[offsets[n]:offsets[n + 1]])) for n in range(len(problem.strategies))]
