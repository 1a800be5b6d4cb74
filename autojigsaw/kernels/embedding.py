"""A lookup in an embedding table whose rows (the vocabulary) are split over a mesh axis.

Each rank holds a chunk of the rows starting at `offset` and looks up only the ids it holds, zeros
for the others: the ranks' outputs are partial sums of the lookup (Megatron's vocabulary-parallel
embedding; DTensor's MaskPartial). Autograd differentiates the masked lookup, so each rank's
weight gradient covers its own rows only, and the ids another rank holds add nothing.
"""

from __future__ import annotations

import torch


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, offset: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """This rank's part of `embedding(whole_weight, ids)`: the rows it holds looked up, zeros elsewhere."""
    rows = weight.shape[0]
    local = ids - offset
    held = (local >= 0) & (local < rows)
    padding = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    looked = torch.ops.aten.embedding(weight, torch.where(held, local, 0), padding, scale_grad_by_freq, sparse)
    return looked * held.unsqueeze(-1).to(looked.dtype)
