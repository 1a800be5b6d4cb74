"""Dropout on local shards that draws exactly the single-device model's mask.

Every rank draws the mask of the whole tensor from the same generator state, as the
single-device model would, and keeps its own slice: training matches the single-device
run bit for bit. The price is drawing (not storing) the full mask on every rank.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def dropout(x: torch.Tensor, p: float, train: bool | None, *, shape: tuple[int, ...],
            offset: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, keep-mask) of aten.native_dropout for the shard of a `shape` tensor at `offset`."""
    if not train or p == 0:
        return aten.native_dropout(x, p, train)
    _, mask = aten.native_dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, train)
    for dim, (start, size) in enumerate(zip(offset, x.shape)):
        if size != shape[dim]:
            mask = mask.narrow(dim, start, size)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x.mul(mask).mul(scale), mask
