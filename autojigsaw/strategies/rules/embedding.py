"""Rule for aten.embedding: the table whole, split by columns, or split by rows (the vocabulary).

Per mesh axis, for embedding(weight [V, D], ids):
  whole       weight R, ids R                   -> R
  columns     weight Shard(1), ids R            -> Shard(last dim): each rank's part of every vector
  ids split   weight R, ids Shard(d)            -> Shard(d)
  vocabulary  weight Shard(0), ids R            -> Partial(sum), kernel vocab_parallel_embedding: each
                                                   rank looks up the ids it holds (kernels/embedding.py)
The first three are DTensor's; the vocabulary split is what transformers' "embedding_rowwise" and torch's
RowwiseParallel on an nn.Embedding place, which DTensor computes with a private placement.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...kernels import registry
from ...kernels.embedding import vocab_parallel_embedding
from ...placements import local_offset
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
VOCAB = "vocab_parallel_embedding"


@register(aten.embedding.default)
def embedding(node, mesh, candidates):
    weight, ids = node.args[0].meta["val"], node.args[1].meta["val"]
    out_dim = ids.ndim  # the vector dim of the output

    def options(n):
        opts = [AxisOption((R, R), (R,))]
        if n == 1:
            return opts
        if weight.shape[1] >= n:
            opts.append(AxisOption((Shard(1), R), (Shard(out_dim),)))
        opts += [AxisOption((R, Shard(d)), (Shard(d),)) for d in range(ids.ndim) if ids.shape[d] >= n]
        if weight.shape[0] >= n:
            opts.append(AxisOption((Shard(0), R), (Partial(),), kernel=VOCAB, note="vocabulary split"))
        return opts

    # the vocabulary is split over one axis at most; its kernel masks the ids of the others
    return [s for s in per_axis(mesh, options) if s.kernel == "local" or s.inputs[0].count(Shard(0)) == 1]


def _call(node, sharding, rank, local_inputs):
    weight = node.args[0].meta["val"]
    offset = local_offset(weight.shape, sharding.inputs[0], rank.mesh.sizes, rank.coord)[0]
    extra = list(node.args[2:])
    return vocab_parallel_embedding, (local_inputs[0], local_inputs[1], offset, *extra), {}


registry.add(registry.Kernel(VOCAB, _call))
