"""LayerNorm, RMSNorm and GroupNorm over dims sharded over mesh axes: exact statistics.

`normalized_shape` is the global one; x, weight and bias hold this rank's chunk of its last dim
(torch.chunk sizes, empty chunks allowed). GroupNorm's spatial dims may be sharded over one or
more axes: each group is a row of that LayerNorm, without affine (its channels' weight and bias
follow). Statistics are sums over the full normalized dims,
all-reduced in fp32 (fp64 stays fp64), the variance in a second pass around the global mean, so
every rank gets its chunk of the single-device result: not a norm over its local channels only.
Gradients of x, weight and bias are sharded like them; the backward all-reduces the row sums
of the input gradient (one all-reduce for both sums of LayerNorm).
"""

from __future__ import annotations

import math

import torch

from ..dtypes import acc_dtype
from ..mesh import MeshAxis
from .collectives import raw_all_reduce
from .once import differentiable_once


Axes = MeshAxis | tuple[MeshAxis, ...]


def _names(axis: Axes) -> str:
    return ", ".join(repr(a.name) for a in ((axis,) if isinstance(axis, MeshAxis) else axis))


def _layout(kernel, x, normalized_shape, params, axis: Axes) -> tuple[tuple[int, ...], int]:
    """The normalized dims of x and the global element count of one row, after checks."""
    shape = tuple(normalized_shape)
    k = len(shape)
    local = tuple(x.shape[x.ndim - k:])
    if k == 0 or x.ndim < k or local[:-1] != shape[:-1] or local[-1] > shape[-1]:
        raise ValueError(
            f"{kernel}: x of shape {tuple(x.shape)} does not end in a chunk of the global "
            f"normalized_shape {shape} (last dim sharded over axis {_names(axis)}); pass the global "
            f"normalized_shape and this rank's chunk of x"
        )
    for name, p in params.items():
        if p is not None and tuple(p.shape) != local:
            raise ValueError(
                f"{kernel}: {name} has shape {tuple(p.shape)} but x's normalized chunk is {local} "
                f"on axis {_names(axis)}; pass this rank's chunk of {name}"
            )
    return tuple(range(x.ndim - k, x.ndim)), math.prod(shape)


def _all_sum(t, axis: Axes):
    """t summed over every rank of `axis` (one all-reduce per axis of a tuple)."""
    for a in (axis,) if isinstance(axis, MeshAxis) else axis:
        t = raw_all_reduce(t, "sum", a)
    return t


def _row_sum(t, dims, axis: Axes):
    return _all_sum(t.sum(dims, keepdim=True), axis)


def _sum_batch(t: torch.Tensor, k: int) -> torch.Tensor:
    """Sum over all but the last k dims (t.sum(()) would sum over every dim)."""
    return t.sum(tuple(range(t.ndim - k))) if t.ndim > k else t


class _ShardedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dims, count, eps, axis):
        xa = x.to(acc_dtype(x.dtype))
        mean = _row_sum(xa, dims, axis) / count
        centered = xa - mean
        var = _row_sum(centered * centered, dims, axis) / count
        rstd = torch.rsqrt(var + eps)
        y = centered * rstd
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.args = (dims, count, axis, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(mean, var)
        return y.to(x.dtype), mean, var  # the statistics too: BatchNorm's running averages take them

    @staticmethod
    @differentiable_once
    def backward(ctx, g, _mean_grad, _var_grad):
        x, weight, mean, rstd = ctx.saved_tensors
        dims, count, axis, bias_dtype = ctx.args
        ga = g.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean) * rstd
        gxhat = ga if weight is None else ga * weight
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.stack([gxhat.sum(dims, keepdim=True),
                                (gxhat * xhat).sum(dims, keepdim=True)])
            sums = _all_sum(sums, axis) / count
            dx = (rstd * (gxhat - sums[0] - xhat * sums[1])).to(x.dtype)
        dw = db = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = _sum_batch(ga * xhat, len(dims)).to(weight.dtype)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            db = _sum_batch(ga, len(dims)).to(bias_dtype)
        return dx, dw, db, None, None, None, None


class _ShardedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dims, count, eps, axis):
        xa = x.to(acc_dtype(x.dtype))
        if eps is None:  # torch's default: the machine epsilon of the computation dtype
            eps = torch.finfo(xa.dtype).eps
        rstd = torch.rsqrt(_row_sum(xa * xa, dims, axis) / count + eps)
        y = xa * rstd
        if weight is not None:
            y = y * weight
        ctx.save_for_backward(x, weight, rstd)
        ctx.args = (dims, count, axis)
        return y.to(x.dtype)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        dims, count, axis = ctx.args
        ga = g.to(rstd.dtype)
        xhat = x.to(rstd.dtype) * rstd
        gxhat = ga if weight is None else ga * weight
        dx = None
        if ctx.needs_input_grad[0]:
            dot = _row_sum(gxhat * xhat, dims, axis) / count
            dx = ((gxhat - xhat * dot) * rstd).to(x.dtype)
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = _sum_batch(ga * xhat, len(dims)).to(weight.dtype)
        return dx, dw, None, None, None, None


def sharded_layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *, axis: MeshAxis):
    """F.layer_norm with the last of the (global) normalized dims sharded over `axis`."""
    dims, count = _layout("sharded_layer_norm", x, normalized_shape,
                          {"weight": weight, "bias": bias}, axis)
    return _ShardedLayerNorm.apply(x, weight, bias, dims, count, eps, axis)[0]


def sharded_rms_norm(x, normalized_shape, weight=None, eps: float | None = None, *, axis: MeshAxis):
    """F.rms_norm with the last of the (global) normalized dims sharded over `axis`."""
    dims, count = _layout("sharded_rms_norm", x, normalized_shape, {"weight": weight}, axis)
    return _ShardedRmsNorm.apply(x, weight, dims, count, eps, axis)


def sharded_group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5, *,
                       spatial: tuple[int, ...], axis: Axes):
    """F.group_norm of x [N, C, *spatial] whose `spatial` sizes are global and whose spatial dims
    are sharded over `axis` (one mesh axis or several): each group normalized over all its points."""
    n, c = x.shape[:2]
    rows = x.reshape(n, num_groups, c // num_groups * math.prod(x.shape[2:]))
    count = c // num_groups * math.prod(spatial)
    _layout("sharded_group_norm", rows, (count,), {}, axis)
    y = _ShardedLayerNorm.apply(rows, None, None, (2,), count, eps, axis)[0].view(x.shape)
    channel = (c,) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.view(channel)
    if bias is not None:
        y = y + bias.view(channel)
    return y


def sharded_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float, *,
                       count: int, axis: Axes):
    """aten._native_batch_norm_legit_functional in training for x [N, C, *spatial] sharded over `axis`
    on its batch or spatial dims (`count` points per channel in all): each channel normalized over
    all its points, as SyncBatchNorm does. Returns (y, mean, rstd, new running mean, new running var)."""
    c = x.shape[1]
    rows = x.transpose(0, 1).reshape(c, -1)  # one row per channel
    _layout("sharded_batch_norm", rows, (count,), {}, axis)
    y, mean, var = _ShardedLayerNorm.apply(rows, None, None, (1,), count, eps, axis)
    y = y.view(c, x.shape[0], *x.shape[2:]).transpose(0, 1).contiguous()
    channel = (c,) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.view(channel)
    if bias is not None:
        y = y + bias.view(channel)
    mean, var = mean.squeeze(1), var.squeeze(1)
    rstd = torch.rsqrt(var + eps)
    with torch.no_grad():  # the running averages (torch's: of the unbiased variance)
        new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
        new_var = running_var * (1 - momentum) + (var * count / max(count - 1, 1)).to(running_var.dtype) * momentum
    return y, mean, rstd, new_mean, new_var
