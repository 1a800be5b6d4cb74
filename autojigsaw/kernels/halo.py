"""Halo exchange: a stencil on a spatially sharded tensor, with its neighbours' edge rows.

A 3x3 convolution at the edge of a rank's chunk of rows needs the row beyond it, which the
next rank holds. `halo_exchange` extends this rank's chunk along one dim with the last `before`
rows of the rank before it and the first `after` rows of the rank after (zeros past the global
edges: a zero-padded stencil), in one all-to-all; its adjoint sends the halos' gradients back
and adds them to the rows they came from. Sharding each spatial dim over its own mesh axis and
extending the dims one after another also fills the corners (the second exchange sends rows
that already hold the first one's halo). `halo_conv` is a convolution of the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mesh import MeshAxis
from .collectives import record, waited
from .once import differentiable_once

c10d = torch.ops._c10d_functional


def _swap(back: torch.Tensor, forward: torch.Tensor, axis: MeshAxis, from_prev: int, from_next: int):
    """Send flat `back` to the previous rank and flat `forward` to the next; receive `from_prev` and
    `from_next` elements (zeros where there is no such rank). Returns (from previous, from next)."""
    n, coord = axis.size, axis.coord
    send, recv = [0] * n, [0] * n
    if coord > 0:
        send[coord - 1], recv[coord - 1] = back.numel(), from_prev
    if coord < n - 1:
        send[coord + 1], recv[coord + 1] = forward.numel(), from_next
    buf = torch.cat(([back] if coord > 0 else []) + ([forward] if coord < n - 1 else []))
    record("send_recv", axis, buf)
    got = waited("send_recv", axis, lambda: c10d.all_to_all_single(buf.contiguous(), recv, send, axis.group))
    prev = got[:from_prev] if coord > 0 else got.new_zeros(from_prev)
    nxt = got[got.numel() - from_next:] if coord < n - 1 else got.new_zeros(from_next)
    return prev, nxt


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, before, after, axis):
        ctx.args = (dim, before, after, axis)
        rows = x.movedim(dim, 0)
        row = rows.shape[1:]
        # the previous rank's halo after is my first rows; the next rank's halo before, my last
        prev, nxt = _swap(rows[:after].reshape(-1), rows[rows.shape[0] - before:].reshape(-1), axis,
                          before * row.numel(), after * row.numel())
        return torch.cat([prev.view(before, *row), rows, nxt.view(after, *row)]).movedim(0, dim)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, before, after, axis = ctx.args
        rows = g.movedim(dim, 0)
        row = rows.shape[1:]
        inner = rows[before:rows.shape[0] - after].clone()
        # each halo's gradient goes back to the rank its rows came from, and is added there
        from_prev, from_next = _swap(rows[:before].reshape(-1), rows[rows.shape[0] - after:].reshape(-1), axis,
                                     after * row.numel(), before * row.numel())
        inner[:after] += from_prev.view(after, *row)
        inner[inner.shape[0] - before:] += from_next.view(before, *row)
        return inner.movedim(0, dim), None, None, None, None


def halo_exchange(x: torch.Tensor, *, dim: int, before: int, after: int, axis: MeshAxis) -> torch.Tensor:
    """x extended along `dim` by `before` rows of the previous rank on `axis` and `after` of the next
    (zeros past the edges)."""
    if before + after == 0 or axis.size == 1:
        return x
    if x.shape[dim] < max(before, after):
        raise ValueError(f"halo_exchange: this rank holds {x.shape[dim]} rows of dim {dim} on mesh axis "
                         f"{axis.name!r}, fewer than the halo of {max(before, after)} its neighbours need; shard "
                         "that dim over fewer ranks or plan again")
    return _HaloExchange.apply(x, dim, before, after, axis)


def halo_conv(x, weight, bias=None, *, stride, padding, dilation, groups: int,
              halos: tuple[tuple[int, int, int, MeshAxis], ...]) -> torch.Tensor:
    """A convolution of this rank's chunk: each dim of `halos` (tensor dim, rows before, rows after,
    its mesh axis) extended from the neighbours, then convolved without padding on that dim."""
    padding = list(padding)
    for dim, before, after, axis in halos:
        x = halo_exchange(x, dim=dim, before=before, after=after, axis=axis)
        padding[dim - 2] = 0
    conv = (F.conv1d, F.conv2d, F.conv3d)[x.ndim - 3]
    return conv(x, weight, bias, stride, padding, dilation, groups)
