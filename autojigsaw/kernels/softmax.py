"""Softmax and log-softmax over a dim that is sharded over a mesh axis.

Each rank holds a chunk of `dim` (torch.chunk sizes, empty chunks allowed). The row maximum and
the sum of exponentials are all-reduced, so every rank gets its chunk of the single-device
result; accumulation is in fp32 for half types (fp64 stays fp64). The gradient of x is sharded
like x, and the backward all-reduces the one row sum it needs.
"""

from __future__ import annotations

import torch

from ..dtypes import acc_dtype
from ..mesh import MeshAxis
from .collectives import raw_all_reduce
from .once import differentiable_once


def _row_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.shape[dim] == 0:  # amax rejects an empty dim: the identity of max
        shape = x.shape[:dim] + (1,) + x.shape[dim + 1:]
        return x.new_full(shape, float("-inf"))
    return x.amax(dim, keepdim=True)


class _ShardedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, half_to_float, log, axis):
        acc = acc_dtype(x.dtype)
        xa = x.to(acc)
        shifted = xa - raw_all_reduce(_row_max(xa, dim), "max", axis)
        total = raw_all_reduce(shifted.exp().sum(dim, keepdim=True), "sum", axis)
        y = shifted - total.log() if log else shifted.exp() / total
        to_float = half_to_float and x.dtype in (torch.half, torch.bfloat16)
        y = y.to(torch.float32 if to_float else x.dtype)
        ctx.save_for_backward(y)
        ctx.args = (dim, log, axis, x.dtype)
        return y

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        dim, log, axis, in_dtype = ctx.args
        acc = acc_dtype(in_dtype)
        ga, ya = g.to(acc), y.to(acc)
        if log:  # d/dx log_softmax: g - softmax * sum(g)
            gx = ga - ya.exp() * raw_all_reduce(ga.sum(dim, keepdim=True), "sum", axis)
        else:  # d/dx softmax: y * (g - sum(g * y))
            dot = raw_all_reduce((ga * ya).sum(dim, keepdim=True), "sum", axis)
            gx = ya * (ga - dot)
        return gx.to(in_dtype), None, None, None, None


def _apply(kernel, x, dim, half_to_float, log, axis: MeshAxis):
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(
            f"{kernel}: dim={dim} is out of range for x of shape {tuple(x.shape)} (sharded over "
            f"axis {axis.name!r}); pass the dim whose chunks the ranks hold"
        )
    if not x.is_floating_point():
        raise ValueError(f"{kernel}: x has dtype {x.dtype} on axis {axis.name!r}; pass a float tensor")
    return _ShardedSoftmax.apply(x, dim % x.ndim, half_to_float, log, axis)


def sharded_softmax(x, dim: int, *, half_to_float: bool = False, axis: MeshAxis):
    """softmax over `dim`, whose chunks are spread over `axis`: this rank's chunk of it."""
    return _apply("sharded_softmax", x, dim, half_to_float, False, axis)


def sharded_log_softmax(x, dim: int, *, half_to_float: bool = False, axis: MeshAxis):
    """log_softmax over `dim`, whose chunks are spread over `axis`: this rank's chunk of it."""
    return _apply("sharded_log_softmax", x, dim, half_to_float, True, axis)
