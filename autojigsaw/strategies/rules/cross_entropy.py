"""Rule for aten.cross_entropy_loss: classes sharded (vocab-parallel), rows sharded, or replicated.

Per mesh axis, for cross_entropy_loss(X, T, weight, reduction, ignore_index, label_smoothing),
X of shape (rows, C) or (N, C, d...) and T of class indices:
  whole    X, T Replicate                        -> Replicate, the op itself
  classes  X Shard(class dim), T Replicate       -> Replicate, kernel vocab_parallel_cross_entropy:
                                                    one all-gather of 3 statistics per row
  rows     X Shard(d), T Shard(d'), d a row dim  -> none: Shard(d'); sum and mean: Partial(sum), the
                                                    mean divided by the global count of non-ignored
                                                    targets (all-reduced by the kernel; a local op
                                                    would divide by the local count)
The class dim is sharded over one axis at most (the kernel reduces over one group). Language
models' losses (Hugging Face's ForCausalLMLoss: view to (rows, C), then this op) thus never gather
the logits. Class weights keep the classes whole (and a mean whole rows).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from ...cost_model.compute import roofline_time
from ...dtypes import acc_dtype
from ...ir import GLOBAL, PLACEMENTS, bytes_sent
from ...kernels import registry
from ...kernels.cross_entropy import REDUCTIONS, vocab_parallel_cross_entropy
from ...placements import local_offset, local_shape
from .base import AxisOption, per_axis, register

aten = torch.ops.aten
R = Replicate()
VOCAB = "vocab_parallel_cross_entropy"
ROWS = "sharded_rows_cross_entropy"  # classes whole, rows sharded, a global mean


def loss_args(node: Node) -> tuple[Node | None, str, int, float]:
    """(weight, reduction, ignore_index, label_smoothing) of a cross_entropy_loss node."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    given = dict(zip(names, node.args[2:]), **node.kwargs)
    return (given.get("weight"), REDUCTIONS[given.get("reduction", 1)], given.get("ignore_index", -100),
            float(given.get("label_smoothing", 0.0)))


def _class_dim(x) -> int:
    return 1 if x.ndim > 1 else 0


def _target_dim(d: int, cd: int) -> int:
    """The target dim matching a row dim d of the logits (the target has no class dim)."""
    return d if d < cd else d - 1


@register(aten.cross_entropy_loss.default)
def cross_entropy(node, mesh, candidates):
    x, target = node.args[0].meta["val"], node.args[1].meta["val"]
    weight, reduction, _, _ = loss_args(node)
    cd = _class_dim(x)
    indices = x.is_floating_point() and not (target.is_floating_point() or target.is_complex())
    kernel_ok = indices and weight is None
    extra = (R,) * (len(candidates) - 2)  # the class weights stay whole

    def options(n):
        opts = [AxisOption((R, R) + extra, (R,))]
        if n == 1 or not indices:
            return opts
        if kernel_ok and x.shape[cd] >= n:
            opts.append(AxisOption((Shard(cd), R) + extra, (R,), kernel=VOCAB, note="classes sharded"))
        if reduction == "mean" and not kernel_ok:
            return opts
        for d in range(x.ndim):
            if d != cd and x.shape[d] >= n:
                td = _target_dim(d, cd)
                out = Shard(td) if reduction == "none" else Partial()
                opts.append(AxisOption((Shard(d), Shard(td)) + extra, (out,), note="rows"))
        return opts

    found = [s for s in per_axis(mesh, options) if s.inputs[0].count(Shard(cd)) <= 1]
    # A mean over sharded rows needs the global count: the kernel, also with the classes whole.
    return [replace(s, kernel=ROWS) if s.kernel == "local" and reduction == "mean"
            and any(isinstance(p, Shard) for p in s.inputs[0]) else s for s in found]


def _axes(node: Node, placements, sizes) -> tuple[int | None, list[int]]:
    """(the axis sharding the classes or None, the axes sharding rows) of the logits' placements."""
    cd = _class_dim(node.args[0].meta["val"])
    classes = [a for a, p in enumerate(placements) if p == Shard(cd) and sizes[a] > 1]
    rows = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim != cd and sizes[a] > 1]
    return (classes[0] if classes else None), rows


def _call(node, sharding, rank, local_inputs):
    x = node.args[0].meta["val"]
    cd = _class_dim(x)
    _, reduction, ignore_index, smoothing = loss_args(node)
    sizes = rank.mesh.sizes
    a, rows = _axes(node, sharding.inputs[0], sizes)
    count_over = tuple(rank.axis(b) for b in rows) if reduction == "mean" else ()
    kwargs = dict(classes=x.shape[cd], offset=local_offset(x.shape, sharding.inputs[0], sizes, rank.coord)[cd],
                  axis=None if a is None else rank.axis(a), count_over=count_over)
    return vocab_parallel_cross_entropy, (local_inputs[0], local_inputs[1], reduction, ignore_index, smoothing), kwargs


def _stats_bytes(rows: int, acc_bytes: int, smoothing: bool) -> int:
    """Input bytes of the one all-gather over the class axis (the backward sends nothing): per row
    the max, the sum of exponentials, the target logit (and the logit sum to smooth)."""
    return (4 if smoothing else 3) * rows * acc_bytes


def _rows(shape, cd: int) -> int:
    return math.prod(shape[:cd]) * math.prod(shape[cd + 1:])


def _traffic(node, rank, backward) -> list[tuple[str, int]]:
    x = node.args[0]
    val = x.meta[GLOBAL]
    shape = local_shape(val.shape, x.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)
    kw, acc = node.kwargs, acc_dtype(val.dtype).itemsize
    stats = _stats_bytes(_rows(shape, _class_dim(val)), acc, node.args[4] > 0)
    n = kw["axis"].size if kw["axis"] is not None else 1
    out = [("all_gather", bytes_sent("all_gather", stats, n))] if n > 1 else []
    return out + [("all_reduce", bytes_sent("all_reduce", acc, rows.size)) for rows in kw["count_over"]]


def _cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """Exp and sums over the local logits (read twice), the all-reduces; saves x, lse and the target."""
    x, target = node.args[0].meta["val"], node.args[1].meta["val"]
    cd = _class_dim(x)
    shape = local_shape(x.shape, strategy.inputs[0], ctx.mesh.sizes, ctx.coord0)
    numel = math.prod(shape)
    rows = _rows(shape, cd)
    acc = acc_dtype(x.dtype).itemsize
    local = float(roofline_time(5 * numel, 2 * numel * x.dtype.itemsize, acc_dtype(x.dtype), ctx.device))
    a, row_axes = _axes(node, strategy.inputs[0], ctx.mesh.sizes)
    _, reduction, _, smoothing = loss_args(node)
    t = local
    if a is not None:
        t += ctx.collective_time("all_gather", _stats_bytes(rows, acc, smoothing > 0), a)
    if reduction == "mean":
        t += sum(ctx.collective_time("all_reduce", acc, b) for b in row_axes)
    backward = ctx.training and grad
    if backward:  # softmax minus one-hot on the local shard: no communication
        t += float(roofline_time(5 * numel, 3 * numel * x.dtype.itemsize, acc_dtype(x.dtype), ctx.device))
    saved = numel * x.dtype.itemsize + rows * (acc + target.dtype.itemsize) if backward else 0.0
    return t, float(saved)


registry.add(registry.Kernel(VOCAB, _call, _traffic, _cost))
registry.add(registry.Kernel(ROWS, _call, _traffic, _cost))
