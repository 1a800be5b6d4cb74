"""A weight pinned split over an axis is read split there: its readers keep the strategies that do.

Megatron's and torchtitan's tensor parallelism: a column- or row-parallel matmul computes with its
shard of the weight and never gathers it over the tensor axis. A node that only casts or views
pinned weights (a transpose, a cast to the compute dtype) passes the pin on to its own readers.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node

from ..ir import STRATEGIES, tensor_inputs
from ..mesh import MeshSpec
from ..placements import format_placements

Allowed = tuple  # per mesh axis: a frozenset of the Shard placements a value may take there, or None (free)


def keep_reads_split(gm: GraphModule, pins: dict, mesh: MeshSpec) -> None:
    """Every reader of a pinned parameter (ParamPin by placeholder node) split over an axis, or of a cast or
    view of such, reads it in a placement the pin allows there; a ValueError names the entry and the node
    where no strategy does."""
    allowed: dict[Node, Allowed] = {}
    entry: dict[Node, str] = {}
    for node, pin in pins.items():
        split = tuple(ok if ok and all(isinstance(p, Shard) for p in ok) else None for ok in pin.allowed)
        if any(ok is not None for ok in split):
            allowed[node], entry[node] = split, pin.entry
    for node in gm.graph.nodes:
        if node.op != "call_function" or STRATEGIES not in node.meta:
            continue
        inputs = tensor_inputs(node)
        reads = [(k, src) for k, (src, _) in enumerate(inputs) if src in allowed]
        if not reads:
            continue
        kept = [s for s in node.meta[STRATEGIES] if all(_within(s.inputs[k], allowed[src]) for k, src in reads)]
        if not kept:
            src = reads[0][1]
            raise ValueError(f"constraints[{entry[src]!r}] cannot hold at node {node.name}: none of its strategies "
                             f"reads {src.name} split as pinned over "
                             f"{[mesh.axis_names[a] for a, ok in enumerate(allowed[src]) if ok]} (it offers "
                             f"{_offered(node)}); pin the weight another way, or leave it to the planner")
        if len(reads) == len(inputs):  # a cast or view of pinned weights: its output stays split, and pinned
            axes = [a for a in range(mesh.ndim) if any(allowed[src][a] is not None for _, src in reads)]
            split = [s for s in kept if all(out is None or isinstance(out[a], Shard) for out in s.outputs for a in axes)]
            if split:
                kept = split
                allowed[node] = tuple(frozenset(out[a] for s in split for out in s.outputs if out is not None)
                                      if a in axes else None for a in range(mesh.ndim))
                entry[node] = entry[reads[0][1]]
        node.meta[STRATEGIES] = kept


def _within(placements, allowed: Allowed) -> bool:
    return all(ok is None or p in ok for ok, p in zip(allowed, placements))


def _offered(node: Node) -> str:
    strategies = node.meta[STRATEGIES]
    shown = {" ".join(format_placements(p) for p in s.inputs) for s in strategies[:6]}
    return "; ".join(sorted(shown)) + (", ..." if len(strategies) > 6 else "")
