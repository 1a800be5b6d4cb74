"""A rank's share of routed experts over tokens every rank holds whole: its own experts' rows only.

Expert parallelism without an all-to-all, as autojigsaw splits a grouped matmul's experts
(strategies/rules/moe.py): every rank sorts all the routed rows, computes those routed to its
contiguous block of experts and leaves the others zero, so the combined outputs summed over the
ranks are the layer's output (a Partial value, reduced by the plan's collectives). No shape
depends on the routing: the rank's rows are rotated to the front with an index (their start is a
value of the offsets, read on the device), the grouped GEMMs stop at the rank's last offset, and
the rotation is undone.
"""

from __future__ import annotations

import torch

from ..capture.routed_experts import combine, expert_mlp, rows_per_expert, sorted_by_expert


def expert_share(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                 mm: str, act: str, gated: bool, first: int, experts: int) -> torch.Tensor:
    """The routed experts' output from experts first .. first + len(w1) - 1 of `experts` alone."""
    expert_ids, perm, token, row_weights = sorted_by_expert(index, weights)
    offs = torch.cumsum(rows_per_expert(expert_ids, experts), dim=0, dtype=torch.int32)
    rows = x[token]
    if w1.shape[0] == 0:  # a rank without experts contributes nothing, through its empty GEMMs: its output
        # stays in the autograd graph, so the backward of the collectives after it runs on every rank
        none = expert_mlp(rows[:0], w1, w2, offs[:0], mm=mm, act=act, gated=gated)
        y = torch.cat([none, none.new_zeros((rows.shape[0], w2.shape[2]))])
    else:
        y = _own_rows_mlp(rows, w1, w2, offs, first, mm=mm, act=act, gated=gated)
    return combine(y, row_weights, perm, index.shape[0], index.shape[1], x.dtype)


def _own_rows_mlp(rows, w1, w2, offs, first: int, *, mm: str, act: str, gated: bool) -> torch.Tensor:
    """expert_mlp of the rows of experts first .. first + len(w1) - 1 (rows sorted by expert); zero elsewhere.

    torch._grouped_mm leaves the rows past its last offset (and their gradient) unset: they are masked."""
    total = rows.shape[0]
    positions = torch.arange(total, device=rows.device)
    start = offs[first - 1] if first else torch.zeros((), dtype=offs.dtype, device=offs.device)
    local_offs = offs[first:first + w1.shape[0]] - start
    own = (positions < local_offs[-1]).unsqueeze(-1)
    rotated = torch.where(own, rows[(positions + start) % total], 0)
    y = torch.where(own, expert_mlp(rotated, w1, w2, local_offs, mm=mm, act=act, gated=gated), 0)
    return y[(positions - start) % total]
