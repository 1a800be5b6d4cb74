"""Mean squared error over sharded input and target: this rank's share of the global loss.

Each rank sums the squared differences of its shard and divides by the global element count,
so the shares add up (a Partial sum over the axes that shard the tensors) to the single-device
mean, with shards of any size. Autograd gives each rank its shard of the gradient.
"""

from __future__ import annotations

import torch

from ..dtypes import acc_dtype


def sharded_mse_loss(x: torch.Tensor, target: torch.Tensor, count: int, reduction: str) -> torch.Tensor:
    """sum((x - target)^2) over this shard, / `count` (the global number of elements) for "mean"."""
    squares = (x - target).pow(2).sum(dtype=acc_dtype(x.dtype))
    return (squares / count if reduction == "mean" else squares).to(x.dtype)
