"""Clear errors for plans that cannot exist."""

from __future__ import annotations

import numpy as np

from ..capture import Captured
from ..mesh import MeshSpec
from ..plan import _bytes
from .problem import Problem


def infeasible_error(captured: Captured, problem: Problem, mesh: MeshSpec, budget: int) -> ValueError:
    """No strategy choice fits the budget: say how far off, and which tensors weigh most."""
    least = sum(float(np.min(m)) for m in problem.memory)
    heaviest = sorted(((float(np.min(m)), name) for name, m in zip(problem.names, problem.memory)),
                      reverse=True)[:5]
    names = {**captured.params, **captured.buffers}
    listing = ", ".join(f"{names.get(n, n)} ({_bytes(b)})" for b, n in heaviest if b > 0)
    return ValueError(
        f"no plan fits the memory budget of {_bytes(budget)} per rank on mesh {mesh.describe()}: "
        f"the least any plan needs is {_bytes(least)} per rank. Heaviest even when sharded: "
        f"{listing}. Use a bigger mesh, a larger memory_budget, or a smaller sample or batch."
    )
