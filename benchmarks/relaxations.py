"""Why a tight budget makes proofs slow: the planner's LP bound against stronger relaxations.

Run: python benchmarks/relaxations.py [--only SUBSTRING] [--tiny]

For each case (a plan at the edge of its memory budget, without recomputation) it prints the
optimum's gap to three lower bounds and HiGHS' time on two formulations of the memory rows:
- LP: the planner's relaxation, every memory row that can bind included;
- Lagrangian: memory priced at the LP's row duals, the rest integral (the bound of any
  per-layer convex hull of plans);
- binding rows, integral: the exact MILP with only the rows the LP binds (what a DP over the
  layer chain with that many memory resources would solve), and how far over the budget its
  plan is elsewhere;
- rows as differences: every memory row written as the previous point's plus what changes (far
  fewer nonzeros, the same LP), and HiGHS' seconds on the whole program either way.
Against the planner's own solve (recorded through the `solver` option); the formulation is the planner's
own, built by `planner.milp.MilpBuilder`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy.sparse import csr_matrix, hstack, identity, vstack
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import autojigsaw  # noqa: E402
from autojigsaw.planner import highs, milp  # noqa: E402
from benchmarks.families import WeatherMixerFamily  # noqa: E402
from benchmarks.scaling import MIXED  # noqa: E402
from benchmarks.solve_speed import MIXERS, TWO, TWO_BY_TWO, one_rank_memory, small  # noqa: E402


def under(name: str, mesh: dict[str, int], fraction: float):
    """A small case of solve_speed.py under `fraction` of its 1-rank memory (cpu spec, float64), as a
    function of the solver to plan with."""
    budget = int(fraction * one_rank_memory(name))
    model, inputs, _ = small(name)
    return lambda solver: autojigsaw.plan(model, inputs, mesh, device="cpu", memory_budget=budget, solver=solver)


def mixer_edge():
    """solve_speed's 8-GPU mixer edge plan (A100-40GB, mixed), no recomputation, as a function of the solver
    to plan with."""
    _, size, mesh = MIXERS[1]
    model, inputs = WeatherMixerFamily().build(size)
    return lambda solver: autojigsaw.plan(model, inputs, mesh, device="a100-40gb", mp_policy=MIXED,
                                          activation_checkpointing="none", solver=solver)


CASES = {"Mistral-2L-h64, 2x2, 0.8": lambda: under("mistral", TWO_BY_TWO, 0.8),
         "Jigsaw mixer dim 44176, 2x4, mixed, none": mixer_edge}
TINY = {"gpt2, 2, 0.6": lambda: under("gpt2", TWO, 0.6)}  # the smoke run's: a second or two a bound


def solved_problem(make_plan) -> tuple:
    """(problem, budget, solution, seconds) of the plan's one solve."""
    seen = []

    def recorded(problem, budget, **kwargs):
        start = time.perf_counter()
        solution = milp.solve(problem, budget, **kwargs)
        seen.append((problem, budget, solution, time.perf_counter() - start))
        return solution

    make_plan(recorded)
    return seen[-1]


def program(problem, budget: float, points) -> tuple:
    """(cost, matrix, lo, hi, upper, integer, which rows are memory rows, builder) of the planner's MILP
    with these points' memory rows."""
    builder = milp.MilpBuilder(problem, budget)
    for point in points:
        builder.add_memory_row(int(point))
    cost, matrix, lo, hi, upper = builder.milp.arrays()
    memory = np.isinf(lo) & (hi == 1.0)  # the memory rows: bytes / budget <= 1
    return cost, matrix.tocsr(), lo, hi, upper, np.concatenate(builder.milp.integer), memory, builder


def as_differences(cost, matrix, lo, hi, upper, integer, memory) -> tuple:
    """The same MILP with memory row k written as r_k = r_{k-1} + (row_k - row_{k-1}) x, r_k <= 1."""
    rows, other = matrix[memory], matrix[~memory]
    k = rows.shape[0]
    steps = vstack([rows[:1], rows[1:] - rows[:-1]]).tocsr()
    chain = csr_matrix(-identity(k)) + csr_matrix((np.ones(k - 1), (np.arange(1, k), np.arange(k - 1))), shape=(k, k))
    stacked = vstack([hstack([other, csr_matrix((other.shape[0], k))]), hstack([steps, chain])]).tocsc()
    return (np.concatenate([cost, np.zeros(k)]), stacked, np.concatenate([lo[~memory], np.zeros(k)]),
            np.concatenate([hi[~memory], np.zeros(k)]), np.concatenate([upper, np.ones(k)]),
            np.concatenate([integer, np.zeros(k, dtype=bool)]))


def measure(name: str, make_plan) -> list:
    problem, budget, solution, seconds = solved_problem(make_plan())
    optimum = solution.objective * milp.OBJECTIVE_SCALE
    candidates = problem.memory.peak_candidates()
    cost, matrix, lo, hi, upper, integer, memory, _ = program(problem, budget, candidates)
    lp = highs.solve_lp(cost, matrix.tocsc(), lo, hi, upper, 300)
    duals = np.where(memory, lp.duals, 0.0)
    priced = highs.solve_mip(cost - matrix.T @ duals, matrix[~memory].tocsc(), lo[~memory], hi[~memory], upper,
                             integer, 300)
    lagrangian = priced.objective + duals[memory] @ hi[memory]
    binding = candidates[np.abs(lp.duals[memory]) > 1e-9]
    f_cost, f_matrix, f_lo, f_hi, f_upper, f_integer, _, f_builder = program(problem, budget, binding)
    start = time.perf_counter()
    relaxed = highs.solve_mip(f_cost, f_matrix.tocsc(), f_lo, f_hi, f_upper, f_integer, 300)
    few_seconds = time.perf_counter() - start
    over = problem.memory.peak(problem.expand(f_builder.group_choice(relaxed.x)))[0] / budget
    start = time.perf_counter()
    whole = highs.solve_mip(cost, matrix.tocsc(), lo, hi, upper, integer, 300)
    whole_seconds = time.perf_counter() - start
    diff = as_differences(cost, matrix, lo, hi, upper, integer, memory)
    start = time.perf_counter()
    chained = highs.solve_mip(*diff, 300)
    chained_seconds = time.perf_counter() - start

    def gap(bound: float) -> str:
        return f"{bound:,.1f} ({(optimum - bound) / optimum:.2%})"

    def proof(result, seconds: float) -> str:
        return f"stopped at {seconds:.0f} s, gap {result.gap:.2%}" if result.timed_out else f"{seconds:.0f} s"

    return [name, f"{optimum:,.1f} ({seconds:.0f} s)", gap(lp.objective), gap(lagrangian),
            f"{gap(relaxed.objective)}, {len(binding)} of {len(candidates)} rows, {few_seconds:.0f} s; "
            f"its plan {over:.3f}x the budget",
            f"{proof(whole, whole_seconds)} ({matrix[memory].nnz:,} nonzeros) / {proof(chained, chained_seconds)} "
            f"({diff[1].nnz - matrix[~memory].nnz:,})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--tiny", action="store_true", help="a small case only (the smoke run)")
    args = parser.parse_args()
    rows = []
    for name, case in (TINY if args.tiny else CASES).items():
        if args.only in name:
            rows.append(measure(name, case))
            print(*rows[-1], sep=" | ", flush=True)
    print(tabulate(rows, headers=["case (objective in us)", "optimum (planner's solve)", "LP bound (gap)",
                                  "Lagrangian bound", "binding rows, integral",
                                  "whole MILP: memory rows as written / as differences"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
