"""Bucket: collectives that go the same way at the same point become one call on a flat buffer.

A collective costs a fixed latency whatever its size (on gloo ~0.3-1 ms, cost_model/devices.py).
As DDP buckets gradients and FSDP gathers a layer's weights at once, this pass (run after fuse)
merges collectives into the kernels of kernels/bucketed.py:

  grad_all_reduce of parameters, same axis and dtype        -> bucket_grad_all_reduce
      (one all-reduce once every member's gradient is in; under FSDP within one unit)
  all_gather, same axis, gradient kind and dtype, one layer  -> bucket_all_gather
      (a layer's q/k/v and gate/up weights; gradients: one reduce-scatter)

A bucket runs just before the first reader of any member, so a member joins only if its input
exists by then (an input that is another bucket's value exists where that bucket runs); buckets
merge in the order they run. Gathers stay within their repeated layer (or module outside layers),
and a bucket holds at most BUCKET_BYTES (DDP's default cap). Each member keeps its placements (on
a getitem); traffic prices the bucket as one call, counted at its first member's node.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from ..capture import Captured
from ..ir import AXIS, GLOBAL, KERNEL, ORIGIN, PLACEMENTS, GradKind, bytes_sent
from ..kernels import collectives as C
from ..kernels import registry
from ..kernels.bucketed import bucket_all_gather, bucket_grad_all_reduce
from ..modules import layer_path, module_path
from .traffic import gather_bytes, local_numel, padded_numel, summed_itemsize

BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default


def _scopes(captured: Captured) -> dict[str, str]:
    """Captured node name -> the repeated layer it runs in ("model.layers.3"), else its module path."""
    params = captured.params
    return {node.name: layer_path(node, params) or module_path(node, params) or ""
            for node in captured.gm.graph.nodes}


@dataclass
class _Bucket:
    ready: int  # the latest of the members' inputs is computed at this position
    needed: int  # the first reader of a member runs at this position: the bucket runs just before
    members: list[Node] = field(default_factory=list)
    nbytes: int = 0


def bucket_collectives(gm: GraphModule, captured: Captured, rank, units: dict[str, str] | None = None) -> None:
    """Merge the bucketable collectives of `captured` rewritten into `gm` (in place; recompile after);
    `units`: FSDP's (parameter placeholder -> layer), whose weights' buckets stay in their layer."""
    scope, params = _scopes(captured), set(captured.params)
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    open_buckets: dict[tuple, list[_Bucket]] = {}
    bucket_of: dict[Node, _Bucket] = {}
    for node in nodes:
        key = _key(node, scope, params, units or {})
        if key is None:
            continue
        (src,) = node.all_input_nodes
        shape, itemsize = local_numel(src, rank)
        nbytes = math.prod(shape) * itemsize
        # a value a bucket gathers exists only where that bucket runs (before its first reader)
        ready = bucket_of[src].needed if src in bucket_of else order[src]
        needed = min((order[u] for u in node.users), default=len(nodes) - 1)
        buckets = open_buckets.setdefault(key, [])
        fits = next((b for b in buckets if max(b.ready, ready) < min(b.needed, needed)
                     and b.nbytes + nbytes <= BUCKET_BYTES), None)
        if fits is None:
            fits = _Bucket(ready, needed)
            buckets.append(fits)
        fits.members.append(node)
        bucket_of[node] = fits
        fits.ready, fits.needed, fits.nbytes = max(fits.ready, ready), min(fits.needed, needed), fits.nbytes + nbytes
    # in the order they run: a bucket that reads another's value runs after it, and a later bucket may
    # erase (merge) the node an earlier one is inserted before, never the reverse
    merged = sorted((b for buckets in open_buckets.values() for b in buckets if len(b.members) > 1),
                    key=lambda b: b.needed)
    for b in merged:
        _merge(gm, b.members, nodes[b.needed])
    gm.graph.lint()


def _key(node: Node, scope: dict[str, str], params: set[str], units: dict[str, str]) -> tuple | None:
    """What must be equal for two collectives to share a bucket; None: not bucketed."""
    if node.op != "call_function" or node.target not in (C.grad_all_reduce, C.all_gather):
        return None
    (src,) = node.all_input_nodes
    dtype = node.meta[GLOBAL].dtype
    kw = node.kwargs
    if node.target is C.grad_all_reduce:
        if src.name not in params:
            # an activation's gradient: waiting for a bucket would hold the backward up; an input's:
            # it may need no gradient at run time, and would be sent in the bucket all the same
            return None
        return (C.grad_all_reduce, kw["axis"], dtype, units.get(src.name))
    return (C.all_gather, kw["axis"], kw["grad"], len(kw["sizes"]), dtype,
            scope.get(node.meta.get(ORIGIN)))


def _merge(gm: GraphModule, members: list[Node], before: Node) -> None:
    """One bucket call just before `before`; every member's readers read its getitem."""
    first, kw = members[0], members[0].kwargs
    srcs = tuple(m.all_input_nodes[0] for m in members)
    if first.target is C.grad_all_reduce:
        fn, kwargs = bucket_grad_all_reduce, dict(axis=kw["axis"])
    else:
        fn = bucket_all_gather
        kwargs = dict(dims=tuple(m.kwargs["dim"] for m in members), sizes=tuple(m.kwargs["sizes"] for m in members),
                      axis=kw["axis"], grad=kw["grad"])
    with gm.graph.inserting_before(before):
        bucket = gm.graph.call_function(fn, srcs, kwargs)
    bucket.meta[PLACEMENTS] = tuple(m.meta[PLACEMENTS][0] for m in members)
    bucket.meta[GLOBAL] = tuple(m.meta[GLOBAL] for m in members)
    bucket.meta[ORIGIN] = first.meta[ORIGIN]
    bucket.meta[AXIS] = first.meta[AXIS]
    bucket.meta[KERNEL] = fn.__name__
    for i, m in enumerate(members):
        with gm.graph.inserting_before(before):
            item = gm.graph.call_function(operator.getitem, (bucket, i))
        item.meta.update({k: v for k, v in m.meta.items() if k in (PLACEMENTS, GLOBAL, AXIS)})
        item.meta[ORIGIN] = bucket.meta[ORIGIN]  # one run of nodes for rewrite/recompute.py
        m.replace_all_uses_with(item)
        gm.graph.erase_node(m)


# ---------------------------------------------------------------- traffic: one call for the bucket


def _grad_all_reduce_traffic(node, rank, backward):
    if not backward:
        return []
    numel = sum(math.prod(local_numel(src, rank)[0]) for src in node.args)
    return [("all_reduce", bytes_sent("all_reduce", numel * summed_itemsize(node.args[0]), node.kwargs["axis"].size))]


def _all_gather_traffic(node, rank, backward):
    kw = node.kwargs
    n = kw["axis"].size
    sent = sum(gather_bytes(*local_numel(src, rank), d, s) for src, d, s in zip(node.args, kw["dims"], kw["sizes"]))
    out = [("all_gather", sent)]
    if backward and kw["grad"] == GradKind.P:
        buffer = sum(padded_numel(local_numel(src, rank)[0], d, n * max(s)) * summed_itemsize(src)
                     for src, d, s in zip(node.args, kw["dims"], kw["sizes"]))
        out.append(("reduce_scatter", bytes_sent("reduce_scatter", buffer, n)))
    return out


registry.add(registry.Kernel(bucket_grad_all_reduce.__name__, None, _grad_all_reduce_traffic))
registry.add(registry.Kernel(bucket_all_gather.__name__, None, _all_gather_traffic))
