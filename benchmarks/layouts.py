"""Planning inside a hand-written layout: each node keeps only the strategies the layout allows.

What a published run *ran* is priced by planning with its layout imposed (torchtitan's tensor
parallelism: every matrix weight stays split over the tensor axis; Megatron-Core's mixture of
experts: attention's tokens over data x expert and heads over tensor, the experts over expert x
tensor), beside the plan autojigsaw would choose; axis_roles.py imposes the roles axis names
suggest the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch.distributed.tensor import Replicate, Shard
from torch.fx import GraphModule, Node

import autojigsaw.api.building
import autojigsaw.api.meshes
import autojigsaw.api.pipelines
import autojigsaw.api.recipe
from autojigsaw.capture.routed_experts import OP as ROUTED_EXPERTS
from autojigsaw.cost_model.compute import ATTENTION
from autojigsaw.ir import STRATEGIES, Strategy, tensor_inputs
from autojigsaw.modules import EXPERT_WEIGHT

Keep = Callable[[Node, Strategy], bool]


# the modules that call autojigsaw.api.recipe.plan_captured by the name they imported
_CALLERS = (autojigsaw.api.building, autojigsaw.api.meshes, autojigsaw.api.pipelines)


@contextlib.contextmanager
def strategies_filtered(keep_for: Callable[[object, GraphModule], Keep], unfiltered: list[str] | None = None):
    """While planning: each node keeps the strategies keep_for(captured, gm) accepts; a node with
    none accepted keeps all of its own (its name goes to `unfiltered`)."""
    plan_captured, annotate = autojigsaw.api.recipe.plan_captured, autojigsaw.api.recipe.annotate

    def planned(captured, *args, **kwargs):
        def annotated(gm, *a, **k):
            annotate(gm, *a, **k)
            keep = keep_for(captured, gm)
            for node in gm.graph.nodes:
                kept = [s for s in node.meta.get(STRATEGIES, ()) if keep(node, s)]
                if kept:
                    node.meta[STRATEGIES] = kept
                elif STRATEGIES in node.meta and unfiltered is not None:
                    unfiltered.append(node.name)

        autojigsaw.api.recipe.annotate = annotated
        try:
            return plan_captured(captured, *args, **kwargs)
        finally:
            autojigsaw.api.recipe.annotate = annotate

    for module in _CALLERS:
        module.plan_captured = planned
    try:
        yield
    finally:
        for module in _CALLERS:
            module.plan_captured = plan_captured


def tensor_parallel(axis: int) -> Callable[[object, GraphModule], Keep]:
    """Megatron's and torchtitan's tensor parallelism on mesh axis `axis`: every matrix weight (and
    its casts and views) is read split over that axis, never gathered there (column- or row-wise,
    embeddings and the output head by vocabulary); the rest -- sequence-parallel norms, the loss
    over split logits -- as the planner finds cheapest."""
    def keep_for(captured, gm: GraphModule) -> Keep:
        weights: set[Node] = set()
        for node in gm.graph.nodes:
            ins = [src for src, _ in tensor_inputs(node)] if node.op == "call_function" else []
            if (node.op == "placeholder" and node.name in captured.params and node.meta["val"].ndim >= 2) or (
                    ins and all(src in weights for src in ins)):
                weights.add(node)

        def keep(node: Node, strategy: Strategy) -> bool:
            if node in weights and any(out is not None and not isinstance(out[axis], Shard)
                                       for out in strategy.outputs):
                return False
            return all(src not in weights or isinstance(pl[axis], Shard)
                       for (src, _), pl in zip(tensor_inputs(node), strategy.inputs))

        return keep

    return keep_for


def megatron_moe(axes: tuple[str, ...]) -> Callable[[object, GraphModule], Keep]:
    """Megatron-Core's mixture-of-experts layout on a data x expert x tensor mesh (`axes`, in order):
    attention's tokens split over data x expert and its heads over tensor, every other matrix weight
    split over tensor as `tensor_parallel` keeps it and whole over expert (data parallelism there); the
    routed experts' tokens over all three axes, dispatched by one all-to-all over expert x tensor (EP =
    expert x tensor, ETP 1), their weights gathered over data as FSDP gathers them."""
    data, expert, tensor = (axes.index(a) for a in ("data", "expert", "tensor"))
    split = Shard(0)

    def keep_for(captured, gm: GraphModule) -> Keep:
        tensor_kept = tensor_parallel(tensor)(captured, gm)

        def keep(node: Node, strategy: Strategy) -> bool:
            if node.target is ROUTED_EXPERTS:
                x, w = strategy.inputs[0], strategy.inputs[3]
                return all(x[a] == split for a in (data, expert, tensor)) and (
                    w[data] == Replicate() and w[expert] == split and w[tensor] == split)
            if node.target in ATTENTION:
                q = strategy.inputs[0]
                return q[expert] == Shard(0) and q[tensor] == Shard(1)
            if node.op == "placeholder" and node.name in captured.params and not node.meta.get(EXPERT_WEIGHT):
                if any(out is not None and out[expert] != Replicate() for out in strategy.outputs):
                    return False
            return tensor_kept(node, strategy)

        return keep

    return keep_for
