"""Cross-entropy over logits whose class dim is sharded over a mesh axis, without gathering them.

Each rank holds a chunk of the classes (torch.chunk sizes, empty chunks allowed) starting at
`offset`. Each rank's row statistics -- maximum, sum of exponentials below it, and the target
logit, picked only by the rank owning the target class (0 elsewhere) -- go out in one all-gather
and are merged into the log-sum-exp as flash attention merges its blocks: one collective of
3 numbers per row (one latency; two all-reduces, Megatron's max then sums, cost four on two
ranks), in fp32 for half types (fp64 stays fp64). Label smoothing adds the row sum of the
logits. The backward is local: softmax minus the (smoothed) one-hot, on this rank's shard.

Rows may also be sharded over other axes (`count_over`): the loss is then this rank's part of
the sum, and a mean divides by the global count of non-ignored targets (all-reduced), as the
single-device mean does. With `axis=None` the classes are whole and only the rows are sharded.
"""

from __future__ import annotations

import torch

from ..dtypes import acc_dtype
from ..mesh import MeshAxis
from .collectives import raw_all_gather, raw_all_reduce
from .once import differentiable_once

REDUCTIONS = ("none", "mean", "sum")  # aten's enum order: 0, 1, 2


def _class_dim(x: torch.Tensor) -> int:
    return 1 if x.ndim > 1 else 0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, reduction, ignore_index, smoothing, classes, offset, axis, count_over):
        cd = _class_dim(x)
        local = x.shape[cd]
        xa = x.to(acc_dtype(x.dtype))
        valid = target != ignore_index
        shifted = target - offset
        owned = valid & (shifted >= 0) & (shifted < local)
        if local:
            row_max = xa.amax(cd)
            picked = xa.gather(cd, shifted.clamp(0, local - 1).unsqueeze(cd)).squeeze(cd)
            picked = torch.where(owned, picked, 0.0)
        else:  # amax rejects an empty dim: the identity of max
            row_max = xa.new_full(target.shape, float("-inf"))
            picked = xa.new_zeros(target.shape)
        # exp of -inf - -inf is nan: a chunk whose row is all -inf adds nothing
        safe_max = torch.where(row_max == float("-inf"), 0.0, row_max)
        stats = [row_max, (xa - safe_max.unsqueeze(cd)).exp().sum(cd), picked]
        if smoothing:
            stats.append(xa.sum(cd))
        k = len(stats)
        stats = torch.stack(stats)
        if axis is not None and axis.size > 1:  # every rank's statistics, merged like flash attention's lse
            stats = raw_all_gather(stats, 0, (k,) * axis.size, axis).unflatten(0, (axis.size, k))
        else:
            stats = stats.unsqueeze(0)
        top = stats[:, 0].amax(0)
        scale = torch.where(stats[:, 0] == float("-inf"), 0.0, (stats[:, 0] - top).exp())
        lse = top + (stats[:, 1] * scale).sum(0).log()
        totals = stats[:, 2:].sum(0)
        loss = lse - totals[0]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (lse - totals[1] / classes)
        loss = torch.where(valid, loss, 0.0)
        count = None
        if reduction == "mean":
            count = valid.sum().to(xa.dtype)
            for rows in count_over:
                count = count if rows.size == 1 else raw_all_reduce(count, "sum", rows)
            loss = loss.sum() / count
        elif reduction == "sum":
            loss = loss.sum()
        ctx.save_for_backward(x, target, lse, count)
        ctx.args = (reduction, ignore_index, smoothing, classes, offset)
        return loss.to(x.dtype)

    @staticmethod
    @differentiable_once
    def backward(ctx, g):
        x, target, lse, count = ctx.saved_tensors
        reduction, ignore_index, smoothing, classes, offset = ctx.args
        cd = _class_dim(x)
        local = x.shape[cd]
        xa = x.to(lse.dtype)
        valid = target != ignore_index
        per_row = g.to(lse.dtype)
        if reduction == "mean":
            per_row = per_row / count
        per_row = torch.where(valid, per_row.expand(target.shape), 0.0)
        dx = (xa - lse.unsqueeze(cd)).exp() * per_row.unsqueeze(cd)
        if smoothing:
            dx = dx - (smoothing / classes) * per_row.unsqueeze(cd)
        shifted = target - offset
        owned = valid & (shifted >= 0) & (shifted < local)
        if local:
            hit = torch.where(owned, -(1 - smoothing) * per_row, 0.0)
            dx = dx.scatter_add(cd, shifted.clamp(0, local - 1).unsqueeze(cd), hit.unsqueeze(cd))
        return dx.to(x.dtype), None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(x, target, reduction: str = "mean", ignore_index: int = -100,
                                 label_smoothing: float = 0.0, *, classes: int, offset: int,
                                 axis: MeshAxis | None, count_over: tuple[MeshAxis, ...] = ()):
    """F.cross_entropy of logits `x` whose class dim (1, or 0 for one row) holds this rank's chunk.

    `classes`: the global number of classes; `offset`: the first class of this rank's chunk;
    `axis`: the mesh axis the classes are sharded over (None: not sharded);
    `count_over`: each axis sharding the rows, for a global mean.
    """
    kernel, where = "vocab_parallel_cross_entropy", axis.name if axis is not None else None
    if reduction not in REDUCTIONS:
        raise ValueError(f"{kernel}: reduction={reduction!r} on axis {where!r}; pass one of {REDUCTIONS}")
    if not x.is_floating_point() or target.is_floating_point() or target.is_complex():
        raise ValueError(f"{kernel}: logits of dtype {x.dtype} and class-index target of dtype {target.dtype} "
                         f"on axis {where!r}; pass float logits and integer class indices (probability "
                         "targets need the whole classes: replicate the logits)")
    cd = _class_dim(x)
    rows = tuple(x.shape[:cd]) + tuple(x.shape[cd + 1:])
    if rows != tuple(target.shape) or not 0 <= offset <= offset + x.shape[cd] <= classes:
        raise ValueError(f"{kernel}: logits chunk of shape {tuple(x.shape)} at class offset {offset} does not "
                         f"match target {tuple(target.shape)} and {classes} classes on axis {where!r}; pass this "
                         "rank's chunk of the class dim and the target of the same rows")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{kernel}: label_smoothing={label_smoothing} on axis {where!r}; pass a value in [0, 1]")
    return _VocabParallelCrossEntropy.apply(x, target, reduction, ignore_index, float(label_smoothing),
                                            classes, offset, axis, tuple(count_over))
