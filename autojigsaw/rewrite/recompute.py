"""Recomputation at run time: the layers a plan recomputes run under torch.utils.checkpoint.

The rewritten graph is split (torch.fx split_module) into runs of nodes that serve one
recomputed layer (or one FSDP unit's layer, runtime/fsdp.py) and runs that serve none; each
recomputed layer's submodule is called through non-reentrant checkpoint. "full" keeps only the layer's inputs; "selective" keeps the outputs
of matmuls, attention and collectives (torchtitan's save list, via create_selective_checkpoint_contexts)
and recomputes the rest; "selective-op" is torchtitan's op-level policy itself, which also recomputes
every second aten.mm/addmm the layer's forward runs (counted afresh in each forward and in each
recomputation, as torchtitan counts). Every rank recomputes the same layers in the same order, so
collectives inside a recomputed layer still meet.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..capture import Captured
from ..cost_model.recompute import PRODUCTS, dispatches_product
from ..modules import layer_path
from ..plan import Plan
from ..ir import ORIGIN

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# What "selective" keeps (torchtitan's save list): matmul and attention outputs, collectives.
SAVED_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
    c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default,
    c10d.all_to_all_single.default, c10d.wait_tensor.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_policy(counts: Counter, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """As "selective", but the 2nd, 4th, ... matrix product of the forward (and of its recomputation) is recomputed."""
    if op in PRODUCTS:
        mode = "recompute" if ctx.is_recompute else "forward"
        counts[mode] += 1
        if counts[mode] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return _selective_policy(ctx, op)


def _op_contexts(counts: Counter | None = None):
    """The selective checkpoint contexts of "selective-op", counting products in `counts` (none: a new one)."""
    return create_selective_checkpoint_contexts(functools.partial(_op_policy, Counter() if counts is None else counts))


class Checkpointed(nn.Module):
    """A layer's submodule, run under non-reentrant checkpoint with the plan's policy; `products`:
    the matrix products the plan counted in the layer ("selective-op" recomputes every second one)."""

    def __init__(self, module: nn.Module, policy: str, products: int = 0, layer: str = ""):
        super().__init__()
        self.module, self.policy, self.products, self.layer = module, policy, products, layer

    def forward(self, *args):
        if self.policy == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            return checkpoint(self.module, *args, use_reentrant=False, context_fn=context)
        if self.policy == "selective-op" and torch.compiler.is_compiling():  # counted afresh inside, as torchtitan
            return checkpoint(self.module, *args, use_reentrant=False, context_fn=_op_contexts)
        if self.policy == "selective-op":
            counts = Counter()
            context = functools.partial(_op_contexts, counts)
            out = checkpoint(self.module, *args, use_reentrant=False, context_fn=context)
            if counts["forward"] != self.products:
                warnings.warn(f"{self.layer} ran {counts['forward']} matrix products (aten.mm/addmm) where the plan "
                              f"counted {self.products}: 'selective-op' recomputes other ones than it priced, so the "
                              "layer's memory and time differ from the plan's (its gradients do not)", stacklevel=2)
                self.products = counts["forward"]  # said once
            return out
        return checkpoint(self.module, *args, use_reentrant=False)


def split_layers(gm: GraphModule, captured: Captured, plan: Plan,
                      weights: dict[str, str] | None = None) -> tuple[GraphModule, dict[str, str]]:
    """`gm` with each layer the plan recomputes run through checkpoint, and the layer of each layer's
    submodule; `gm` itself and {} if there are none. `weights` (parameter placeholder -> layer: FSDP's
    units): those layers are split out too, with the nodes that pass their weights on (gradient sums and
    masks, identities forward), moved to just before their first reader."""
    weights = weights or {}
    policy_of = dict(plan.recompute)
    layers = set(policy_of) | set(weights.values())
    if not layers:
        return gm, {}
    if weights:
        _to_first_reader(gm, set(weights))
    layer_of_origin, products = dict(weights), Counter()
    for node in captured.gm.graph.nodes:
        layer = layer_path(node, captured.params) if node.op == "call_function" else None
        if layer in layers:
            layer_of_origin[node.name] = layer
            products[layer] += dispatches_product(node)
    partition, runs, current = {}, [], None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_of_origin.get(node.meta.get(ORIGIN))
        if not runs or layer != current:
            runs.append(layer)
            current = layer
        partition[node] = len(runs) - 1
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    pieces = {f"submod_{k}": layer for k, layer in enumerate(runs) if layer is not None}
    for name, layer in pieces.items():
        if layer in policy_of:
            setattr(split, name, Checkpointed(getattr(split, name), policy_of[layer], products[layer], layer))
    return split, pieces


def _to_first_reader(gm: GraphModule, weights: set[str]) -> None:
    """Nodes made for a weight in `weights` (its gradient's sums and masks, placed just after its placeholder)
    moved to just before their first reader, so that they run with the layer that reads the weight."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.meta.get(ORIGIN) in weights and node.users:
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            min(node.users, key=order.__getitem__).prepend(node)
    gm.recompile()
