"""Rule for the FFTs (torch.fft): shard a dim the transform does not touch, or replicate.

Spectral mixers (FourCastNet's AFNO, FNOs) transform a field over its spatial dims; every other
dim (samples, channels) is a batch to the FFT, so a shard of it needs nothing. A transformed dim
stays whole: a distributed FFT would need an all-to-all per dim.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from .base import other_dims_split, per_axis, register

aten = torch.ops.aten
_ONE_DIM = (aten.fft_fft.default, aten.fft_ifft.default, aten.fft_rfft.default, aten.fft_irfft.default,
            aten.fft_hfft.default, aten.fft_ihfft.default)
_TWO_DIMS = (aten.fft_fft2.default, aten.fft_ifft2.default, aten.fft_rfft2.default, aten.fft_irfft2.default)
_N_DIMS = (aten.fft_fftn.default, aten.fft_ifftn.default, aten.fft_rfftn.default, aten.fft_irfftn.default)


@register(*_ONE_DIM, *_TWO_DIMS, *_N_DIMS)
def fft(node: Node, mesh, candidates):
    x = node.args[0].meta["val"]
    transformed = _transformed_dims(node, x.ndim)
    return per_axis(mesh, other_dims_split(x.shape, transformed, note="a dim the FFT does not transform"))


def _transformed_dims(node: Node, ndim: int) -> set[int]:
    """The dims the transform runs over (every dim where the call leaves it to the sizes or to all)."""
    args = list(node.args) + [None] * 3
    dim = node.kwargs.get("dim", args[2])
    if dim is None:
        if node.target in _ONE_DIM:
            dim = -1
        elif node.target in _TWO_DIMS:
            dim = (-2, -1)
        else:  # fftn without dim: all dims, or the last len(s) -- both kept whole
            return set(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return {d % ndim for d in dims}
