"""Halos: the rows of a spatially sharded dim that a stencil, a pooling window or a padding reads
from other ranks, fetched before the op runs on this rank's chunk.

Each rank holds a torch.chunk of the rows of one dim. A node whose output rows each read a
window of input rows (a convolution, a pooling) or a mapped row (circular, reflect or replicate
padding) is run on this rank's output chunk by first fetching the input rows that chunk reads:
`fetch_rows` takes every rank's list of wanted rows (as runs of global row indices; an index
outside the dim reads `fill`, the op's padding), sends each rank the rows it wants that this rank
holds (one all-to-all), and returns this rank's wanted rows in order. Its adjoint sends the
gradients of fetched rows back to their owners, which add them up (a row read by two ranks, or
twice, gets both). Dims sharded over two mesh axes are fetched one after another, so a 3x3
stencil also gets its corners.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..mesh import MeshAxis
from .collectives import record, waited
from .once import differentiable_once

c10d = torch.ops._c10d_functional

Runs = tuple[tuple[int, int], ...]  # (first global row, number of rows) in the order they are wanted


def row_starts(sizes) -> list[int]:
    """The first global row of each chunk of `sizes`."""
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def fetch_pieces(runs: Runs, sizes) -> list[tuple[int | None, int, int]]:
    """The runs split by owner: (owning rank or None for fill, first row in the owner's chunk, rows)."""
    starts, total = row_starts(sizes), sum(sizes)
    out = []
    for start, length in runs:
        row, end = start, start + length
        while row < end:
            if row < 0 or row >= total:
                stop = min(end, 0) if row < 0 else end
                out.append((None, 0, stop - row))
            else:
                owner = max(j for j, s in enumerate(starts) if s <= row and sizes[j] > 0)
                stop = min(end, starts[owner] + sizes[owner])
                out.append((owner, row - starts[owner], stop - row))
            row = stop
    return out


def _exchange(x: torch.Tensor, sends: list[list[tuple[int, int]]], recv_rows: list[int],
              axis: MeshAxis) -> torch.Tensor:
    """Rows of x (dim 0) to other ranks, sends[j] = (first row, rows) pieces for rank j; the rows
    received from each rank, concatenated in rank order."""
    row = math.prod(x.shape[1:])
    parts = [x.narrow(0, first, n) for j, pieces in enumerate(sends) if j != axis.coord for first, n in pieces]
    buf = torch.cat([p.reshape(-1) for p in parts]) if parts else x.new_zeros(0)
    send = [0 if j == axis.coord else sum(n for _, n in sends[j]) * row for j in range(axis.size)]
    recv = [0 if j == axis.coord else recv_rows[j] * row for j in range(axis.size)]
    record("send_recv", axis, buf)
    return waited("send_recv", axis, lambda: c10d.all_to_all_single(buf.contiguous(), recv, send, axis.group))


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, wants, sizes, axis, fill):
        ctx.args = (dim, wants, sizes, axis, x.shape)
        rows = x.movedim(dim, 0)
        me = axis.coord
        mine = fetch_pieces(wants[me], sizes)
        sends = [[(first, n) for owner, first, n in fetch_pieces(wants[j], sizes) if owner == me] for j in range(axis.size)]
        recv_rows = [sum(n for owner, _, n in mine if owner == j != me) for j in range(axis.size)]
        got = _exchange(rows, sends, recv_rows, axis).view(-1, *rows.shape[1:])
        at = dict(zip(range(axis.size), row_starts(recv_rows)))
        out = []
        for owner, first, n in mine:
            if owner is None:
                out.append(rows.new_full((n, *rows.shape[1:]), fill))
            elif owner == me:
                out.append(rows.narrow(0, first, n))
            else:
                out.append(got.narrow(0, at[owner], n))
                at[owner] += n
        return torch.cat(out).movedim(0, dim)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, wants, sizes, axis, shape = ctx.args
        grads = g.movedim(dim, 0)
        me = axis.coord
        mine = fetch_pieces(wants[me], sizes)
        # the gradient of each fetched row goes back to its owner: the forward's sends, reversed
        back = [[] for _ in range(axis.size)]
        at = 0
        for owner, first, n in mine:
            if owner is not None:
                back[owner].append((at, n))
            at += n
        theirs = [[(first, n) for owner, first, n in fetch_pieces(wants[j], sizes) if owner == me] for j in range(axis.size)]
        got = _exchange(grads, back, [sum(n for _, n in theirs[j]) if j != me else 0 for j in range(axis.size)], axis)
        got = got.view(-1, *grads.shape[1:])
        dx = grads.new_zeros((shape[dim], *grads.shape[1:]))
        at = 0
        for j in range(axis.size):
            for first, n in theirs[j]:
                if j == me:
                    continue
                dx[first:first + n] += got[at:at + n]
                at += n
        at = 0
        for owner, first, n in mine:
            if owner == me:
                dx[first:first + n] += grads[at:at + n]
            at += n
        return dx.movedim(0, dim), None, None, None, None, None


def fetch_rows(x: torch.Tensor, *, dim: int, wants: tuple[Runs, ...], sizes: tuple[int, ...], axis: MeshAxis,
               fill: float = 0.0) -> torch.Tensor:
    """This rank's wanted rows of the dim that x holds a chunk of (chunk sizes `sizes` over `axis`),
    `wants[r]` naming rank r's as runs of global rows; rows outside the dim read `fill`."""
    if x.shape[dim] != sizes[axis.coord]:
        raise ValueError(f"fetch_rows: this rank holds {x.shape[dim]} rows of dim {dim}, but the plan gives it "
                         f"{sizes[axis.coord]} of {sum(sizes)} on mesh axis {axis.name!r}; plan again")
    return _FetchRows.apply(x, dim, wants, sizes, axis, fill)


def halo_conv(x, weight, bias=None, *, stride, padding, dilation, groups: int,
              fetches: tuple[tuple[int, tuple[Runs, ...], tuple[int, ...], MeshAxis], ...]) -> torch.Tensor:
    """A convolution of this rank's chunk: each dim of `fetches` (tensor dim, every rank's wanted
    rows, the chunk sizes, its mesh axis) fetched with its zero padding, then convolved unpadded."""
    padding = list(padding)
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis)
        padding[dim - 2] = 0
    conv = (F.conv1d, F.conv2d, F.conv3d)[x.ndim - 3]
    return conv(x, weight, bias, stride, padding, dilation, groups)


def halo_conv_transpose(x, weight, bias=None, *, stride, padding, output_padding, groups: int, dilation,
                        fetches, crops) -> torch.Tensor:
    """A transposed convolution of this rank's chunk: each dim of `fetches` fetched (the input rows
    whose scatter reaches this rank's output rows, zeros past the edges), transposed-convolved
    unpadded, and of each dim of `crops` (dim, first row, rows) this rank's output rows kept."""
    padding, output_padding = list(padding), list(output_padding)
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis)
        padding[dim - 2] = output_padding[dim - 2] = 0
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[x.ndim - 3]
    y = conv(x, weight, bias, stride, padding, output_padding, groups, dilation)
    for dim, start, rows in crops:
        y = y.narrow(dim, start, rows)
    return y


def halo_pool(x, kernel_size, stride, padding, *rest, op, fetches, fill: float):
    """A max or average pooling (aten `op`, its arguments after x) of this rank's chunk: each dim of
    `fetches` fetched with the pooling's padding value (`fill`), then pooled unpadded on that dim."""
    padding = list(padding)  # one entry per spatial dim
    first = x.ndim - len(kernel_size)
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis, fill=fill)
        padding[dim - first] = 0
    return op(x, kernel_size, stride, padding, *rest)


def halo_pad(x, pad, *, mode: str, value, fetches):
    """F.pad of this rank's chunk: each dim of `fetches` fetched as the padding maps its rows (the
    constant where it adds one), then the other dims padded as the captured call pads them."""
    pad = list(pad)
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis, fill=0.0 if value is None else value)
        k = x.ndim - 1 - dim  # pad's pairs run from the last dim
        pad[2 * k] = pad[2 * k + 1] = 0
    return F.pad(x, pad, mode=mode, value=value) if any(pad) else x


def halo_resample(x, *, op, align_corners, out_size: tuple[int, ...], fetches, crops):
    """Nearest or linear upsampling (aten `op`) of this rank's chunk: each dim of `fetches` fetched
    (linear: with a neighbour row each side, copies of the edge row past the dim's ends), the
    fetched rows upsampled by the same power of two, and of each dim of `crops` (dim, scale, first
    row, rows) the rows of this rank's output chunk kept. `out_size`: the spatial dims' global sizes."""
    for dim, wants, sizes, axis in fetches:
        x = fetch_rows(x, dim=dim, wants=wants, sizes=sizes, axis=axis)
    first = x.ndim - len(out_size)
    size = list(out_size)
    for dim, scale, _, _ in crops:
        size[dim - first] = scale * x.shape[dim]
    y = op(x, size, None) if align_corners is None else op(x, size, align_corners, None)
    for dim, _, start, rows in crops:
        y = y.narrow(dim, start, rows)
    return y
