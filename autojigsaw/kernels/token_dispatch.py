"""Token dispatch: routed experts with the tokens split, each routed row sent to its expert's rank.

The mixture-of-experts layer as DeepSeek-V3, Qwen3-MoE and Mixtral train under Megatron-Core and
torchtitan. The ranks of one mesh axis (or of several, flattened: MeshAxis over their group) hold
their own tokens and a contiguous block of the experts (rank q: experts[q] of them, in order).
Each rank routes its tokens (the router ran on them before, as the model writes it), then:

  1. sorts its (token, choice) rows by expert and counts them per expert;
  2. exchanges the counts (all-to-all of E integers), so every rank knows how many rows it gets
     from each rank for each of its experts;
  3. sends each row to the rank of its expert (all-to-all with uneven splits, `_ExchangeRows`,
     whose backward is the same exchange reversed);
  4. orders the rows it received by local expert and runs its experts' MLPs (grouped GEMMs:
     torch._grouped_mm or transformers' fallback, the op the model was captured with);
  5. sends the results back (the reverse all-to-all) and combines them as the model does: weighted
     by the router's scores, back in token order, summed over the top-k choices.

Dropless: every row is kept, whatever the routing. The counts are read on the host (`tolist`,
as Megatron and torchtitan do): under torch.compile they are data-dependent sizes, checked
non-negative, and the compiled graph keeps them symbolic (dynamo's capture_scalar_outputs).
"""

from __future__ import annotations

import math

import torch

from ..capture.routed_experts import combine, expert_mlp, rows_per_expert, sorted_by_expert
from ..mesh import MeshAxis
from . import collectives as C
from .collectives import c10d
from .once import differentiable_once


def _exchange(rows: torch.Tensor, send: list, recv: list, axis: MeshAxis) -> torch.Tensor:
    """all_to_all_single of rows: send[q] rows of `rows` to rank q, recv[q] rows from it (the own ones stay)."""
    if not torch.compiler.is_compiling():
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        C.record_sent("all_to_all", axis, (sum(send) - send[axis.coord]) * row_bytes)
    return C.waited("all_to_all", axis, lambda: c10d.all_to_all_single(rows.contiguous(), recv, send, axis.group))


class _ExchangeRows(torch.autograd.Function):
    """Rows to the ranks of `axis` (send[q] to rank q, recv[q] from it); backward: the gradients back."""

    @staticmethod
    def forward(ctx, rows, send, recv, axis):
        ctx.args = (send, recv, axis)
        return _exchange(rows, send, recv, axis)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        send, recv, axis = ctx.args
        return _exchange(g, recv, send, axis), None, None, None


def _sizes(counts: torch.Tensor) -> list:
    """Host ints of `counts`, marked as the sizes they are (non-negative) for torch.compile."""
    sizes = counts.tolist()
    for s in sizes:
        torch._check(s >= 0)
    return sizes


def _exchange_counts(counts: torch.Tensor, experts: tuple[int, ...], axis: MeshAxis) -> torch.Tensor:
    """[n, e]: the rows every rank routes to each of this rank's e experts (`counts`: this rank's, per expert)."""
    own = experts[axis.coord]
    got = _exchange(counts, list(experts), [own] * axis.size, axis)
    return got.view(axis.size, own)


def _by_local_expert(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): the received rows (by source rank, then expert) ordered by local expert, and the
    cumulative rows per local expert."""
    n, own = recv_counts.shape
    offs = torch.cumsum(recv_counts.sum(0), dim=0, dtype=torch.int32)
    if own == 0:
        return torch.arange(total, device=recv_counts.device), offs
    blocks = torch.arange(n * own, device=recv_counts.device)
    block = torch.repeat_interleave(blocks, recv_counts.reshape(-1), output_size=total)
    return torch.sort(block % own, stable=True).indices, offs


def _unordered(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The rows of y = rows[order] back in the order of `rows`."""
    inverse = torch.empty_like(order).index_put((order,), torch.arange(order.shape[0], device=order.device))
    return y[inverse]


def token_dispatch(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, *, mm: str, act: str, gated: bool, experts: tuple[int, ...],
                   axis: MeshAxis) -> torch.Tensor:
    """routed_experts on this rank's tokens x [t, H] (their top-k `index` and scores `weights` [t, k]),
    with this rank's experts w1, w2; rank q of `axis` holds experts[q] of them, in order."""
    _check(w1, w2, experts, axis)
    tokens, k = index.shape
    expert_ids, perm, token, row_weights = sorted_by_expert(index, weights)
    counts = rows_per_expert(expert_ids, sum(experts)).to(torch.int64)
    recv_counts = _exchange_counts(counts, experts, axis)
    send = _sizes(torch.stack([c.sum() for c in counts.split(list(experts))]))
    recv = _sizes(recv_counts.sum(1))
    received = _ExchangeRows.apply(x[token], send, recv, axis)
    order, offs = _by_local_expert(recv_counts, received.shape[0])
    y = expert_mlp(received[order], w1, w2, offs, mm=mm, act=act, gated=gated)
    back = _ExchangeRows.apply(_unordered(y, order), recv, send, axis)
    return combine(back, row_weights, perm, tokens, k, x.dtype)


def _check(w1: torch.Tensor, w2: torch.Tensor, experts: tuple[int, ...], axis: MeshAxis) -> None:
    own = experts[axis.coord] if len(experts) == axis.size else None
    if own != w1.shape[0] or own != w2.shape[0]:
        raise ValueError(f"token_dispatch: experts={tuple(experts)} over mesh axis {axis.name!r} ({axis.size} ranks) "
                         f"must give each rank's expert count, this rank's ({axis.coord}) equal to its weights' "
                         f"{w1.shape[0]} and {w2.shape[0]}; pass the weights' chunk sizes over the axis")
