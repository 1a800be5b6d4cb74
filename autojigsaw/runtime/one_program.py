"""One traced program per process group: every rank takes rank 0's order of the ops they all traced."""

from __future__ import annotations

import torch.distributed as dist

from ..capture import Captured
from ..capture.order import in_order, program_order


def follow_rank0_order(captured: Captured | None) -> None:
    """Put this rank's program in rank 0's order and names where it computes the same ops (one broadcast,
    which every rank joins, a rank that could not capture the model too)."""
    if dist.get_world_size() == 1:
        return
    box = [program_order(captured.gm.graph) if captured is not None and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if captured is not None and box[0] is not None:
        captured.gm = in_order(captured.gm, box[0])
