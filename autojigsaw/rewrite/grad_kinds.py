"""Gradient kinds: for every replicated value, is its gradient full or partial on each axis?

A Replicate value's gradient is either full on every rank ("R") or a contribution that
sums to it over the axis ("P") -- see kernels/collectives.py. A reader whose output is
sharded or partial on the axis hands back "P"; one whose output stays replicated passes
on its own output's kind; the model output seeds "R". A value takes "P" as soon as one
reader returns "P": the sum is then formed once, where the value was made -- a gather
becomes gather/reduce-scatter, a parameter gets one all-reduce (as DDP does; on an FSDP axis
FSDP's reduce-scatter sums it instead, and a full one is masked to rank 0 before that sum) -- and
readers that return "R" are masked to rank 0. One exception, Megatron's: an op with replicated
parameters (a norm) whose partial gradient would only be summed upstream by the all-reduces that
made its input sums it at its own output, so its parameters need no all-reduce of their own.
Only this pass inserts gradient collectives.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Replicate
from torch.fx import Graph, GraphModule, Node

from ..ir import AXIS, GLOBAL, ORIGIN, PLACEMENTS, GradKind, needs_grad
from ..kernels import collectives as C
from ..kernels.experts import expert_gather_mm

aten = torch.ops.aten


# Collectives that read a Replicate value on their own axis: either gradient kind is fine.
_EITHER = {C.shard_slice, C.to_partial}
# Collectives that make a Replicate value on their axis: their backward follows its kind.
_MAKERS = {C.all_gather, C.all_reduce}
# Kernels whose Replicate output on their `axis` is gathered inside: their backward follows its kind too.
_GATHERING_KERNELS = {expert_gather_mm}
COLLECTIVES = {C.all_gather, C.reduce_scatter, C.all_reduce, C.all_to_all, C.shard_slice,
               C.to_partial, C.grad_all_reduce, C.grad_mask}


def set_grad_kinds(gm: GraphModule, rank, sources: set[str], params: set[str], *,
                   summed_axis: int | None = None, summed_params: set[str] = frozenset()) -> None:
    """Set `grad=` on every collective, insert gradient masks and all-reduces (in place).

    `sources`: names of the placeholders whose gradient is wanted (parameters, inputs);
    `params`: those that are parameters; `summed_axis`: the mesh axis over which the gradients of
    `summed_params` are summed outside the graph (FSDP's reduce-scatter, an accumulated step's sum).
    """
    graph = gm.graph
    grad = needs_grad(gm, sources)
    kinds: dict[tuple[Node, int, int], GradKind] = {}
    for node in reversed(list(graph.nodes)):
        if not grad.get(node) or node.op == "output":
            continue
        multi = len(node.meta[PLACEMENTS]) > 1
        for idx, pl in enumerate(node.meta[PLACEMENTS]):
            axes = [a for a, p in enumerate(pl or ()) if isinstance(p, Replicate) and rank.mesh.sizes[a] > 1]
            said = {a: {u: _contribution(u, a, kinds) for u in _readers(node, idx)} for a in axes}
            for a in axes:
                kinds[(node, idx, a)] = GradKind.P if GradKind.P in said[a].values() else GradKind.R
            if not multi:  # a tuple's readers are getitems, which settle themselves
                _agree(graph, node, {a: (kinds[(node, idx, a)], said[a]) for a in axes}, rank)
                if node.op == "placeholder":
                    summed_outside = summed_axis if node.name in summed_params else None
                    _sum_gradient_at(graph, node, [a for a in axes if kinds[(node, idx, a)] == GradKind.P
                                                   and a != summed_outside], rank)
                    if summed_outside in axes and kinds[(node, idx, summed_outside)] == GradKind.R:
                        # full on every rank of the axis, whose sum outside the graph adds them up: keep rank 0's
                        mask = (C.grad_mask, summed_outside, {"axis": rank.axis(summed_outside)})
                        _before_readers(graph, node, [mask])
                _settle_before_parameters(graph, node, [a for a in axes if kinds[(node, idx, a)] == GradKind.P],
                                          kinds, grad, params, rank)
        if multi:
            _mask_full_items(graph, node, kinds, rank)


def _settle_before_parameters(graph: Graph, node: Node, axes: list[int], kinds, grad, params, rank) -> None:
    """Sum a partial gradient at the output of an op with replicated parameters (a norm before a
    column-sharded linear), as Megatron does, when the sum would otherwise only happen upstream
    at all-reduces whose backward then has nothing to do: one all-reduce of the activation's
    gradient instead of one per parameter, the same bytes, fewer collectives. Whether an input
    wants a gradient does not enter (the planner counts traffic without knowing it)."""
    if node.op != "call_function" or node.target in COLLECTIVES:
        return
    own = [i for i in node.all_input_nodes if i.op == "placeholder" and i.name in params]
    settle = [a for a in axes if any(isinstance(p.meta[PLACEMENTS][0][a], Replicate) for p in own)
              and _all_summed_upstream([i for i in node.all_input_nodes if i.op != "placeholder"], a, grad)]
    _sum_gradient_at(graph, node, settle, rank)
    for a in settle:
        kinds[(node, 0, a)] = GradKind.R


def _all_summed_upstream(values: list[Node], a: int, grad) -> bool:
    """Does some gradient of `values` reach a maker over axis a, and every one only makers?"""
    found = [_summed_upstream(v, a, grad) for v in values]
    return True in found and False not in found


# Ops through which a gradient passes unchanged or summed: its partial kind reaches their inputs.
_PASS_GRAD = {aten.add.Tensor, aten.sub.Tensor, aten.view.default, aten._unsafe_view.default,
              aten.reshape.default, aten.clone.default, aten.alias.default}


def _summed_upstream(value: Node, a: int, grad) -> bool | None:
    """Would a partial gradient of `value` on axis a be summed only by all-reduces over a that made
    it (so that a full one makes their backward free)? None: no gradient reaches any maker."""
    if not grad.get(value) or value.op == "placeholder":
        return None
    if value.op != "call_function":
        return False
    if value.target is C.all_reduce:
        return value.meta.get(AXIS) == a
    if value.target in _PASS_GRAD:
        found = [_summed_upstream(i, a, grad) for i in value.all_input_nodes]
        return None if all(f is None for f in found) else False not in found
    return False


def _mask_full_items(graph: Graph, node: Node, kinds, rank) -> None:
    """A tuple's gradients form one buffer (unbind's is a stack): items with a full gradient
    among partial ones on an axis are masked to rank 0, so that all of it is partial."""
    n_items = len(node.meta[PLACEMENTS])
    for a in range(rank.mesh.ndim):
        if GradKind.P not in {kinds.get((node, i, a)) for i in range(n_items)}:
            continue
        for item in [u for u in node.users if kinds.get((node, u.args[1], a)) == GradKind.R]:
            readers = list(item.users)
            masked = _chain(graph, item, [(C.grad_mask, a, {"axis": rank.axis(a)})])
            for u in readers:
                u.replace_input_with(item, masked)
            kinds[(node, item.args[1], a)] = GradKind.P


def _readers(node: Node, idx: int) -> list[Node]:
    return [u for u in node.users
            if not (u.op == "call_function" and u.target is operator.getitem) or u.args[1] == idx]


def _agree(graph: Graph, node: Node, decided: dict, rank) -> None:
    """Make the producer and every reader of `node` follow the decided kind on each axis."""
    masks: dict[Node, list[int]] = {}
    for a, (kind, said) in decided.items():
        for u, c in said.items():
            if c is None:
                u.update_kwarg("grad", kind)
            elif c == GradKind.R and kind == GradKind.P:
                masks.setdefault(u, []).append(a)
        if node.op == "call_function" and node.target in _MAKERS and node.meta.get(AXIS) == a:
            node.update_kwarg("grad", kind)
        elif node.op == "call_function" and node.target in _GATHERING_KERNELS and node.kwargs["axis"] == rank.axis(a):
            node.update_kwarg("grad", kind)
    shared: dict[tuple[int, ...], Node] = {}
    for u, axes in masks.items():
        key = tuple(axes)
        if key not in shared:
            shared[key] = _chain(graph, node, [(C.grad_mask, a, {"axis": rank.axis(a)}) for a in axes])
        u.replace_input_with(node, shared[key])


def _sum_gradient_at(graph: Graph, node: Node, axes: list[int], rank) -> None:
    """All-reduce the gradient of `node` over `axes`: grad_all_reduce ops between it and its readers."""
    _before_readers(graph, node, [(C.grad_all_reduce, a, {"axis": rank.axis(a)}) for a in axes])


def _before_readers(graph: Graph, node: Node, calls) -> None:
    """node -> calls (as _chain) -> every reader of node."""
    if not calls:
        return
    users = list(node.users)
    last = _chain(graph, node, calls)
    for u in users:
        u.replace_input_with(node, last)


def _chain(graph: Graph, node: Node, calls) -> Node:
    """node -> call -> call ...: identity-forward gradient ops, one per (fn, axis, kwargs)."""
    value = node
    for fn, a, kwargs in calls:
        with graph.inserting_after(value):
            new = graph.call_function(fn, (value,), kwargs)
        new.meta.update({k: v for k, v in node.meta.items() if k in (PLACEMENTS, GLOBAL, ORIGIN)})
        new.meta[AXIS] = a
        value = new
    return value


def _contribution(reader: Node, a: int, kinds) -> GradKind | None:
    """What `reader` hands back for a Replicate input on axis a: R, P or None (either is fine)."""
    if reader.op == "output":
        return GradKind.R
    if reader.target in _EITHER and reader.meta.get(AXIS) == a:
        return None
    outs = reader.meta.get(PLACEMENTS, ())
    if any(pl is not None and not isinstance(pl[a], Replicate) for pl in outs):
        return GradKind.P
    own = [kinds.get((reader, i, a), GradKind.R) for i in range(len(outs))]
    return GradKind.P if GradKind.P in own else GradKind.R
