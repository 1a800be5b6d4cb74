"""The recipe: capture -> strategies -> costs -> solve -> Plan; then rewrite -> materialize -> compile.

`plan` runs the first half on any mesh without a process group; `parallelize` runs all of it on
each rank (at the first call when no example inputs are given; rank 0 alone plans and sends the
plan) and hands the result to a ParallelModule, which only holds and runs it.
"""

from .building import parallelize
from .planning import best_mesh, evaluate, plan
from .recipe import capture_for, plan_captured, with_traffic

__all__ = ["best_mesh", "capture_for", "evaluate", "parallelize", "plan", "plan_captured", "with_traffic"]
