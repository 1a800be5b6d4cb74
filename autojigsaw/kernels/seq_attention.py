"""Sequence-sharded attention on the shards the rewrite hands over: contiguous chunks of dim -2.

`ring` runs kernels.attention.ring_attention on this rank's chunk; with layout="zigzag" it
first moves q, k, v to the zigzag layout (pieces i and 2n-1-i, which balances causal work
over the ring) and the output back, one all-to-all per tensor each way, exact adjoints.
`gathered_kv` is SDPA of this rank's query rows against every key, the causal mask shifted
to the rows' global positions (SDPA's own is_causal would align it with row 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mesh import MeshAxis
from ..placements import chunk_sizes
from .attention import ring_attention
from .ring import from_zigzag, to_zigzag, zigzag_layout, zigzag_sizes


def _rows(mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """A row-broadcast mask that takes a gradient, expanded to `rows` (the ring wants its rows)."""
    if mask is None or mask.shape[-2] != 1 or not mask.requires_grad:
        return mask
    return mask.expand(*mask.shape[:-2], rows, mask.shape[-1])


def ring(q, k, v, attn_mask=None, *, is_causal: bool, scale: float | None, enable_gqa: bool,
         layout: str, seq_len: int, axis: MeshAxis) -> torch.Tensor:
    """This rank's contiguous chunk of SDPA(Q, K, V), q, k, v holding its chunk of dim -2.

    attn_mask holds this rank's rows for layout "contiguous", every row for "zigzag" (one
    row broadcast over all of them either way), and every key in global order.
    """
    kw = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, axis=axis)
    if layout == "contiguous":
        return ring_attention(q, k, v, _rows(attn_mask, q.shape[-2]), seq_sizes=chunk_sizes(seq_len, axis.size),
                              **kw)
    move = dict(dim=-2, seq_len=seq_len, axis=axis)
    q, k, v = (to_zigzag(t, **move) for t in (q, k, v))
    if attn_mask is not None and attn_mask.shape[-2] != 1:
        runs = zigzag_layout(seq_len, axis.size)[axis.coord]
        attn_mask = torch.cat([attn_mask.narrow(-2, start, length) for start, length in runs], -2)
    out = ring_attention(q, k, v, _rows(attn_mask, q.shape[-2]), seq_sizes=zigzag_sizes(seq_len, axis.size),
                         layout="zigzag", **kw)
    return from_zigzag(out, **move)


def gathered_kv(q, k, v, attn_mask=None, *, is_causal: bool, scale: float | None, enable_gqa: bool,
                row_offset: int) -> torch.Tensor:
    """SDPA of this rank's query rows (global positions from `row_offset`) against all keys."""
    if is_causal:
        rows = torch.arange(row_offset, row_offset + q.shape[-2], device=q.device)
        keep = rows[:, None] >= torch.arange(k.shape[-2], device=q.device)[None, :]
        if attn_mask is None or attn_mask.dtype == torch.bool:
            attn_mask = keep if attn_mask is None else attn_mask & keep
        else:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale, enable_gqa=enable_gqa)
