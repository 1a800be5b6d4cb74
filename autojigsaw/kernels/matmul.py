"""Fused distributed linears that overlap communication with the matmuls: 1-D and 2-D (SUMMA).

Each kernel equals a composition of collectives.py's collectives with F.linear, forward and
backward, with the same gradient convention, but moves chunks in a pairwise ring: step s
(1 <= s < n) sends to rank coord + s and receives from coord - s (one all_to_all_single with a
single non-empty split each way), and the matmul on the chunk at hand runs while the next step
is in flight, since functional collectives return before `wait_tensor`. Chunks travel padded to
the largest of `sizes` (torch.chunk sizes, zero allowed), so a kernel sends exactly the bytes of
the collective it replaces and counts them under that collective's name (a failure, too, is a
CollectiveError naming it). Every call allocates fresh buffers: no returned or saved tensor
aliases memory a later call writes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir import GradKind
from ..mesh import MeshAxis
from . import collectives as C
from .collectives import c10d
from .once import differentiable_once

# ---------------------------------------------------------------- the ring


def _pack(t: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """`t` padded to `chunk` along dim, that dim moved first, contiguous: a message."""
    return C.pad_dim(t, dim, chunk).movedim(dim, 0).contiguous()


def _unpack(buf: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return buf.narrow(0, 0, size).movedim(0, dim)


def _exchange(kind: str, buf: torch.Tensor, step: int, axis: MeshAxis) -> torch.Tensor:
    """Start ring step `step` of collective `kind`: send buf to coord + step, receive its like from coord - step."""
    n, coord = axis.size, axis.coord
    send, recv = [0] * n, [0] * n
    send[(coord + step) % n] = buf.shape[0]
    recv[(coord - step) % n] = buf.shape[0]
    return C.named_failure(kind, axis, lambda: c10d.all_to_all_single(buf, recv, send, axis.group))


def _ring_gather(x, dim, sizes, axis: MeshAxis, consume) -> None:
    """All-gather x's chunks along dim, calling consume(src, chunk) on each as it arrives.

    consume(coord, x) runs first, while step 1 is in flight; step s + 1 is issued before the
    chunk of step s is consumed. Counted as the all_gather it replaces.
    """
    n, coord = len(sizes), axis.coord
    buf = _pack(x, dim, max(sizes))
    C.record("all_gather", axis, buf)
    live = n > 1 and buf.numel() > 0  # same on every rank: only the padded chunk's shape matters
    pending = _exchange("all_gather", buf, 1, axis) if live else None
    consume(coord, x)
    for step in range(1, n):
        recv = buf
        if live:
            recv = C.wait("all_gather", axis, pending)
            if step + 1 < n:
                pending = _exchange("all_gather", buf, step + 1, axis)
        src = (coord - step) % n
        consume(src, _unpack(recv, dim, sizes[src]))


def _ring_reduce_scatter(produce, dim, sizes, axis: MeshAxis) -> torch.Tensor:
    """Sum over the axis of produce(dst), this rank's addend to rank dst's chunk along dim.

    The addend for the next destination is computed while the previous one is in flight; this
    rank's own addend comes last. Counted as the reduce_scatter it replaces.
    """
    n, coord, chunk = len(sizes), axis.coord, max(sizes)
    total = pending = None
    for step in range(1, n):
        buf = _pack(produce((coord + step) % n), dim, chunk)
        if step == 1:
            C.record("reduce_scatter", axis, buf.unsqueeze(0).expand(n, *buf.shape))
        if buf.numel() == 0:
            continue
        issued = _exchange("reduce_scatter", buf, step, axis)
        if pending is not None:
            recv = C.wait("reduce_scatter", axis, pending)
            total = recv if total is None else total + recv
        pending = issued
    own = produce(coord)
    if n == 1:
        C.record("reduce_scatter", axis, own)  # nothing sent, but the call is counted
    if pending is not None:
        recv = C.wait("reduce_scatter", axis, pending)
        total = recv if total is None else total + recv
    return own if total is None else own + _unpack(total, dim, sizes[coord])


# ---------------------------------------------------------------- argument checks


def _check_sizes(kernel, sizes, axis: MeshAxis, *, what="sizes") -> None:
    if len(sizes) != axis.size:
        raise ValueError(
            f"{kernel}: {what}={tuple(sizes)} has {len(sizes)} entries but mesh axis {axis.name!r} "
            f"has {axis.size} ranks; pass chunk_sizes(global_size, {axis.size})"
        )


def _check_dim(kernel, x, dim, size, sizes, axis: MeshAxis) -> int:
    if not -x.ndim <= dim < x.ndim or dim % x.ndim == x.ndim - 1:
        raise ValueError(
            f"{kernel}: dim={dim} must be a non-last dim of x (shape {tuple(x.shape)}): the last "
            f"dim holds the features; shard tokens, sequence or batch over axis {axis.name!r}"
        )
    dim %= x.ndim
    if x.shape[dim] != size:
        raise ValueError(
            f"{kernel}: x has {x.shape[dim]} entries along dim {dim} but sizes={tuple(sizes)} over "
            f"axis {axis.name!r} expect {size}; pass the sizes of this shard layout"
        )
    return dim


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # -1 is ambiguous for empty t


def _weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The weight gradient of F.linear: g^T x over all leading dims."""
    return _flat(g).t() @ _flat(x)


def _bias_grad(g: torch.Tensor) -> torch.Tensor:
    return _flat(g).sum(0)


def _add(acc, t):
    return t if acc is None else acc + t


# ---------------------------------------------------------------- 1-D: all-gather-linear


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dim, sizes, axis, grad):
        chunks, outs = [None] * len(sizes), [None] * len(sizes)

        def consume(src, chunk):
            chunks[src] = chunk
            outs[src] = F.linear(chunk, weight, bias)

        _ring_gather(x, dim, sizes, axis, consume)
        ctx.save_for_backward(weight, *(chunks if ctx.needs_input_grad[1] else ()))  # x only for dW
        ctx.args = (dim, sizes, axis, grad, bias is not None)
        return torch.cat(outs, dim)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        weight, *chunks = ctx.saved_tensors
        dim, sizes, axis, grad, has_bias = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gs = torch.split(g, list(sizes), dim)
        dw = [None]

        def weight_part(i):
            if need_w:
                dw[0] = _add(dw[0], _weight_grad(gs[i], chunks[i]))

        def produce(dst):  # the weight gradient rides along to fill the ring's waits
            weight_part(dst)
            return gs[dst] @ weight

        if need_x and grad == GradKind.P:
            dx = _ring_reduce_scatter(produce, dim, sizes, axis)
        else:
            for i in range(len(sizes)):
                weight_part(i)
            dx = gs[axis.coord] @ weight if need_x else None
        db = _bias_grad(g) if has_bias and need_b else None
        return dx, dw[0], db, None, None, None, None


def all_gather_linear(x, weight, bias=None, *, dim: int, sizes: tuple[int, ...], axis: MeshAxis,
                      grad: GradKind):
    """F.linear(all_gather(x, dim=dim, ...), weight, bias), the gather overlapped with the matmul.

    dim is a non-last dim of x (tokens, sequence, batch); the gradient of x follows `grad` as
    all_gather's does ("P": an overlapped matmul-reduce-scatter, "R": the local slice); the
    gradients of weight and bias are what F.linear gives on this rank (the caller reduces them).
    """
    if grad not in tuple(GradKind):
        raise ValueError(f"all_gather_linear: grad={grad!r} on axis {axis.name!r}; use 'R' or 'P'")
    _check_sizes("all_gather_linear", sizes, axis)
    dim = _check_dim("all_gather_linear", x, dim, sizes[axis.coord], sizes, axis)
    return _AllGatherLinear.apply(x, weight, bias, dim, tuple(sizes), axis, grad)


# ---------------------------------------------------------------- 1-D: linear-reduce-scatter


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dim, sizes, op, axis):
        xs = torch.split(x, list(sizes), dim)
        y = _ring_reduce_scatter(lambda dst: F.linear(xs[dst], weight, bias), dim, sizes, axis)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)  # x only for dW
        ctx.args = (dim, sizes, op, axis, bias is not None)
        return y / len(sizes) if op == "avg" else y

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dim, sizes, op, axis, has_bias = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        xs = torch.split(x, list(sizes), dim) if need_w else None
        dx, acc = [None] * len(sizes), {"w": None, "b": None}

        def consume(src, chunk):  # chunk: rank src's slice of the full output gradient
            if op == "avg":
                chunk = chunk / len(sizes)
            if need_x:
                dx[src] = chunk @ weight
            if need_w:
                acc["w"] = _add(acc["w"], _weight_grad(chunk, xs[src]))
            if has_bias and need_b:
                acc["b"] = _add(acc["b"], _bias_grad(chunk))

        _ring_gather(g, dim, sizes, axis, consume)
        gx = torch.cat(dx, dim) if need_x else None
        return gx, acc["w"], acc["b"], None, None, None, None


def linear_reduce_scatter(x, weight, bias=None, *, dim: int, sizes: tuple[int, ...], op: str,
                          axis: MeshAxis):
    """reduce_scatter(F.linear(x, weight, bias), dim=dim, ...), each chunk's matmul overlapped.

    x's last dim is sharded over the axis (weight holds the matching in-features), so the
    product is Partial; it is reduced and scattered along the non-last dim `dim`. As in that
    composition, a bias is added on every rank before the reduction.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"linear_reduce_scatter: op={op!r} on axis {axis.name!r}; use 'sum' or 'avg'")
    _check_sizes("linear_reduce_scatter", sizes, axis)
    dim = _check_dim("linear_reduce_scatter", x, dim, sum(sizes), sizes, axis)
    return _LinearReduceScatter.apply(x, weight, bias, dim, tuple(sizes), op, axis)


# ---------------------------------------------------------------- 2-D: SUMMA-style linear


def _columns(x, w_full, own, own_lo, lo, hi) -> torch.Tensor:
    """Columns [lo, hi) of x @ w_full^T, reusing `own` (the columns from own_lo) where it can."""
    own_hi = own_lo + own.shape[-1]
    parts = []
    for start, stop, cached in ((lo, min(hi, own_lo), False),
                                (max(lo, own_lo), min(hi, own_hi), True),
                                (max(lo, own_hi), hi, False)):
        if start < stop:
            parts.append(own[..., start - own_lo:stop - own_lo] if cached
                         else F.linear(x, w_full[start:stop]))
    return torch.cat(parts, -1) if len(parts) != 1 else parts[0]


def _offsets(sizes) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


class _SummaLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_sizes, y_sizes, domain, tensor):
        # Prefetch the domain all-gather of W's out-blocks; meanwhile multiply by our own block.
        a, wo = len(w_sizes), _offsets(w_sizes)
        buf = _pack(weight, 0, max(w_sizes))
        C.record("all_gather", domain, buf)
        pending = (C.named_failure("all_gather", domain, lambda: c10d.all_gather_into_tensor(buf, a, domain.group))
                   if a > 1 and buf.numel() else None)
        own = F.linear(x, weight)
        w_full = weight
        if pending is not None:
            w_full = C.wait("all_gather", domain, pending)
            if any(s != buf.shape[0] for s in w_sizes):
                w_full = torch.cat([blk[:s] for blk, s in zip(w_full.chunk(a), w_sizes)])
        elif a > 1:
            w_full = weight.new_zeros(wo[-1], weight.shape[1])
        # The tensor-partial product, reduce-scattered over tensor along out, one block a step.
        yo, last = _offsets(y_sizes), x.ndim - 1
        y = _ring_reduce_scatter(
            lambda dst: _columns(x, w_full, own, wo[domain.coord], yo[dst], yo[dst + 1]),
            last, y_sizes, tensor)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w_full)  # x only for dW
        ctx.args = (w_sizes, y_sizes, domain, tensor)
        ctx.has_bias = bias is not None
        return y + bias if bias is not None else y

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        x, w_full = ctx.saved_tensors
        w_sizes, y_sizes, domain, tensor = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        yo, wo, last = _offsets(y_sizes), _offsets(w_sizes), g.ndim - 1
        cols, dx = [None] * len(y_sizes), [None]

        def consume(src, chunk):  # columns of the full output gradient, dX accumulated meanwhile
            cols[src] = chunk
            if need_x:
                dx[0] = _add(dx[0], chunk @ w_full[yo[src]:yo[src + 1]])

        _ring_gather(g, last, y_sizes, tensor, consume)
        dw = None
        if need_w:  # dW^T rows of the full out dim, reduce-scattered over domain one block a step
            g_full, x_flat = _flat(torch.cat(cols, -1)), _flat(x)
            dw = _ring_reduce_scatter(lambda dst: g_full[:, wo[dst]:wo[dst + 1]].t() @ x_flat,
                                      0, w_sizes, domain)
        db = _bias_grad(g) if ctx.has_bias and need_b else None
        return dx[0], dw, db, None, None, None, None


def summa_linear(x, weight, bias=None, *, weight_sizes: tuple[int, ...], out_sizes: tuple[int, ...],
                 domain: MeshAxis, tensor: MeshAxis):
    """F.linear on Jigsaw's 2-D zero-redundancy layout over a ("domain", "tensor") mesh.

    x [..., in]: any leading dims sharded over domain (tokens, batch), in over tensor.
    weight [out, in] (Linear layout): out over domain (chunk sizes `weight_sizes`), in over tensor.
    Returns y [..., out] with x's leading dims and out over tensor (chunk sizes `out_sizes`).
    bias, optional: this rank's out chunk over tensor, added after the reduction; its gradient
    is this rank's contribution over domain (the caller all-reduces it, as for any replicated
    parameter). Equals, with the gradients of x and weight sharded like x and weight:
        reduce_scatter(F.linear(x, all_gather(weight, dim=0, grad="P") over domain),
                       dim=-1 over tensor) + bias
    """
    _check_sizes("summa_linear", weight_sizes, domain, what="weight_sizes")
    _check_sizes("summa_linear", out_sizes, tensor, what="out_sizes")
    if sum(weight_sizes) != sum(out_sizes):
        raise ValueError(
            f"summa_linear: weight_sizes={tuple(weight_sizes)} (over {domain.name!r}) and "
            f"out_sizes={tuple(out_sizes)} (over {tensor.name!r}) must split the same out-features"
        )
    rows = weight_sizes[domain.coord]
    if weight.ndim != 2 or weight.shape[0] != rows or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"summa_linear: weight {tuple(weight.shape)} must be [weight_sizes[{domain.coord}]="
            f"{rows}, {x.shape[-1]}] (x's local in-features over {tensor.name!r}); pass this "
            f"rank's block of the [out, in] weight"
        )
    if bias is not None and tuple(bias.shape) != (out_sizes[tensor.coord],):
        raise ValueError(
            f"summa_linear: bias {tuple(bias.shape)} must be this rank's out chunk over "
            f"{tensor.name!r}, shape ({out_sizes[tensor.coord]},)"
        )
    return _SummaLinear.apply(x, weight, bias, tuple(weight_sizes), tuple(out_sizes), domain, tensor)
