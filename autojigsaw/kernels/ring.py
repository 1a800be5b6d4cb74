"""Sequence layouts over one mesh axis, the ring shift, and the contiguous <-> zigzag relayout.

A layout says which global positions each rank holds, as runs `(global start, length)` in
local order: one run per rank for a contiguous chunk, two for zigzag (rank i holds pieces i
and 2n-1-i of `torch.chunk(S, 2n)`, which balances causal attention). Every decision here is
made on Python ints, so torch.compile sees no data-dependent branch; all traffic goes through
functional collectives, is counted by `count_comm` and fails as a CollectiveError.
"""

from __future__ import annotations

import torch

from ..mesh import MeshAxis
from ..placements import chunk_sizes
from .collectives import c10d, named_failure, record, waited
from .once import differentiable_once

Run = tuple[int, int]  # (global start, length)
Layout = tuple[tuple[Run, ...], ...]  # the runs of every rank on the axis

LAYOUTS = ("contiguous", "zigzag")


def zigzag_sizes(seq_len: int, n: int) -> tuple[int, ...]:
    """Local lengths of the zigzag layout of `seq_len` tokens over `n` ranks."""
    pieces = chunk_sizes(seq_len, 2 * n)
    return tuple(pieces[i] + pieces[2 * n - 1 - i] for i in range(n))


def _starts(sizes) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def contiguous_layout(sizes) -> Layout:
    """Rank i holds the i-th run of `sizes` (torch.chunk sizes, or any others)."""
    return tuple(((start, size),) for start, size in zip(_starts(sizes), sizes))


def zigzag_layout(seq_len: int, n: int) -> Layout:
    """Rank i holds pieces i and 2n-1-i of torch.chunk(seq_len, 2n), in that order."""
    pieces = chunk_sizes(seq_len, 2 * n)
    starts = _starts(pieces)
    return tuple(
        ((starts[i], pieces[i]), (starts[2 * n - 1 - i], pieces[2 * n - 1 - i])) for i in range(n)
    )


def make_layout(seq_sizes: tuple[int, ...], layout: str) -> Layout:
    """The layout named `layout` whose local lengths are `seq_sizes`."""
    if layout == "contiguous":
        return contiguous_layout(seq_sizes)
    if layout != "zigzag":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    seq_len, n = sum(seq_sizes), len(seq_sizes)
    if tuple(seq_sizes) != zigzag_sizes(seq_len, n):
        raise ValueError(
            f"seq_sizes {tuple(seq_sizes)} are not a zigzag layout of {seq_len} tokens over "
            f"{n} ranks; pass zigzag_sizes({seq_len}, {n}) = {zigzag_sizes(seq_len, n)}"
        )
    return zigzag_layout(seq_len, n)


# ---------------------------------------------------------------- the ring shift


def ring_shift(buf: torch.Tensor, *, axis: MeshAxis) -> torch.Tensor:
    """Start sending flat `buf` to the next rank; returns the pending block of the previous one.

    The result must go through `collectives.wait("send_recv", axis, ...)` before use; compute
    placed between the two overlaps with the transfer.
    """
    n, coord = axis.size, axis.coord
    assert buf.ndim == 1 and n > 1
    send, recv = [0] * n, [0] * n
    send[(coord + 1) % n] = recv[(coord - 1) % n] = buf.numel()
    record("send_recv", axis, buf)
    return named_failure("send_recv", axis, lambda: c10d.all_to_all_single(buf.contiguous(), recv, send, axis.group))


# ---------------------------------------------------------------- relayout (an all-to-all)


def _common(have: tuple[Run, ...], want: tuple[Run, ...]) -> list[tuple[int, int, int]]:
    """(offset in `have`, offset in `want`, length) of the positions in both, in `want` order."""
    common = []
    want_off = 0
    for w_start, w_len in want:
        have_off = 0
        for h_start, h_len in have:
            lo, hi = max(w_start, h_start), min(w_start + w_len, h_start + h_len)
            if lo < hi:
                common.append((have_off + lo - h_start, want_off + lo - w_start, hi - lo))
            have_off += h_len
        want_off += w_len
    return sorted(common, key=lambda c: c[1])


def _relayout(x, dim, src: Layout, dst: Layout, axis: MeshAxis):
    """This rank's piece of a sequence along `dim`, moved from layout `src` to layout `dst`."""
    n, coord = len(src), axis.coord
    rows = x.movedim(dim, 0)
    send = [_common(src[coord], dst[j]) for j in range(n)]
    recv = [_common(src[j], dst[coord]) for j in range(n)]
    parts = [rows.narrow(0, h, length) for seg in send for h, _, length in seg]
    buf = torch.cat(parts or [rows.narrow(0, 0, 0)]).contiguous()
    record("all_to_all", axis, buf)
    splits = [sum(c[2] for c in seg) for seg in recv], [sum(c[2] for c in seg) for seg in send]
    out = waited("all_to_all", axis, lambda: c10d.all_to_all_single(buf, *splits, axis.group))
    pieces, at = [], 0  # (offset in dst, received rows); received in sender order
    for seg in recv:
        for _, want, length in seg:
            pieces.append((want, out.narrow(0, at, length)))
            at += length
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces] or [out.narrow(0, 0, 0)]).movedim(0, dim)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, src, dst, axis):
        ctx.args = (dim, src, dst, axis)
        return _relayout(x, dim, src, dst, axis)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, src, dst, axis = ctx.args
        # A relayout permutes the global sequence: its adjoint is the inverse relayout.
        return _relayout(g, dim, dst, src, axis), None, None, None, None


def _check_local(x, dim, layout: Layout, coord, what):
    size = sum(length for _, length in layout[coord])
    if x.shape[dim] != size:
        raise ValueError(
            f"{what}: dim {dim} of x has {x.shape[dim]} tokens, but rank {coord} holds {size} "
            f"of this sequence in that layout; pass the local chunk along `dim`"
        )


def to_zigzag(x, *, dim: int, seq_len: int, axis: MeshAxis):
    """Contiguous Shard(dim) local chunk -> this rank's zigzag chunk (exact adjoint)."""
    src, dst = contiguous_layout(chunk_sizes(seq_len, axis.size)), zigzag_layout(seq_len, axis.size)
    dim = dim % x.ndim
    _check_local(x, dim, src, axis.coord, "to_zigzag")
    return _Relayout.apply(x, dim, src, dst, axis) if axis.size > 1 else x


def from_zigzag(x, *, dim: int, seq_len: int, axis: MeshAxis):
    """This rank's zigzag chunk -> the contiguous Shard(dim) local chunk (exact adjoint)."""
    src, dst = zigzag_layout(seq_len, axis.size), contiguous_layout(chunk_sizes(seq_len, axis.size))
    dim = dim % x.ndim
    _check_local(x, dim, src, axis.coord, "from_zigzag")
    return _Relayout.apply(x, dim, src, dst, axis) if axis.size > 1 else x
