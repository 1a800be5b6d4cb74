"""Resizing a sharded dim where each output row is a weighted sum of input rows no local call reproduces.

Linear resampling to any size (source row i x (in - 1) / (out - 1) with aligned corners, (i + 0.5)
x scale - 0.5 without) and adaptive average pooling (output row i averages input rows
floor(i in / out) ... ceil((i + 1) in / out) - 1) read rows at positions that depend on the
global row index, so an aten call on a rank's rows computes other positions. `halo_resize`
fetches the rows each rank's output rows read (kernels/halo.py), computes the sharded dims here at
one device's positions (`ROWS`, in the precision aten computes them), and leaves the other
dims to aten.
"""

from __future__ import annotations

import torch

from ..dtypes import acc_dtype
from .halo import fetch_rows


def halo_resize(x: torch.Tensor, *, op, op_args: tuple, out_size: tuple[int, ...], fetches, rows) -> torch.Tensor:
    """`op(x, size, *op_args)` of this rank's chunk: each dim of `fetches` fetched, each dim of `rows`
    (dim, row kind of `ROWS`, its first fetched row, first output row, output rows, input size,
    output size, scale) computed here, the other spatial dims by `op` (to `out_size`, their global sizes)."""
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis)
    size, first = list(out_size), x.ndim - len(out_size)
    for dim, kind, fetched_from, start, n, in_size, out_rows, scale in rows:
        x = ROWS[kind](x, dim, fetched_from, range(start, start + n), in_size, out_rows, scale)
        size[dim - first] = n
    # a dim already at its size is copied: its scale is exactly 1, its windows single rows
    return op(x, size, *op_args)


def _lerp(x, dim: int, fetched_from: int, in_size: int, source) -> torch.Tensor:
    """x's dim interpolated between the rows below and above each of `source` (positions, in the
    accumulation dtype), x holding the input rows from `fetched_from` on."""
    below = source.floor().long().clamp(max=in_size - 1)
    above = (below + 1).clamp(max=in_size - 1)
    weight = (source - below).clamp(0, 1).to(x.dtype).reshape([-1] + [1] * (x.ndim - dim - 1))
    low, high = x.index_select(dim, below - fetched_from), x.index_select(dim, above - fetched_from)
    return low * (1 - weight) + high * weight


def _corners(x, dim, fetched_from, out_rows, in_size, out_size, scale) -> torch.Tensor:
    """Linear resampling with align_corners=True: source row i x scale, scale (in - 1) / (out - 1)."""
    acc = acc_dtype(x.dtype)
    source = torch.arange(out_rows.start, out_rows.stop, dtype=acc, device=x.device) * torch.tensor(scale, dtype=acc)
    return _lerp(x, dim, fetched_from, in_size, source)


def _half_pixel(x, dim, fetched_from, out_rows, in_size, out_size, scale) -> torch.Tensor:
    """Linear resampling with align_corners=False: source row (i + 0.5) x scale - 0.5, none below 0,
    scale in / out or 1 / the call's scale factor."""
    acc = acc_dtype(x.dtype)
    half = torch.tensor(0.5, dtype=acc)
    source = (torch.arange(out_rows.start, out_rows.stop, dtype=acc, device=x.device) + half) * torch.tensor(
        scale, dtype=acc) - half
    return _lerp(x, dim, fetched_from, in_size, source.clamp(min=0))


def _window_means(x, dim, fetched_from, out_rows, in_size, out_size, scale) -> torch.Tensor:
    """Adaptive average pooling's means over the windows of `out_rows`."""
    weights = x.new_zeros((len(out_rows), x.shape[dim]), dtype=acc_dtype(x.dtype))
    for j, i in enumerate(out_rows):
        lo, hi = i * in_size // out_size, -(-(i + 1) * in_size // out_size)
        weights[j, lo - fetched_from:hi - fetched_from] = 1 / (hi - lo)
    y = x.movedim(dim, -1).to(weights.dtype) @ weights.T
    return y.to(x.dtype).movedim(-1, dim)


ROWS = {"corners": _corners, "half_pixel": _half_pixel, "window_means": _window_means}
