"""Every rank's graph of a plan, rewritten and linted at plan time (AUTOJIGSAW_CHECK_RANKS=1).

Planning rewrites rank 0's graph only, for its traffic; with uneven shards every rank runs a graph
of its own. With AUTOJIGSAW_CHECK_RANKS=1 in the environment each plan is also rewritten for the
coordinates whose graphs can differ (along each mesh axis the first two and the last two, so every
coordinate of axes up to 4) and each graph linted (`Graph.lint`: every value is defined before it
is used): a rank's broken graph shows when planning, not at launch.
"""

from __future__ import annotations

import itertools
import os

from ..capture import Captured
from ..mesh import MeshSpec, RankView
from ..plan import Plan
from .rewrite import rewrite

CHECK_ENV = "AUTOJIGSAW_CHECK_RANKS"


def checking_every_rank() -> bool:
    """Does the environment ask for every rank's graph at plan time?"""
    return os.environ.get(CHECK_ENV, "0") not in ("", "0")


def distinct_coordinates(mesh: MeshSpec) -> list[tuple[int, ...]]:
    """The coordinates whose graphs can differ: per axis the first two and the last two."""
    per_axis = [sorted({c for c in (0, 1, size - 2, size - 1) if 0 <= c < size}) for size in mesh.sizes]
    return list(itertools.product(*per_axis))


def lint_every_rank(captured: Captured, plan: Plan) -> None:
    """Rewrite `plan` for each of its mesh's distinct coordinates and lint the graph."""
    for coord in distinct_coordinates(plan.mesh):
        rank = RankView(plan.mesh, coord, (None,) * plan.mesh.ndim)
        try:
            rewrite(captured, plan, rank, training=plan.training).graph.lint()
        except Exception as e:
            where = ", ".join(f"{a}={c}" for a, c in zip(plan.mesh.axis_names, coord))
            raise RuntimeError(f"autojigsaw: the plan's graph for the rank at {where} is broken: {e}. "
                               "This is a bug in autojigsaw; please report it with the plan's JSON "
                               "(plan.to_json())") from e
