"""What the rules of ops that read other ranks' rows share: which rows each rank fetches, the bytes
that moves, and the time it takes (kernels/halo.py runs it).

A node's spatial dim d, sharded over one mesh axis, is described by a `RowMap`: for the chunk
sizes of its output rows, every rank's wanted input rows (`Runs`, global indices; outside the
dim: the op's padding). A window op (convolution, pooling) reads a window per output row; a
padding reads one mapped row per output row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.distributed.tensor import Shard

from ...ir import GLOBAL, PLACEMENTS
from ...kernels.halo import Runs, fetch_layout, row_starts
from ...placements import chunk_sizes, local_offset, local_shape

RowMap = Callable[[tuple[int, ...]], tuple[Runs, ...]]  # output chunk sizes -> every rank's wanted rows


def windows(stride: int, padding: int, reach: int) -> RowMap:
    """Output row i reads input rows stride x i - padding ... + reach (a convolution, a pooling)."""
    return lambda out_sizes: tuple(((stride * o - padding, stride * (n - 1) + reach + 1),) if n else ()
                                   for o, n in zip(row_starts(out_sizes), out_sizes))


def scattered(stride: int, padding: int, reach: int) -> RowMap:
    """Input row j reaches output rows stride x j - padding ... + reach (a transposed convolution): the
    input rows that reach each rank's output rows. Where the kernel is narrower than the stride, some
    output rows are reached by none (bias only): the first row fetched then scatters from no later
    than the chunk's first row, and at least one row is fetched."""
    def runs(out_sizes):
        out = []
        for o, n in zip(row_starts(out_sizes), out_sizes):
            first = min(-((reach - o - padding) // stride), (o + padding) // stride)  # ceil, floor
            last = max((o + n - 1 + padding) // stride, first)
            out.append(((first, last - first + 1),) if n else ())
        return tuple(out)

    return runs


def spans(first: Callable[[int], int], end: Callable[[int], int]) -> RowMap:
    """Output row i reads input rows first(i) ... end(i) - 1, both non-decreasing in i (adaptive
    pooling's windows, of varying size; linear resampling to any size)."""
    return lambda out_sizes: tuple(((first(o), end(o + n - 1) - first(o)),) if n else ()
                                   for o, n in zip(row_starts(out_sizes), out_sizes))


def mapped(source: Callable[[int], int]) -> RowMap:
    """Output row j reads input row source(j) (negative: the op's constant), as runs of consecutive rows."""
    def runs(out_sizes):
        out, start = [], 0
        for n in out_sizes:
            mine: list[list[int]] = []
            for i in map(source, range(start, start + n)):
                if mine and i == mine[-1][0] + mine[-1][1] and (i >= 0) == (mine[-1][0] >= 0):
                    mine[-1][1] += 1
                else:
                    mine.append([i, 1])
            out.append(tuple((a, b) for a, b in mine))
            start += n
        return tuple(out)

    return runs


def one_axis_each(placements, dims) -> bool:
    """Is every one of `dims` sharded over one mesh axis at most (a fetch runs over one axis)?"""
    return all(placements.count(Shard(d)) <= 1 for d in dims)


def fetches(x_shape, y_shape, placements, maps: dict[int, RowMap], mesh_sizes):
    """(tensor dim, mesh axis, every rank's wanted rows, input chunk sizes) of each mapped dim the
    placements shard, in the order they are fetched."""
    out = []
    for a, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim in maps and mesh_sizes[a] > 1:
            n = mesh_sizes[a]
            out.append((p.dim, a, maps[p.dim](chunk_sizes(y_shape[p.dim], n)), chunk_sizes(x_shape[p.dim], n)))
    return out


def kernel_fetches(found, rank) -> tuple:
    """The found dims of `fetches` as the halo kernels take them: (tensor dim, every rank's wanted
    rows, input chunk sizes, this rank's mesh axis)."""
    return tuple((d, wants, sizes, rank.axis(a)) for d, a, wants, sizes in found)


def computed_rows(kind: str, found, x_shape, y_shape, out_placements, rank, scales: dict[int, float]) -> tuple:
    """kernels/resize.halo_resize's `rows` for the found dims of `fetches`: (dim, `kind`, this rank's
    first fetched row, first output row, output rows, input size, output size, the dim's scale)."""
    offset = local_offset(y_shape, out_placements, rank.mesh.sizes, rank.coord)
    mine = local_shape(y_shape, out_placements, rank.mesh.sizes, rank.coord)
    return tuple((d, kind, wants[rank.coord[a]][0][0], offset[d], mine[d], x_shape[d], y_shape[d], scales.get(d))
                 for d, a, wants, _ in found)


def nonempty(x_shape, y_shape, maps, mesh_sizes, placements) -> bool:
    """Does every rank hold input and output rows of each fetched dim?"""
    return all(min(chunk_sizes(x_shape[d], mesh_sizes[a])) > 0 and min(chunk_sizes(y_shape[d], mesh_sizes[a])) > 0
               for d, a, _, _ in fetches(x_shape, y_shape, placements, maps, mesh_sizes))


def fetch_bytes(shape, itemsize: int, steps, coords) -> tuple[list[int], list[int]]:
    """(bytes every rank sends in each step's exchange, none where no rank wants another's rows;
    this rank's fetched shape): steps of (dim, wants, sizes), coords this rank's on each step's axis."""
    shape, sent = list(shape), []
    for (d, wants, sizes), c in zip(steps, coords):
        layout = fetch_layout(wants, sizes)
        if layout.shifts:
            sent.append(math.prod(shape) // max(shape[d], 1) * itemsize * layout.rows_sent)
        shape[d] = sum(n for _, n in wants[c])
    return sent, shape


def traffic(node, rank, backward) -> list[tuple[str, int]]:
    """A rewritten fetching node's bytes: one all-to-all per fetched dim, and again for the rows'
    gradients when its input takes one."""
    x = node.args[0]
    val = x.meta[GLOBAL]
    shape = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)
    steps = [(d, wants, sizes) for d, wants, sizes, _ in node.kwargs["fetches"]]
    coords = [axis.coord for *_, axis in node.kwargs["fetches"]]
    sent = fetch_bytes(shape, val.dtype.itemsize, steps, coords)[0]
    return [("send_recv", b) for b in sent * (2 if x in backward else 1)]


def fetch_time(x, placements, y_shape, maps, ctx, backward: bool) -> tuple[float, list[int]]:
    """Seconds of the fetches (twice with the gradients' when `backward`), and the largest fetched
    local shape."""
    sizes = ctx.mesh.sizes
    found = fetches(tuple(x.shape), tuple(y_shape), placements, maps, sizes)
    shape = list(local_shape(x.shape, placements, sizes, ctx.coord0))
    t = 0.0
    for d, a, wants, chunks in found:
        layout = fetch_layout(wants, chunks)
        if layout.shifts:
            row = math.prod(shape) // max(shape[d], 1) * x.dtype.itemsize
            t += ctx.collective_time("send_recv", layout.rows_sent * row, a) * (2 if backward else 1)
        shape[d] = max(sum(n for _, n in w) for w in wants)
    return t, shape
