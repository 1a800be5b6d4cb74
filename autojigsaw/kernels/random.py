"""Dropout and other random draws on local shards that draw exactly the single-device numbers.

Every rank draws the whole tensor from the same generator state, as the single-device model
would, and keeps its own slice: training matches the single-device run bit for bit. The price
is drawing (not storing) the whole tensor on every rank.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten
# Draws whose numbers depend on their tensors' values (a probability, a mean); the others read
# only the shape (randn_like, normal_, ...), so their whole tensor need not be filled.
_READ_VALUES = {aten.bernoulli.default, aten.bernoulli.Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
                aten.normal.Tensor_Tensor}


def dropout(x: torch.Tensor, p: float, train: bool | None, *, shape: tuple[int, ...], stride: tuple[int, ...],
            offset: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, keep-mask) of aten.native_dropout for the shard at `offset` of a `shape` tensor whose
    single-device strides are `stride`: the generator fills the mask in memory order, so a transposed
    input's mask is drawn in its transposed order."""
    if not train or p == 0:
        return aten.native_dropout(x, p, train)
    ones = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device).fill_(1)
    _, mask = aten.native_dropout(ones, p, train)
    mask = _own_slice(mask, offset, x.shape)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul(scale), mask


def draw(op, args: tuple, kwargs: dict, *, shape: tuple[int, ...], offset: tuple[int, ...],
         strides: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Elementwise random `op` (randn_like, bernoulli, ...) for the shard at `offset` of a `shape` output.

    Each tensor argument becomes a whole one of its global `strides`, holding the shard's values where
    the draw reads them (zeros elsewhere: an elementwise draw takes as many numbers from the generator
    whatever the values); the whole tensor is drawn and this rank's slice kept.
    """
    stride = iter(strides)
    local_shape = next(t.shape for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

    def whole(t):
        if not isinstance(t, torch.Tensor):
            return t
        full = torch.empty_strided(shape, next(stride), dtype=t.dtype, device=t.device)
        if op in _READ_VALUES:
            full.zero_()[_slices(offset, t.shape)] = t
        return full

    with torch.no_grad():  # the draws' gradients are zero: nothing flows back through them
        args, kwargs = pytree.tree_map(whole, (args, kwargs))
        return _own_slice(op(*args, **kwargs), offset, local_shape)


def _slices(offset, size) -> tuple[slice, ...]:
    return tuple(slice(start, start + n) for start, n in zip(offset, size))


def _own_slice(full: torch.Tensor, offset, size) -> torch.Tensor:
    """This rank's part of `full`, in storage of its own (a view would keep the whole tensor alive)."""
    if tuple(size) == tuple(full.shape):
        return full
    return full[_slices(offset, size)].clone()
