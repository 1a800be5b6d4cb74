"""The planner: one strategy per node, minimizing step time under a memory budget."""

from .problem import Problem, build_problem
from .milp import solve

__all__ = ["Problem", "build_problem", "solve"]
