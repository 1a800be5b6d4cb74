"""Rules for convolutions, patch embeddings and recoveries above all: batch, channel, spatial sharding.

Per mesh axis, for Y = conv(X, W, b) with X [B, Cin, *spatial] (1-, 2- or 3-D), W [Cout, Cin / groups, *k]:
  batch    X Shard(0), W and b Replicate               -> Y Shard(0)
  out      X Replicate, W Shard(0), b Shard(0)          -> Y Shard(1)   (groups == 1)
  in       X Shard(1), W Shard(1), b Partial            -> Y Partial    (groups == 1)
  spatial  X Shard(d), W and b Replicate                -> Y Shard(d)
A transposed convolution's W is [Cin, Cout / groups, *k]: its "out" shards W's dim 1, its "in" dim 0.
Patches (stride == kernel, no padding, output padding or dilation) shard a spatial dim with no halo
where every shard boundary falls on a patch boundary. Any other convolution shards a spatial dim
over one mesh axis through kernel "halo_conv": each rank first fetches the input rows its output
rows read (kernels/halo.py, rules/halo.py). A convolution over whole patches (batched, ungrouped)
is also offered as kernel "patch_gemm", one GEMM on the cut-out patches (kernels/patch_gemm.py):
the cheaper on GPUs in TF32 and bf16, where cuDNN runs patch convolutions on CUDA cores.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...cost_model.compute import backward_factor, flops, memory_time, roofline_time
from ...kernels import registry
from ...kernels.halo import halo_conv, halo_conv_transpose
from ...kernels.patch_gemm import patch_conv, patch_conv_transpose
from ...placements import chunks_align, local_offset, local_shape
from . import halo
from .base import AxisOption, per_axis, register
from .matmul import trim_options

aten = torch.ops.aten
R = Replicate()


_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)  # padding="same" or "valid"
_TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
PATCH_GEMM = "patch_gemm"
HALO = "halo_conv"


@register(*_CONVS, *_TRANSPOSED, aten.convolution.default)
def conv(node, mesh, candidates):
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    y = node.meta["val"]
    transposed, groups = _conv_args(node)[3:5]
    has_bias = len(candidates) == 3
    spatial = range(2, x.ndim)
    patches = _patch_dims(node)
    stencils = _stencils(node)
    w_out, w_in = (1, 0) if transposed else (0, 1)  # the weight dims of out and in channels

    def options(n):
        opts = [AxisOption((R, R, R), (R,))]
        if n == 1:
            return opts
        if x.shape[0] >= n:
            opts.append(AxisOption((Shard(0), R, R), (Shard(0),), note="batch"))
        if groups == 1:
            if w.shape[w_out] >= n:
                opts.append(AxisOption((R, Shard(w_out), Shard(0)), (Shard(1),), note="out channels"))
            if x.shape[1] >= n:
                opts.append(AxisOption((Shard(1), Shard(w_in), Partial()), (Partial(),), note="in channels"))
        opts += [AxisOption((Shard(d), R, R), (Shard(d),), note="patches") for d in patches if y.shape[d] >= n]
        opts += [AxisOption((Shard(d), R, R), (Shard(d),), kernel=HALO, note="rows and halos") for d in stencils]
        return opts

    found = per_axis(mesh, lambda n: trim_options(options(n), has_bias))
    # the side with more points holds `kernel` of them per point of the other
    fine, coarse = (y.shape, x.shape) if transposed else (x.shape, y.shape)
    found = [s for s in found if _patches_align(s.inputs[0], fine, coarse, w.shape, mesh, patches)
             and _no_empty_shard(s.inputs[0], s.inputs[1], x.shape, w.shape, mesh)
             and halo.one_axis_each(s.inputs[0], stencils)
             and halo.nonempty(x.shape, y.shape, stencils, mesh.sizes, s.inputs[0])]
    whole_patches = all(fine[d] == coarse[d] * w.shape[d] for d in spatial)
    if groups == 1 and w.ndim == x.ndim and len(patches) == len(spatial) and whole_patches:
        found += [replace(s, kernel=PATCH_GEMM) for s in found]
    return found


def _conv_args(node):
    """(stride, padding, dilation, transposed, groups, output_padding), one entry per spatial dim."""
    args = list(node.args) + [None] * 9
    n = node.args[0].meta["val"].ndim - 2
    if node.target in _CONVS:  # (x, w, b, stride, padding, dilation, groups)
        stride, padding, dilation, transposed, groups, output_padding = args[3], args[4], args[5], False, args[6], 0
    elif node.target in _TRANSPOSED:  # (x, w, b, stride, padding, output_padding, groups, dilation)
        stride, padding, output_padding, groups, dilation, transposed = args[3:8] + [True]
    else:  # convolution: (x, w, b, stride, padding, dilation, transposed, output_padding, groups)
        stride, padding, dilation, transposed, output_padding, groups = args[3:9]
    if isinstance(padding, str):  # "valid" or "same"
        padding = 0 if padding == "valid" else None
    return [_per_dim(stride, 1, n), _per_dim(padding, 0, n), _per_dim(dilation, 1, n), bool(transposed),
            groups or 1, _per_dim(output_padding, 0, n)]


def _per_dim(v, default, n: int) -> list:
    """A conv argument as one entry per spatial dim (given as None, one int, or one per dim)."""
    if v is None or isinstance(v, int):
        return [default if v is None else v] * n
    return list(v) * n if len(v) == 1 else list(v)


def _padding(node) -> list[int] | None:
    """Zeros padded on each side of each spatial dim (None: "same" padding that is not symmetric)."""
    _, padding, dilation, *_ = _conv_args(node)
    if not (node.target in _CONVS and len(node.args) > 4 and node.args[4] == "same"):
        return padding
    reach = [dil * (k - 1) for dil, k in zip(dilation, node.args[1].meta["val"].shape[2:])]
    return None if any(r % 2 for r in reach) else [r // 2 for r in reach]


def _patch_dims(node) -> list[int]:
    """The spatial dims a convolution cuts into whole, non-overlapping patches."""
    stride, padding, dilation, _, _, output_padding = _conv_args(node)
    w = node.args[1].meta["val"]
    return [d for d in range(2, w.ndim) if w.shape[d] == stride[d - 2] and padding[d - 2] == 0
            and dilation[d - 2] == 1 and output_padding[d - 2] == 0]


def _stencils(node) -> dict[int, halo.RowMap]:
    """The input rows each output row reads (a transposed convolution: whose scatter reaches it), on
    every spatial dim but whole patches' (the patch rule's)."""
    stride, _, dilation, transposed, _, _ = _conv_args(node)
    padding, w, patches = _padding(node), node.args[1].meta["val"], _patch_dims(node)
    if padding is None:  # "same" with an even kernel pads one side more
        return {}
    rows = halo.scattered if transposed else halo.windows
    return {d: rows(stride[d - 2], padding[d - 2], dilation[d - 2] * (w.shape[d] - 1))
            for d in range(2, w.ndim) if d not in patches}


def _patches_align(x_pl, fine_shape, coarse_shape, w_shape, mesh, patches) -> bool:
    """Does every shard of a patched dim hold whole patches, exactly those of the other side's shard?"""
    for d in patches:
        parts = [n for p, n in zip(x_pl, mesh.sizes) if p == Shard(d) and n > 1]
        if parts and not chunks_align(fine_shape[d], coarse_shape[d], w_shape[d], parts):
            return False
    return True


def _no_empty_shard(x_pl, w_pl, x_shape, w_shape, mesh) -> bool:
    """Does every rank hold a channel and a point of X and a slice of W's channels? torch.chunk leaves
    the last ranks none when a dim is small (6 over 4: 2, 2, 2, 0), and a convolution refuses an empty one."""
    for coord in itertools.product(*map(range, mesh.sizes)):
        if min(local_shape(x_shape, x_pl, mesh.sizes, coord)[1:]) == 0:
            return False
        if min(local_shape(w_shape, w_pl, mesh.sizes, coord)[:2]) == 0:
            return False
    return True


def _patch_gemm_call(node, sharding, rank, local_inputs):
    transposed = _conv_args(node)[3]
    return (patch_conv_transpose if transposed else patch_conv), tuple(local_inputs), {}


def _patch_gemm_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The GEMM at the tensor-core rate, plus cutting the patches out and putting them back."""
    x, w, y = node.args[0].meta["val"], node.args[1].meta["val"], node.meta["val"]
    sizes, coord = ctx.mesh.sizes, ctx.coord0
    xs, ws = (local_shape(v.shape, pl, sizes, coord) for v, pl in zip((x, w), strategy.inputs))
    ys = local_shape(y.shape, strategy.outputs[0], sizes, coord)
    moved = (math.prod(xs) + math.prod(ys)) * y.dtype.itemsize
    gemm = roofline_time(flops(node.target, [xs, ws], [ys]), moved + math.prod(ws) * y.dtype.itemsize,
                         y.dtype, ctx.device, "matmul")
    passes = 1 + (backward_factor(node.target) if ctx.training and grad else 0)
    return float((gemm + memory_time(2 * moved, ctx.device)) * passes), float("nan")


registry.add(registry.Kernel(PATCH_GEMM, _patch_gemm_call, None, _patch_gemm_cost))


def _halo_call(node, sharding, rank, local_inputs):
    stride, _, dilation, transposed, groups, output_padding = _conv_args(node)
    x, y = node.args[0].meta["val"], node.meta["val"]
    found = halo.fetches(x.shape, y.shape, sharding.inputs[0], _stencils(node), rank.mesh.sizes)
    fetches = halo.kernel_fetches(found, rank)
    kwargs = dict(stride=stride, padding=_padding(node), dilation=dilation, groups=groups, fetches=fetches)
    if not transposed:
        return halo_conv, tuple(local_inputs), kwargs
    # the fetched rows' scatter starts at output row stride x first - padding: keep this rank's from there
    offset = local_offset(y.shape, sharding.outputs[0], rank.mesh.sizes, rank.coord)
    ys = local_shape(y.shape, sharding.outputs[0], rank.mesh.sizes, rank.coord)
    crops = tuple((d, offset[d] - (stride[d - 2] * wants[rank.coord[a]][0][0] - kwargs["padding"][d - 2]), ys[d])
                  for d, a, wants, _ in found)
    return halo_conv_transpose, tuple(local_inputs), {**kwargs, "output_padding": output_padding, "crops": crops}


def _halo_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The convolution on the fetched rows (the most any rank fetches), and the fetches."""
    x, w, y = node.args[0].meta["val"], node.args[1].meta["val"], node.meta["val"]
    backward = ctx.training and grad
    fetch, fetched = halo.fetch_time(x, strategy.inputs[0], y.shape, _stencils(node), ctx, backward)
    ws = local_shape(w.shape, strategy.inputs[1], ctx.mesh.sizes, ctx.coord0)
    ys = local_shape(y.shape, strategy.outputs[0], ctx.mesh.sizes, ctx.coord0)
    moved = (math.prod(fetched) + math.prod(ws) + math.prod(ys)) * x.dtype.itemsize
    conv_time = roofline_time(flops(node.target, [fetched, ws], [ys]), moved, x.dtype, ctx.device, "conv")
    t = conv_time * (1 + (backward_factor(node.target) if backward else 0)) + fetch
    return float(t), float(math.prod(fetched) * x.dtype.itemsize if backward else 0)


registry.add(registry.Kernel(HALO, _halo_call, halo.traffic, _halo_cost))
