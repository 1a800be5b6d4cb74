"""Rule and cost for aten.einsum (XLNet's relative attention, a Fourier neural operator's mode mixing).

Per mesh axis, for an explicit equation ("bixy,ioxy->boxy"; "..." spelled out, right-aligned):
  an output letter   every operand that has it Shard there (Replicate where it broadcasts) -> Shard there
  a summed letter    every operand that has it Shard there (Replicate where it broadcasts) -> Partial
  replicated         every operand Replicate                                             -> Replicate
A letter repeated within one operand (a diagonal) is never sharded; an equation without "->"
(implicit output) gets no rule. Priced as a matmul: 2 FLOPs per point of the letters' joint range,
and in backward that again for each operand that needs a gradient.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from ...cost_model.compute import backward_factor, roofline_time
from ...cost_model.einsum import einsum_flops, spelled_letters
from ...kernels import registry
from ...placements import local_shape
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()


def _spelled(node: Node) -> tuple[list[str], str] | None:
    """(each operand's letters, the output's), "..." spelled out; None for an implicit output."""
    return spelled_letters(node.args[0], [t.meta["val"].ndim for t in node.args[1]])


@register(aten.einsum.default)
def einsum(node, mesh, candidates):
    letters = _spelled(node)
    if letters is None or len(letters[0]) != len(candidates):
        return None
    terms, out = letters
    shapes = [tuple(t.meta["val"].shape) for t in node.args[1]]
    out_shape = tuple(node.meta["val"].shape)
    size = {c: n for term, shape in zip(terms, shapes) for c, n in zip(term, shape) if n != 1}
    size.update(zip(out, out_shape))
    diagonal = {c for term in terms for c in term if term.count(c) > 1}

    def split(c: str) -> tuple:
        return tuple(Shard(term.index(c)) if c in term and shape[term.index(c)] != 1 else R
                     for term, shape in zip(terms, shapes))

    def options(n):
        opts = [AxisOption((R,) * len(terms), (R,))]
        if n == 1:
            return opts
        for c in sorted(set("".join(terms)) - diagonal):
            if size.get(c, 1) < n:
                continue
            if c in out:
                opts.append(AxisOption(split(c), (Shard(out.index(c)),), note=f"einsum over {c}"))
            else:
                opts.append(AxisOption(split(c), (Partial(),), note=f"einsum, partial sums over {c}"))
        return opts

    return per_axis(mesh, options)


def einsum_cost(node, strategy, ctx, grad: bool, operand_grads=None) -> tuple[float, float] | None:
    """(seconds, NaN): 2 FLOPs per point of the letters' joint local range, at the matmul roofline; its
    backward one such product per operand that needs a gradient (`operand_grads`), as a matmul's."""
    letters = _spelled(node)
    if letters is None:
        return None
    terms, out = letters
    local = [local_shape(tuple(t.meta["val"].shape), pl, ctx.mesh.sizes, ctx.coord0)
             for t, pl in zip(node.args[1], strategy.inputs)]
    val = node.meta["val"]
    local_out = local_shape(tuple(val.shape), strategy.outputs[0], ctx.mesh.sizes, ctx.coord0)
    moved = sum(math.prod(s) for s in [*local, local_out]) * val.dtype.itemsize
    t = float(roofline_time(einsum_flops(terms, out, [*local, local_out]), moved, val.dtype, ctx.device, "matmul"))
    return t * (1 + (backward_factor(aten.mm.default, operand_grads) if ctx.training and grad else 0.0)), math.nan


registry.local_cost(aten.einsum.default, einsum_cost)
