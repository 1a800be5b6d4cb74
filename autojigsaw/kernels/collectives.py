"""Autograd-aware collectives over one mesh axis, for local shards of DTensor-placed values.

Every function moves a local shard from one placement to another on one mesh axis and
knows its exact adjoint. Gradients follow one convention (see rewrite/grad_kinds.py):
the gradient of a Shard value is sharded the same way, of a Partial value it is the full
gradient on every rank, and of a Replicate value it is either the full gradient on every
rank (grad="R") or a contribution that sums to it over the axis (grad="P"). Functions
whose backward depends on that choice take `grad`.

Uneven shards (torch.chunk sizes, given as `sizes`) are padded to the largest chunk before
communicating and trimmed after. All traffic goes through functional collectives, so
torch.compile traces them without graph breaks; every call is counted by `count_comm`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..dtypes import reduce_dtype
from ..ir import GradKind, bytes_sent

c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------- traffic accounting


@dataclass
class CommLog:
    """Collectives one rank ran while counting: (kind, axis, bytes sent), in call order."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, _, b in self.calls)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for k, _, _ in self.calls if kind is None or k == kind)


_ACTIVE_LOGS: list[CommLog] = []


@contextlib.contextmanager
def count_comm():
    """Record every collective this process runs inside the block (eager mode only)."""
    log = CommLog()
    _ACTIVE_LOGS.append(log)
    try:
        yield log
    finally:
        _ACTIVE_LOGS.remove(log)


def record(kind: str, axis: str, tensor: torch.Tensor, n: int) -> None:
    if _ACTIVE_LOGS and not torch.compiler.is_compiling():
        sent = bytes_sent(kind, tensor.numel() * tensor.element_size(), n)
        for log in _ACTIVE_LOGS:
            log.calls.append((kind, axis, sent))


# ---------------------------------------------------------------- raw (non-autograd) ops


class CollectiveError(RuntimeError):
    """A collective that failed (a peer rank died, stalled past the timeout, or disagreed).

    Says which collective, on which mesh axis and process group; the backend's error is its
    cause. ParallelModule adds the graph node it served.
    """

    def __init__(self, message: str, kind: str = "", axis: str = ""):
        super().__init__(message)
        self.kind, self.axis = kind, axis


def _waited(kind: str, axis: str, n: int, group, start):
    """The result of `start()`, a functional collective, waited for; a failure named (eager only)."""
    if torch.compiler.is_compiling():
        return c10d.wait_tensor(start())
    try:
        return c10d.wait_tensor(start())
    except RuntimeError as e:
        raise CollectiveError(
            f"{kind} over mesh axis {axis!r} ({n} ranks, process group {group}) failed: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. A peer rank died, stalled past the "
            "process group's timeout, or runs another plan; see the other ranks' errors", kind, axis) from e


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - dim - 1) + [0, extra]
    return F.pad(x, pad)


def raw_all_gather(x, dim, sizes, axis, group):
    n = len(sizes)
    chunk = max(sizes)
    x = pad_dim(x, dim, chunk).movedim(dim, 0).contiguous()
    record("all_gather", axis, x, n)
    y = _waited("all_gather", axis, n, group, lambda: c10d.all_gather_into_tensor(x, n, group))
    y = y.movedim(0, dim)  # all chunks, each padded to `chunk`
    if all(s == chunk for s in sizes):
        return y.contiguous()
    return torch.cat([y.narrow(dim, i * chunk, s) for i, s in enumerate(sizes)], dim)


def _raw_reduce_scatter(x, dim, sizes, coord, op, axis, group):
    n = len(sizes)
    chunk = max(sizes)
    dtype, x = x.dtype, x.to(reduce_dtype(x.dtype, op))
    if any(s != chunk for s in sizes):
        pieces = torch.split(x, list(sizes), dim)
        x = torch.cat([pad_dim(p, dim, chunk) for p in pieces], dim)
    x = x.movedim(dim, 0).contiguous()
    record("reduce_scatter", axis, x, n)
    y = _waited("reduce_scatter", axis, n, group, lambda: c10d.reduce_scatter_tensor(x, _wire_op(op), n, group))
    if op == "avg":
        y = y / n
    return y.movedim(0, dim).narrow(dim, 0, sizes[coord]).to(dtype).contiguous()


def raw_all_reduce(x, op, n, axis, group):
    dtype, x = x.dtype, x.to(reduce_dtype(x.dtype, op)).contiguous()
    record("all_reduce", axis, x, n)
    y = _waited("all_reduce", axis, n, group, lambda: c10d.all_reduce(x, _wire_op(op), group))
    return (y / n if op == "avg" else y).to(dtype)


def _raw_all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group):
    """Local S(src_dim) shard -> local S(dst_dim) shard on the same axis."""
    n = len(src_sizes)
    src_chunk, dst_chunk = max(src_sizes), max(dst_sizes)
    send = [
        pad_dim(pad_dim(piece, dst_dim, dst_chunk), src_dim, src_chunk)
        for piece in torch.split(x, list(dst_sizes), dst_dim)
    ]
    buf = torch.stack(send).contiguous()
    record("all_to_all", axis, buf, n)
    recv = _waited("all_to_all", axis, n, group, lambda: c10d.all_to_all_single(buf, [1] * n, [1] * n, group))
    pieces = [
        recv[i].narrow(src_dim, 0, src_sizes[i]).narrow(dst_dim, 0, dst_sizes[coord])
        for i in range(n)
    ]
    return torch.cat(pieces, src_dim)


def _wire_op(op: str) -> str:
    # gloo has no AVG: average as a sum scaled afterwards (callers divide).
    return "sum" if op == "avg" else op


def _offset(sizes, coord) -> int:
    return sum(sizes[:coord])


# ---------------------------------------------------------------- autograd functions


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, coord, axis, group, grad):
        ctx.args = (dim, sizes, coord, axis, group, grad)
        return raw_all_gather(x, dim, sizes, axis, group)

    @staticmethod
    def backward(ctx, g):
        dim, sizes, coord, axis, group, grad = ctx.args
        if grad == GradKind.R:
            gx = g.narrow(dim, _offset(sizes, coord), sizes[coord])
        else:
            gx = _raw_reduce_scatter(g, dim, sizes, coord, "sum", axis, group)
        return gx, None, None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, coord, op, axis, group):
        ctx.args = (dim, sizes, axis, group, op)
        return _raw_reduce_scatter(x, dim, sizes, coord, op, axis, group)

    @staticmethod
    def backward(ctx, g):
        dim, sizes, axis, group, op = ctx.args
        gx = raw_all_gather(g.contiguous(), dim, sizes, axis, group)
        if op == "avg":
            gx = gx / len(sizes)
        return gx, None, None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, n, axis, group, grad):
        ctx.args = (op, n, axis, group, grad)
        y = raw_all_reduce(x, op, n, axis, group)
        if op in ("max", "min"):
            ctx.save_for_backward(x == y)
        return y

    @staticmethod
    def backward(ctx, g):
        op, n, axis, group, grad = ctx.args
        if grad == GradKind.P:
            g = raw_all_reduce(g, "sum", n, axis, group)
        if op == "avg":
            g = g / n
        elif op in ("max", "min"):
            (winner,) = ctx.saved_tensors
            g = g * winner
        return g, None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group):
        ctx.args = (src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group)
        return _raw_all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group)

    @staticmethod
    def backward(ctx, g):
        src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group = ctx.args
        gx = _raw_all_to_all(g, dst_dim, src_dim, dst_sizes, src_sizes, coord, axis, group)
        return gx, None, None, None, None, None, None, None


class _ShardSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, coord, axis, group, grad):
        ctx.args = (dim, sizes, coord, axis, group, grad, x.shape[dim])
        # A copy, not a view: local ops such as view() expect the layout of a fresh shard.
        return x.narrow(dim, _offset(sizes, coord), sizes[coord]).contiguous()

    @staticmethod
    def backward(ctx, g):
        dim, sizes, coord, axis, group, grad, full = ctx.args
        if grad == GradKind.R:
            gx = raw_all_gather(g.contiguous(), dim, sizes, axis, group)
        else:  # a zero-padded contribution: the sum over the axis is the full gradient
            gx = g.new_zeros(g.shape[:dim] + (full,) + g.shape[dim + 1:])
            gx.narrow(dim, _offset(sizes, coord), sizes[coord]).copy_(g)
        return gx, None, None, None, None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, coord, n, grad):
        ctx.args = (op, coord, n, grad)
        if op == "sum" and coord != 0:
            return torch.zeros_like(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        # Every rank holds the full gradient of the Partial value (g / n for an average).
        op, coord, n, grad = ctx.args
        if op == "avg":
            g = g * n
        if grad == GradKind.P and coord != 0:
            g = torch.zeros_like(g)
        return g, None, None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, axis, group):
        ctx.args = (n, axis, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        n, axis, group = ctx.args
        return raw_all_reduce(g, "sum", n, axis, group), None, None, None


class _GradMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coord):
        ctx.coord = coord
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.coord == 0 else torch.zeros_like(g)), None


# ---------------------------------------------------------------- the public functions
# Each moves a local shard over the mesh axis `axis` (its process group `group`, its size
# `len(sizes)` or `n`, this rank's position `coord`). They appear by name in gm.code.


def all_gather(x, *, dim: int, sizes: tuple[int, ...], coord: int, axis: str, group: str, grad: GradKind):
    """Shard(dim) -> Replicate: concatenate the chunks of every rank."""
    return _AllGather.apply(x, dim, sizes, coord, axis, group, grad)


def reduce_scatter(x, *, dim: int, sizes: tuple[int, ...], coord: int, op: str, axis: str, group: str):
    """Partial(op) -> Shard(dim): reduce over ranks, keep this rank's chunk."""
    return _ReduceScatter.apply(x, dim, sizes, coord, op, axis, group)


def all_reduce(x, *, op: str, n: int, axis: str, group: str, grad: GradKind):
    """Partial(op) -> Replicate."""
    return _AllReduce.apply(x, op, n, axis, group, grad)


def all_to_all(x, *, src_dim: int, dst_dim: int, src_sizes: tuple[int, ...],
               dst_sizes: tuple[int, ...], coord: int, axis: str, group: str):
    """Shard(src_dim) -> Shard(dst_dim) on the same axis."""
    return _AllToAll.apply(x, src_dim, dst_dim, src_sizes, dst_sizes, coord, axis, group)


def shard_slice(x, *, dim: int, sizes: tuple[int, ...], coord: int, axis: str, group: str, grad: GradKind):
    """Replicate -> Shard(dim): keep this rank's chunk (no communication forward)."""
    return _ShardSlice.apply(x, dim, sizes, coord, axis, group, grad)


def to_partial(x, *, op: str, coord: int, n: int, grad: GradKind):
    """Replicate -> Partial(op): a sum keeps the value on the first rank only, avg on all."""
    if op not in ("sum", "avg"):
        raise ValueError(f"cannot turn a replicated value into Partial({op}); only sum and avg")
    return _ToPartial.apply(x, op, coord, n, grad)


def grad_all_reduce(x, *, n: int, axis: str, group: str):
    """Identity forward; all-reduce of the gradient backward (a contribution made full)."""
    return _GradAllReduce.apply(x, n, axis, group)


def grad_mask(x, *, coord: int):
    """Identity forward; backward keeps the full gradient on the first rank only."""
    return _GradMask.apply(x, coord)
