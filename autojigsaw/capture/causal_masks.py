"""Attention masks that are causal whatever the input become SDPA's `is_causal=True`.

Traced by torch.export, transformers builds its causal mask from position indices, a (batch, 1, S, S)
boolean tensor, where its eager run passes `is_causal=True` (it skips the mask only when not tracing). A
boolean mask computed from no input (no user input, parameter or buffer) is evaluated here, on the CPU; where
it is exactly the causal one, SDPA takes `is_causal=True` and the mask's nodes go: no S x S mask is held, the
flash kernel runs, and the planner prices the half of the scores causal attention computes.

The mask's subgraph is computed node by node while a node holds at most `WHOLE` elements. Larger nodes must be
pointwise, expands or unsqueezes of smaller ones (a mask is a comparison of broadcast indices); they are computed
a block of rows at a time, for one index of every leading dim the smaller tensors do not vary along.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
WHOLE = 2**24  # elements: a node of a mask's subgraph at most this large is computed whole
MOST = 2**32  # elements: a mask that would take more than this to check is left as it is
# elementwise, yet not tagged pointwise
_BITWISE = {getattr(aten, op).Tensor for op in ("__and__", "__or__", "__xor__")}


def causal_masks_as_flags(gm: GraphModule) -> int:
    """SDPA nodes whose boolean mask depends on no input and is exactly causal take `is_causal=True`.

    Returns how many did; the mask nodes no other node reads are erased.
    """
    verdicts: dict[Node, set[Node] | None] = {}  # mask -> its subgraph where it is causal
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        kwargs = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs
        mask = kwargs["attn_mask"]
        if not isinstance(mask, Node) or kwargs["is_causal"] or not _square(kwargs):
            continue
        if mask not in verdicts:
            verdicts[mask] = _causal_region(mask, order)
        if verdicts[mask] is not None:
            q, k, v = (kwargs.pop(name) for name in ("query", "key", "value"))
            node.args, node.kwargs = (q, k, v), {**kwargs, "attn_mask": None, "is_causal": True}
            changed += 1
    _erase_unread(gm, set().union(*(region for region in verdicts.values() if region is not None)), order)
    return changed


def _causal_region(mask: Node, order: dict[Node, int]) -> set[Node] | None:
    """`mask` and the nodes it is computed from, where it depends on no input and is exactly causal; else None."""
    region = _ancestors(mask)
    try:
        return region if region is not None and _is_causal(mask, region, order) else None
    except Exception:  # noqa: BLE001 - an op that does not run here: the mask stays as the model wrote it
        return None


def _square(kwargs: dict) -> bool:
    """Queries and keys of one length (is_causal aligns the mask with the top-left corner), the mask's shape."""
    q, k, mask = (kwargs[name].meta.get("val") for name in ("query", "key", "attn_mask"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, mask)) or mask.dtype != torch.bool:
        return False
    return q.shape[-2] == k.shape[-2] and tuple(mask.shape[-2:]) == (q.shape[-2], k.shape[-2])


def _is_causal(mask: Node, region: set[Node], order: dict[Node, int]) -> bool:
    """Is `mask`, computed by the nodes of `region` from constants alone, True exactly on and below the diagonal?"""
    whole: dict[Node, object] = {}
    for node in sorted(region, key=order.__getitem__):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > WHOLE:
            if not _broadcasting(node.target):
                return False
            continue
        if any(n in region and n not in whole for n in node.all_input_nodes):
            return False  # a small node read from a large one: not a mask of broadcast indices
        args, kwargs = pytree.tree_map(lambda a: _on_cpu(whole[a] if isinstance(a, Node) else a),
                                       (node.args, node.kwargs))
        whole[node] = node.target(*args, **kwargs)
    shape = tuple(mask.meta["val"].shape)
    if mask in whole:
        return _agrees(whole[mask], 0, shape[-2], shape[-1])
    leaves = [whole[n] for n in region if n in whole and _read_by_large(n, region, whole)]
    aligned = all(n.target is not aten.unsqueeze.default for n in region if n not in whole)  # dims right-aligned
    lead = [range(1) if aligned and all(_constant_along(t, d, len(shape)) for t in leaves) else range(shape[d])
            for d in range(len(shape) - 2)]
    if math.prod(len(r) for r in lead) * shape[-2] * shape[-1] > MOST:
        return False
    rows = max(1, WHOLE // shape[-1])
    for index in itertools.product(*lead):
        for start in range(0, shape[-2], rows):
            block = tuple(slice(i, i + 1) for i in index) + (slice(start, start + rows), slice(None))
            if not _agrees(_block(mask, block, whole), start, min(start + rows, shape[-2]), shape[-1]):
                return False
    return True


def _broadcasting(target) -> bool:
    """Is each element of `target`'s output its inputs' at the same index, after broadcasting?"""
    return (target in (aten.expand.default, aten.unsqueeze.default) or target in _BITWISE
            or torch.Tag.pointwise in getattr(target, "tags", ()))


def _ancestors(mask: Node) -> set[Node] | None:
    """`mask` and every node it is computed from; None where one is an input, a buffer or a random draw."""
    region, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in region:
            continue
        if node.op != "call_function" or not (isinstance(node.target, torch._ops.OpOverload)
                                               or node.target is operator.getitem):
            return None
        if node.target is not operator.getitem and torch.Tag.nondeterministic_seeded in node.target.tags:
            return None
        region.add(node)
        stack.extend(node.all_input_nodes)
    return region


def _on_cpu(a):
    """Constants where the graph has a device (a model captured on the meta device): the CPU."""
    return torch.device("cpu") if isinstance(a, torch.device) else a


def _read_by_large(node: Node, region: set[Node], whole: dict) -> bool:
    return any(user in region and user not in whole for user in node.users)


def _constant_along(t, dim: int, rank: int) -> bool:
    """Is tensor `t`, aligned on the right with a tensor of `rank` dims, the same at every index of `dim`?"""
    if not isinstance(t, torch.Tensor):
        return True
    own = dim - (rank - t.dim())
    return own < 0 or t.shape[own] == 1 or bool((t == t.narrow(own, 0, 1)).all())


def _block(node: Node, block: tuple[slice, ...], whole: dict):
    """`node`'s value at `block` (a slice per dim of its shape), of its rank, broadcastable to the block's shape."""
    if node in whole:
        return _sliced(whole[node], block)
    if node.target is aten.expand.default:
        inner = _block(node.args[0], block[len(block) - _rank(node.args[0]):], whole)
        return inner[(None,) * (len(block) - inner.dim())]
    if node.target is aten.unsqueeze.default:
        dim = node.args[1] % len(block)
        return _block(node.args[0], block[:dim] + block[dim + 1:], whole).unsqueeze(dim)
    args, kwargs = pytree.tree_map_only(Node, lambda a: _block(a, block[len(block) - _rank(a):], whole),
                                        (node.args, node.kwargs))
    return node.target(*args, **kwargs)


def _rank(node: Node) -> int:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _sliced(t, block: tuple[slice, ...]):
    """`t` at `block`, right-aligned: a dim of size 1 stays whole, to broadcast."""
    if not isinstance(t, torch.Tensor):
        return t
    block = block[len(block) - t.dim():] if t.dim() else ()
    return t[tuple(slice(None) if n == 1 else b for n, b in zip(t.shape, block))]


def _agrees(values: torch.Tensor, start: int, stop: int, columns: int) -> bool:
    """Are `values`, rows `start` to `stop` of a mask (broadcastable to them), the causal mask's?"""
    causal = torch.arange(columns) <= torch.arange(start, stop).unsqueeze(-1)
    return bool((values == causal).all())


def _erase_unread(gm: GraphModule, region: set[Node], order: dict[Node, int]) -> None:
    """Erase the causal masks' `region` (the masks and what they are computed from; masks may share nodes, each
    erased once), as far as no other node reads them."""
    for node in sorted(region, key=order.__getitem__, reverse=True):
        if not node.users:
            gm.graph.erase_node(node)
