"""Rules for the grouped matmul of mixture-of-experts layers: experts over an axis, or each sharded.

Hugging Face's default experts (`grouped_mm`) sort the routed rows X [S, K] by expert and call a
grouped matmul (X, W [E, K, N], offs [E]): torch._grouped_mm in bf16, else transformers'
grouped_mm_fallback. Row i of the output is X[i] @ W[e] for the expert e whose range holds i.
Both get these strategies per mesh axis:
  replicated  X, W, offs Replicate                       -> Replicate
  experts     X Replicate, W Shard(0), offs Replicate    -> Partial: each rank computes the rows of
              its own experts, zero elsewhere (tokens stay replicated; priced at balanced routing)
  experts gathered  as experts, the output Replicate: the rows of each rank's experts all-gathered
              (rules/expert_gather.py, half the bytes of the Partial's all-reduce)
  columns     X Replicate, W Shard(2), offs Replicate    -> Shard(1)  (Megatron inside every expert)
  rows        X Shard(1), W Shard(1), offs Replicate     -> Partial
These serve grouped matmuls outside a recognised routed-experts region (capture/expert_region.py:
transformers' default experts become one routed_experts node, rules/routed_experts.py); their
strategies note why. The router (softmax, topk, sort, histc, index) runs replicated, as do other
forms of aten._grouped_mm (a bias, another out_dtype, 3-D x 3-D, 2-D x 2-D or 3-D x 2-D groups).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...capture.routed_experts import NOT_DISPATCHED
from ...cost_model.compute import backward_factor, roofline_time
from ...ir import Strategy
from ...kernels import registry
from ...placements import local_offset, local_shape
from .base import AxisOption, per_axis, register
from .expert_gather import gathered_options, keep

aten = torch.ops.aten
R = Replicate()
GROUPED_MM = "transformers.grouped_mm_fallback.default"
KERNEL = "grouped_mm"


def _unsupported_form(node) -> str | None:
    """Why the rule below cannot shard this grouped matmul (None: it can): only X [S, K], W [E, K, N], offs."""
    if node.target is not aten._grouped_mm.default:
        return None
    names = ("self", "mat2", "offs", "bias", "out_dtype")  # aten::_grouped_mm's schema
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    x, w, offs, bias, out_dtype = (given.get(k) for k in names)
    if (x.meta["val"].ndim, w.meta["val"].ndim) != (2, 3) or offs is None:
        return f"{x.meta['val'].ndim}-D x {w.meta['val'].ndim}-D{'' if offs is not None else ' without offs'}"
    if bias is not None:
        return "a bias"
    if node.meta["val"].dtype != x.meta["val"].dtype:
        return f"out_dtype {out_dtype}"
    return None


@register(GROUPED_MM, aten._grouped_mm.default)
def grouped_mm(node, mesh, candidates):
    if (form := _unsupported_form(node)) is not None:
        return [Strategy(((R,) * mesh.ndim,) * len(candidates), ((R,) * mesh.ndim,), fallback=True,
                         note=f"no sharding rule for grouped_mm of {form}")]  # its region's reason: the form
    experts, k, n_out = node.args[1].meta["val"].shape

    def options(n):
        opts = [AxisOption((R, R, R), (R,), kernel=KERNEL)]
        if n == 1:
            return opts
        if experts >= n:
            opts.append(AxisOption((R, Shard(0), R), (Partial(),), kernel=KERNEL, note="experts"))
        if n_out >= n:
            opts.append(AxisOption((R, Shard(2), R), (Shard(1),), kernel=KERNEL, note="columns"))
        if k >= n:
            opts.append(AxisOption((Shard(1), Shard(1), R), (Partial(),), kernel=KERNEL, note="rows"))
        return opts + gathered_options(n, experts, n_out)

    # experts split over several axes: every rank keeps at least one
    found = [s for s in per_axis(mesh, options)
             if math.prod(n for n, p in zip(mesh.sizes, s.inputs[1]) if p == Shard(0)) <= experts
             and keep(s, mesh.sizes)]
    return _with_reason(found, node.meta.get(NOT_DISPATCHED))


def _with_reason(strategies: list[Strategy], reason: str | None) -> list[Strategy]:
    """The strategies noting why their experts are not behind a token dispatch (capture/expert_region.py)."""
    if reason is None:
        return strategies
    told = f"no token dispatch: {reason}"
    return [dataclasses.replace(s, note=f"{s.note}; {told}" if s.note else told) for s in strategies]


def expert_rows_mm(op, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, first: int) -> torch.Tensor:
    """`op` on the rows routed to experts first .. first + len(w) - 1 only; the other rows zero.

    The rows are rotated so that the local experts' rows come first (an index, not a data-dependent
    slice: no host sync, compiles), the op computes those, and the result is rotated back. Rows
    past the op's last offset are masked to zero on the way in and out: torch._grouped_mm leaves
    them, and their input gradient, uninitialized (transformers' fallback writes zeros).
    """
    rows = torch.arange(x.shape[0], device=x.device)
    start = offs[first - 1] if first else torch.zeros((), dtype=offs.dtype, device=offs.device)
    local_offs = offs[first:first + w.shape[0]] - start
    routed = (rows < local_offs[-1]).unsqueeze(-1)
    out = op(torch.where(routed, x[(rows + start) % x.shape[0]], 0), w, local_offs)
    return torch.where(routed, out, 0)[(rows - start) % x.shape[0]]


def _expert_dims(strategy, mesh_sizes) -> tuple[int, ...]:
    """The mesh axes that split the experts (dim 0 of the weight)."""
    return tuple(a for a, p in enumerate(strategy.inputs[1]) if p == Shard(0) and mesh_sizes[a] > 1)


# The kernel: the op itself on local shards; with the experts split, only the local experts' rows.
def _call(node, sharding, rank, local_inputs):
    if not _expert_dims(sharding, rank.mesh.sizes):
        return node.target, tuple(local_inputs), {}
    first = local_offset(node.args[1].meta["val"].shape, sharding.inputs[1], rank.mesh.sizes, rank.coord)[0]
    return expert_rows_mm, (node.target, *local_inputs), {"first": first}


def _cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """A matmul of the rank's rows (S / n of them with the experts split n ways) on its shards."""
    x, w, out = node.args[0].meta["val"], node.args[1].meta["val"], node.meta["val"]
    sizes = ctx.mesh.sizes
    w_local = local_shape(w.shape, strategy.inputs[1], sizes, ctx.coord0)
    rows = x.shape[0] * w_local[0] / w.shape[0]  # balanced routing
    x_local = local_shape(x.shape, strategy.inputs[0], sizes, ctx.coord0)
    out_local = local_shape(out.shape, strategy.outputs[0], sizes, ctx.coord0)
    rotated = math.prod(x_local) + math.prod(out_local)
    moved = (rotated + math.prod(w_local)) * x.dtype.itemsize
    if _expert_dims(strategy, sizes):  # two row rotations and two masks read and write X and the output again
        moved += 4 * rotated * x.dtype.itemsize
    t = float(roofline_time(2 * rows * w_local[1] * w_local[2], moved, x.dtype, ctx.device, "matmul"))
    if ctx.training and grad:
        t *= 1 + backward_factor(aten.mm.default)
    return t, math.nan


registry.add(registry.Kernel(KERNEL, _call, cost=_cost))
