"""Clear errors for plans that cannot exist."""

from __future__ import annotations

import numpy as np

from ..capture import Captured
from ..mesh import MeshSpec
from ..plan import format_bytes
from .problem import Problem


class PlanDoesNotFit(ValueError):
    """No plan fits the memory budget (a ValueError, as every error of the user's inputs)."""


def infeasible_error(captured: Captured, problem: Problem, mesh: MeshSpec, budget: int,
                     recompute: str = "none") -> PlanDoesNotFit:
    """No strategy choice fits the budget: say how far off, and which tensors weigh most."""
    mem = problem.memory
    own = mem.own_bytes([len(s) for s in problem.strategies])
    lean = np.array([int(np.argmin(o)) for o in own])
    peak, point = mem.peak(lean)
    heaviest = sorted(((float(o.min()), problem.names[n]) for n, o in enumerate(own)), reverse=True)[:5]
    names = {**captured.params, **captured.buffers}
    listing = ", ".join(f"{names.get(n, n)} ({format_bytes(b)})" for b, n in heaviest if b > 0)
    return PlanDoesNotFit(
        f"no plan fits the memory budget of {format_bytes(budget)} per rank on mesh {mesh.describe()}: "
        f"the layout that gives every node its smallest shards needs {format_bytes(peak)} per rank (peak at "
        f"the {mem.describe(point)}). "
        f"Largest even when sharded as far as the mesh allows (with gradients and optimizer state): "
        f"{listing}. "
        + (f"Recomputation was tried (activation_checkpointing={recompute!r}). " if recompute != "none" else
           "Try activation_checkpointing='auto' (or 'full'), which recomputes activations instead of keeping them. ")
        + "Relax one of: a bigger mesh (more ranks to shard over), a larger memory_budget, "
        "a smaller sample or batch, or training=False if no backward pass is needed."
    )
