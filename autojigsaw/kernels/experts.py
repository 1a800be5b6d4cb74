"""Expert parallelism with replicated tokens: each rank multiplies the rows of its own experts, the
output is all-gathered from those row ranges.

X [S, K] holds the routed rows sorted by expert and offs [E] the cumulative row counts (every rank
has both), so a contiguous block of experts owns one contiguous row range, known on every rank:
the gather is a variable-size all-gather (all_to_all_single with the ranges as splits, one host
read of offs, as transformers' grouped_mm_fallback does). Each rank sends (n - 1) x its rows,
where summing zero-padded outputs would all-reduce the whole output.

Gradients follow collectives.py's convention for the Replicate output and X: with the full output
gradient on every rank ("R"), a rank's expert weights need only its own range of it and X's
gradient is all-gathered by ranges; with a contribution ("P"), the output gradient's ranges are
first summed over the ranks and X's gradient stays a contribution, zero outside the rank's range.
Forward and backward are custom ops of static output shapes, so torch.compile traces one call.
"""

from __future__ import annotations

import torch

from ..dtypes import reduce_dtype
from ..ir import GradKind
from ..mesh import MeshAxis
from . import collectives as C
from .collectives import c10d


def row_ranges(offs: torch.Tensor, experts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) of the rows of each rank's block of experts (`experts`: experts per rank)."""
    bounds = [0, *offs.tolist()]
    out, first = [], 0
    for e in experts:
        out.append((bounds[first], bounds[first + e]))
        first += e
    return tuple(out)


def _exchange(kind: str, send: torch.Tensor, send_rows: list[int], recv_rows: list[int], axis: MeshAxis):
    """all_to_all_single of rows: send_rows[q] rows of `send` to rank q, recv_rows[q] rows from it.

    Every rank calls it or none: callers skip it only when no rank has any row.
    """
    return C.waited(kind, axis, lambda: c10d.all_to_all_single(send.contiguous(), recv_rows, send_rows, axis.group))


def _gather_rows(y: torch.Tensor, ranges, total: int, axis: MeshAxis) -> torch.Tensor:
    """[total, ...]: every rank's rows placed in its range, zero past the last range."""
    n, c = axis.size, axis.coord
    lengths = [stop - start for start, stop in ranges]
    C.record("all_gather", axis, y)
    if sum(lengths) > 0:
        recv = _exchange("all_gather", y.repeat(n - 1, *[1] * (y.ndim - 1)),
                         [0 if q == c else lengths[c] for q in range(n)],
                         [0 if q == c else lengths[q] for q in range(n)], axis)
    else:
        recv = y.new_empty((0, *y.shape[1:]))
    pieces = list(recv.split([0 if q == c else lengths[q] for q in range(n)]))
    pieces[c] = y
    out = y.new_zeros((total, *y.shape[1:]))
    out[:ranges[-1][1]] = torch.cat(pieces)
    return out


def _sum_own_range(g: torch.Tensor, ranges, axis: MeshAxis) -> torch.Tensor:
    """Sum over the axis of this rank's range of every rank's `g` (each sends the others theirs)."""
    n, c = axis.size, axis.coord
    lengths = [stop - start for start, stop in ranges]
    dtype, g = g.dtype, g.to(reduce_dtype(g.dtype, "sum"))
    own = g[ranges[c][0]:ranges[c][1]]
    send = torch.cat([g[start:stop] for q, (start, stop) in enumerate(ranges) if q != c])
    C.record("send_recv", axis, send)
    if sum(lengths) > 0:
        recv = _exchange("reduce_scatter", send, [0 if q == c else lengths[q] for q in range(n)],
                         [0 if q == c else lengths[c] for q in range(n)], axis)
        own = own + recv.view(n - 1, *own.shape).sum(0)
    return own.to(dtype)


def _resolve(op: str):
    """The OpOverload named `op` ("transformers.grouped_mm_fallback.default")."""
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _local(offs, experts, axis: MeshAxis):
    """(every rank's row range, this rank's range, its experts' offsets within it)."""
    ranges = row_ranges(offs, experts)
    first = sum(experts[:axis.coord])
    start, stop = ranges[axis.coord]
    return ranges, (start, stop), offs[first:first + experts[axis.coord]] - start


# Custom ops: their outputs have static shapes while the row ranges inside are read from offs, so
# torch.compile (fullgraph) sees one opaque call instead of a data-dependent one.
@torch.library.custom_op("autojigsaw::expert_gather_mm", mutates_args=())
def _forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, op: str, experts: list[int],
             name: str, size: int, group: str | None, coord: int, grad: str) -> torch.Tensor:
    axis = MeshAxis(name, size, group, coord)
    ranges, (start, stop), local_offs = _local(offs, experts, axis)
    return _gather_rows(_resolve(op)(x[start:stop], w, local_offs), ranges, x.shape[0], axis)


@_forward.register_fake
def _(x, w, offs, op, experts, name, size, group, coord, grad):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("autojigsaw::expert_gather_mm_backward", mutates_args=())
def _backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, op: str, experts: list[int],
              name: str, size: int, group: str | None, coord: int, grad: str) -> tuple[torch.Tensor, torch.Tensor]:
    axis = MeshAxis(name, size, group, coord)
    ranges, (start, stop), local_offs = _local(offs, experts, axis)
    g_own = g[start:stop] if grad == GradKind.R else _sum_own_range(g, ranges, axis)
    x_own = x[start:stop]
    dx_own = _resolve(op)(g_own, w.transpose(1, 2), local_offs)  # the same grouped matmul, transposed experts
    dw = torch.zeros_like(w)
    bounds = [0, *local_offs.tolist()]
    for e in range(w.shape[0]):
        torch.mm(x_own[bounds[e]:bounds[e + 1]].t(), g_own[bounds[e]:bounds[e + 1]], out=dw[e])
    if grad == GradKind.R:
        return _gather_rows(dx_own.contiguous(), ranges, x.shape[0], axis), dw
    dx = torch.zeros_like(x)
    dx[start:stop] = dx_own
    return dx, dw


@_backward.register_fake
def _(g, x, w, offs, op, experts, name, size, group, coord, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _save(ctx, inputs, output):
    x, w, offs, *args = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.args = args


def _grad(ctx, g):
    x, w, offs = ctx.saved_tensors
    dx, dw = _backward(g.contiguous(), x, w, offs, *ctx.args)
    return dx, dw, *[None] * (2 + len(ctx.args))


_forward.register_autograd(_grad, setup_context=_save)


def expert_gather_mm(op, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, experts: tuple[int, ...],
                     axis: MeshAxis, grad: GradKind = GradKind.R) -> torch.Tensor:
    """op(x, all experts' w, offs), Replicate, from this rank's experts `w` (rank q holds experts[q]).

    `op` is the grouped matmul (X [S, K], W [E, K, N], offs [E]), an OpOverload; x and offs are
    the whole (replicated) ones, w the rank's contiguous block of experts.
    """
    if len(experts) != axis.size or experts[axis.coord] != w.shape[0] or sum(experts) != offs.shape[0]:
        raise ValueError(
            f"expert_gather_mm: experts={tuple(experts)} over mesh axis {axis.name!r} ({axis.size} ranks) "
            f"must give each rank's expert count, this rank's equal to its weight's {w.shape[0]} and summing "
            f"to offs' {offs.shape[0]}; pass chunk_sizes(num_experts, {axis.size})")
    if grad not in tuple(GradKind):
        raise ValueError(f"expert_gather_mm: grad={grad!r} on axis {axis.name!r}; use 'R' or 'P'")
    return _forward(x, w, offs, str(op), list(experts), axis.name, axis.size, axis.group, axis.coord, str(grad))
