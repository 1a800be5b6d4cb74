"""Recomputation chosen with the sharding: per layer, none, selective or full, under the budget.

"selective-op" (torchtitan's own policy) is planned when asked for; "auto" chooses among none,
selective and full.

For a policy, recomputing the first k repeated layers frees their saved activations at the
peak (the end of the forward, where every layer's are live) and adds their forward time
again; which k does not matter for the peak, only how many, and earlier layers' activations
live longest. "auto" solves the sharding for no recomputation, and for each policy at the
fewest layers that fit (bisection: fitting is monotone in k) and at every layer, and keeps
the fastest plan: recomputation is chosen per layer, jointly with the sharding, in a handful
of MILPs. When the plan without recomputation fits, each recomputed variant is searched only
for a faster plan: HiGHS prunes at the fastest plan's time, and a variant whose LP bound is
above it is ruled out at once. A variant whose solve runs out of time counts as not fitting,
with a warning, so that one hard variant does not lose the plans of the others.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch.fx import Node

from ..cost_model.estimate import EdgeCosts
from ..cost_model.recompute import Layer, recompute_time, recomputed_nodes, repeated_layers, with_recompute
from .milp import Solution, SolverTimeout
from .problem import Problem

POLICIES = ("selective", "full")


@dataclass(frozen=True)
class Recomputed:
    """A solved problem with its recomputation: (layer name, policy) for each recomputed layer."""

    problem: Problem
    solution: Solution | None
    layers: tuple[tuple[str, str], ...] = ()


def solve_with_recompute(problem: Problem, nodes: list[Node], params: dict[str, str], policy: str,
                         budget: float | None, solve: Callable[..., Solution | None]) -> Recomputed:
    """The best plan under `policy` ("none", "selective", "selective-op", "full" or "auto")."""
    layers = repeated_layers(nodes, params)
    if not layers and policy not in ("none", "auto"):
        raise ValueError(f"activation_checkpointing={policy!r}: recomputation runs per repeated layer (a stack of "
                         "numbered modules, as model.layers.0, model.layers.1, ...), and this model has none; hold "
                         "the repeated blocks in a named nn.ModuleList, or give activation_checkpointing='none'")
    if policy == "none" or not layers:
        return Recomputed(problem, solve(problem, budget))
    timeouts: list[tuple[str, SolverTimeout]] = []
    cuts: dict[int, None] = {}  # the memory rows earlier variants needed, in the order found

    def attempt(pol: str, k: int, beat: float | None = None) -> Recomputed:
        p, chosen = variant(problem, nodes, layers, pol, k) if k else (problem, ())
        try:
            solution = solve(p, budget, known_cuts=tuple(cuts), beat=beat)
            cuts.update(dict.fromkeys(solution.cuts if solution else ()))
            return Recomputed(p, solution, chosen)
        except SolverTimeout as e:
            timeouts.append((f"{k} layers {pol}" if k else "no recomputation", e))
            return Recomputed(p, None, chosen)

    if policy != "auto":
        p, chosen = variant(problem, nodes, layers, policy, len(layers))
        return Recomputed(p, solve(p, budget), chosen)
    tried = [attempt("none", 0)]
    for pol in POLICIES:
        if tried[0].solution is not None:  # the plan without recomputation fits: only a faster one is wanted
            tried.append(attempt(pol, len(layers), beat=_fastest(tried).solution.objective))
            continue
        every = attempt(pol, len(layers))
        tried.append(every)
        if every.solution is None:
            continue  # nothing fits
        lo, hi, best = 0, len(layers), every  # fits at hi, not at lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = attempt(pol, mid)
            if r.solution is not None:
                hi, best = mid, r
            else:
                lo = mid
        tried.append(best)
    feasible = [r for r in tried if r.solution is not None]
    if timeouts and not feasible:
        raise timeouts[0][1]
    if timeouts:
        warnings.warn("planner: activation_checkpointing='auto' ran out of time on "
                      + ", ".join(name for name, _ in timeouts)
                      + "; the plan is the fastest of the variants it solved", stacklevel=3)
    return _with_gap_of_all(_fastest(tried), feasible) if feasible else tried[0]


def _fastest(tried: list[Recomputed]) -> Recomputed:
    return min((r for r in tried if r.solution is not None), key=lambda r: r.solution.objective)


def _with_gap_of_all(chosen: Recomputed, feasible: list[Recomputed]) -> Recomputed:
    """The fastest variant, its gap measured from the lowest bound of every variant solved: another
    variant's plan, solved within its own gap, may hide a faster one (a variant ruled out by its
    cutoff has none below the chosen plan)."""
    objective = chosen.solution.objective
    lower = min(r.solution.objective * (1 - r.solution.gap) for r in feasible)
    gap = max(objective - lower, 0.0) / objective if objective > 0 else 0.0
    gap = 0.0 if gap <= 1e-6 else max(gap, chosen.solution.gap)
    return replace(chosen, solution=replace(chosen.solution, gap=gap))


def variant(problem: Problem, nodes: list[Node], layers: list[Layer], policy: str, k: int):
    """The problem with the first `k` layers recomputed under `policy`, and their names."""
    chosen = tuple((layers[j].name, policy) for j in range(k))
    return with_layers_recomputed(problem, nodes, layers, chosen), chosen


def with_layers_recomputed(problem: Problem, nodes: list[Node], layers: list[Layer],
                           chosen: tuple[tuple[str, str], ...]) -> Problem:
    """The problem with each (layer name, policy) of `chosen` recomputed."""
    policy_of = dict(chosen)
    unknown = set(policy_of) - {layer.name for layer in layers}
    if unknown:
        raise ValueError(f"the plan recomputes layers {sorted(unknown)}, which this model does not have; plan it again")
    dropped = [recomputed_nodes(layer, nodes, policy_of.get(layer.name, "none")) for layer in layers]
    time = list(problem.time)
    for d in dropped:
        for i, extra in recompute_time(problem.time, nodes, d).items():
            time[i] = time[i] + extra
    # under "full" the forward collectives into recomputed nodes run again; "selective" keeps their outputs
    again = frozenset().union(*(d for d, layer in zip(dropped, layers) if policy_of.get(layer.name) == "full"))
    edges = [replace(e, costs=EdgeCosts(e.costs.time * 1.5, e.costs.bytes)) if e.dst in again else e
             for e in problem.edges]
    memory = with_recompute(problem.memory, layers, dropped, resaved=again)
    return replace(problem, time=time, edges=edges, memory=memory)


__all__ = ["Recomputed", "solve_with_recompute"]
