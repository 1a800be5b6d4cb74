"""Writes into a buffer (`key = x.new_empty(...); key[..., :k].copy_(a)`, as DeepSeek-V3's attention builds
its keys) become `aten.copy(slice, a)` once export makes the graph functional. That op has no derivative in
eager autograd ("derivative for aten::copy is not implemented" at the first backward), so each is replaced by
what it computes: its source, broadcast to the destination's shape and cast to its dtype.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten


def differentiable_copies(gm: GraphModule) -> None:
    """Replace every aten.copy(dst, src) of `gm` by src expanded to dst's shape and cast to its dtype."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.copy.default and not node.kwargs:
            node.replace_all_uses_with(_as_written(gm, node))
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _as_written(gm: GraphModule, copy: Node) -> Node:
    """The value copy(dst, src) writes: src broadcast to dst's shape, in its dtype."""
    dst, src = copy.args[:2]
    want, value = dst.meta["val"], src.meta["val"]
    out = src
    with gm.graph.inserting_before(copy):  # broadcast, then cast: eager's backward casts, then sums
        if tuple(value.shape) != tuple(want.shape):
            sizes = [s if isinstance(s, int) else gm.graph.call_function(aten.sym_size.int, (dst, i))
                     for i, s in enumerate(want.shape)]
            for i, s in enumerate(sizes):
                if isinstance(s, Node):
                    s.meta["val"] = want.shape[i]
            out = _call(gm, aten.expand.default, (out, sizes), {}, copy)
        if value.dtype != want.dtype:
            out = _call(gm, aten._to_copy.default, (out,), {"dtype": want.dtype}, copy)
    return out


def _call(gm: GraphModule, target, args: tuple, kwargs: dict, like: Node) -> Node:
    """A new node computing target(*args, **kwargs), its fake value computed, its stack trace like's."""
    node = gm.graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = like.meta["val"].fake_mode
    with mode:
        node.meta["val"] = target(*values[0], **values[1])
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node
