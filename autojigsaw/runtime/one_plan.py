"""One plan per process group: rank 0 plans and sends it, so that every rank runs the same one.

Every rank planning for itself costs world_size times the CPU where ranks share a machine, and a
solve cut short by its time limit ends wherever the clock stops it: at another plan on each rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch.distributed as dist

from ..plan import Plan
from .exchange import from_rank0


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


def _sendable(error: Exception) -> Exception:
    """`error` itself where it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error that does not survive pickling is sent as text
        return RuntimeError(f"planning failed on rank 0: {type(error).__name__}: {error}")
