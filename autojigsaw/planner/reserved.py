"""Plans that fit as torch's CUDA caching allocator holds memory: the budget bounds what it reserves.

The MILP's memory rows bound the bytes live at each program point (cost_model/liveness.py), a
linear function of the strategies chosen. A CUDA device runs out of what the caching allocator
reserves (cost_model/allocations.py), which is no linear function of them: rounding, cached
blocks that no later request fits, pools per stream, the temporaries a cross-entropy's backward
makes. On a device spec with `caching_allocator` the rule is:

1. solve with the memory rows bounded by b = the budget B;
2. replay the plan through the allocator on a device of B bytes, which gives its cache back and
   tries again where a request does not fit (as torch does): its peaks, and the bytes a request
   lacked even then (the shortfall);
3. no shortfall: the plan (its reserved peak is at most B). Otherwise solve again with b lowered by
   the shortfall (from the plan's live peak if b so lowered would not bind it), doubled at each
   further try (fragmentation need not shrink with the bytes live), and go back to 2, at most
   RESOLVES times; then no plan fits.

The bound only falls, so each solve chooses among fewer plans than the one before. A plan that fits
only by the allocator giving its cache back (`Footprint.retries` > 0) is kept, and said so in the log:
each retry synchronises the device, a cost the step time leaves out. Elsewhere (the CPU spec) there is
no allocator to replay: one solve under the budget, as the rows say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch.fx import Node

from ..cost_model.allocations import Footprint, StepFacts, lifetimes, replay, step_facts
from ..cost_model.devices import DeviceSpec
from ..cost_model.recompute import repeated_layers
from .problem import Problem
from .recompute import Recomputed

RESOLVES = 4
log = logging.getLogger("autojigsaw")


@dataclass(frozen=True)
class Fitted:
    """The chosen plan (its solution None when none fits) and its footprint (or the last plan's that did not fit)."""

    chosen: Recomputed
    footprint: Footprint | None = None


def allocator_facts(nodes: list[Node], params: dict[str, str], grad: dict[str, bool], device: DeviceSpec,
                    *, training: bool) -> StepFacts | None:
    """What the allocator replay needs of the graph; None on a device without a caching allocator."""
    if not device.caching_allocator:
        return None
    return step_facts(nodes, params, grad, [layer.nodes for layer in repeated_layers(nodes, params)],
                      training=training)


def footprint(problem: Problem, choice: np.ndarray, facts: StepFacts | None, device: DeviceSpec,
              capacity: float | None = None) -> Footprint | None:
    """The plan's peaks as the device's caching allocator holds them, on `capacity` bytes; None without one."""
    if facts is None:
        return None
    spans = lifetimes(problem.memory, choice, facts, compiled=device.fused_pointwise)
    return replay(spans, problem.memory.n_points, expandable_segments=device.expandable_segments,
                  capacity=int(capacity) if capacity else None)


def solve_reserved(solve_under: Callable[[float], Recomputed], budget: float,
                   measure: Callable[[Recomputed], Footprint | None]) -> Fitted:
    """The fastest plan whose reserved peak fits `budget`, by the rule above (`solve_under(bound)`: a
    solve with the memory rows bounded by `bound`; `measure`: its footprint, None without an allocator)."""
    bound, last = budget, None
    for attempt in range(RESOLVES + 1):
        chosen = solve_under(bound)
        if chosen.solution is None:
            return Fitted(chosen, last)
        last = measure(chosen)
        excess = last.shortfall or last.reserved - budget if last is not None else 0
        if excess <= 0:
            if last is not None and last.retries:
                log.info("planner: the plan fits %.4g B only by the caching allocator giving back its cache %d "
                         "times in two steps (each synchronises the device)", budget, last.retries)
            return Fitted(chosen, last)
        lower, live = excess * 2**attempt, chosen.solution.peak_memory
        # a bound the plan's live peak stays under would give the same plan again: then lower from its peak
        start = bound if bound - lower < live else live
        log.info("planner: the plan under a memory bound of %.4g B (%.4g live at its peak) lacks %.4g B of the "
                 "budget's %.4g as the caching allocator holds memory (%.4g allocated): solving again under %.4g",
                 bound, live, excess, budget, last.allocated, start - lower)
        bound = start - lower
        if bound <= 0:
            break
    return Fitted(Recomputed(chosen.problem, None, chosen.layers), last)
