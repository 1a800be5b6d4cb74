"""Annotate: every node's legal ways to run on local shards, written to node.meta[STRATEGIES].

A Strategy (ir.py) fixes the placement of each tensor input and output on every mesh axis, and
the kernel that computes the output shards ("local" = the same ATen op on local shards;
others are autojigsaw kernels that communicate inside). Rules come from autojigsaw's own
rules (strategies/rules: matmuls, norms, softmax, attention, ...) first, then DTensor's, and a
node no rule covers runs replicated, marked as a fallback: slower, never wrong.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from ..ir import STRATEGIES, Strategy, output_values, tensor_inputs
from ..mesh import MeshSpec
from ..placements import Placements, replicated
from . import rules
from .dtensor_rules import dtensor_strategies


def layout_candidates(shape: Sequence[int], mesh: MeshSpec) -> list[Placements]:
    """Every placement of a free tensor (parameter or input): each axis Replicate or Shard(d)."""
    per_axis = [
        [Replicate()] + [Shard(d) for d, size in enumerate(shape) if size >= n > 1]
        for n in mesh.sizes
    ]
    return [tuple(c) for c in itertools.product(*per_axis)]


def _candidates(node: Node, index: int, cache: dict | None = None) -> list[Placements]:
    strategies = node.meta[STRATEGIES]
    key = ("candidates", id(strategies), index)
    if cache is not None and key in cache:
        return cache[key]
    seen: dict[Placements, None] = {}
    for s in strategies:
        if s.outputs[index] is not None:
            seen.setdefault(s.outputs[index])
    found = list(seen)
    if cache is not None:
        cache[key] = found
        cache[("keep", id(strategies))] = strategies  # the id stays unique while cached
    return found


def _signature(node: Node, candidates: list[list[Placements]]) -> tuple:
    """What a node's strategies depend on: op, literal args, shapes and input candidates."""
    def one(a):
        if isinstance(a, Node):
            v = a.meta.get("val")
            return (tuple(v.shape), v.dtype, tuple(v.stride())) if isinstance(v, torch.Tensor) else repr(v)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else repr(a)

    leaves = tuple(one(a) for a in pytree.tree_leaves((node.args, node.kwargs)))
    outs = tuple((tuple(v.shape), v.dtype) if v is not None else None for v in output_values(node))
    return (node.target, str(pytree.tree_structure((node.args, node.kwargs))), leaves, outs,
            tuple(id(c) for c in candidates))


def node_strategies(node: Node, mesh: MeshSpec, fixed: dict[str, Placements] | None = None,
                    outputs: Sequence[Placements] | None = None, cache: dict | None = None) -> list[Strategy]:
    """All strategies for one node, given that its producers were annotated before it.

    `fixed` pins placeholders to one placement; `outputs` are the placements the graph's
    outputs must be returned in (default: replicated, the whole tensor on every rank).
    `cache` (one per graph and mesh) shares the list between nodes whose strategies depend on
    equal things -- the nodes of repeated layers -- so each is worked out once.
    """
    if node.op == "placeholder":
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return [Strategy((), (None,))]
        if fixed and node.name in fixed:
            pin = fixed[node.name]
            if all(isinstance(want, Placement) for want in pin):
                return [Strategy((), (pin,))]
            # None leaves an axis to the planner, a tuple of placements a choice among them (a data axis
            # pins only its own: strategies/data_pins.py)
            return [Strategy((), (p,)) for p in layout_candidates(val.shape, mesh)
                    if all(want is None or got in (want if isinstance(want, tuple) else (want,))
                           for want, got in zip(pin, p))]
        key = ("placeholder", tuple(val.shape), val.dtype)
        if cache is None or key not in cache:
            found = [Strategy((), (p,)) for p in layout_candidates(val.shape, mesh)]
            if cache is None:
                return found
            cache[key] = found
        return cache[key]
    if node.op == "output":
        return [Strategy(combo, ()) for combo in itertools.product(*_output_choices(node, mesh, outputs, cache))]
    inputs = tensor_inputs(node)
    candidates = [_candidates(src, i, cache) for src, i in inputs]
    if cache is None:
        return _strategies(node, mesh, inputs, candidates)
    key = _signature(node, candidates)
    if key not in cache:
        found = _strategies(node, mesh, inputs, candidates)
        # Equal lists become one object, so the readers of repeated layers hit the cache too.
        cache[key] = cache.setdefault(("list", tuple(found)), found)
    return cache[key]


MAX_OUTPUT_STRATEGIES = 4096


def _output_choices(node: Node, mesh: MeshSpec, outputs: Sequence[Placements] | None, cache) -> list[list]:
    """The placements each graph output may come back in. A None in `outputs` (beside a returned loss)
    lets the planner choose among what its producer makes; the output node's strategies are the product
    of the choices, so past MAX_OUTPUT_STRATEGIES (CLIP returns ten tensors beside its loss: 16^10 on a
    2x2 mesh) the smallest free outputs come back whole, as they do where no loss is returned."""
    inputs = tensor_inputs(node)
    wanted = tuple(outputs) if outputs is not None else (replicated(mesh.ndim),) * len(inputs)
    choices = [[w] if w is not None else _candidates(src, i, cache) for w, (src, i) in zip(wanted, inputs)]
    free = sorted((k for k, w in enumerate(wanted) if w is None),
                  key=lambda k: -output_values(inputs[k][0])[inputs[k][1]].numel())
    count = 1
    for k in free:
        if count * len(choices[k]) > MAX_OUTPUT_STRATEGIES:
            choices[k] = [replicated(mesh.ndim)]
        count *= len(choices[k])
    return choices


def _strategies(node: Node, mesh: MeshSpec, inputs, candidates) -> list[Strategy]:
    if node.target is operator.getitem:
        return [Strategy((p,), (p,)) for p in candidates[0]]
    n_out = len(output_values(node))
    if not inputs:  # a factory (arange, zeros, ...): made whole on every rank
        return [Strategy((), (replicated(mesh.ndim),) * n_out, note="factory")]
    found = rules.strategies_for(node, mesh, candidates)
    if found is None:
        pairs = dtensor_strategies(node, mesh, {src: c for (src, _), c in zip(inputs, candidates)})
        found = [Strategy(i, o) for i, o in pairs or []
                 if _standard(i) and _standard(o) and _partials_offered(i, candidates)]
    found = list(dict.fromkeys(found))
    if not found:
        name = getattr(node.target, "__name__", str(node.target))
        return [Strategy((replicated(mesh.ndim),) * len(inputs), (replicated(mesh.ndim),) * n_out,
                         fallback=True, note=f"no sharding rule for {name}")]
    return found


def _standard(placements_list) -> bool:
    """Plain Shard / Replicate / Partial only (DTensor's private variants need its runtime)."""
    return all(
        pl is None or all(type(p) in (Shard, Replicate, Partial) for p in pl)
        for pl in placements_list
    )


def _partials_offered(inputs: tuple[Placements, ...], candidates) -> bool:
    """Does every Partial input come from a producer that makes it? (No value turns Partial.)"""
    return all(
        not isinstance(p, Partial) or any(c[a] == p for c in cands)
        for pl, cands in zip(inputs, candidates) for a, p in enumerate(pl)
    )


def annotate(gm: GraphModule, mesh: MeshSpec, fixed: dict[str, Placements] | None = None,
             outputs: Sequence[Placements] | None = None) -> None:
    """Write node.meta[STRATEGIES] for every node, in topological order."""
    cache: dict = {}
    for node in gm.graph.nodes:
        node.meta[STRATEGIES] = node_strategies(node, mesh, fixed, outputs, cache)
