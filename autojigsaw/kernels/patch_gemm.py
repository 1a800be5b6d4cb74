"""A convolution over non-overlapping patches (stride == kernel, no padding) run as one GEMM.

Such a convolution is a linear map of each patch: cut the input into its patches, multiply by
the flattened filter, put the results back. cuDNN's convolutions are weak at this shape (with
TF32 they stay off the tensor cores, see cost_model.compute), so the GEMM is what vLLM and
transformers run for patch embeddings too. Works on local shards as they are: a shard of whole
patches is itself a patchwise convolution. Autograd differentiates the reshapes and the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def patch_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """conv{1,2,3}d(x, w, b, stride=kernel) for x [B, Cin, *spatial], w [Cout, Cin, *kernel]."""
    kernel, n = tuple(w.shape[2:]), w.ndim - 2
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    split = x.reshape(x.shape[0], x.shape[1], *[d for g, k in zip(grid, kernel) for d in (g, k)])
    # [B, Cin, T1, k1, .., Tn, kn] -> [B, T1..Tn, Cin, k1..kn]
    order = [0, *range(2, 2 + 2 * n, 2), 1, *range(3, 3 + 2 * n, 2)]
    patches = split.permute(order).reshape(x.shape[0], *grid, -1)
    y = F.linear(patches, w.reshape(w.shape[0], -1), b)
    return y.movedim(-1, 1).contiguous()


def patch_conv_transpose(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """conv_transpose{1,2,3}d(x, w, b, stride=kernel) for x [B, Cin, *grid], w [Cin, Cout, *kernel]."""
    kernel, n, cout = tuple(w.shape[2:]), w.ndim - 2, w.shape[1]
    grid = tuple(x.shape[2:])
    y = F.linear(x.movedim(1, -1), w.reshape(w.shape[0], -1).t())  # [B, T1..Tn, Cout * k1..kn]
    y = y.reshape(x.shape[0], *grid, cout, *kernel)
    # [B, T1..Tn, Cout, k1..kn] -> [B, Cout, T1, k1, .., Tn, kn]
    order = [0, 1 + n, *[d for i in range(n) for d in (1 + i, 2 + n + i)]]
    y = y.permute(order).reshape(x.shape[0], cout, *[g * k for g, k in zip(grid, kernel)])
    return y if b is None else y + b.reshape(cout, *[1] * n)
