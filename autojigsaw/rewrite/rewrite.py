"""Rewrite: Plan + graph -> the graph one rank runs, on local shards with explicit collectives.

Every node of the captured graph becomes: the collectives that move its inputs to the
placements its strategy needs (ir.redistribute_steps), then its op on local shards
(DTensor's local-argument rules make view and factory shapes local) or an autojigsaw
kernel. Gradient collectives are then set by rewrite/grad_kinds.py. The result is plain
FX: `gm.code` reads as the program each rank runs.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..capture import Captured
from ..ir import (AXIS, GLOBAL, KERNEL, ORIGIN, PLACEMENTS, Collective, GradKind, output_values, redistribute_steps,
                  step_sizes, tensor_inputs)
from ..kernels import collectives, registry
from ..mesh import RankView
from ..modules import data_sums, layer_units
from ..placements import Placements
from ..plan import NodeSharding, Plan
from ..strategies.dtensor_rules import local_call
from ..training import data_axes
from .bucket import bucket_collectives
from .fuse import fuse_collectives
from .grad_kinds import set_grad_kinds

# Export turned reshapes into views where the traced strides allowed it; local shards
# from collectives may have other strides, so views become reshapes (still views when legal).
_RESHAPES = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
             torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


# The function that runs each resharding step on local shards.
_COLLECTIVES = {
    Collective.all_gather: collectives.all_gather,  # Shard -> Replicate: concatenate every rank's chunk
    Collective.reduce_scatter: collectives.reduce_scatter,  # Partial -> Shard: sum, keep this rank's chunk
    Collective.all_reduce: collectives.all_reduce,  # Partial -> Replicate: the sum on every rank
    Collective.all_to_all: collectives.all_to_all,  # Shard(i) -> Shard(j): swap the split dim in one exchange
    Collective.shard_slice: collectives.shard_slice,  # Replicate -> Shard: slice locally, nothing sent
    Collective.to_partial: collectives.to_partial,  # Replicate -> Partial: keep the value on one rank
}


def rewrite(captured: Captured, plan: Plan, rank: RankView, *, training: bool = True,
            inputs_with_grad: frozenset[str] = frozenset()) -> GraphModule:
    """The local-shard graph of `rank` for `plan` (gradient collectives set when training)."""
    by_name = {n.name: n for n in plan.nodes}
    _check_matches(captured, by_name)
    fsdp = plan.data_parallel == "fsdp"
    graph = Graph()
    env: dict[Node, Node] = {}
    moved: dict[tuple, Node] = {}  # (producer, output index, placements) -> moved value
    for node in captured.gm.graph.nodes:
        sharding = by_name.get(node.name)
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            # FX renames an input named like a builtin ("input" -> "input_1"); every pass after this one
            # finds inputs by their captured names (a renamed one lost its gradient's sum over the mesh)
            new.name = node.name
            _annotate(new, node, sharding.outputs, node.name)
        elif node.op == "output":
            values = [_moved(env, moved, graph, src, i, pl, rank, node.name)
                      for (src, i), pl in zip(tensor_inputs(node), sharding.inputs)]
            if fsdp:
                values = [_own_storage(graph, v, captured.params) for v in values]
            outputs = iter(values)
            flat = [next(outputs) if isinstance(a, Node) and src_is_tensor(a)
                    else env.get(a, a) if isinstance(a, Node) else a for a in node.args[0]]
            new = graph.output(tuple(flat))
            new.meta[ORIGIN] = node.name
        else:
            new = _emit(graph, env, moved, node, sharding, rank)
        env[node] = new
    gm = GraphModule(captured.gm, graph)
    split = plan.split_over_data(captured.params)
    if training:
        once = fsdp or plan.sums_once  # FSDP's, or a step's sum once its microbatches have accumulated
        set_grad_kinds(gm, rank, set(captured.params) | set(inputs_with_grad), set(captured.params),
                       summed_axis=data_axes(plan.mesh)[0] if once else None,
                       summed_params={n.name for n in captured.gm.graph.nodes if n.name in captured.params
                                      and data_sums(n, fsdp=fsdp, split=n.name in split)})
    fuse_collectives(gm)
    units = layer_units(list(captured.gm.graph.nodes), captured.params, split) if fsdp else None
    bucket_collectives(gm, captured, rank, units)
    gm.recompile()
    return gm


def src_is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def check_plan_matches(captured: Captured, plan: Plan) -> None:
    """A ValueError unless `plan` has an entry of the right shape for every node of the captured program."""
    _check_matches(captured, {n.name: n for n in plan.nodes})


def _check_matches(captured: Captured, by_name) -> None:
    extra = set(by_name) - {node.name for node in captured.gm.graph.nodes}
    if extra:  # the plan's program does more than this one (its costs are another program's)
        raise ValueError(f"the plan has nodes this model's program does not ({', '.join(sorted(extra)[:3])}): it was "
                         "made for another model, or in another mode (train / eval); plan again with this model")
    for node in captured.gm.graph.nodes:
        sharding = by_name.get(node.name)
        if sharding is None:
            raise ValueError(
                f"the plan has no entry for node {node.name!r}: it was made for another model "
                "or other input shapes; plan again with this model and these inputs"
            )
        outs = output_values(node)
        if outs and outs[0] is not None and tuple(outs[0].shape) != tuple(sharding.shape):
            raise ValueError(
                f"node {node.name!r} has shape {tuple(outs[0].shape)} but the plan expects "
                f"{tuple(sharding.shape)}: plan again for these input shapes"
            )


def _own_storage(graph: Graph, value: Node, params: dict[str, str]) -> Node:
    """`value`, copied if it is a parameter or a view of one (a model that returns its embedding):
    FSDP frees a gathered parameter after the forward, and the output would read freed memory."""
    source = value
    while source.op == "call_function" and getattr(source.target, "is_view", False):
        source = source.args[0]
    if not (source.op == "placeholder" and source.name in params):
        return value
    copy = graph.call_function(torch.ops.aten.clone.default, (value,))
    copy.meta.update({k: value.meta[k] for k in (PLACEMENTS, ORIGIN, GLOBAL) if k in value.meta})
    return copy


def _annotate(new: Node, old: Node, placements, origin: str) -> None:
    new.meta[PLACEMENTS] = tuple(placements)
    new.meta[ORIGIN] = origin
    new.meta[GLOBAL] = old.meta.get("val")


def _emit(graph: Graph, env, moved, node: Node, sharding: NodeSharding, rank: RankView) -> Node:
    """The moves of the node's inputs and the local op or kernel itself."""
    inputs = tensor_inputs(node)
    if node.target is operator.getitem:
        src, index = node.args
        new = graph.call_function(operator.getitem, (env[src], index))
        _annotate(new, node, (env[src].meta[PLACEMENTS][index],), node.name)
        # The plan may read a tuple element in other placements than it was made in: move it.
        env[node] = new
        return _moved(env, moved, graph, node, 0, sharding.outputs[0], rank, node.name)
    local_inputs = [_moved(env, moved, graph, src, i, pl, rank, node.name)
                    for (src, i), pl in zip(inputs, sharding.inputs)]
    if sharding.kernel == "local":
        op, args, kwargs = local_call(node, rank, sharding.inputs, sharding.outputs, local_inputs)
        op = _RESHAPES.get(op, op)
    else:
        op, args, kwargs = registry.kernel_call(sharding.kernel, node, sharding, rank, local_inputs)
    new = graph.call_function(op, args, kwargs)
    _annotate(new, node, sharding.outputs, node.name)
    if sharding.kernel != "local":
        new.meta[KERNEL] = sharding.kernel
    return new


def _moved(env, moved, graph: Graph, src: Node, index: int, target: Placements,
           rank: RankView, consumer: str) -> Node:
    """`src`'s output `index` in placements `target`, moved once and shared by its readers."""
    value = env[src]
    if index and src.target is not operator.getitem:
        raise AssertionError(f"multi-output node {src.name} read without getitem")
    current = value.meta[PLACEMENTS][index]
    key = (src, index, target)
    if current == target:
        return value
    if key in moved:
        return moved[key]
    shape = output_values(src)[index].shape
    for step in redistribute_steps(current, target):
        a = step.axis
        if rank.mesh.sizes[a] == 1:
            continue
        sizes = step_sizes(step, shape, rank.mesh.sizes, rank.coord)
        kwargs = {**dataclasses.asdict(sizes), "axis": rank.axis(a)}
        if step.kind not in (Collective.reduce_scatter, Collective.all_to_all):
            kwargs["grad"] = GradKind.R  # settled by set_grad_kinds
        value = graph.call_function(_COLLECTIVES[step.kind], (value,), kwargs)
        value.meta[PLACEMENTS] = (step.after,)
        value.meta[AXIS] = a
        value.meta[ORIGIN] = consumer
        value.meta[GLOBAL] = output_values(src)[index]
    moved[key] = value
    return value
