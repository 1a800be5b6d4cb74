"""The planner: one strategy per node, minimizing step time under a memory budget."""

from .milp import solve
from .problem import Problem, build_problem

__all__ = ["Problem", "build_problem", "solve"]
