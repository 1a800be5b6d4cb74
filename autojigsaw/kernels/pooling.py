"""Adaptive average pooling over a sharded dim.

To one point: each rank pools its rows and weights the result by the fraction of the dim's rows
it holds, so the shares add up (a Partial sum over the axes that shard the dim) to the
single-device mean, with chunks of any size: the feature map is never gathered, only the pooled
point is summed. To more points (a pyramid pooling's 2, 3 and 6): output row i averages input
rows floor(i L / k) ... ceil((i + 1) L / k) - 1, windows of varying size that no pooling of the
local rows reproduces, so each rank fetches the rows its output rows read and averages them here.
"""

from __future__ import annotations

import torch

from ..dtypes import acc_dtype
from .halo import fetch_rows


def partial_mean_pool(x: torch.Tensor, output_size, *, op, share: float) -> torch.Tensor:
    """`op(x, output_size)` (an adaptive average pooling) of this rank's rows, times `share`."""
    return op(x, output_size) * share


def halo_adaptive_pool(x: torch.Tensor, output_size, *, op, fetches, rows) -> torch.Tensor:
    """Adaptive average pooling (aten `op`) of this rank's chunk: each dim of `fetches` fetched, each
    dim of `rows` (dim, its first fetched row, first output row, output rows, input size, output
    size) averaged here over one device's windows, the other dims by `op` (to their global sizes)."""
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis)
    size, first = list(output_size), x.ndim - len(output_size)
    for dim, fetched_from, start, n, in_size, out_size in rows:
        x = _window_means(x, dim, fetched_from, range(start, start + n), in_size, out_size)
        size[dim - first] = n
    return op(x, size)  # a dim already at its size is copied: its windows are single rows


def _window_means(x, dim: int, fetched_from: int, out_rows: range, in_size: int, out_size: int) -> torch.Tensor:
    """The means of x's dim over adaptive pooling's windows for `out_rows`, x holding rows from `fetched_from` on."""
    weights = x.new_zeros((len(out_rows), x.shape[dim]), dtype=acc_dtype(x.dtype))
    for j, i in enumerate(out_rows):
        lo, hi = i * in_size // out_size, -(-(i + 1) * in_size // out_size)
        weights[j, lo - fetched_from:hi - fetched_from] = 1 / (hi - lo)
    y = x.movedim(dim, -1).to(weights.dtype) @ weights.T
    return y.to(x.dtype).movedim(-1, dim)
