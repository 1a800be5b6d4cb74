"""Adaptive average pooling to one point over a sharded dim.

Each rank pools its rows and weights the result by the fraction of the dim's rows it holds, so
the shares add up (a Partial sum over the axes that shard the dim) to the single-device mean,
with chunks of any size: the feature map is never gathered, only the pooled point is summed.
(To more points, the windows vary in size: kernels/resize.py.)
"""

from __future__ import annotations

import torch


def partial_mean_pool(x: torch.Tensor, output_size, *, op, share: float) -> torch.Tensor:
    """`op(x, output_size)` (an adaptive average pooling) of this rank's rows, times `share`."""
    return op(x, output_size) * share
