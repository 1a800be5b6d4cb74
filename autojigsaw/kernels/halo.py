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

import functools
import itertools
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class FetchLayout:
    """Who sends which rows to whom, the same on every rank: one block of rows per rank shift.

    Rank r gets the rows it wants from rank (r + shift) % n in the block of that shift, padded to
    the block's rows on every rank, so that every rank runs the same collectives with buffers of the
    same shapes (a compiled step's graphs then differ by rank in constants only). Edge ranks send
    their blocks around the ring, unread.
    """

    pieces: tuple[tuple[tuple[int | None, int, int], ...], ...]  # per rank: fetch_pieces of its wants
    shifts: tuple[int, ...]  # (owner - receiver) % n of every piece that crosses ranks, ascending
    block: tuple[int, ...]  # rows of each shift's block

    @property
    def rows_sent(self) -> int:
        """Rows every rank sends (and receives) in one exchange, padding included."""
        return sum(self.block)


@functools.lru_cache(maxsize=256)
def fetch_layout(wants: tuple[Runs, ...], sizes: tuple[int, ...]) -> FetchLayout:
    """The blocks that move every rank's `wants` of a dim chunked as `sizes`."""
    n = len(sizes)
    pieces = tuple(tuple(fetch_pieces(w, sizes)) for w in wants)
    count: dict[int, list[int]] = {}
    for r, mine in enumerate(pieces):
        for owner, _, rows in mine:
            if owner is not None and owner != r:
                count.setdefault((owner - r) % n, [0] * n)[r] += rows
    shifts = tuple(sorted(count))
    return FetchLayout(pieces, shifts, tuple(max(count[s]) for s in shifts))


def _blocks(layout: FetchLayout, me: int, n: int, outgoing: bool) -> list[tuple[int, int, int]]:
    """(peer, shift, rows) of the blocks this rank sends (outgoing) or receives, in buffer order: by
    peer, then shift, as all_to_all_single lays them out on both sides."""
    out = [((me - s) % n if outgoing else (me + s) % n, s, rows) for s, rows in zip(layout.shifts, layout.block)]
    return sorted(out)


def _exchange(blocks: dict[int, torch.Tensor], layout: FetchLayout, axis: MeshAxis, forward: bool,
              row_shape) -> dict[int, torch.Tensor]:
    """One all-to-all of a block of rows per shift; forward: block s goes to rank (me - s) % n and
    comes from (me + s) % n; backward, the other way. Returns the received blocks by shift (none,
    without a collective, where no rank wants another's rows: the layout is the same on all)."""
    n, me = axis.size, axis.coord
    if not layout.shifts:
        return {}
    sends, recvs = _blocks(layout, me, n, forward), _blocks(layout, me, n, not forward)
    row = math.prod(row_shape)
    buf = torch.cat([blocks[s].reshape(-1) for _, s, _ in sends])
    send, recv = [0] * n, [0] * n
    for peer, _, rows in sends:
        send[peer] += rows * row
    for peer, _, rows in recvs:
        recv[peer] += rows * row
    record("send_recv", axis, buf)
    got = waited("send_recv", axis, lambda: c10d.all_to_all_single(buf.contiguous(), recv, send, axis.group))
    out, at = {}, 0
    for _, s, rows in recvs:
        out[s] = got.narrow(0, at, rows * row).view(rows, *row_shape)
        at += rows * row
    return out


def _padded(parts: list[torch.Tensor], rows: int, like: torch.Tensor) -> torch.Tensor:
    """`parts` stacked, then padding rows (never read) up to `rows`.

    The padding repeats `like`'s first row rather than being zeros: a block that is all padding on
    one rank must still depend on the step's data there, or a compiled backward moves its
    collective into the forward on that rank only, out of step with the others (zeros, even
    0 x a row, are folded into a constant).
    """
    have = sum(p.shape[0] for p in parts)
    if have == rows:
        return torch.cat(parts)
    return torch.cat(parts + [like.narrow(0, 0, 1).expand(rows - have, *like.shape[1:])])


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, wants, sizes, axis, fill):
        layout = fetch_layout(wants, sizes)
        ctx.args = (dim, layout, axis, x.shape)
        rows, n, me = x.movedim(dim, 0), axis.size, axis.coord
        # block s: the rows that rank (me - s) % n wants from me, in its order
        outgoing = {s: _padded([rows.narrow(0, first, k) for owner, first, k in layout.pieces[(me - s) % n]
                                if owner == me], b, rows) for s, b in zip(layout.shifts, layout.block)}
        got = _exchange(outgoing, layout, axis, True, rows.shape[1:])
        at = dict.fromkeys(layout.shifts, 0)
        out = []
        for owner, first, k in layout.pieces[me]:
            if owner is None:
                out.append(rows.new_full((k, *rows.shape[1:]), fill))
            elif owner == me:
                out.append(rows.narrow(0, first, k))
            else:
                s = (owner - me) % n
                out.append(got[s].narrow(0, at[s], k))
                at[s] += k
        # contiguous: the op after it may be one whose compiled backward assumes so
        return torch.cat(out).movedim(0, dim).contiguous()

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, layout, axis, shape = ctx.args
        grads, n, me = g.movedim(dim, 0), axis.size, axis.coord
        # the gradient of each fetched row goes back to its owner, in the block it came in
        back: dict[int, list[torch.Tensor]] = {s: [] for s in layout.shifts}
        dx = grads.new_zeros((shape[dim], *grads.shape[1:]))
        at = 0
        for owner, first, k in layout.pieces[me]:
            if owner == me:
                dx[first:first + k] += grads[at:at + k]
            elif owner is not None:
                back[(owner - me) % n].append(grads[at:at + k])
            at += k
        got = _exchange({s: _padded(back[s], b, grads) for s, b in zip(layout.shifts, layout.block)}, layout, axis,
                        False, grads.shape[1:])
        for s in layout.shifts:
            at = 0
            for owner, first, k in layout.pieces[(me - s) % n]:
                if owner == me:
                    dx[first:first + k] += got[s][at:at + k]
                    at += k
        return dx.movedim(0, dim).contiguous(), None, None, None, None, None


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
        padding[dim - 2] = 0
    for dim, start, rows in crops:
        # rows past the last one the fetched rows reach (the call's output padding, or rows no
        # input reaches where the kernel is narrower than the stride) get the bias alone
        reach = (x.shape[dim] - 1) * stride[dim - 2] + dilation[dim - 2] * (weight.shape[dim] - 1) + 1
        output_padding[dim - 2] = max(start + rows - reach, 0)
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
