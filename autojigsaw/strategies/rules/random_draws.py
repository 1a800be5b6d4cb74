"""Rules for ops that draw random numbers (randn_like, rand_like, bernoulli, normal_, ...).

Every rank's generator is seeded alike, so an op run on each rank's shard would give every
shard the same numbers: a diffusion model's noise repeated across the batch, with no error.
An elementwise draw with no gradient shards through the "draw" kernel, which draws the whole
tensor as one device would and keeps the rank's slice; any other seeded op with no rule of
its own (a gamma sample, an RNN with dropout) runs whole on every rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ...ir import output_values, tensor_inputs
from .base import DRAWS, AxisOption, per_axis, register

aten = torch.ops.aten

# Elementwise in every tensor input, as many numbers drawn per element whatever its value, and no
# gradient reaches those inputs (derivatives.yaml). Not poisson or a gamma sample: their rejection
# samplers draw more or fewer numbers by value, so a whole draw around one shard is not one device's.
_DRAWN_ELEMENTWISE = {
    aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor, aten.cauchy.default,
    aten.exponential.default, aten.geometric.default, aten.log_normal.default,
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
    aten.normal_functional.default, aten.rand_like.default,
    aten.randint_like.default, aten.randint_like.low_dtype, aten.randint_like.Tensor,
    aten.randn_like.default, aten.random.default, getattr(aten.random, "from"), aten.random.to,
    aten.uniform.default,
}


@register(DRAWS)
def draws(node, mesh, candidates):
    shape, inputs = node.meta["val"].shape, tensor_inputs(node)
    n_in, n_out = len(inputs), len(output_values(node))
    elementwise = node.target in _DRAWN_ELEMENTWISE and all(src.meta["val"].shape == shape for src, _ in inputs)

    def options(n):
        opts = [AxisOption((Replicate(),) * n_in, (Replicate(),) * n_out)]
        if elementwise and n > 1:
            opts += [AxisOption((Shard(d),) * n_in, (Shard(d),), kernel="draw",
                                note="whole draw, own slice") for d in range(len(shape)) if shape[d] >= n]
        return opts

    return per_axis(mesh, options)
