"""Bucketed collectives: several values moved on one mesh axis in one call on a flat buffer.

Each computes exactly what the single collectives of kernels/collectives.py compute, member by
member (the same padding, the same sums per element, the same gradient convention), but pays
one latency for all: the members are flattened into one buffer, moved once, and split again.
The rewrite pass rewrite/bucket.py makes them; a bucket holds one dtype.
"""

from __future__ import annotations

import torch

from ..dtypes import reduce_dtype
from ..ir import GradKind
from ..mesh import MeshAxis
from .collectives import c10d, gather_chunk, pad_dim, raw_all_reduce, record, unpad_chunks, waited
from .once import differentiable_once


def _flat(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces])


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, start = [], 0
    for shape in shapes:
        numel = shape.numel()
        out.append(flat.narrow(-1, start, numel))
        start += numel
    return [piece.reshape(*flat.shape[:-1], *shape) for piece, shape in zip(out, shapes)]


def _scatter_piece(g: torch.Tensor, dim: int, sizes) -> torch.Tensor:
    """A member's gradient laid out for a reduce-scatter: one padded chunk per rank, on dim 0."""
    chunk = max(sizes)
    pieces = torch.split(g, list(sizes), dim)
    padded = torch.cat([pad_dim(p, dim, chunk) for p in pieces], dim).movedim(dim, 0)
    return padded.reshape(len(sizes), -1)


class _BucketAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dims, sizes, axis, grad, *xs):
        n = axis.size
        chunks = [gather_chunk(x, d, s) for x, d, s in zip(xs, dims, sizes)]
        flat = _flat(chunks)
        record("all_gather", axis, flat)
        y = waited("all_gather", axis, lambda: c10d.all_gather_into_tensor(flat, n, axis.group)).view(n, -1)
        ctx.args = (dims, sizes, axis, grad, [c.shape for c in chunks], [x.dtype for x in xs])
        pieces = _split(y, [c.shape for c in chunks])
        return tuple(unpad_chunks(piece.flatten(0, 1), d, s) for piece, d, s in zip(pieces, dims, sizes))

    @staticmethod
    @differentiable_once
    def backward(ctx, *gs):
        dims, sizes, axis, grad, shapes, dtypes = ctx.args
        c = axis.coord
        if grad == GradKind.R:
            gx = [None if g is None else g.narrow(d, sum(s[:c]), s[c]) for g, d, s in zip(gs, dims, sizes)]
        else:
            gx = _reduce_scatter_grads(gs, dims, sizes, axis, shapes, dtypes)
        return (None,) * 4 + tuple(gx)


def _reduce_scatter_grads(gs, dims, sizes, axis: MeshAxis, shapes, dtypes):
    """The sum over ranks of each member's full gradient, this rank's chunk of it: one reduce-scatter."""
    n, coord = axis.size, axis.coord
    wire = reduce_dtype(dtypes[0])
    like = next(g for g in gs if g is not None)
    pieces = [like.new_zeros(n, shape.numel(), dtype=wire) if g is None else _scatter_piece(g.to(wire), d, s)
              for g, d, s, shape in zip(gs, dims, sizes, shapes)]
    flat = torch.cat(pieces, 1).reshape(-1)
    record("reduce_scatter", axis, flat)
    y = waited("reduce_scatter", axis, lambda: c10d.reduce_scatter_tensor(flat, "sum", n, axis.group))
    return [piece.movedim(0, d).narrow(d, 0, s[coord]).to(dt).contiguous()
            for piece, d, s, dt in zip(_split(y, shapes), dims, sizes, dtypes)]


class _BucketGradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, axis, *xs):
        ctx.args = (axis, [x.shape for x in xs])
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @differentiable_once
    def backward(ctx, *gs):
        axis, shapes = ctx.args
        like = next(g for g in gs if g is not None)
        gs = [g if g is not None else like.new_zeros(shape) for g, shape in zip(gs, shapes)]
        summed = raw_all_reduce(_flat(gs), "sum", axis)
        return (None,) + tuple(_split(summed, shapes))


def bucket_all_gather(*xs, dims: tuple[int, ...], sizes: tuple[tuple[int, ...], ...], axis: MeshAxis, grad: GradKind):
    """all_gather of every x (Shard(dims[i]) -> Replicate, chunks sizes[i]) in one call; a tuple."""
    return _BucketAllGather.apply(dims, sizes, axis, grad, *xs)


def bucket_grad_all_reduce(*xs, axis: MeshAxis):
    """grad_all_reduce of every x in one call: identity forward, one all-reduce of all gradients backward."""
    return _BucketGradAllReduce.apply(axis, *xs)
