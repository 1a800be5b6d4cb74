"""The strides a random draw's inputs have when the single-device model runs eagerly.

A CPU generator fills a tensor in memory order, so a dropout mask drawn in another layout than
the single-device one holds other numbers (a transposed input's mask is drawn transposed). Export's
fake tensors do not always have eager's strides: a convolution of a channels-last-strided view is
channels-last under fake CPU tensors and contiguous in eager. So a graph that draws is replayed on
the meta device, whose kernels lay tensors out as eager ones do, and each drawing node records its
inputs' strides.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

EAGER_STRIDES = "eager_strides"  # node.meta key: per tensor input of a drawing node, its eager strides

aten = torch.ops.aten


def record_eager_strides(gm: GraphModule, input_strides: dict[str, tuple[int, ...]]) -> None:
    """Set node.meta[EAGER_STRIDES] on every node that draws random numbers (in place).

    `input_strides`: placeholder name -> the strides of the tensor the model is called with; other
    placeholders (parameters, buffers) take their export values' strides, as does the output of an op
    the meta device cannot run (`nonzero`: its size depends on the values).
    """
    if not any(_draws(n) for n in gm.graph.nodes):
        return
    feeds = [_on_meta(n.meta.get("val"), input_strides.get(n.name)) for n in gm.graph.nodes if n.op == "placeholder"]
    _Replay(gm).run(*feeds)


def _draws(node: Node) -> bool:
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


class _Replay(Interpreter):
    """The graph on meta tensors; a view the replayed strides do not allow becomes a reshape (export
    chose views where its own strides allowed them)."""

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    def run_node(self, node: Node):
        if _draws(node):
            args = pytree.tree_leaves((self.map_nodes_to_values(node.args, node),
                                       self.map_nodes_to_values(node.kwargs, node)))
            node.meta[EAGER_STRIDES] = tuple(tuple(a.stride()) for a in args if isinstance(a, torch.Tensor))
        try:
            return super().run_node(node)
        except Exception:  # noqa: BLE001 - an op meta cannot run: its export value, on meta
            return pytree.tree_map(_on_meta, node.meta.get("val"))

    def call_function(self, target, args, kwargs):
        if "device" in kwargs:  # a factory (torch.rand(..., device=x.device) in drop-path) makes meta tensors too
            kwargs = {**kwargs, "device": torch.device("meta")}
        try:
            return super().call_function(target, args, kwargs)
        except RuntimeError:
            if target is not aten.view.default:
                raise
            return aten.reshape.default(*args, **kwargs)


def _on_meta(val, stride: tuple[int, ...] | None = None):
    """A tensor value as a meta tensor of its strides (or `stride`); anything else as it is."""
    if not isinstance(val, torch.Tensor):
        return val
    return torch.empty_strided(val.shape, val.stride() if stride is None else stride, dtype=val.dtype, device="meta")
