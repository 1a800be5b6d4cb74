"""Redistribution: the per-axis collective steps that move a tensor between two placements.

One function decides the steps, so the cost model prices exactly what the rewrite emits.
Shards of one dim over several axes nest in axis order (DTensor's default), so an axis is
gathered only after every later axis sharding the same dim, and sharded again after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from ..placements import Placements, chunk_sizes, local_shape


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis, from placements `before` to `after`."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | shard_slice | to_partial
    axis: int
    before: Placements
    after: Placements

    @property
    def communicates(self) -> bool:
        return self.kind not in ("shard_slice", "to_partial")


def _set(pl: Placements, axis: int, p) -> Placements:
    return pl[:axis] + (p,) + pl[axis + 1:]


def _dims(p) -> set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


def redistribute_steps(src: Placements, dst: Placements) -> list[Step]:
    """The steps from `src` to `dst` (an empty list when they are equal)."""
    changed = {a for a in range(len(src)) if src[a] != dst[a]}
    if not changed:
        return []
    if len(changed) == 1:
        (a,) = changed
        step = _direct(src, dst, a)
        if step is not None:
            return [step]
    # Undo every changed axis and every later axis nested in the same dim, then redo.
    grow = True
    while grow:
        grow = False
        for a in list(changed):
            dims = _dims(src[a]) | _dims(dst[a])
            for b in range(a + 1, len(src)):
                if b not in changed and dims & (_dims(src[b]) | _dims(dst[b])):
                    changed.add(b)
                    grow = True
    steps, cur = [], src
    for a in sorted(changed, reverse=True):
        if isinstance(cur[a], Shard):
            steps.append(Step("all_gather", a, cur, nxt := _set(cur, a, Replicate())))
            cur = nxt
        elif isinstance(cur[a], Partial):
            steps.append(Step("all_reduce", a, cur, nxt := _set(cur, a, Replicate())))
            cur = nxt
    for a in sorted(changed):
        if isinstance(dst[a], Shard):
            steps.append(Step("shard_slice", a, cur, nxt := _set(cur, a, dst[a])))
            cur = nxt
        elif isinstance(dst[a], Partial):
            steps.append(Step("to_partial", a, cur, nxt := _set(cur, a, dst[a])))
            cur = nxt
    assert cur == dst, (src, dst, cur)
    return steps


def _direct(src: Placements, dst: Placements, a: int) -> Step | None:
    """A single collective for a change on one axis, when nesting allows it."""
    s, d = src[a], dst[a]
    later = set().union(*(_dims(p) for p in src[a + 1:])) if a + 1 < len(src) else set()
    if isinstance(d, Replicate) and isinstance(s, Partial):
        return Step("all_reduce", a, src, dst)
    if isinstance(d, Replicate) and isinstance(s, Shard) and s.dim not in later:
        return Step("all_gather", a, src, dst)
    if isinstance(d, Shard) and d.dim not in later:
        if isinstance(s, Replicate):
            return Step("shard_slice", a, src, dst)
        if isinstance(s, Partial) and s.reduce_op in ("sum", "avg"):
            return Step("reduce_scatter", a, src, dst)
        if isinstance(s, Shard) and s.dim not in later:
            return Step("all_to_all", a, src, dst)
    if isinstance(d, Partial) and isinstance(s, Replicate) and d.reduce_op in ("sum", "avg"):
        return Step("to_partial", a, src, dst)
    return None


def adjoint(step: Step, partial_grad: bool) -> Step | None:
    """The collective that carries the gradient back through `step`, or None if it is local.

    `partial_grad`: the gradient of the replicated result arrives as partial contributions
    (see kernels/collectives.py), so a gather turns into a reduce-scatter.
    """
    a, before, after = step.axis, step.before, step.after
    if step.kind == "all_gather":
        return Step("reduce_scatter", a, _set(after, a, Partial()), before) if partial_grad else None
    if step.kind == "all_reduce":
        return Step("all_reduce", a, _set(after, a, Partial()), after) if partial_grad else None
    if step.kind == "reduce_scatter":
        return Step("all_gather", a, after, _set(before, a, Replicate()))
    if step.kind in ("all_to_all", "shard_slice"):
        return Step("all_to_all" if step.kind == "all_to_all" else "all_gather", a, after, before)
    return None


# ---------------------------------------------------------------- sizes of each step


def step_sizes(step: Step, shape, mesh_sizes, coord) -> dict:
    """Static arguments of a step on the rank at `coord`: dims and per-rank chunk sizes."""
    n = mesh_sizes[step.axis]
    if step.kind in ("all_gather", "shard_slice"):
        p = step.before[step.axis] if step.kind == "all_gather" else step.after[step.axis]
        whole = step.after if step.kind == "all_gather" else step.before
        full = local_shape(shape, whole, mesh_sizes, coord)[p.dim]
        return {"dim": p.dim, "sizes": chunk_sizes(full, n)}
    if step.kind == "reduce_scatter":
        p = step.after[step.axis]
        full = local_shape(shape, step.before, mesh_sizes, coord)[p.dim]
        return {"dim": p.dim, "sizes": chunk_sizes(full, n), "op": step.before[step.axis].reduce_op}
    if step.kind == "all_to_all":
        s, d = step.before[step.axis], step.after[step.axis]
        src_full = local_shape(shape, _set(step.before, step.axis, Replicate()), mesh_sizes, coord)
        return {"src_dim": s.dim, "dst_dim": d.dim, "src_sizes": chunk_sizes(src_full[s.dim], n),
                "dst_sizes": chunk_sizes(src_full[d.dim], n)}
    if step.kind == "all_reduce":
        return {"op": step.before[step.axis].reduce_op}
    return {"op": step.after[step.axis].reduce_op}  # to_partial


def step_input_numel(step: Step, shape, mesh_sizes, coord) -> tuple[str, int] | None:
    """(collective, elements of the buffer this rank sends into it), as the kernels pad it."""
    if not step.communicates:
        return None
    local = list(local_shape(shape, step.before, mesh_sizes, coord))
    args = step_sizes(step, shape, mesh_sizes, coord)
    n = mesh_sizes[step.axis]
    if step.kind == "all_gather":
        local[args["dim"]] = max(args["sizes"])
    elif step.kind == "reduce_scatter":
        local[args["dim"]] = n * max(args["sizes"])
    elif step.kind == "all_to_all":
        local[args["src_dim"]] = max(args["src_sizes"])
        local[args["dst_dim"]] = n * max(args["dst_sizes"])
    return step.kind, math.prod(local)
