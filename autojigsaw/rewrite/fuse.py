"""Fuse: linears and the collectives around them become kernels that overlap the two.

After the rewrite has set every gradient kind, three patterns are replaced by the fused kernels
of kernels/matmul.py, which compute the same values and gradients and send the same bytes
under the same collective names, but move chunks in a ring while the previous chunk multiplies:

  all_gather(x, non-last dim) -> linear                        all_gather_linear
  linear -> reduce_scatter(non-last dim)                       linear_reduce_scatter
  all_gather(W over A, grad P) -> linear -> reduce_scatter(last dim over B), no bias
                                                               summa_linear (Jigsaw's 2-D layout)

A pattern fuses only when its intermediate values have no other reader. Unfused stay: a biased
2-D linear (its bias is replicated over B with a full gradient on every rank, which summa_linear,
bias chunk in and chunk gradient out, would turn into a partial one), and patterns that sum
bf16/fp16 values (the collectives sum those in fp32, the fused kernels do not yet).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..dtypes import reduce_dtype
from ..ir import AXIS, GLOBAL, KERNEL, ORIGIN, PLACEMENTS, GradKind
from ..kernels import collectives as C
from ..kernels import registry
from ..kernels.matmul import all_gather_linear, linear_reduce_scatter, summa_linear
from .traffic import gather_bytes, local_numel, scatter_bytes

_LINEAR = torch.ops.aten.linear.default


def fuse_collectives(gm: GraphModule) -> None:
    """Replace every fusable pattern of a rewritten graph by its fused kernel (in place; recompile)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _LINEAR:
            _summa(gm, node) or _gather_linear(gm, node) or _linear_scatter(gm, node)
    gm.graph.lint()


def _sums_natively(value: Node) -> bool:
    """Do the collectives sum `value` in its own dtype (as the fused kernels do)?"""
    dtype = value.meta[GLOBAL].dtype
    return reduce_dtype(dtype) == dtype


def _only_reader(value: Node, reader: Node) -> bool:
    return list(value.users) == [reader]


def _calls(node, fn) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is fn


def _sole_scatter(linear: Node) -> Node | None:
    users = list(linear.users)
    return users[0] if len(users) == 1 and _calls(users[0], C.reduce_scatter) else None


def _replace(gm: GraphModule, old: Node, fn, args: tuple, kwargs: dict, dead: list[Node]) -> None:
    """Put fn(*args, **kwargs), the kernel of fn's name, in place of `old` (keeping its metadata), then drop `dead`."""
    with gm.graph.inserting_after(old):
        new = gm.graph.call_function(fn, args, kwargs)
    new.meta.update({k: v for k, v in old.meta.items() if k in (PLACEMENTS, GLOBAL, ORIGIN, AXIS)})
    new.meta[KERNEL] = fn.__name__
    old.replace_all_uses_with(new)
    for node in [old, *dead]:
        gm.graph.erase_node(node)


def _linear_args(linear: Node) -> tuple[Node, Node, Node | None]:
    args = list(linear.args) + [None]
    return args[0], args[1], args[2]


def _gather_linear(gm: GraphModule, linear: Node) -> bool:
    x, w, b = _linear_args(linear)
    if not (_calls(x, C.all_gather) and _only_reader(x, linear)) or x in (w, b):
        return False
    kw = x.kwargs
    if kw["dim"] % x.meta[GLOBAL].ndim == x.meta[GLOBAL].ndim - 1:
        return False  # the gathered dim holds the features: not a token / batch dim
    if kw["grad"] == GradKind.P and not _sums_natively(x):
        return False
    _replace(gm, linear, all_gather_linear, (x.args[0], w, b), dict(kw), [x])
    return True


def _linear_scatter(gm: GraphModule, linear: Node) -> bool:
    scatter = _sole_scatter(linear)
    if scatter is None or scatter.kwargs["op"] not in ("sum", "avg") or not _sums_natively(linear):
        return False
    ndim = linear.meta[GLOBAL].ndim
    if scatter.kwargs["dim"] % ndim == ndim - 1:
        return False  # scattered over the out-features: the 2-D pattern's, not this one's
    x, w, b = _linear_args(linear)
    _replace(gm, scatter, linear_reduce_scatter, (x, w, b), dict(scatter.kwargs), [linear])
    return True


def _summa(gm: GraphModule, linear: Node) -> bool:
    x, wg, b = _linear_args(linear)
    scatter = _sole_scatter(linear)
    if (b is not None or scatter is None or not _sums_natively(linear)
            or not (_calls(wg, C.all_gather) and _only_reader(wg, linear))):
        return False
    g, s = wg.kwargs, scatter.kwargs
    ndim = linear.meta[GLOBAL].ndim
    if (g["dim"] != 0 or g["grad"] != GradKind.P or s["op"] != "sum" or s["dim"] % ndim != ndim - 1
            or g["axis"].name == s["axis"].name or sum(g["sizes"]) != sum(s["sizes"])):
        return False
    kwargs = dict(weight_sizes=g["sizes"], out_sizes=s["sizes"], domain=g["axis"], tensor=s["axis"])
    _replace(gm, scatter, summa_linear, (x, wg.args[0]), kwargs, [linear, wg])
    return True


# ---------------------------------------------------------------- traffic, as the unfused collectives


def _gather_bytes(x: Node, dim: int, sizes, rank) -> int:
    return gather_bytes(*local_numel(x, rank), dim, sizes)


def _scatter_bytes(out: Node, dim: int, sizes, rank) -> int:
    """Bytes of the reduce-scatter whose result `out` is."""
    shape, itemsize = local_numel(out, rank)
    return scatter_bytes(shape, itemsize, dim % len(shape), sizes)


def _gather_linear_traffic(node, rank, backward):
    kw = node.kwargs
    nbytes = _gather_bytes(node.args[0], kw["dim"], kw["sizes"], rank)
    back = [("reduce_scatter", nbytes)] if node.args[0] in backward and kw["grad"] == GradKind.P else []
    return [("all_gather", nbytes)] + back


def _linear_scatter_traffic(node, rank, backward):
    kw = node.kwargs
    nbytes = _scatter_bytes(node, kw["dim"], kw["sizes"], rank)
    return [("reduce_scatter", nbytes)] + ([("all_gather", nbytes)] if backward else [])


def _summa_traffic(node, rank, backward):
    kw = node.kwargs
    w = node.args[1]
    gather = _gather_bytes(w, 0, kw["weight_sizes"], rank)
    scatter = _scatter_bytes(node, -1, kw["out_sizes"], rank)
    out = [("all_gather", gather), ("reduce_scatter", scatter)]
    if backward:
        out.append(("all_gather", scatter))
    if w in backward:
        out.append(("reduce_scatter", gather))
    return out


# Only this pass inserts them (no plan names them): no builder. Named as _replace names their nodes.
registry.add(registry.Kernel(all_gather_linear.__name__, None, _gather_linear_traffic))
registry.add(registry.Kernel(linear_reduce_scatter.__name__, None, _linear_scatter_traffic))
registry.add(registry.Kernel(summa_linear.__name__, None, _summa_traffic))
