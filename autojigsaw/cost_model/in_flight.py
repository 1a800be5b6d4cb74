"""Microbatches in flight: a pipeline stage holds the saved activations of several at once.

Under a pipeline schedule a stage runs the forwards of up to k microbatches before the backward
of the first (1F1B: k = stages after it, plus one). The memory model prices one microbatch's
forward and backward; the other k - 1 hold what it holds across the turn from forward to
backward -- every item live at both the last forward point and the first backward point that is
not a parameter's (weights, gradients, optimizer states and FSDP's gathered copies are the
stage's, once) -- for the whole step. Each such item gets k - 1 more copies over every point,
so a memory row stays linear in the choice of strategies.
"""

from __future__ import annotations

from dataclasses import replace

from .liveness import LinearItem, MaxItem, MemoryModel, Member


def with_in_flight(memory: MemoryModel, in_flight: int, persistent: set[int]) -> MemoryModel:
    """`memory` with the activations held across forward and backward counted `in_flight` times;
    `persistent`: node indices of the parameters and buffers (their items are not an activation's)."""
    if in_flight <= 1 or not memory.training:
        return memory
    n, extra = len(memory.names), in_flight - 1
    last = memory.n_points - 1

    def held(item) -> bool:
        return item.start <= n - 1 and item.end >= n

    lin = [LinearItem(i.node, i.vec, 0, last, i.scale * extra) for i in memory.lin
           if held(i) and i.node not in persistent]
    maxes = [MaxItem(tuple(Member(m.node, m.vec, m.scale * extra) for m in i.members), 0, last)
             for i in memory.maxes if held(i)]
    scaled = replace(memory, vectors=list(memory.vectors), _ids=dict(memory._ids))
    pairs = [replace(i, src_bytes=scaled.vector(extra * memory.vectors[i.src_bytes]),
                     dst_bytes=scaled.vector(extra * memory.vectors[i.dst_bytes]), start=0, end=last)
             for i in memory.pairs if held(i)]
    return replace(scaled, lin=memory.lin + lin, maxes=memory.maxes + maxes, pairs=memory.pairs + pairs)

