"""Small objects exchanged among the ranks, with an error that says what did not arrive and why.

Gloo's and NCCL's own timeout is a bare RuntimeError from deep inside torch; a rank that waits for
another that stopped, or that raised before the exchange, should be told which exchange and why.
"""

from __future__ import annotations

import torch.distributed as dist

# why a rank waits in vain at one of parallelize's exchanges before the step
BEFORE_PARALLELIZE = ("A rank stopped, or raised before this exchange (an argument that differs by rank?): "
                      "call parallelize alike on every rank")


def from_rank0(value, what: str, why_late: str = BEFORE_PARALLELIZE):
    """Rank 0's `value` on every rank (one broadcast, which every rank joins)."""
    box = [value]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as e:  # gloo's and NCCL's timeouts are RuntimeErrors
        raise _late(what, why_late, e) from e
    return box[0]


def from_every_rank(value, what: str, why_late: str = BEFORE_PARALLELIZE) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    gathered = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, value)
    except RuntimeError as e:
        raise _late(what, why_late, e) from e
    return gathered


def _late(what: str, why_late: str, error: RuntimeError) -> RuntimeError:
    return RuntimeError(f"rank {dist.get_rank()}: {what} did not arrive within the process group's timeout "
                        f"({str(error).splitlines()[0]}). {why_late}")
