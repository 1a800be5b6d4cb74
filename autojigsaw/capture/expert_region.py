"""Routed-expert regions of a captured graph, each replaced by one call of `autojigsaw::routed_experts`.

A region is recognised from its grouped matmuls outward, op for op as transformers writes its
default experts (capture/routed_experts.py): the first grouped matmul's rows are the tokens
gathered in the order of a sort of the router's top-k experts, its offsets the cumulative
histogram of the sorted ids; its output goes through the gate's activation (times the up
projection) into a second grouped matmul on the same offsets, whose rows are weighted by the
sorted scores, put back in token order and summed over the k choices. Every node but the last
must serve the region alone. The router itself (softmax, sigmoid, grouped top-k, any code
that yields `index` and `weights` per token) stays in the graph as the model writes it.

A grouped matmul whose region is not recognised (custom routing, a bias, a norm after the
experts) stays as it is, planned by strategies/rules/moe.py, with the reason under
NOT_DISPATCHED for the plan to show. The parameters only routed experts read are marked
EXPERT_WEIGHT: their dim 0 is the experts, which the data axis may split (strategies/data_pins.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from ..modules import EXPERT_WEIGHT
from .routed_experts import NOT_DISPATCHED, OP

aten = torch.ops.aten
GROUPED_MMS = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SORTS = (aten.sort.default, aten.sort.stable)


class _NoMatch(Exception):
    """The region around a grouped matmul is not transformers' routed experts; the message says why."""


@dataclass(frozen=True)
class Region:
    """One recognised region: its five inputs, the experts' body, its nodes (the output last)."""

    x: Node
    index: Node
    weights: Node
    w1: Node
    w2: Node
    mm: str
    act: str
    gated: bool
    nodes: tuple[Node, ...]


def collapse_routed_experts(gm: GraphModule) -> None:
    """Replace every recognised region by one routed_experts call (in place); note why others are not."""
    seen: set[Node] = set()
    for node in list(gm.graph.nodes):
        if node in seen or not is_grouped_mm(node):
            continue
        try:
            region = match(node)
        except _NoMatch as e:
            partners = [u for u in _arg(node, 2, "offs").users if is_grouped_mm(u)] if _arg(node, 2, "offs") else []
            for g in {node, *partners}:
                g.meta[NOT_DISPATCHED] = str(e)
                seen.add(g)
            continue
        _collapse(gm.graph, region)
    _mark_expert_weights(gm.graph)


def is_grouped_mm(node: Node) -> bool:
    return node.op == "call_function" and str(node.target) in GROUPED_MMS


def _arg(node: Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _expect(ok: bool, reason: str) -> None:
    if not ok:
        raise _NoMatch(reason)


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _sole_user(node: Node, what: str) -> Node:
    _expect(len(node.users) == 1, f"{node.name} feeds {len(node.users)} nodes, not only {what}")
    return next(iter(node.users))


def _uncast(node: Node) -> Node:
    """`node` without a dtype cast in front (transformers casts the rows to the weights' dtype)."""
    return node.args[0] if _is(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} else node


def match(g1: Node) -> Region:
    """The region whose first grouped matmul is `g1`; _NoMatch says why there is none."""
    rows, w1, offs = _grouped_operands(g1)
    x, perm, k = _dispatched_rows(_uncast(rows))
    index, sort = _router_choice(perm, k, x)
    counted = _offsets(offs, sort, w1)
    body, act, gated, h = _body(g1)
    g2 = _sole_user(h, "the second grouped matmul")
    h_cast = None
    if _is(g2, aten._to_copy.default):
        h_cast, g2 = g2, _sole_user(g2, "the second grouped matmul")
    _expect(is_grouped_mm(g2) and str(g2.target) == str(g1.target), "the experts' body is not grouped_mm, "
            "activation, grouped_mm (a bias, a norm or another op after the experts)")
    rows2, w2, offs2 = _grouped_operands(g2)
    _expect(offs2 is offs and _uncast(rows2) is h, "the second grouped matmul has other offsets or rows")
    weights, combine = _combine(g2, perm, index, x)
    dispatch = [sort.args[0], sort, perm, _uncast(rows).args[1][0], _uncast(rows), rows, *counted]
    nodes = _in_order(g1.graph, [*dispatch, g1, *body, h_cast, g2, *combine])
    region = Region(x, index, weights, w1, w2, str(g1.target), act, gated, nodes)
    _check_closed(region)
    return region


def _in_order(graph: Graph, nodes: list[Node | None]) -> tuple[Node, ...]:
    """The distinct nodes in graph order."""
    wanted = {n for n in nodes if n is not None}
    return tuple(n for n in graph.nodes if n in wanted)


def _check_closed(region: Region) -> None:
    """Every node of the region but its output serves the region alone."""
    inside = set(region.nodes)
    for node in region.nodes[:-1]:
        outside = [u.name for u in node.users if u not in inside]
        _expect(not outside, f"{node.name} of the routed experts is also read by {', '.join(outside)}")


def _collapse(graph: Graph, region: Region) -> Node:
    """One routed_experts call in place of the region's nodes."""
    out = region.nodes[-1]
    with graph.inserting_before(out):
        new = graph.create_node("call_function", OP, (region.x, region.index, region.weights, region.w1, region.w2,
                                                      region.mm, region.act, region.gated), name="routed_experts")
    new.meta.update(out.meta)
    first_mm = next(n for n in region.nodes if is_grouped_mm(n))
    for key in ("nn_module_stack", "stack_trace"):  # the experts' module
        if key in first_mm.meta:
            new.meta[key] = first_mm.meta[key]
    out.replace_all_uses_with(new)
    for node in reversed(region.nodes):
        graph.erase_node(node)
    return new


def _mark_expert_weights(graph: Graph) -> None:
    """Mark the parameters whose only readers are routed experts' weights (through casts and transposes
    that keep dim 0, the experts)."""
    for node in graph.nodes:
        if node.op == "placeholder" and node.users and all(_reaches_expert_weight(u, node) for u in node.users):
            node.meta[EXPERT_WEIGHT] = True


def _reaches_expert_weight(user: Node, value: Node) -> bool:
    if _is(user, OP):
        return value in user.args[3:5] and value not in user.args[:3]
    keeps_dim0 = (_is(user, aten.transpose.int) and 0 not in {d % _val(value).ndim for d in user.args[1:3]}
                  or _is(user, aten.alias.default, aten._to_copy.default))
    return keeps_dim0 and bool(user.users) and all(_reaches_expert_weight(u, user) for u in user.users)


def _grouped_operands(g: Node) -> tuple[Node, Node, Node]:
    x, w, offs = _arg(g, 0, "self"), _arg(g, 1, "mat2"), _arg(g, 2, "offs")
    if str(g.target) == GROUPED_MMS[0]:
        _expect(_arg(g, 3, "bias") is None, "the grouped matmul adds a bias")
        _expect(_arg(g, 4, "out_dtype") is None, "the grouped matmul casts its output")
    _expect(offs is not None and _val(x) is not None and _val(x).ndim == 2 and _val(w).ndim == 3,
            "the grouped matmul is not rows [S, K] by experts [E, K, N] at offsets [E]")
    return x, w, offs


def _dispatched_rows(rows: Node) -> tuple[Node, Node, int]:
    """(tokens X, the sort's permutation, k) of rows = X[perm // k]."""
    reason = "its rows are not the tokens in the order of a sort of the router's top-k (x[perm // k])"
    _expect(_is(rows, aten.index.Tensor) and len(rows.args[1]) == 1, reason)
    x, (token,) = rows.args
    _expect(_is(token, aten.floor_divide.default) and isinstance(token.args[1], int), reason)
    perm, k = token.args
    _expect(_is(perm, operator.getitem) and perm.args[1] == 1 and _is(perm.args[0], *_SORTS), reason)
    return x, perm, k


def _router_choice(perm: Node, k: int, x: Node) -> tuple[Node, Node]:
    """(index [T, k], the sort) where the sort is of index.flatten(), ascending."""
    sort = perm.args[0]
    flat = sort.args[0]
    _expect(not sort.kwargs.get("descending", False) and (len(sort.args) < 3 or not sort.args[2]),
            "the routed rows are sorted in descending expert order")
    _expect(_is(flat, *_VIEWS) and _val(flat).ndim == 1, "the sorted ids are not the top-k indices flattened")
    index = flat.args[0]
    shape = tuple(_val(index).shape)
    _expect(len(shape) == 2 and shape[1] == k and not _val(index).is_floating_point(),
            f"the sorted ids are not a [tokens, {k}] top-k index")
    _expect(_val(x).ndim == 2 and _val(x).shape[0] == shape[0], "the tokens and the top-k index differ in count")
    return index, sort


def _offsets(offs: Node, sort: Node, w1: Node) -> list[Node]:
    """The nodes of offs = cumsum(histc(sorted ids)) over the E experts of w1."""
    reason = "its offsets are not the cumulative histogram of the sorted expert ids"
    _expect(_is(offs, aten.cumsum.default) and offs.args[1] == 0, reason)
    hist = offs.args[0]
    experts = _val(w1).shape[0]
    _expect(_is(hist, aten.histc.default) and tuple(hist.args[1:4]) == (experts, 0, experts - 1), reason)
    ids = _uncast(hist.args[0])
    _expect(_is(ids, operator.getitem) and ids.args == (sort, 0), reason)
    return [offs, hist, hist.args[0], ids]


def _activation(node: Node) -> str | None:
    if _is(node, aten.silu.default):
        return "silu"
    if _is(node, aten.relu.default):
        return "relu"
    if _is(node, aten.gelu.default):
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    return None


def _body(g1: Node) -> tuple[list[Node], str, bool, Node]:
    """(its nodes, activation, gated, its output) of act(gate) * up or act(h) after the first grouped matmul."""
    first = _sole_user(g1, "the experts' activation")
    act = _activation(first)
    if act is not None and first.args[0] is g1:
        return [first], act, False, first
    reason = "the experts' body is not act(gate) * up or act(h) (silu, gelu, relu) between two grouped matmuls"
    n_out = _val(g1).shape[1]
    _expect(_is(first, aten.split.Tensor) and first.args[1] * 2 == n_out and first.args[2] in (-1, 1), reason)
    items = sorted(first.users, key=lambda u: u.args[1])
    _expect(len(items) == 2 and [u.args[1] for u in items] == [0, 1], reason)
    gate, up = items
    act_node = _sole_user(gate, "the activation")
    act = _activation(act_node)
    _expect(act is not None, reason)
    product = _sole_user(act_node, "the gate's product")
    _expect(_is(product, aten.mul.Tensor) and set(product.args) == {act_node, up} and len(up.users) == 1, reason)
    return [first, gate, up, act_node, product], act, True, product


def _combine(g2: Node, perm: Node, index: Node, x: Node) -> tuple[Node, list[Node]]:
    """(scores [T, k], the combine's nodes, its output last): (y * w[perm])[inverse].view(T, k, H).sum(1)."""
    reason = "the experts' rows are not weighted by the sorted scores, unsorted and summed over the top-k"
    weighted = _sole_user(g2, "the scores' product")
    _expect(_is(weighted, aten.mul.Tensor) and g2 in weighted.args, reason)
    scale = weighted.args[1] if weighted.args[0] is g2 else weighted.args[0]
    _expect(_is(scale, aten.unsqueeze.default) and scale.args[1] in (-1, 1), reason)
    picked = scale.args[0]
    _expect(_is(picked, aten.index.Tensor) and list(picked.args[1]) == [perm], reason)
    flat = picked.args[0]
    _expect(_is(flat, *_VIEWS) and _val(flat).ndim == 1, reason)
    weights = flat.args[0]
    _expect(tuple(_val(weights).shape) == tuple(_val(index).shape) and _val(weights).is_floating_point(), reason)
    unsorted = _sole_user(weighted, "the unsort")
    _expect(_is(unsorted, aten.index.Tensor) and len(unsorted.args[1]) == 1, reason)
    inverse = unsorted.args[1][0]
    _expect(_is(inverse, aten.index_put.default) and list(inverse.args[1]) == [perm], reason)
    empty, positions = inverse.args[0], inverse.args[2]
    _expect(_is(empty, aten.empty_like.default) and empty.args[0] is perm, reason)
    _expect(_is(positions, aten.arange.default, aten.arange.start), reason)
    grouped = _sole_user(unsorted, "the view by token")
    tokens, k = _val(index).shape
    _expect(_is(grouped, *_VIEWS) and tuple(_val(grouped).shape)[:2] == (tokens, k), reason)
    summed = _sole_user(grouped, "the sum over the top-k")
    _expect(_is(summed, aten.sum.dim_IntList) and list(summed.args[1]) == [1] and not summed.kwargs.get("keepdim")
            and (len(summed.args) < 3 or not summed.args[2]), reason)
    out = summed
    if len(summed.users) == 1 and _is(next(iter(summed.users)), aten._to_copy.default):
        out = next(iter(summed.users))
    _expect(_val(out).dtype == _val(x).dtype and set(out.kwargs) <= {"dtype"},
            "the routed experts' output is not in the tokens' dtype")
    nodes = [weighted, scale, picked, flat, unsorted, inverse, empty, positions, grouped, summed]
    return weights, nodes + ([out] if out is not summed else [])
