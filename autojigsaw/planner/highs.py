"""HiGHS through its own Python binding (highspy): the LP with its row duals, and the MILP from a known plan.

One LP gives the planner's bound and the duals its column windows are pruned with; every branching
starts from a plan that fits, which HiGHS prunes with from the first node (scipy's `milp` returns no
duals and takes no starting solution).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import highspy
import numpy as np
from scipy.sparse import csc_matrix


@dataclass(frozen=True)
class Result:
    """What one HiGHS run found: x (None when it found no solution), its objective, the gap left."""

    x: np.ndarray | None
    objective: float
    timed_out: bool  # stopped by the time limit (x is then the best solution found, if any)
    gap: float  # the relative gap left at the time limit; 0 when solved
    duals: np.ndarray | None = None  # row duals, for an LP: reduced costs are cost - matrix.T @ duals
    stopped: bool = False  # `stop` accepted x before the search ended: x is not proven optimal
    bound: float = -np.inf  # no solution of this program is below it (a MIP's dual bound, an LP's objective)


_banner_shown = False

# HiGHS keeps worker threads after a solve. Stopped at interpreter exit, before C++'s own teardown: a
# one-rank training script that exited with them running aborted ("terminate called without an active exception").
atexit.register(highspy.Highs.resetGlobalScheduler, True)


def _new_highs() -> highspy.Highs:
    """A HiGHS instance. The process's first one prints HiGHS' banner to stdout (before any
    option can be set), so that one is made with stdout pointed at /dev/null."""
    global _banner_shown
    if _banner_shown:
        return highspy.Highs()
    _banner_shown = True
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _highs(cost, matrix: csc_matrix, lo, hi, upper, integer, time_limit: float, options: dict) -> highspy.Highs:
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), matrix.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(len(cost)), upper
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = matrix.indptr, matrix.indices, matrix.data
    if integer is not None:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    h = _new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    for name, value in options.items():
        h.setOptionValue(name, value)
    h.passModel(lp)
    return h


def solve_lp(cost, matrix: csc_matrix, lo, hi, upper, time_limit: float) -> Result:
    """The LP min cost.x, lo <= matrix.x <= hi, 0 <= x <= upper, with its row duals."""
    return GrowingLp().solve(cost, matrix, lo, hi, upper, time_limit)


class GrowingLp:
    """One LP that only grows (columns and rows appended): each solve after the first adds what is new to the
    model HiGHS holds and starts from its last basis (dual simplex), where a new model starts from nothing."""

    def __init__(self):
        self._h: highspy.Highs | None = None

    def solve(self, cost, matrix: csc_matrix, lo, hi, upper, time_limit: float) -> Result:
        """The LP min cost.x, lo <= matrix.x <= hi, 0 <= x <= upper, with its row duals: the program as it
        stands, which extends the one solved before."""
        n, m = len(cost), matrix.shape[0]
        warm = self._h is not None
        if not warm:
            self._h = _highs(cost, matrix, lo, hi, upper, None, time_limit, {})
        else:
            cols, rows = self._h.getNumCol(), self._h.getNumRow()
            self._h.setOptionValue("time_limit", float(time_limit))
            if n > cols:
                self._h.addCols(n - cols, cost[cols:], np.zeros(n - cols), upper[cols:], 0,
                                np.zeros(n - cols, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
            if m > rows:
                new = matrix[rows:].tocsr()
                self._h.addRows(m - rows, lo[rows:], hi[rows:], new.nnz, new.indptr[:-1].astype(np.int32),
                                new.indices.astype(np.int32), new.data)
        self._h.run()
        if warm and self._h.getModelStatus() not in _SETTLED:  # the last basis led nowhere: start from nothing
            self._h.clearSolver()
            self._h.run()
        return _result(self._h, dual=True)


def solve_mip(cost, matrix: csc_matrix, lo, hi, upper, integer, time_limit: float, *,
              start: np.ndarray | None = None, stop: Callable[[np.ndarray, float], bool] | None = None,
              cutoff: float = np.inf, polish: bool = False, mip_gap: float = 0.0,
              progress: Callable[[float, float], None] | None = None) -> Result:
    """The MILP over the same rows with `integer` columns integral, from a feasible solution:
    `start` gives the values of the first len(start) columns, and HiGHS completes the others; its
    primal heuristics run only if the start is to be `polish`ed (else the branching finds what they would).
    `stop(x, objective)`, asked of every improving solution, ends the search at the first it accepts
    (returned `stopped`: not proven optimal). `cutoff`: only a solution below it is wanted; HiGHS
    prunes every node whose bound reaches it, and x is None when none is below. `mip_gap`: the search
    ends at a solution within this relative gap of the dual bound. `progress(primal, dual)` is told the
    bounds as the search runs."""
    # HiGHS presolve restarts cost more than they save here; the planner's column windows do the useful part
    options = {"presolve": "off", "mip_rel_gap": max(mip_gap, _OPTIMAL_GAP)}
    if start is not None and len(start) and stop is None and not polish:
        options.update(_PROVING)
    if np.isfinite(cutoff):
        options["objective_bound"] = float(cutoff)
    h = _highs(cost, matrix, lo, hi, upper, integer, time_limit, options)
    if start is not None and len(start):
        h.setSolution(len(start), np.arange(len(start), dtype=np.int32), np.asarray(start, dtype=float))
    accepted: list[tuple[np.ndarray, float]] = []
    if stop is not None:
        _stop_at(h, len(cost), stop, accepted)
    if progress is not None:
        h.cbMipInterrupt.subscribe(lambda event: progress(event.data_out.mip_primal_bound,
                                                          event.data_out.mip_dual_bound))
    h.run()
    if accepted:
        x, bound = accepted[0]
        return Result(x, float(cost @ x), False, 0.0, stopped=True, bound=bound)
    found = _result(h, dual=False)
    if found.objective >= cutoff:  # HiGHS keeps a solution its heuristics found above the cutoff
        return Result(None, float("inf"), found.timed_out, 0.0)
    return found


_OPTIMAL_GAP = 1e-7  # HiGHS' relative gap when asked for the optimum


# A proof from a plan in hand: HiGHS' primal heuristics (RINS, RENS, feasibility jump, root reduced cost
# run even at heuristic effort 0) look for plans its branching finds anyway. On the mixer's edge plans
# they take a third of each proof (20.5 s without them against 31.6 s, 66 against 107 s, 3.3 against 8.9 s).
# From a plan a quick round accepted at once (T5 at 0.6 with its norm in fp64: 1.4 % above the optimum),
# RINS finds the optimum at node 635 where the branching alone finds it at node 5,127 (13 s against 53 s),
# so such a start is polished (where it is already the optimum, that costs ~12 %).
_PROVING = {"mip_heuristic_effort": 0.0, "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
            "mip_heuristic_run_feasibility_jump": False, "mip_heuristic_run_root_reduced_cost": False}


def _stop_at(h: highspy.Highs, n: int, stop: Callable[[np.ndarray, float], bool], accepted: list) -> None:
    """Interrupt `h` after the first improving solution `stop` accepts, kept in `accepted` with the dual
    bound of that moment (HiGHS takes an interrupt only from its interrupt callback, not from the solution one)."""
    def improving(event):
        x = np.array(event.data_out.mip_solution[:n])
        if not accepted and stop(x, float(event.data_out.objective_function_value)):
            accepted.append((x, float(event.data_out.mip_dual_bound)))

    def interrupt(event):
        if accepted:
            event.interrupt()

    h.cbMipImprovingSolution.subscribe(improving)
    h.cbMipInterrupt.subscribe(interrupt)


# kObjectiveBound: the cutoff pruned the whole search (HiGHS 1.16 says kOptimal or kInfeasible instead)
_SETTLED = (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit,
            highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible,
            highspy.HighsModelStatus.kObjectiveBound)


def _result(h: highspy.Highs, dual: bool) -> Result:
    status, info = h.getModelStatus(), h.getInfo()
    if status not in _SETTLED:
        raise RuntimeError(f"HiGHS stopped with status '{h.modelStatusToString(status)}' on the planner's "
                           f"program ({h.getNumCol()} variables, {h.getNumRow()} rows); please report it")
    timed_out = status == highspy.HighsModelStatus.kTimeLimit
    found = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible) or not found:
        return Result(None, float("inf"), timed_out, 0.0)
    solution = h.getSolution()
    gap = float(info.mip_gap) if timed_out and np.isfinite(info.mip_gap) else 0.0
    objective = float(info.objective_function_value)
    bound = objective if dual else float(info.mip_dual_bound)
    return Result(np.array(solution.col_value), objective, timed_out, gap,
                  np.array(solution.row_dual) if dual else None, bound=bound if np.isfinite(bound) else -np.inf)
