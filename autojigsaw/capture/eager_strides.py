"""The strides a random draw's inputs have when the single-device model runs eagerly.

A CPU generator fills a tensor in memory order, so a dropout mask drawn in another layout than
the single-device one holds other numbers (a transposed input's mask is drawn transposed). Export's
fake tensors do not always have eager's strides: a view's stride on a dim of size 1 can differ, and
a convolution of that view is then channels-last under fake CPU tensors and contiguous in eager
(SegFormer). So a graph that draws is replayed on the meta device, whose views and pointwise kernels
lay tensors out as eager's do, and each drawing node records its inputs' strides. Two choices CPU
eager makes and meta does not are made as eager makes them: a convolution's output memory format
(meta's is always contiguous; fake CPU tensors ask the backend, given the replay's input strides),
and attention's (meta runs the math kernel; CPU's flash kernel keeps the query's layout, DPT's
(batch, tokens, heads, dim)). On CUDA the replay is meta's alone.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.nn.attention import SDPBackend
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
            out = super().run_node(node)
        except Exception:  # noqa: BLE001 - an op meta cannot run: its export value, on meta
            return pytree.tree_map(_on_meta, node.meta.get("val"))
        if _on_cpu(node) and node.target in _CPU_LAYOUTS:
            out = _CPU_LAYOUTS[node.target](node.target, out, *self.map_nodes_to_values(node.args, node),
                                            **self.map_nodes_to_values(node.kwargs, node))
        return out

    def call_function(self, target, args, kwargs):
        if "device" in kwargs:  # a factory (torch.rand(..., device=x.device) in drop-path) makes meta tensors too
            kwargs = {**kwargs, "device": torch.device("meta")}
        try:
            return super().call_function(target, args, kwargs)
        except RuntimeError:
            if target is not aten.view.default:
                raise
            return aten.reshape.default(*args, **kwargs)


def _on_cpu(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _cpu_attention_layout(op, out, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """Attention's output as CPU eager lays it out: its flash kernel keeps the query's layout (DPT's
    (batch, tokens, heads, dim)-strided queries give such an output), where meta runs the math kernel,
    whose output is contiguous."""
    on_cpu = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)  # no pages touched
              for t in (query, key, value, attn_mask)]
    if torch._fused_sdp_choice(*on_cpu, dropout_p, is_causal, **kwargs) != SDPBackend.FLASH_ATTENTION.value:
        return out
    layout = sorted(range(query.ndim), key=lambda d: -query.stride(d))
    return torch.empty_permuted(out.shape, layout, dtype=out.dtype, device="meta")


def _cpu_conv_layout(op, out, *args, **kwargs):
    """A convolution's output as CPU eager lays it out: its backend's memory format for these input
    and weight strides (channels-last after a channels-last input), which fake CPU tensors ask the
    backend for and meta's kernel does not (it returns every output contiguous)."""
    with FakeTensorMode():
        fake = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype),
                                    (args, kwargs))
        stride = op(*fake[0], **fake[1]).stride()
    return torch.empty_strided(out.shape, stride, dtype=out.dtype, device="meta")


_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding,
          aten.conv3d.padding, aten.conv_transpose1d.default, aten.conv_transpose2d.input,
          aten.conv_transpose3d.input, aten.convolution.default)
_CPU_LAYOUTS = {aten.scaled_dot_product_attention.default: _cpu_attention_layout,
                **dict.fromkeys(_CONVS, _cpu_conv_layout)}


def _on_meta(val, stride: tuple[int, ...] | None = None):
    """A tensor value as a meta tensor of its strides (or `stride`); anything else as it is."""
    if not isinstance(val, torch.Tensor):
        return val
    return torch.empty_strided(val.shape, val.stride() if stride is None else stride, dtype=val.dtype, device="meta")
