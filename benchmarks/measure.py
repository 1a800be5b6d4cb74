"""Measured (not predicted) traffic and memory of one training step, for any implementation.

Traffic: PyTorch's CommDebugMode sees every functional collective, DTensor's included; it
counts calls, so `CommBytes` adds the bytes each rank sends, by autojigsaw's one definition
(`cost_model.comm.bytes_sent`, ring algorithms). Memory: PyTorch's MemTracker follows every
live tensor storage (parameters, gradients, optimizer state, activations, temporaries) and
keeps the peak. Both are dispatch modes, so they see eager execution only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from autojigsaw.ir import bytes_sent

_c10d = torch.ops._c10d_functional
# functional collective -> (kind for bytes_sent, index of the group-name argument)
_COLLECTIVES = {
    _c10d.all_reduce: ("all_reduce", 2), _c10d.all_reduce_: ("all_reduce", 2),
    _c10d.all_reduce_coalesced: ("all_reduce", 2), _c10d.all_reduce_coalesced_: ("all_reduce", 2),
    _c10d.all_gather_into_tensor: ("all_gather", 2), _c10d.all_gather_into_tensor_coalesced: ("all_gather", 2),
    _c10d.reduce_scatter_tensor: ("reduce_scatter", 3),
    _c10d.reduce_scatter_tensor_coalesced: ("reduce_scatter", 3),
    _c10d.all_to_all_single: ("all_to_all", 3), _c10d.broadcast: ("send_recv", 2),
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


class CommBytes(CommDebugMode):
    """CommDebugMode that also adds up the bytes this rank sends (`.bytes`) per collective kind."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entry = None if any(t is DTensor for t in types) else _COLLECTIVES.get(getattr(func, "_overloadpacket", None))
        if entry is not None:
            kind, group_arg = entry
            n = _resolve_process_group(args[group_arg]).size()
            self.bytes[kind] = self.bytes.get(kind, 0) + bytes_sent(kind, _nbytes(args[0]), n)
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def comm_of(step: Callable[[], object]) -> tuple[int, int]:
    """(collective calls, bytes sent by this rank) of one call of `step`."""
    with CommBytes() as comm:
        step()
    return comm.get_total_counts(), comm.total_bytes


def peak_memory_of(step: Callable[[], object], module: torch.nn.Module, optimizer) -> dict[str, int]:
    """Peak live bytes on this rank during `step`, in total and by kind, from MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(snapshot.values()), {})
    return {str(getattr(k, "value", k)): int(v) for k, v in per_device.items()}


def timed_step(run, x) -> float:
    """Wall seconds of `run.step(x)` between two barriers (ranks where `run.active` is False only wait)."""
    dist.barrier()
    start = time.perf_counter()
    if run.active:
        run.step(x)
    dist.barrier()
    return time.perf_counter() - start
