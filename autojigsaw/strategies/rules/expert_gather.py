"""The "experts gathered" strategy of the grouped expert matmul: expert parallelism, output all-gathered.

Per mesh axis (kernel expert_gather_mm, kernels/experts.py):
  experts gathered  X Replicate, W Shard(0), offs Replicate -> Replicate: each rank multiplies the
                    rows routed to its experts (one contiguous range, rows being sorted by expert)
                    and the ranges are all-gathered: (n - 1) x its rows sent, where the Partial
                    "experts" strategy all-reduces the whole output. X's gradient is gathered the
                    same way (full on every rank), the experts' needs no collective.
The experts are split over one axis; the others run replicated or by columns under the same kernel.
Priced, like the Partial strategy, at balanced routing: S * E_r / E rows on a rank of E_r experts.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from ...cost_model.compute import backward_factor, roofline_time
from ...dtypes import reduce_dtype
from ...ir import GLOBAL, PLACEMENTS, GradKind, bytes_sent
from ...kernels import registry
from ...kernels.experts import expert_gather_mm
from ...placements import chunk_sizes, local_shape
from .base import AxisOption

R = Replicate()
KERNEL = "expert_gather_mm"


def gathered_options(n: int, experts: int, n_out: int) -> list[AxisOption]:
    """This strategy's options on an axis of n ranks: the experts split, or (elsewhere) replicated or by columns."""
    if n == 1:
        return []
    opts = [AxisOption((R, R, R), (R,), kernel=KERNEL)]
    if experts >= n:
        opts.append(AxisOption((R, Shard(0), R), (R,), kernel=KERNEL, note="experts gathered"))
    if n_out >= n:
        opts.append(AxisOption((R, Shard(2), R), (Shard(1),), kernel=KERNEL, note="columns"))
    return opts


def keep(strategy, mesh_sizes) -> bool:
    """Is `strategy` of another kernel, or of this one with the experts split over exactly one axis?"""
    return strategy.kernel != KERNEL or len(_axes(strategy.inputs[1], mesh_sizes)) == 1


def _axes(w_placements, mesh_sizes) -> list[int]:
    return [a for a, p in enumerate(w_placements) if p == Shard(0) and mesh_sizes[a] > 1]


def _call(node, sharding, rank, local_inputs):
    axes = _axes(sharding.inputs[1], rank.mesh.sizes)
    if len(axes) != 1 or sharding.outputs[0][axes[0]] != R or sharding.inputs[0][axes[0]] != R:
        raise ValueError(f"node {node.name!r}: {KERNEL} splits the experts (W Shard(0)) over one mesh axis "
                         f"and takes X and gives its output Replicate there, but the plan says inputs "
                         f"{sharding.inputs}, output {sharding.outputs[0]}; name kernel 'grouped_mm' for another "
                         "layout, or plan again")
    a = axes[0]
    experts = chunk_sizes(node.args[1].meta["val"].shape[0], rank.mesh.sizes[a])
    return expert_gather_mm, (node.target, *local_inputs), {"experts": experts, "axis": rank.axis(a),
                                                            "grad": GradKind.R}


def _rows(total_rows: int, experts: tuple[int, ...], coord: int) -> int:
    """Rows routed to rank `coord`'s experts at balanced routing."""
    return total_rows * experts[coord] // sum(experts)


def _traffic(node, rank, backward) -> list[tuple[str, int]]:
    """The output's gather; backward: X's gather (full gradient) or the output gradient's ranges sent (partial)."""
    x, w = node.args[1], node.args[2]
    kw = node.kwargs
    n, coord = kw["axis"].size, kw["axis"].coord
    val = x.meta[GLOBAL]
    k = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)[1]
    n_out = local_shape(node.meta[GLOBAL].shape, node.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)[1]
    total, rows, itemsize = val.shape[0], _rows(val.shape[0], kw["experts"], coord), val.dtype.itemsize
    out = [("all_gather", bytes_sent("all_gather", rows * n_out * itemsize, n))]
    if kw["grad"] == GradKind.R and x in backward:
        out.append(("all_gather", bytes_sent("all_gather", rows * k * itemsize, n)))
    elif kw["grad"] == GradKind.P and (x in backward or w in backward):
        out.append(("send_recv", (total - rows) * n_out * reduce_dtype(val.dtype, "sum").itemsize))
    return out


def _cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """A matmul of the rank's rows on its shards, the output's gather, backward X's gradient's gather."""
    x, w, out = node.args[0].meta["val"], node.args[1].meta["val"], node.meta["val"]
    sizes = ctx.mesh.sizes
    (a,) = _axes(strategy.inputs[1], sizes)
    w_local = local_shape(w.shape, strategy.inputs[1], sizes, ctx.coord0)
    n_out = local_shape(out.shape, strategy.outputs[0], sizes, ctx.coord0)[1]
    rows = _rows(x.shape[0], chunk_sizes(w.shape[0], sizes[a]), ctx.coord0[a])
    itemsize = x.dtype.itemsize
    moved = (rows * w_local[1] + rows * n_out + x.shape[0] * n_out + math.prod(w_local)) * itemsize
    t = float(roofline_time(2 * rows * w_local[1] * w_local[2], moved, x.dtype, ctx.device, "matmul"))
    if ctx.training and grad:
        t *= 1 + backward_factor(torch.ops.aten.mm.default)
        t += ctx.collective_time("all_gather", rows * w_local[1] * itemsize, a)
    return t + ctx.collective_time("all_gather", rows * n_out * itemsize, a), math.nan


registry.add(registry.Kernel(KERNEL, _call, _traffic, _cost))
