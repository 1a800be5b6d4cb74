"""One traced program per process group: every rank takes rank 0's order of the ops they all traced."""

from __future__ import annotations

import torch.distributed as dist

from ..capture import Captured
from ..capture.order import in_order, program_order
from .exchange import from_rank0


def follow_rank0_order(captured: Captured | None) -> None:
    """Put this rank's program in rank 0's order and names where it computes the same ops (one broadcast,
    which every rank joins, a rank that could not capture the model too)."""
    if dist.get_world_size() == 1:
        return
    rank0 = dist.get_rank() == 0
    order = from_rank0(program_order(captured.gm.graph) if captured is not None and rank0 else None,
                       "rank 0's traced program")
    if captured is not None and order is not None and not rank0:
        captured.gm = in_order(captured.gm, order)
