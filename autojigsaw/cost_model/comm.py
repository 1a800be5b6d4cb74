"""Communication cost: bytes each rank sends per collective, and alpha-beta time over a link.

`bytes_sent` is the one definition of "bytes sent" in the project: the kernels count real
traffic with it and the planner predicts with it, so the two can be compared exactly.
Bytes follow the bandwidth-optimal ring algorithms (as NCCL's bus bandwidth does).
"""

from __future__ import annotations

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


def bytes_sent(kind: str, input_bytes: int, n: int) -> int:
    """Bytes one rank sends in `kind` over `n` ranks, given the bytes of its input buffer.

    all_gather: input is the local chunk; reduce_scatter and all_to_all: the full local
    buffer; all_reduce: the tensor reduced; send_recv: the message itself.
    """
    if n <= 1:
        return 0
    if kind == "all_gather":
        return input_bytes * (n - 1)
    if kind in ("reduce_scatter", "all_to_all"):
        return input_bytes * (n - 1) // n
    if kind == "all_reduce":
        return 2 * input_bytes * (n - 1) // n
    if kind == "send_recv":
        return input_bytes
    raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")


def latency_steps(kind: str, n: int) -> int:
    """Message rounds of the ring algorithm (each costs one link latency)."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(kind, n - 1)


def collective_time(kind: str, input_bytes: int, n: int, latency_s: float, bandwidth: float) -> float:
    """Alpha-beta time of one collective: rounds x latency + bytes sent / bandwidth."""
    if n <= 1:
        return 0.0
    return latency_steps(kind, n) * latency_s + bytes_sent(kind, input_bytes, n) / bandwidth
