"""Communication cost: alpha-beta time of a collective over a link, numerically and as formulas.

Bytes sent are `ir.bytes_sent` (the bandwidth-optimal ring algorithms, as NCCL's bus
bandwidth counts them), which the kernels use to count real traffic too.

Time is alpha-beta per algorithm, as NCCL chooses them: a ring costs one latency per step
(n-1 steps, 2(n-1) for an all-reduce) plus its bytes over the link bandwidth; an all-reduce
may instead run as a (double binary) tree, 2 log2(n) latencies and twice the buffer over the
bandwidth, which wins for small messages on many ranks. The faster of the two is taken.
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir import COLLECTIVES
from .formulas import Formula, symbols


def latency_steps(kind: str, n: int) -> int:
    """Message rounds of the ring algorithm (each costs one link latency)."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(kind, n - 1)


_B, _N, _ALPHA, _BETA = symbols("B n alpha beta")
_SENT = {  # bytes sent per rank, as bytes_sent (the floor division aside)
    "all_gather": _B * (_N - 1),
    "reduce_scatter": _B * (_N - 1) / _N,
    "all_to_all": _B * (_N - 1) / _N,
    "all_reduce": 2 * _B * (_N - 1) / _N,
    "send_recv": _B,
}
_RING_STEPS = {"all_reduce": 2 * (_N - 1), "send_recv": sympy.Integer(1)}

RING: dict[str, Formula] = {
    kind: Formula(f"{kind}_ring_time", _RING_STEPS.get(kind, _N - 1) * _ALPHA + sent / _BETA,
                  (_B, _N, _ALPHA, _BETA))
    for kind, sent in _SENT.items()
}
TREE_ALL_REDUCE = Formula("all_reduce_tree_time", 2 * sympy.log(_N, 2) * _ALPHA + 2 * _B / _BETA,
                          (_B, _N, _ALPHA, _BETA))


def collective_time(kind: str, input_bytes, n: int, latency_s: float, bandwidth: float, *,
                    tree: bool = True):
    """Seconds of one collective over a link (input_bytes may be a numpy array).

    `tree`: the backend may run an all-reduce as a tree (NCCL does, gloo does not).
    """
    if kind not in RING:
        raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
    if n <= 1:
        return np.zeros_like(input_bytes, dtype=float) if isinstance(input_bytes, np.ndarray) else 0.0
    t = RING[kind](input_bytes, n, latency_s, bandwidth)
    if kind == "all_reduce" and tree and n > 2:
        t = np.minimum(t, TREE_ALL_REDUCE(input_bytes, n, latency_s, bandwidth))
    return t
