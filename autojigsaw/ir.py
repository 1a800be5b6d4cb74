"""What every stage shares: node.meta keys, Strategy, a node's tensor values, gradients, resharding steps.

Strategies write a node's legal ways to run (Strategy) under STRATEGIES; the cost model
prices them; the planner picks one; the rewrite applies it. Resharding between two
placements is a list of per-axis collective steps (`redistribute_steps`), decided in one
place so the cost model prices exactly what the rewrite emits; `bytes_sent` is the one
definition of the bytes a collective sends, for the kernels' counts and the planner's
predictions alike. Shards of one dim over several axes nest in axis order (DTensor's
default), so an axis is gathered only after every later axis sharding the same dim.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from enum import Enum

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from .dtypes import value_carries_grad
from .placements import Placements, chunk_sizes, local_shape

# ---------------------------------------------------------------- node.meta keys
# On the captured graph, strategies.annotate writes STRATEGIES. On a rewritten graph, the
# rewrite writes PLACEMENTS, GLOBAL and ORIGIN on every node, AXIS on every collective and
# KERNEL on every node that runs a registered kernel.

STRATEGIES = "autojigsaw_strategies"  # captured node: list[Strategy], its legal ways to run
PLACEMENTS = "autojigsaw_placements"  # rewritten node: tuple of its outputs' placements
GLOBAL = "autojigsaw_global"  # rewritten node: the global fake value(s) it holds a shard of
ORIGIN = "autojigsaw_origin"  # rewritten node: name of the captured node it serves
AXIS = "autojigsaw_axis"  # rewritten collective: index of the mesh axis it works on
KERNEL = "autojigsaw_kernel"  # rewritten kernel call: the name of its kernels.registry.Kernel


# ---------------------------------------------------------------- strategies and values


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: placements of its tensor inputs and outputs, and the kernel."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    kernel: str = "local"
    fallback: bool = False
    note: str = ""

    @property
    def output(self) -> Placements:
        return self.outputs[0]


def tensor_inputs(node: Node) -> list[tuple[Node, int]]:
    """The tensor values a node reads, as (producer, output index), in flattened arg order."""
    if node.op == "call_function" and node.target is operator.getitem:
        return [(node.args[0], node.args[1])]
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [(a, 0) for a in leaves if isinstance(a, Node) and _is_tensor_value(a)]


def with_local_tensors(args, kwargs: dict, tensors) -> tuple[tuple, dict]:
    """(args, kwargs) of a node with its tensor inputs replaced by `tensors`, in order (its local shards)."""
    tensors = iter(tensors)

    def local(arg):
        return next(tensors) if isinstance(arg, Node) and isinstance(arg.meta.get("val"), torch.Tensor) else arg

    return pytree.tree_map(local, (tuple(args), dict(kwargs)))


def draws_random_numbers(node: Node) -> bool:
    """A seeded op that draws: not one whose dropout probability is 0 or that runs in eval (attention)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    arguments = node.target._schema.arguments
    value = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
             for i, a in enumerate(arguments)}
    return value.get("dropout_p", 1) != 0 and value.get("p", 1) != 0 and value.get("train", True) is not False


def _is_tensor_value(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val))


def output_values(node: Node) -> list[torch.Tensor | None]:
    """The node's outputs (one entry per tuple element), non-tensors as None."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return [val if isinstance(val, torch.Tensor) else None]


def needs_grad(gm: GraphModule, sources: set[str], value_key: str = GLOBAL) -> dict[Node, bool]:
    """Nodes whose outputs receive a gradient: of a differentiable dtype, downstream of a source, and
    upstream of an output along such nodes (a detach -- a no_grad region's output -- passes none).

    `value_key`: the meta entry holding each node's value (the captured graph's is "val").
    """
    out: dict[Node, bool] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            out[node] = node.name in sources
            continue
        vals = node.meta.get(value_key)
        vals = vals if isinstance(vals, (tuple, list)) else [vals]
        out[node] = (node.target is not torch.ops.aten.detach.default and any(value_carries_grad(v) for v in vals)
                     and any(out.get(i, False) for i in node.all_input_nodes))
    reaches_output = {n for n in nodes if n.op == "output"}
    for node in reversed(nodes):
        if out[node] and any(u in reaches_output for u in node.users):
            reaches_output.add(node)
    return {node: g and (node in reaches_output or node.op == "output") for node, g in out.items()}


def grads_by_name(gm: GraphModule, sources: set[str]) -> dict[str, bool]:
    """needs_grad of a captured (not yet rewritten) graph, by node name."""
    return {node.name: g for node, g in needs_grad(gm, sources, "val").items()}


# ---------------------------------------------------------------- collectives and resharding steps

class _Named(str, Enum):
    """An enum whose members are their own names as strings: they compare, hash and print as such."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


class GradKind(_Named):
    """How the gradient of a Replicate value arrives on one mesh axis (see kernels/collectives.py)."""

    R = "R"  # the full gradient on every rank
    P = "P"  # a contribution on each rank; their sum over the axis is the gradient


class Collective(_Named):
    """A collective over one mesh axis: the resharding steps' and the kernels' traffic."""

    all_gather = "all_gather"  # Shard -> Replicate
    reduce_scatter = "reduce_scatter"  # Partial -> Shard
    all_reduce = "all_reduce"  # Partial -> Replicate
    all_to_all = "all_to_all"  # Shard(i) -> Shard(j)
    shard_slice = "shard_slice"  # Replicate -> Shard: a local slice, nothing sent
    to_partial = "to_partial"  # Replicate -> Partial: a local mask, nothing sent
    send_recv = "send_recv"  # a ring hop inside a kernel


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


def bytes_sent(kind: Collective | str, input_bytes: int, n: int) -> int:
    """Bytes one rank sends in `kind` over `n` ranks, given the bytes of its input buffer.

    all_gather: input is the local chunk; reduce_scatter and all_to_all: the full local
    buffer; all_reduce: the tensor reduced; send_recv: the message itself.
    """
    if n <= 1:
        return 0
    if kind == Collective.all_gather:
        return input_bytes * (n - 1)
    if kind in (Collective.reduce_scatter, Collective.all_to_all):
        return input_bytes * (n - 1) // n
    if kind == Collective.all_reduce:
        return 2 * input_bytes * (n - 1) // n
    if kind == Collective.send_recv:
        return input_bytes
    raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")


@dataclass(frozen=True)
class Step:
    """One collective on one mesh axis, from placements `before` to `after`."""

    kind: Collective
    axis: int
    before: Placements
    after: Placements

    @property
    def communicates(self) -> bool:
        return self.kind not in (Collective.shard_slice, Collective.to_partial)


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
            steps.append(Step(Collective.all_gather, a, cur, nxt := _set(cur, a, Replicate())))
            cur = nxt
        elif isinstance(cur[a], Partial):
            steps.append(Step(Collective.all_reduce, a, cur, nxt := _set(cur, a, Replicate())))
            cur = nxt
    for a in sorted(changed):
        if isinstance(dst[a], Shard):
            steps.append(Step(Collective.shard_slice, a, cur, nxt := _set(cur, a, dst[a])))
            cur = nxt
        elif isinstance(dst[a], Partial):
            steps.append(Step(Collective.to_partial, a, cur, nxt := _set(cur, a, dst[a])))
            cur = nxt
    assert cur == dst, (src, dst, cur)
    return steps


def _direct(src: Placements, dst: Placements, a: int) -> Step | None:
    """A single collective for a change on one axis, when nesting allows it."""
    s, d = src[a], dst[a]
    later = set().union(*(_dims(p) for p in src[a + 1:])) if a + 1 < len(src) else set()
    if isinstance(d, Replicate) and isinstance(s, Partial):
        return Step(Collective.all_reduce, a, src, dst)
    if isinstance(d, Replicate) and isinstance(s, Shard) and s.dim not in later:
        return Step(Collective.all_gather, a, src, dst)
    if isinstance(d, Shard) and d.dim not in later:
        if isinstance(s, Replicate):
            return Step(Collective.shard_slice, a, src, dst)
        if isinstance(s, Partial) and s.reduce_op in ("sum", "avg"):
            return Step(Collective.reduce_scatter, a, src, dst)
        if isinstance(s, Shard) and s.dim not in later:
            return Step(Collective.all_to_all, a, src, dst)
    if isinstance(d, Partial) and isinstance(s, Replicate) and d.reduce_op in ("sum", "avg"):
        return Step(Collective.to_partial, a, src, dst)
    return None


def adjoint(step: Step, partial_grad: bool) -> Step | None:
    """The collective that carries the gradient back through `step`, or None if it is local.

    `partial_grad`: the gradient of the replicated result arrives as partial contributions
    (see kernels/collectives.py), so a gather turns into a reduce-scatter.
    """
    a, before, after = step.axis, step.before, step.after
    if step.kind == Collective.all_gather:
        return Step(Collective.reduce_scatter, a, _set(after, a, Partial()), before) if partial_grad else None
    if step.kind == Collective.all_reduce:
        return Step(Collective.all_reduce, a, _set(after, a, Partial()), after) if partial_grad else None
    if step.kind == Collective.reduce_scatter:
        return Step(Collective.all_gather, a, after, _set(before, a, Replicate()))
    if step.kind in (Collective.all_to_all, Collective.shard_slice):
        return Step(Collective.all_to_all if step.kind == Collective.all_to_all else Collective.all_gather, a, after, before)
    return None


# ---------------------------------------------------------------- sizes of each step
# The static arguments of a step's collective on one rank; field names are its keywords.


@dataclass(frozen=True)
class Chunks:
    """all_gather, shard_slice: the dim split over the axis and every rank's chunk of it."""

    dim: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ScatterChunks:
    """reduce_scatter: the dim it scatters, every rank's chunk of it, and the reduction."""

    dim: int
    sizes: tuple[int, ...]
    op: str


@dataclass(frozen=True)
class SwapChunks:
    """all_to_all: the dim split before and after, and every rank's chunk of each."""

    src_dim: int
    dst_dim: int
    src_sizes: tuple[int, ...]
    dst_sizes: tuple[int, ...]


@dataclass(frozen=True)
class Reduction:
    """all_reduce, to_partial: the reduction."""

    op: str


StepSizes = Chunks | ScatterChunks | SwapChunks | Reduction


def step_sizes(step: Step, shape, mesh_sizes, coord) -> StepSizes:
    """Static arguments of a step on the rank at `coord`: dims and per-rank chunk sizes."""
    n = mesh_sizes[step.axis]
    if step.kind in (Collective.all_gather, Collective.shard_slice):
        p = step.before[step.axis] if step.kind == Collective.all_gather else step.after[step.axis]
        whole = step.after if step.kind == Collective.all_gather else step.before
        full = local_shape(shape, whole, mesh_sizes, coord)[p.dim]
        return Chunks(p.dim, chunk_sizes(full, n))
    if step.kind == Collective.reduce_scatter:
        p = step.after[step.axis]
        full = local_shape(shape, step.before, mesh_sizes, coord)[p.dim]
        return ScatterChunks(p.dim, chunk_sizes(full, n), step.before[step.axis].reduce_op)
    if step.kind == Collective.all_to_all:
        s, d = step.before[step.axis], step.after[step.axis]
        src_full = local_shape(shape, _set(step.before, step.axis, Replicate()), mesh_sizes, coord)
        return SwapChunks(s.dim, d.dim, chunk_sizes(src_full[s.dim], n), chunk_sizes(src_full[d.dim], n))
    if step.kind == Collective.all_reduce:
        return Reduction(step.before[step.axis].reduce_op)
    return Reduction(step.after[step.axis].reduce_op)  # to_partial


def step_input_numel(step: Step, shape, mesh_sizes, coord) -> tuple[str, int] | None:
    """(collective, elements of the buffer this rank sends into it), as the kernels pad it."""
    if not step.communicates:
        return None
    local = list(local_shape(shape, step.before, mesh_sizes, coord))
    args = step_sizes(step, shape, mesh_sizes, coord)
    n = mesh_sizes[step.axis]
    if isinstance(args, ScatterChunks):
        local[args.dim] = n * max(args.sizes)
    elif isinstance(args, Chunks):  # an all_gather: shard_slice sends nothing
        local[args.dim] = max(args.sizes)
    elif isinstance(args, SwapChunks):
        local[args.src_dim] = max(args.src_sizes)
        local[args.dst_dim] = n * max(args.dst_sizes)
    return step.kind, math.prod(local)
