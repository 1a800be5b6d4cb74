"""Exact solve: a mixed-integer program (HiGHS, through planner/highs.py).

x[g, s] = 1 picks strategy s for every node of group g (nodes of repeated layers share a group).
The objective is predicted step time: node times plus, per pair of groups joined by edges, the
resharding cost of the pair's choices, through continuous y[p, q] tied to x by marginal rows
(exact with binary x, tight in the LP on tree-like graphs).

Memory: the peak over the schedule must fit the budget. Each row is exact at its program point
(a storage saved by several readers is z >= each reader's bytes; a buffer that exists only when
two placements differ is w[P] <= both sides' mass on P). A program with at most ROWS_UP_FRONT
points that can be a peak gets every row before the first solve; otherwise rows are added lazily:
solve a quick plan, evaluate its whole memory profile, add the rows of its worst points over the
budget, repeat, and prove only a plan that fits. Branching sees only the columns whose LP reduced
cost is within a window of the bound (widened until the best plan lies inside it), starts from the
fastest plan found so far that fits, and may be asked only for a plan faster than `beat`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix

from ..cost_model.liveness import MaxItem, PairItem
from . import highs
from .progress import SolveProgress
from .problem import Problem

OBJECTIVE_SCALE = 1e6  # objective in microseconds: HiGHS' tolerances suit numbers near 1
DEFAULT_MIP_GAP = 0.01  # a plan proven within 1 % of the optimum: the cost model's own error is several percent
_FIRST_WINDOW = 3e-3  # reduced costs kept in the first branching, relative to the LP bound
CUTS_PER_ROUND = 8  # memory rows added per plan that does not fit
ROWS_UP_FRONT = 128  # at most this many points that can be a peak: each gets its row before the first solve
# (then every plan HiGHS returns fits; more rows make every LP denser, and a 2-layer Mistral on 2x2, 214
# points, solves faster with lazy rows)


@dataclass(frozen=True)
class Solution:
    """The chosen strategy per node, its predicted cost, and how the solve went."""

    choice: np.ndarray
    objective: float  # predicted seconds per step
    peak_memory: float  # predicted peak bytes per rank
    peak_point: int
    cuts: tuple[int, ...]  # program points whose memory row was added
    solves: int
    seconds: float
    gap: float = 0.0  # how far above the optimum it may be, relative to its objective: 0 = proven optimal


class SolverTimeout(ValueError):
    """The solver's time limit came before it found any plan that fits."""


class Milp:
    """Sparse rows, bounds and integrality of one growing MILP; `optimize` finds its optimum."""

    def __init__(self, n_x: int, cutoff: float = np.inf, mip_gap: float = 0.0, progress: SolveProgress | None = None):
        self.n = n_x
        self.cutoff = cutoff  # only a plan below this objective is wanted: none found above it is returned
        self.mip_gap = mip_gap  # a plan proven within this relative gap of the optimum is good enough
        self.progress = progress
        self.cost: list[np.ndarray] = [np.zeros(n_x)]
        self.upper: list[np.ndarray] = [np.ones(n_x)]
        self.zero_one: list[np.ndarray] = [np.ones(n_x, dtype=bool)]  # 0 or 1 in every integral solution
        self.integer: list[np.ndarray] = [np.ones(n_x, dtype=bool)]
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.gap = 0.0  # how far the last solve's plan may be above the optimum, relative to its objective
        self.proven = False  # the last solve's plan is within mip_gap of the optimum (LP integral, or proven)
        self.timed_out = False  # a branching was stopped by the time limit
        # what a solve found, for the next one on the same rows (the proof after a quick plan that fits):
        # the program only grows, so (variables, rows) names it
        self._relaxed: tuple | None = None
        self._lp = highs.GrowingLp()
        self._branched: dict[bytes, tuple | None] = {}
        self._accepted_early: np.ndarray | None = None  # the plan a quick round took at once: the proof polishes it

    def add_vars(self, cost: np.ndarray, upper: float = 1.0, zero_one: bool = False, integer: bool = False) -> int:
        first = self.n
        self.n += len(cost)
        self.integer.append(np.full(len(cost), integer))
        self.cost.append(np.asarray(cost, dtype=float))
        self.upper.append(np.full(len(cost), upper))
        self.zero_one.append(np.full(len(cost), zero_one))
        return first

    def add_rows(self, rows, cols, vals, lo, hi) -> None:
        base = len(self.lo)
        self.rows.append(np.asarray(rows, dtype=np.int64) + base)
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.asarray(vals, dtype=float))
        self.lo.extend(np.broadcast_to(lo, (int(np.max(rows)) + 1 if len(rows) else 0,)))
        self.hi.extend(np.broadcast_to(hi, (int(np.max(rows)) + 1 if len(rows) else 0,)))

    def arrays(self) -> tuple:
        """(cost, matrix (CSC), row lower, row upper, column upper) of the program as it stands."""
        matrix = coo_matrix((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                            shape=(len(self.lo), self.n)).tocsc()
        return np.concatenate(self.cost), matrix, np.array(self.lo), np.array(self.hi), np.concatenate(self.upper)

    def optimize(self, n_int: int, time_limit: float, prove: bool = True,
                 fits: Callable[[np.ndarray], bool] = lambda x: True, start: np.ndarray | None = None
                 ) -> np.ndarray | None:
        """The optimum (within `mip_gap` of it), from the LP relaxation when that is integral (it usually
        is), else by branching; with `prove` False, the first improving plan that fits near the bound, else
        the narrowest window's best plan (not proven optimal);
        a window's plan that does not `fit` is returned at once, for the rows it lacks. `start`: a plan
        that fits, an earlier solution (of this program before its last rows: variables are only
        appended), which every branching starts from and keeps in its window. After it, `proven` says
        whether the plan is within `mip_gap` of the optimum, and `gap` how far it may be from it."""
        deadline = time.perf_counter() + time_limit
        self.proven, self.gap = False, 0.0
        program = self.arrays()
        relaxed = self._relaxation(program, time_limit)
        slack = 1e-7 * abs(relaxed.objective) + 1e-6  # HiGHS' tolerances, in the objective's units
        if not relaxed.timed_out:
            if relaxed.x is None or relaxed.objective >= self.cutoff - slack:
                return None  # infeasible even fractionally, or no plan can beat the cutoff
            self._report(None, relaxed.objective)
            if _integral(relaxed.x[:n_int]):
                self.proven = True
                return relaxed.x
        if relaxed.timed_out:  # the deadline came in the LP: branch on the whole program for what time is left
            best = self._branch(*program, np.ones(self.n, dtype=bool), deadline, start)
            if best is None:
                return None
            self.gap = _gap(best.objective, best.bound)
            self.proven = not self.timed_out
            return best.x
        return self._in_windows(program, relaxed, slack, deadline, prove, fits, start)

    def _relaxation(self, program: tuple, time_limit: float):
        """The LP relaxation of `program` (this one's arrays), solved once per shape: (variables, rows)."""
        shape = (self.n, len(self.lo))
        if self._relaxed is None or self._relaxed[0] != shape:
            self._relaxed, self._branched = (shape, self._lp.solve(*program, time_limit)), {}
        return self._relaxed[1]

    def _in_windows(self, program: tuple, relaxed, slack: float, deadline: float, prove: bool,
                    fits: Callable[[np.ndarray], bool], start: np.ndarray | None) -> np.ndarray | None:
        """`optimize` past a fractional LP: branch on the columns whose reduced cost lies within a window
        above the LP bound, the window widening until the best plan found lies within it (or within
        `mip_gap` of the lowest cost a plan outside it can have)."""
        cost, matrix, lo, hi, upper = program
        inside = np.zeros(self.n, dtype=bool)  # the start's strategies and pair terms
        if start is not None:
            inside[:len(start)] = start > 1e-9
        bound, reduced = relaxed.objective, cost - matrix.T @ relaxed.duals
        fixable = np.concatenate(self.zero_one)
        near = 1 - self.mip_gap  # a plan need only be proven below objective x near
        # a column whose reduced cost reaches past the cutoff is in no plan below it: no window need be wider
        window = min(_FIRST_WINDOW * abs(bound), self.cutoff - bound)
        reach = 16 * window  # a plan this near the bound: its proof branches once, on the columns within reach
        if start is not None and prove:  # a proof from a plan near the bound needs no narrower window first
            distance = near * (cost[:len(start)] @ start) - bound
            window = distance if distance <= reach else window
        zero_rows = matrix.tocsr()[(lo == 0) & (hi == 0)]
        while True:
            keep = _propagated(zero_rows, ~fixable | (reduced <= window + slack)) | inside
            # a quick round ends at the first plan that fits, beats the start and lies near enough the bound
            # for the proof to branch once (or needs none, within mip_gap of it): the proof follows from it
            near_bound = max(bound + reach, bound / near) if near > 0 else np.inf
            bar = min(np.inf if start is None else cost[:len(start)] @ start - slack, near_bound, self.cutoff)
            stop = None if prove else (lambda x, objective: objective < bar and fits(x))
            best = self._branch(cost, matrix, lo, hi, upper, keep, deadline, start, stop, ceiling=bound + window)
            if best is not None and not fits(best.x):
                return best.x
            if best is None and (keep.all() or window >= self.cutoff - bound):
                return None
            if best is not None:
                # a plan with a column outside the window costs more than bound + window
                lower = max(bound, min(best.bound, bound + window))
                exact = not best.stopped and best.objective - bound <= window + slack
                self.proven = exact or near * best.objective <= lower + slack
                self.gap = _gap(best.objective, lower)
                self._report(best.objective, lower)
            if best is not None and not self.proven:  # a plan that fits: the wider windows start from it
                start, inside = best.x, inside | (best.x > 1e-9)
            if best is not None and (not prove or self.proven or self.timed_out):
                return best.x
            # no plan among the kept columns, or one too far above the bound to rule the others out:
            # widen step by step, as the best plan usually needs only a few more columns; with a cutoff and
            # no plan yet, straight to the cutoff's window (narrower ones would each prove "none" again)
            if best is None and np.isfinite(self.cutoff):
                window = self.cutoff - bound
            else:
                needed = None if best is None else near * best.objective - bound
                window = min(4 * window + slack if needed is None or needed > 16 * window else needed,
                             self.cutoff - bound)

    def _branch(self, cost, matrix, lo, hi, upper, keep, deadline, start, stop=None, ceiling: float = np.inf
                ) -> _Branched | None:
        """The MILP on the columns `keep`, the others fixed at 0; None if none fits. `stop(x, objective)`
        may end the search at an improving plan (stopped: not proven optimal). `ceiling`: the lowest cost of a
        plan with a column not kept (what the progress line's bound cannot pass)."""
        key = np.packbits(keep).tobytes()
        if key in self._branched:
            return self._branched[key]
        cols = np.flatnonzero(keep)
        time_limit = max(deadline - time.perf_counter(), 1.0)

        def whole(x_cols: np.ndarray) -> np.ndarray:
            x = np.zeros(self.n)
            x[cols] = x_cols
            return x

        exact = highs.solve_mip(cost[cols], matrix[:, cols], lo, hi, upper[cols], np.concatenate(self.integer)[cols],
                                time_limit, start=None if start is None else start[cols[cols < len(start)]],
                                stop=None if stop is None else (lambda x, objective: stop(whole(x), objective)),
                                cutoff=self.cutoff, polish=start is not None and start is self._accepted_early,
                                mip_gap=self.mip_gap, progress=None if self.progress is None else
                                (lambda primal, dual: self._report(primal, min(dual, ceiling))))
        if exact.x is None:
            if exact.timed_out:
                raise SolverTimeout(f"the planner found no plan within its time limit of {time_limit:.0f} s; "
                                    "give tie_layers=True (one choice per repeated layer), a larger "
                                    "memory_budget, or a smaller mesh")
            self._branched[key] = None
            return None
        if exact.timed_out:  # the time limit: keep the best plan found, and say how far off it may be
            self.timed_out = True
        found = _Branched(whole(exact.x), exact.objective, exact.stopped, exact.bound)
        if exact.stopped:
            self._accepted_early = found.x
        if not exact.timed_out and not exact.stopped:
            self._branched[key] = found
        return found

    def _report(self, incumbent: float | None, bound: float | None) -> None:
        """Tell the progress line (objective units) about an incumbent or a bound."""
        if self.progress is not None:
            self.progress.update(None if incumbent is None or not np.isfinite(incumbent)
                                 else incumbent / OBJECTIVE_SCALE,
                                 None if bound is None or not np.isfinite(bound) else bound / OBJECTIVE_SCALE)


@dataclass(frozen=True)
class _Branched:
    """What one branching found: the plan's columns, its objective, whether `stop` ended the search early,
    and the branching's dual bound (no plan among its columns is below it)."""

    x: np.ndarray
    objective: float
    stopped: bool
    bound: float


def _gap(objective: float, lower: float) -> float:
    """The relative gap between a plan and a lower bound on the optimum; 0 below HiGHS' own tolerance."""
    gap = max(objective - lower, 0.0) / max(abs(objective), 1e-12)
    return 0.0 if gap <= 1e-6 else gap


def _integral(x: np.ndarray) -> bool:
    """Whether every entry is an integer, to HiGHS' tolerance."""
    return bool(np.all(np.abs(x - np.round(x)) < 1e-7))


def _propagated(zero_rows, keep: np.ndarray) -> np.ndarray:
    """`keep`, less the columns a row "= 0" then forces to 0: those of a row whose kept
    coefficients all have one sign (an edge's marginal row once its pairs are all fixed at 0)."""
    positive, negative = (zero_rows > 0).astype(float), (zero_rows < 0).astype(float)
    while True:
        kept = keep.astype(float)
        one_sign = (positive @ kept > 0) != (negative @ kept > 0)
        forced = keep & (abs(zero_rows[one_sign]).sum(axis=0).A1 > 0)
        if not forced.any():
            return keep
        keep = keep & ~forced


class MilpBuilder:
    """The MILP of a Problem (`milp`): x per group, y per edge block, memory rows on demand.

        builder = MilpBuilder(problem, budget)
        builder.add_memory_row(point)
        cost, matrix, row_lo, row_hi, col_upper = builder.milp.arrays()
    """

    def __init__(self, problem: Problem, budget: float | None, beat: float | None = None, mip_gap: float = 0.0,
                 progress: SolveProgress | None = None):
        self.p = problem
        self.budget = budget
        reps = np.unique(problem.group, return_index=True)[1]
        self.rep = reps  # the first node of every group
        self.sizes = np.array([len(problem.strategies[r]) for r in reps])
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.milp = Milp(int(self.offsets[-1]), np.inf if beat is None else beat * OBJECTIVE_SCALE, mip_gap, progress)
        self.z: dict[int, int] = {}
        self.w: dict[tuple, tuple[int, np.ndarray]] = {}
        self._assignment()
        self._objective()
        if budget is not None:
            self._memory_levels()

    def x(self, node: int) -> int:
        return int(self.offsets[self.p.group[node]])

    def _assignment(self) -> None:
        g = np.repeat(np.arange(len(self.sizes)), self.sizes)
        self.milp.add_rows(g, np.arange(len(g)), np.ones(len(g)), 1.0, 1.0)

    def _memory_levels(self) -> None:
        """Per group whose strategies differ in memory, an integer = its strategy's rank by bytes held."""
        # A branch on it splits the memory-saving strategies from the others, where a branch on one
        # strategy meets a twin that saves the same bytes (the same sharding on the other mesh axis).
        mem, group = self.p.memory, self.p.group
        held = np.zeros(int(self.offsets[-1]))
        for node, vec, _, _, scale, _ in mem.lin:
            x = self.x(node)
            held[x:x + self.sizes[group[node]]] += scale * mem.vectors[vec]
        for g in range(len(self.sizes)):
            levels, rank = np.unique(np.round(held[self.offsets[g]:self.offsets[g + 1]]), return_inverse=True)
            if len(levels) > 1:
                k = self.milp.add_vars(np.zeros(1), upper=len(levels) - 1, integer=True)
                cols = np.concatenate([[k], self.offsets[g] + np.arange(self.sizes[g])])
                vals = np.concatenate([[1.0], -rank.ravel()])
                self.milp.add_rows(np.zeros(len(cols), dtype=np.int64), cols, vals, 0.0, 0.0)

    def _objective(self) -> None:
        p, cost = self.p, self.milp.cost[0]
        for n, t in enumerate(p.time):
            cost[self.x(n):self.x(n) + len(t)] += t * OBJECTIVE_SCALE
        pairs: dict[tuple[int, int], np.ndarray] = {}
        for e in p.edges:
            gs, gd = int(p.group[e.src]), int(p.group[e.dst])
            if gs == gd:  # tied ends take the same strategy index
                cost[self.x(e.src):self.x(e.src) + self.sizes[gs]] += np.diag(e.costs.time) * OBJECTIVE_SCALE
            elif (gs, gd) in pairs:
                pairs[(gs, gd)] = pairs[(gs, gd)] + e.costs.time
            else:
                pairs[(gs, gd)] = e.costs.time
        for (gs, gd), matrix in pairs.items():
            self._pair(gs, gd, matrix * OBJECTIVE_SCALE)
        if p.data is not None:
            self._data_traffic(p.data)

    def _data_traffic(self, data) -> None:
        """FSDP's traffic as DataTraffic prices it: its hidden share slowing compute (slowdown x F on the
        strategies) and one variable for what is exposed, at least F / layers and F - C (us)."""
        n_x, cost = int(self.offsets[-1]), self.milp.cost[0]
        traffic, compute = np.zeros(n_x), np.zeros(n_x)
        for n, t in data.time.items():
            traffic[self.x(n):self.x(n) + len(t)] += t * OBJECTIVE_SCALE
        for n in data.compute:
            compute[self.x(n):self.x(n) + len(self.p.time[n])] += self.p.time[n] * OBJECTIVE_SCALE
        cost += data.slowdown * traffic
        z = self.milp.add_vars(np.array([1.0 - data.slowdown]), upper=np.inf)
        for coef in (traffic / data.layers, traffic - compute):
            cols = np.flatnonzero(coef)
            self.milp.add_rows(np.zeros(len(cols) + 1, dtype=np.int64), np.concatenate([[z], cols]),
                               np.concatenate([[1.0], -coef[cols]]), 0.0, np.inf)

    def _pair(self, gs: int, gd: int, matrix: np.ndarray) -> None:
        cost, xs, xd = self.milp.cost[0], self.offsets[gs], self.offsets[gd]
        row_keys, row_of = np.unique(matrix, axis=0, return_inverse=True)
        col_keys, col_of = np.unique(matrix.T, axis=0, return_inverse=True)
        row_of, col_of = row_of.ravel(), col_of.ravel()
        if len(col_keys) == 1:  # the cost depends on the producer's choice only
            cost[xs:xs + len(row_of)] += matrix[:, 0]
            return
        if len(row_keys) == 1:  # ... or on the consumer's only
            cost[xd:xd + len(col_of)] += matrix[0, :]
            return
        first_col = np.array([np.flatnonzero(col_of == q)[0] for q in range(len(col_keys))])
        block = row_keys[:, first_col]
        n_p, n_q = block.shape
        y0 = self.milp.add_vars(block.ravel(), zero_one=True)
        y = y0 + np.arange(n_p * n_q)
        # sum_q y[p, q] - sum_{s in class p} x[s] = 0, then the same over columns
        rows = np.concatenate([np.repeat(np.arange(n_p), n_q), row_of,
                               n_p + np.tile(np.arange(n_q), n_p), n_p + col_of])
        cols = np.concatenate([y, xs + np.arange(len(row_of)), y, xd + np.arange(len(col_of))])
        vals = np.concatenate([np.ones(n_p * n_q), -np.ones(len(row_of)), np.ones(n_p * n_q),
                               -np.ones(len(col_of))])
        self.milp.add_rows(rows, cols, vals, 0.0, 0.0)

    # ------------------------------------------------------------ memory rows

    def add_memory_row(self, point: int) -> None:
        """Bytes live at `point` <= budget, exactly, as one linear row (scaled by the budget)."""
        mem, p = self.p.memory, self.p
        coef = np.zeros(int(self.offsets[-1]))
        extra_cols, extra_vals = [], []
        for node, vec, start, end, scale, _ in mem.lin:
            if start <= point <= end:
                x = self.x(node)
                coef[x:x + self.sizes[p.group[node]]] += scale * mem.vectors[vec]
        for k, item in enumerate(mem.maxes):
            if item.start <= point <= item.end:
                extra_cols.append(self._z(k, item))
                extra_vals.append(self.budget)  # z is in budgets; the row is divided by the budget below
        for item in mem.pairs:
            if item.start <= point <= item.end:
                cols, vals = self._pair_bytes(item, coef)
                extra_cols += cols
                extra_vals += vals
        nz = np.flatnonzero(coef)
        cols = np.concatenate([nz, np.array(extra_cols, dtype=np.int64)])
        vals = np.concatenate([coef[nz], np.array(extra_vals, dtype=float)]) / self.budget
        self.milp.add_rows(np.zeros(len(cols), dtype=np.int64), cols, vals, -np.inf, 1.0)

    def _z(self, k: int, item: MaxItem) -> int:
        """A variable >= each member's bytes (in budgets, as every memory row): the storage
        several readers save, counted once."""
        if k not in self.z:
            z = self.milp.add_vars(np.zeros(1), upper=np.inf)
            members = {(int(self.p.group[n]), v, s) for n, v, s in item.members}
            for g, v, s in sorted(members):
                x = self.offsets[g] + np.arange(self.sizes[g])
                self.milp.add_rows(np.zeros(len(x) + 1, dtype=np.int64), np.concatenate([[z], x]),
                                    np.concatenate([[1.0], -s * self.p.memory.vectors[v] / self.budget]), 0.0, np.inf)
            self.z[k] = z
        return self.z[k]

    def _pair_bytes(self, item: PairItem, coef: np.ndarray) -> tuple[list, list]:
        """Add a collective buffer's bytes: both ends' share, minus it where nothing moves."""
        mem, p = self.p.memory, self.p
        src_ids, dst_ids = mem.vectors[item.src_ids], mem.vectors[item.dst_ids]
        src_b, dst_b = mem.vectors[item.src_bytes], mem.vectors[item.dst_bytes]
        gs, gd = int(p.group[item.src]), int(p.group[item.dst])
        xs, xd = self.x(item.src), self.x(item.dst)
        if gs == gd:  # one variable for both ends: moved exactly where the two ids differ
            coef[xd:xd + len(dst_b)] += (src_b + dst_b) * (src_ids != dst_ids)
            return [], []
        coef[xs:xs + len(src_b)] += src_b
        coef[xd:xd + len(dst_b)] += dst_b
        w0, common = self._w(gs, gd, item)
        vals = [-float(src_b[np.flatnonzero(src_ids == pid)[0]] + dst_b[np.flatnonzero(dst_ids == pid)[0]])
                for pid in common]
        return list(range(w0, w0 + len(common))), vals

    def _w(self, gs: int, gd: int, item: PairItem) -> tuple[int, np.ndarray]:
        """w[P] <= mass of both ends on placement P: equals 1 exactly when nothing moves."""
        key = (gs, gd, item.src_ids, item.dst_ids)
        if key not in self.w:
            mem = self.p.memory
            src_ids, dst_ids = mem.vectors[item.src_ids], mem.vectors[item.dst_ids]
            common = np.intersect1d(src_ids, dst_ids)
            w0 = self.milp.add_vars(np.zeros(len(common)))
            rows, cols, vals = [], [], []
            for k, pid in enumerate(common):
                for side, (g, ids) in enumerate(((gs, src_ids), (gd, dst_ids))):
                    members = self.offsets[g] + np.flatnonzero(ids == pid)
                    r = 2 * k + side
                    rows += [r] * (len(members) + 1)
                    cols += [w0 + k] + list(members)
                    vals += [1.0] + [-1.0] * len(members)
            if rows:
                self.milp.add_rows(rows, cols, vals, -np.inf, 0.0)
            self.w[key] = (w0, common)
        return self.w[key]

    def optimize(self, time_limit: float, prove: bool, fits: Callable[[np.ndarray], bool],
                 start: np.ndarray | None) -> np.ndarray | None:
        """Milp.optimize on the program as it stands (its columns, None where no plan is found)."""
        return self.milp.optimize(int(self.offsets[-1]), time_limit, prove, fits, start)

    def group_choice(self, x: np.ndarray) -> np.ndarray:
        """The strategy index per group that the columns `x` pick."""
        return np.array([int(np.argmax(x[self.offsets[g]:self.offsets[g + 1]])) for g in range(len(self.sizes))])


def solve(problem: Problem, budget: float | None, *, time_limit: float = 300.0,
          known_cuts: tuple[int, ...] = (), beat: float | None = None, mip_gap: float = DEFAULT_MIP_GAP,
          progress: SolveProgress | None = None) -> Solution | None:
    """The strategy per node minimizing predicted step time with peak memory <= budget; None if none fits.

    `known_cuts`: program points whose memory rows a similar problem needed (a recomputation
    variant of this one), added up front: each is exact, and each found again costs a solve.
    `beat`: seconds a plan must be faster than (another variant's plan), else None; the search
    prunes at it, so a variant that cannot win is ruled out without being solved.
    `mip_gap`: the search ends at a plan proven within this relative gap of the optimum (0: proven
    optimal); Solution.gap says how far it may be. `progress`: what shows a long solve's bounds
    (None: a SolveProgress on stderr).
    """
    start = time.perf_counter()
    progress = progress if progress is not None else SolveProgress()
    try:
        return _solve(problem, budget, time_limit, known_cuts, MilpBuilder(problem, budget, beat, mip_gap, progress),
                      start)
    finally:
        progress.close()


def _solve(problem: Problem, budget: float | None, time_limit: float, known_cuts: tuple[int, ...],
           builder: MilpBuilder, start: float) -> Solution | None:
    """solve's rounds: quick plans until one fits (memory rows added for those that do not), then its proof."""
    candidates = problem.memory.peak_candidates()
    every_row = budget is not None and len(candidates) <= ROWS_UP_FRONT  # then every plan fits: prove at once
    cuts: list[int] = []
    if budget is not None:
        _add_memory_rows(builder, [int(c) for c in candidates] if every_row else known_cuts, cuts)
    solves, prove = 0, budget is None or every_row
    best: tuple[float, np.ndarray] | None = None  # the fastest plan found that fits: every solve starts from it
    while True:
        # the memory rows a plan needs are found on quick plans; only the last solve proves optimality
        x = builder.optimize(max(time_limit - (time.perf_counter() - start), 1.0), prove,
                             lambda x: _fits(problem.memory.peak(problem.expand(builder.group_choice(x)))[0], budget),
                             None if best is None else best[1])
        solves += 1
        if x is None:
            return None
        choice = problem.expand(builder.group_choice(x))
        profile = problem.memory.profile(choice)
        point = int(np.argmax(profile))
        peak = float(profile[point])
        fits = _fits(peak, budget)
        if fits and (best is None or problem.objective(choice) < best[0]):
            best = (problem.objective(choice), x)
        if fits and not prove and not builder.milp.proven:
            prove = True
            continue
        if fits:
            if builder.milp.timed_out:
                _warn_cut_short(builder.milp.gap, time_limit)
            return Solution(choice, problem.objective(choice), peak, point, tuple(cuts), solves,
                            time.perf_counter() - start, builder.milp.gap)
        assert point not in cuts, f"the memory row of point {point} is not exact"
        _add_memory_rows(builder, _worst_points(profile, candidates, cuts, budget), cuts)
        prove = False


def _add_memory_rows(builder: MilpBuilder, points, cuts: list[int]) -> None:
    """The memory row of each of `points`, each noted in `cuts`."""
    for point in points:
        builder.add_memory_row(point)
        cuts.append(point)


def _warn_cut_short(gap: float, time_limit: float) -> None:
    """A warning, at solve's caller, that the time limit stopped the search `gap` short of the optimum."""
    warnings.warn(f"planner: time limit of {time_limit:.0f} s reached; the plan is within "
                  f"{gap:.1%} of the optimum (a tight memory_budget makes the search hard)", stacklevel=4)


def _fits(peak, budget: float | None):
    """Whether `peak` (bytes, or an array of them) is within the budget, to HiGHS' feasibility tolerance."""
    return budget is None or peak <= budget * (1 + 1e-6)


def _worst_points(profile: np.ndarray, candidates: np.ndarray, cuts: list[int], budget: float) -> list[int]:
    """The peak and up to CUTS_PER_ROUND - 1 other over-budget peak candidates, worst first: a
    plan's memory is flat across much of its backward, and every new row found costs a solve."""
    worst = [int(np.argmax(profile))]
    over = candidates[~_fits(profile[candidates], budget)]
    worst += [int(q) for q in over[np.argsort(-profile[over], kind="stable")] if q not in cuts and q != worst[0]]
    return worst[:CUTS_PER_ROUND]
