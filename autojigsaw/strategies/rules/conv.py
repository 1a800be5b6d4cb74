"""Rules for 2-D convolutions, patch embeddings above all: batch, channel and spatial sharding.

Per mesh axis, for Y = conv2d(X, W, b) with X [B, Cin, H, W], W [Cout, Cin / groups, kh, kw]:
  batch    X Shard(0), W and b Replicate               -> Y Shard(0)
  out      X Replicate, W Shard(0), b Shard(0)          -> Y Shard(1)   (groups == 1)
  in       X Shard(1), W Shard(1), b Partial            -> Y Partial    (groups == 1)
  spatial  X Shard(2 or 3), W and b Replicate           -> Y the same dim
Spatial sharding needs no halo: only for a patch embedding (stride == kernel, no padding or
dilation) whose shard boundaries fall on patch boundaries on every rank, as they do when
the patch rows (columns) divide evenly over the axes that shard them.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...placements import chunk_sizes, local_shape
from .base import AxisOption, per_axis, register
from .matmul import trim_options

aten = torch.ops.aten
R = Replicate()


@register(aten.conv2d.default, aten.convolution.default)
def conv2d(node, mesh, candidates):
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    y = node.meta["val"]
    if x.ndim != 4:
        return None  # conv1d / conv3d through convolution.default: DTensor's rule
    stride, padding, dilation, transposed, groups = _conv_args(node)
    has_bias = len(candidates) == 3
    patches = [d for d in (2, 3) if _is_patch_dim(w.shape[d], stride[d - 2], padding[d - 2],
                                                  dilation[d - 2], transposed)]

    def options(n):
        opts = [AxisOption((R, R, R), (R,))]
        if n == 1:
            return opts
        if x.shape[0] >= n:
            opts.append(AxisOption((Shard(0), R, R), (Shard(0),), note="batch"))
        if groups == 1 and not transposed:
            if w.shape[0] >= n:
                opts.append(AxisOption((R, Shard(0), Shard(0)), (Shard(1),), note="out channels"))
            if x.shape[1] >= n:
                opts.append(AxisOption((Shard(1), Shard(1), Partial()), (Partial(),),
                                       note="in channels"))
        opts += [AxisOption((Shard(d), R, R), (Shard(d),), note="patches")
                 for d in patches if y.shape[d] >= n]
        return opts

    found = per_axis(mesh, lambda n: trim_options(options(n), has_bias))
    return [s for s in found if _patches_align(s.inputs[0], x.shape, y.shape, w.shape, mesh)
            and _no_empty_shard(s.inputs[0], s.inputs[1], x.shape, w.shape, mesh)]


def _conv_args(node):
    """(stride, padding, dilation, transposed, groups) of conv2d or convolution, defaults filled."""
    args = list(node.args) + [None] * 9
    if node.target is aten.conv2d.default:
        stride, padding, dilation, groups = (args[3] or [1, 1], args[4] or [0, 0],
                                             args[5] or [1, 1], args[6] or 1)
        transposed = False
    else:
        stride, padding, dilation, transposed, groups = args[3], args[4], args[5], args[6], args[8]
    if isinstance(padding, str):  # "valid" or "same"
        padding = [0, 0] if padding == "valid" else [None, None]
    return [_pair(stride), _pair(padding), _pair(dilation), bool(transposed), groups]


def _pair(v):
    return list(v) * 2 if len(v) == 1 else list(v)


def _is_patch_dim(kernel: int, stride: int, padding, dilation: int, transposed: bool) -> bool:
    return not transposed and kernel == stride and padding == 0 and dilation == 1


def _patches_align(x_pl, x_shape, y_shape, w_shape, mesh) -> bool:
    """Does every shard of a spatial dim of X hold whole patches, exactly those of Y's shard?"""
    for d in (2, 3):
        parts = [n for p, n in zip(x_pl, mesh.sizes) if p == Shard(d) and n > 1]
        if parts and not _aligned(x_shape[d], y_shape[d], w_shape[d], parts):
            return False
    return True


def _no_empty_shard(x_pl, w_pl, x_shape, w_shape, mesh) -> bool:
    """Does every rank hold a channel and a pixel of X and a channel of W? torch.chunk leaves the
    last ranks none when a dim is small (6 over 4: 2, 2, 2, 0), and conv2d refuses an empty one."""
    for coord in itertools.product(*map(range, mesh.sizes)):
        if min(local_shape(x_shape, x_pl, mesh.sizes, coord)[1:]) == 0:
            return False
        if min(local_shape(w_shape, w_pl, mesh.sizes, coord)[:2]) == 0:
            return False
    return True


def _aligned(size_in: int, size_out: int, patch: int, parts: list[int]) -> bool:
    """Do torch.chunk's nested chunks of size_in equal `patch` x those of size_out?"""
    if not parts:
        return size_in == patch * size_out
    ins, outs = chunk_sizes(size_in, parts[0]), chunk_sizes(size_out, parts[0])
    return all(_aligned(i, o, patch, parts[1:]) for i, o in zip(ins, outs))
