"""One plan per process group: rank 0 plans and sends it, so that every rank runs the same one.

Every rank planning for itself costs world_size times the CPU where ranks share a machine, and a
solve cut short by its time limit ends wherever the clock stops it: at another plan on each rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch.distributed as dist

from ..plan import Plan


def planned_on_rank0(make: Callable[[], Plan]) -> Plan:
    """`make()` on rank 0 alone; its Plan, or the error it raised, on every rank."""
    if dist.get_world_size() == 1:
        return make()
    sent = None
    if dist.get_rank() == 0:
        try:
            sent = make()
        except Exception as e:  # sent too: the other ranks raise it instead of waiting for a plan
            sent = _sendable(e)
    sent = from_rank0(sent, "rank 0's plan", "Planning on rank 0 took longer than the process group's timeout, or "
                      "rank 0 stopped: give init_process_group a longer timeout=, or plan once with autojigsaw.plan "
                      "and pass plan= to parallelize")
    if isinstance(sent, BaseException):
        raise sent
    return sent


def from_rank0(value, what: str, why_late: str):
    """Rank 0's `value` on every rank (one broadcast, which every rank joins); where it does not arrive
    within the process group's timeout, a RuntimeError naming `what` and saying `why_late`."""
    box = [value]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as e:  # gloo's and NCCL's timeouts are RuntimeErrors
        raise RuntimeError(f"rank {dist.get_rank()}: {what} did not arrive ({str(e).splitlines()[0]}). "
                           f"{why_late}") from e
    return box[0]


def _sendable(error: Exception) -> Exception:
    """`error` itself where it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error that does not survive pickling is sent as text
        return RuntimeError(f"planning failed on rank 0: {type(error).__name__}: {error}")
