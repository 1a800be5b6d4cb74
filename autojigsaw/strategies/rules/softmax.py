"""Rules for softmax and log-softmax: local over an unsharded dim, a kernel over a sharded one.

Per mesh axis, for softmax(X, dim):
  local    X Shard(d), d != dim (or Replicate)   -> the same, the op itself on local rows
  sharded  X Shard(dim)                          -> Shard(dim), kernel sharded_softmax: row max
                                                    and sum all-reduced, accumulated in fp32
The softmax dim may be sharded over one axis only (the kernel reduces over one group).
Captured graphs hold aten._softmax / _log_softmax / _safe_softmax and, for code calling
torch.softmax, aten.softmax.int / log_softmax.int, which DTensor has no rule for.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Shard

from ...cost_model.compute import backward_factor, flops, roofline_time
from ...dtypes import acc_dtype
from ...ir import GLOBAL, PLACEMENTS, bytes_sent
from ...kernels import registry
from ...kernels.safe_softmax import sharded_safe_softmax
from ...kernels.softmax import sharded_log_softmax, sharded_softmax
from ...placements import local_shape
from .base import AxisOption, kernel_axis, other_dims_split, per_axis, register

aten = torch.ops.aten

_KERNELS = {
    aten._softmax.default: sharded_softmax, aten.softmax.int: sharded_softmax,
    aten._log_softmax.default: sharded_log_softmax, aten.log_softmax.int: sharded_log_softmax,
    aten._safe_softmax.default: sharded_safe_softmax,
}
_HALF = (torch.float16, torch.bfloat16)


def half_to_float(node) -> bool | None:
    """The kernel's half_to_float for this node; None when its output dtype is beyond the kernel."""
    x = node.args[0].meta["val"]
    if node.target in (aten._softmax.default, aten._log_softmax.default):
        return bool(node.args[2])
    dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    if dtype is None or dtype == x.dtype:
        return False
    return True if dtype == torch.float32 and x.dtype in _HALF else None


@register(*_KERNELS)
def softmax(node, mesh, candidates):
    x = node.args[0].meta["val"]
    dim = node.args[1] % x.ndim
    kernel_ok = x.is_floating_point() and half_to_float(node) is not None

    batch_split = other_dims_split(x.shape, {dim})

    def options(n):
        opts = batch_split(n)
        if n > 1 and kernel_ok and x.shape[dim] >= n:
            opts.append(AxisOption((Shard(dim),), (Shard(dim),), kernel="sharded_softmax", note="softmax dim sharded"))
        return opts

    return [s for s in per_axis(mesh, options) if s.inputs[0].count(Shard(dim)) <= 1]


def _axis(node, strategy, dim: int) -> int:
    """The mesh axis that shards the softmax dim: the kernel reduces over it."""
    return kernel_axis(node, strategy.inputs[0], dim, strategy.kernel)


def _sharded_call(node, sharding, rank, local_inputs):
    dim = node.args[1] % node.args[0].meta["val"].ndim
    kwargs = dict(half_to_float=half_to_float(node), axis=rank.axis(_axis(node, sharding, dim)))
    return _KERNELS[node.target], (local_inputs[0], dim), kwargs


def _stats_bytes(shape, dim: int, dtype: torch.dtype) -> int:
    """Bytes of one all-reduced row statistic (max or sum), in the kernel's accumulation dtype."""
    acc = acc_dtype(dtype).itemsize
    return math.prod(shape[:dim]) * math.prod(shape[dim + 1:]) * acc


def _traffic(node, rank, backward) -> list[tuple[str, int]]:
    """Two all-reduces of the row statistics forward (max, sum), one backward."""
    x = node.args[0]
    val = x.meta[GLOBAL]
    shape = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)
    nbytes = bytes_sent("all_reduce", _stats_bytes(shape, node.args[1], val.dtype), node.kwargs["axis"].size)
    return [("all_reduce", nbytes)] * (3 if backward else 2)


def softmax_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The local softmax as the default estimate prices it, plus the all-reduces of row statistics."""
    x, y = node.args[0].meta["val"], node.meta["val"]
    dim = node.args[1] % x.ndim
    shape = local_shape(x.shape, strategy.inputs[0], ctx.mesh.sizes, ctx.coord0)
    numel = math.prod(shape)
    t = float(roofline_time(flops(node.target, [shape], [shape]),
                            numel * (x.dtype.itemsize + y.dtype.itemsize), y.dtype, ctx.device, "softmax"))
    a = _axis(node, strategy, dim)
    reduce = ctx.collective_time("all_reduce", _stats_bytes(shape, dim, x.dtype), a)
    if ctx.training and grad:
        return t * (1 + backward_factor(node.target)) + 3 * reduce, math.nan
    return t + 2 * reduce, math.nan


registry.add(registry.Kernel("sharded_softmax", _sharded_call, _traffic, softmax_cost))
