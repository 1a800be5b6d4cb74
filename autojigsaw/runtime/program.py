"""Program: what one rank runs for one input shape (or one pipeline stage), as `parallelize` builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import GraphModule

from ..capture import Captured
from ..mesh import RankView
from ..plan import Plan
from ..training import Precision
from .fsdp import FsdpUnits


@dataclass(frozen=True)
class Program:
    """What one rank runs: the captured graph, its plan, the rank, the rewritten graph and what runs it (split
    in layers for recomputation or FSDP's units, compiled)."""

    captured: Captured
    plan: Plan
    rank: RankView
    graph: GraphModule
    run: Callable
    precision: Precision = Precision()
    symbolic: Captured | None = None  # with dynamic=True: the graph at symbolic sizes, its plan serves their range
    units: FsdpUnits | None = None  # FSDP's units over the data axis (the first program makes them)
