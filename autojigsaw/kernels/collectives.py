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
from ..mesh import MeshAxis
from .once import differentiable_once

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


def record(kind: str, axis: MeshAxis, tensor: torch.Tensor) -> None:
    if _ACTIVE_LOGS and not torch.compiler.is_compiling():
        record_sent(kind, axis, bytes_sent(kind, tensor.numel() * tensor.element_size(), axis.size))


def record_sent(kind: str, axis: MeshAxis, sent: int) -> None:
    """Record a collective that sends `sent` bytes (an uneven all-to-all: the rows to the other ranks)."""
    if _ACTIVE_LOGS and not torch.compiler.is_compiling():
        for log in _ACTIVE_LOGS:
            log.calls.append((kind, axis.name, sent))


# ---------------------------------------------------------------- raw (non-autograd) ops


class CollectiveError(RuntimeError):
    """A collective that failed (a peer rank died, stalled past the timeout, or disagreed).

    Says which collective, on which mesh axis and process group; the backend's error is its
    cause. ParallelModule adds the graph node it served.
    """

    def __init__(self, message: str, kind: str = "", axis: str = ""):
        super().__init__(message)
        self.kind, self.axis = kind, axis


def named_failure(kind: str, axis: MeshAxis, fn):
    """fn(), which starts or waits for a functional collective, a backend failure raised as a
    CollectiveError naming `kind` and `axis` (eager only). Every collective a kernel runs goes through it."""
    if torch.compiler.is_compiling():
        return fn()
    try:
        return fn()
    except RuntimeError as e:
        raise CollectiveError(
            f"{kind} over mesh axis {axis.name!r} ({axis.size} ranks, process group {axis.group}) failed: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. A peer rank died, stalled past the "
            "process group's timeout, or runs another plan; see the other ranks' errors", kind, axis.name) from e


def wait(kind: str, axis: MeshAxis, pending: torch.Tensor) -> torch.Tensor:
    """The result of a started functional collective, a failure named."""
    return named_failure(kind, axis, lambda: c10d.wait_tensor(pending))


def waited(kind: str, axis: MeshAxis, start):
    """The result of `start()`, a functional collective, waited for; a failure named."""
    return named_failure(kind, axis, lambda: c10d.wait_tensor(start()))


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - dim - 1) + [0, extra]
    return F.pad(x, pad)


def gather_chunk(x, dim, sizes):
    """This rank's send buffer for an all-gather on `dim`: padded to the largest chunk, `dim` first."""
    return pad_dim(x, dim, max(sizes)).movedim(dim, 0).contiguous()


def unpad_chunks(y, dim, sizes):
    """Every rank's padded chunk, concatenated on dim 0 as gathered, as the whole tensor on `dim`."""
    chunk = max(sizes)
    y = y.movedim(0, dim)
    if all(s == chunk for s in sizes):
        return y.contiguous()
    return torch.cat([y.narrow(dim, i * chunk, s) for i, s in enumerate(sizes)], dim)


def raw_all_gather(x, dim, sizes, axis: MeshAxis):
    x = gather_chunk(x, dim, sizes)
    record("all_gather", axis, x)
    y = waited("all_gather", axis, lambda: c10d.all_gather_into_tensor(x, len(sizes), axis.group))
    return unpad_chunks(y, dim, sizes)


def _raw_reduce_scatter(x, dim, sizes, op, axis: MeshAxis):
    n = len(sizes)
    chunk = max(sizes)
    dtype, x = x.dtype, x.to(reduce_dtype(x.dtype, op))
    if any(s != chunk for s in sizes):
        pieces = torch.split(x, list(sizes), dim)
        x = torch.cat([pad_dim(p, dim, chunk) for p in pieces], dim)
    x = x.movedim(dim, 0).contiguous()
    record("reduce_scatter", axis, x)
    y = waited("reduce_scatter", axis, lambda: c10d.reduce_scatter_tensor(x, _wire_op(op), n, axis.group))
    if op == "avg":
        y = y / n
    return y.movedim(0, dim).narrow(dim, 0, sizes[axis.coord]).to(dtype).contiguous()


def raw_all_reduce(x, op, axis: MeshAxis):
    dtype, x = x.dtype, x.to(reduce_dtype(x.dtype, op)).contiguous()
    record("all_reduce", axis, x)
    y = waited("all_reduce", axis, lambda: c10d.all_reduce(x, _wire_op(op), axis.group))
    return (y / axis.size if op == "avg" else y).to(dtype)


def _raw_all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes, axis: MeshAxis):
    """Local S(src_dim) shard -> local S(dst_dim) shard on the same axis."""
    n = len(src_sizes)
    src_chunk, dst_chunk = max(src_sizes), max(dst_sizes)
    send = [
        pad_dim(pad_dim(piece, dst_dim, dst_chunk), src_dim, src_chunk)
        for piece in torch.split(x, list(dst_sizes), dst_dim)
    ]
    buf = torch.stack(send).contiguous()
    record("all_to_all", axis, buf)
    recv = waited("all_to_all", axis, lambda: c10d.all_to_all_single(buf, [1] * n, [1] * n, axis.group))
    pieces = [
        recv[i].narrow(src_dim, 0, src_sizes[i]).narrow(dst_dim, 0, dst_sizes[axis.coord])
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
    def forward(ctx, x, dim, sizes, axis, grad):
        ctx.args = (dim, sizes, axis, grad)
        return raw_all_gather(x, dim, sizes, axis)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, sizes, axis, grad = ctx.args
        if grad == GradKind.R:
            gx = g.narrow(dim, _offset(sizes, axis.coord), sizes[axis.coord])
        else:
            gx = _raw_reduce_scatter(g, dim, sizes, "sum", axis)
        return gx, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, op, axis):
        ctx.args = (dim, sizes, axis, op)
        return _raw_reduce_scatter(x, dim, sizes, op, axis)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, sizes, axis, op = ctx.args
        gx = raw_all_gather(g.contiguous(), dim, sizes, axis)
        if op == "avg":
            gx = gx / len(sizes)
        return gx, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, axis, grad):
        ctx.args = (op, axis, grad)
        y = raw_all_reduce(x, op, axis)
        if op in ("max", "min"):
            ctx.save_for_backward(x == y)
        return y

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        op, axis, grad = ctx.args
        if grad == GradKind.P:
            g = raw_all_reduce(g, "sum", axis)
        if op == "avg":
            g = g / axis.size
        elif op in ("max", "min"):
            (winner,) = ctx.saved_tensors
            g = g * winner
        return g, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, src_sizes, dst_sizes, axis):
        ctx.args = (src_dim, dst_dim, src_sizes, dst_sizes, axis)
        return _raw_all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes, axis)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        src_dim, dst_dim, src_sizes, dst_sizes, axis = ctx.args
        gx = _raw_all_to_all(g, dst_dim, src_dim, dst_sizes, src_sizes, axis)
        return gx, None, None, None, None, None


class _ShardSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, axis, grad):
        ctx.args = (dim, sizes, axis, grad, x.shape[dim])
        # A copy, not a view: local ops such as view() expect the layout of a fresh shard.
        return x.narrow(dim, _offset(sizes, axis.coord), sizes[axis.coord]).contiguous()

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        dim, sizes, axis, grad, full = ctx.args
        if grad == GradKind.R:
            gx = raw_all_gather(g.contiguous(), dim, sizes, axis)
        else:  # a zero-padded contribution: the sum over the axis is the full gradient
            gx = g.new_zeros(g.shape[:dim] + (full,) + g.shape[dim + 1:])
            gx.narrow(dim, _offset(sizes, axis.coord), sizes[axis.coord]).copy_(g)
        return gx, None, None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, axis, grad):
        ctx.args = (op, axis, grad)
        if op == "sum" and axis.coord != 0:
            return torch.zeros_like(x)
        return x.view_as(x)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        # Every rank holds the full gradient of the Partial value (g / n for an average).
        op, axis, grad = ctx.args
        if op == "avg":
            g = g * axis.size
        if grad == GradKind.P and axis.coord != 0:
            g = torch.zeros_like(g)
        return g, None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        return raw_all_reduce(g, "sum", ctx.axis), None


class _GradMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.coord = axis.coord
        return x.view_as(x)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        return (g if ctx.coord == 0 else torch.zeros_like(g)), None


# ---------------------------------------------------------------- the public functions
# Each moves a local shard over one mesh axis (`axis`: its name, size, process group and this
# rank's position); chunk `sizes` have one entry per rank of it. They appear by name in gm.code.


def all_gather(x, *, dim: int, sizes: tuple[int, ...], axis: MeshAxis, grad: GradKind):
    """Shard(dim) -> Replicate: concatenate the chunks of every rank."""
    return _AllGather.apply(x, dim, sizes, axis, grad)


def reduce_scatter(x, *, dim: int, sizes: tuple[int, ...], op: str, axis: MeshAxis):
    """Partial(op) -> Shard(dim): reduce over ranks, keep this rank's chunk."""
    return _ReduceScatter.apply(x, dim, sizes, op, axis)


def all_reduce(x, *, op: str, axis: MeshAxis, grad: GradKind):
    """Partial(op) -> Replicate."""
    return _AllReduce.apply(x, op, axis, grad)


def all_to_all(x, *, src_dim: int, dst_dim: int, src_sizes: tuple[int, ...],
               dst_sizes: tuple[int, ...], axis: MeshAxis):
    """Shard(src_dim) -> Shard(dst_dim) on the same axis."""
    return _AllToAll.apply(x, src_dim, dst_dim, src_sizes, dst_sizes, axis)


def shard_slice(x, *, dim: int, sizes: tuple[int, ...], axis: MeshAxis, grad: GradKind):
    """Replicate -> Shard(dim): keep this rank's chunk (no communication forward)."""
    return _ShardSlice.apply(x, dim, sizes, axis, grad)


def to_partial(x, *, op: str, axis: MeshAxis, grad: GradKind):
    """Replicate -> Partial(op): a sum keeps the value on the first rank only, avg on all."""
    if op not in ("sum", "avg"):
        raise ValueError(f"cannot turn a replicated value into Partial({op}) on mesh axis {axis.name!r}; "
                         "only sum and avg")
    return _ToPartial.apply(x, op, axis, grad)


def grad_all_reduce(x, *, axis: MeshAxis):
    """Identity forward; all-reduce of the gradient backward (a contribution made full)."""
    return _GradAllReduce.apply(x, axis)


def grad_mask(x, *, axis: MeshAxis):
    """Identity forward; backward keeps the full gradient on the first rank only."""
    return _GradMask.apply(x, axis)
