"""Clear errors for plans that cannot exist."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..capture import Captured
from ..cost_model.allocations import Footprint
from ..cost_model.liveness import MemoryModel
from ..mesh import MeshSpec
from ..plan import format_bytes
from .problem import Problem


class PlanDoesNotFit(ValueError):
    """No plan fits the memory budget (a ValueError, as every error of the user's inputs)."""


def infeasible_error(captured: Captured, problem: Problem, mesh: MeshSpec, budget: int,
                     recompute: str = "none", reserved: Footprint | None = None,
                     whole_inputs: bool = False) -> PlanDoesNotFit:
    """No strategy choice fits the budget: say how far off, and which tensors weigh most where it peaks.
    `reserved`: the last plan that fitted as bytes live but not as the caching allocator holds them;
    `whole_inputs`: the caller passes each input whole (training.Regime.whole_inputs)."""
    mem = problem.memory
    own = mem.own_bytes([len(s) for s in problem.strategies])
    lean = np.array([int(np.argmin(o)) for o in own])
    peak, point = mem.peak(lean)
    names = {**captured.params, **captured.buffers}
    live = live_by_node(mem, lean, point)
    heaviest = sorted(live.items(), key=lambda kv: -sum(kv[1]))[:5]
    listing = ", ".join(f"{names.get(problem.names[n], problem.names[n])} ({_weight(kept, rest)})"
                        for n, (kept, rest) in heaviest if kept + rest > 0)
    inputs = [problem.names[n] for n, _ in heaviest if problem.names[n] in captured.inputs]
    held = (f"Every rank holds the input{'s' * (len(inputs) > 1)} {', '.join(inputs)} whole, as passed: "
            "input_placements= passes each rank only its shard. " if whole_inputs and inputs else "")
    if reserved is not None:
        lacks = reserved.shortfall or reserved.reserved - budget
        lead = (f"no plan fits the memory budget of {format_bytes(budget)} per rank on mesh {mesh.describe()} as "
                f"torch's CUDA caching allocator holds memory: the last plan tried ({format_bytes(reserved.allocated)} "
                f"allocated at its peak) lacks {format_bytes(lacks)} even with the allocator's cache given back, "
                f"and the layout that gives every node its smallest shards needs {format_bytes(peak)} live (at the "
                f"{mem.describe(point)}). ")
    else:
        lead = (f"no plan fits the memory budget of {format_bytes(budget)} per rank on mesh {mesh.describe()}: "
                f"the layout that gives every node its smallest shards needs {format_bytes(peak)} per rank (peak at "
                f"the {mem.describe(point)}). ")
    return PlanDoesNotFit(
        lead
        + f"Largest there, sharded as far as the mesh allows (with gradients and optimizer state): {listing}. "
        + held
        + (f"Recomputation was tried (activation_checkpointing={recompute!r}). " if recompute != "none" else
           "Try activation_checkpointing='auto' (or 'full'), which recomputes activations instead of keeping them. ")
        + "Relax one of: a bigger mesh (more ranks to shard over), a larger memory_budget, "
        "a smaller sample or batch, or training=False if no backward pass is needed."
    )


def live_by_node(mem: MemoryModel, choice: np.ndarray, point: int) -> dict[int, tuple[float, float]]:
    """Bytes of the tensors live at `point` per node (collective buffers left out), as (kept to the optimizer
    step, the rest): a parameter keeps its weight, gradient and optimizer state to the step (FSDP: its shards
    of them) and a gathered copy only while its unit runs."""
    last = mem.n_points - 1
    kept, rest = defaultdict(float), defaultdict(float)
    for item in mem.lin:
        if item.start <= point <= item.end:
            b = float(mem.vectors[item.vec][choice[item.node]] * item.scale)
            (kept if item.end == last else rest)[item.node] += b
    for m in mem.maxes:
        if m.start <= point <= m.end:
            b, node = max((float(mem.vectors[v][choice[i]] * s), i) for i, v, s in m.members)
            rest[node] += b
    return {n: (kept[n], rest[n]) for n in set(kept) | set(rest)}


def _weight(kept: float, rest: float) -> str:
    if kept and rest:
        return (f"{format_bytes(kept + rest)}: {format_bytes(kept)} kept to the optimizer step, "
                f"{format_bytes(rest)} in use there")
    return format_bytes(kept + rest)
