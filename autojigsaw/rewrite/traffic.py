"""Exact traffic of a rewritten graph: bytes each collective sends, forward and backward.

Read off the rewritten graph itself (after grad_kinds), so the prediction covers exactly
the collectives that will run, with the padding the kernels add to uneven shards.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch.fx import GraphModule, Node

from ..dtypes import reduce_dtype
from ..ir import GLOBAL, ORIGIN, PLACEMENTS, GradKind, bytes_sent, needs_grad
from ..kernels import collectives as C
from ..kernels import registry
from ..placements import local_shape


def local_numel(node: Node, rank) -> tuple[list[int], int]:
    val = node.meta[GLOBAL]
    val = val[0] if isinstance(val, (tuple, list)) else val
    shape = list(local_shape(val.shape, node.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord))
    return shape, val.dtype.itemsize


def summed_itemsize(node: Node, op: str = "sum") -> int:
    """Bytes per element a reduction of `node`'s value sends (bf16/fp16 sums go in fp32)."""
    val = node.meta[GLOBAL]
    val = val[0] if isinstance(val, (tuple, list)) else val
    return reduce_dtype(val.dtype, op).itemsize


def padded_numel(shape: list[int], dim: int, size: int) -> int:
    return math.prod(shape[:dim] + [size] + shape[dim + 1:])


def gather_bytes(shape: list[int], itemsize: int, dim: int, sizes) -> int:
    """Bytes sent gathering a local `shape` along `dim` from chunks of `sizes` (padded to the largest)."""
    return bytes_sent("all_gather", padded_numel(shape, dim, max(sizes)) * itemsize, len(sizes))


def scatter_bytes(shape: list[int], itemsize: int, dim: int, sizes) -> int:
    """Bytes sent reduce-scattering into chunks of `sizes` along `dim` (`shape`: any local shape of it)."""
    return bytes_sent("reduce_scatter", padded_numel(shape, dim, len(sizes) * max(sizes)) * itemsize, len(sizes))


def collective_traffic(node: Node, rank, backward: frozenset) -> list[tuple[str, int]]:
    """(collective, bytes sent) of one rewritten node, forward then backward."""
    if node.op != "call_function":
        return []
    if node.target not in (C.all_gather, C.reduce_scatter, C.all_reduce, C.all_to_all,
                           C.shard_slice, C.grad_all_reduce):
        return registry.kernel_traffic(node, rank, backward)
    (src,) = node.all_input_nodes
    shape, itemsize = local_numel(src, rank)
    kw = node.kwargs
    out = []
    if node.target is C.all_gather:
        out.append(("all_gather", gather_bytes(shape, itemsize, kw["dim"], kw["sizes"])))
        if backward and kw["grad"] == GradKind.P:
            out.append(("reduce_scatter", scatter_bytes(shape, summed_itemsize(src), kw["dim"], kw["sizes"])))
    elif node.target is C.reduce_scatter:
        out.append(("reduce_scatter", scatter_bytes(shape, summed_itemsize(src, kw["op"]), kw["dim"], kw["sizes"])))
        if backward:  # the gradient's gather: the same elements, in the value's dtype (it sums nothing)
            out.append(("all_gather", scatter_bytes(shape, itemsize, kw["dim"], kw["sizes"])))
    elif node.target in (C.all_reduce, C.grad_all_reduce):
        numel, n = math.prod(shape), kw["axis"].size
        if node.target is C.all_reduce:
            out.append(("all_reduce", bytes_sent("all_reduce", numel * summed_itemsize(src, kw["op"]), n)))
        if backward and (node.target is C.grad_all_reduce or kw["grad"] == GradKind.P):
            out.append(("all_reduce", bytes_sent("all_reduce", numel * summed_itemsize(src), n)))
    elif node.target is C.all_to_all:
        n = len(kw["src_sizes"])
        shape[kw["src_dim"]] = max(kw["src_sizes"])
        numel = padded_numel(shape, kw["dst_dim"], n * max(kw["dst_sizes"]))
        out.append(("all_to_all", bytes_sent("all_to_all", numel * itemsize, n)))
        if backward:
            out.append(out[0])
    elif node.target is C.shard_slice and backward and kw["grad"] == GradKind.R:
        out.append(("all_gather", gather_bytes(shape, itemsize, kw["dim"], kw["sizes"])))
    return out


def traffic_by_origin(gm: GraphModule, rank, sources: set[str], training: bool) -> dict[str, int]:
    """Bytes each rank sends per step, summed per captured node the collectives serve."""
    grad = needs_grad(gm, sources) if training else {}
    total: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        backward = frozenset(i for i in node.all_input_nodes if grad.get(i, False))
        for _, nbytes in collective_traffic(node, rank, backward):
            total[node.meta.get(ORIGIN, node.name)] += nbytes
    return dict(total)
