"""What the other stages know of a kernel: one Kernel record per name (its call, traffic and cost), one registry.

The rewrite marks each node running a kernel with the kernel's name (ir.KERNEL), so the
traffic of a rewritten node and the cost of a strategy are both found by that name. The one
other lookup is `local_cost`: the cost of a node that runs its own ATen op ("local"), for ops
whose default estimate misses something (causal attention skips half of its blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import Node

from ..capture.eager_strides import EAGER_STRIDES
from ..ir import KERNEL, tensor_inputs, with_local_tensors
from ..placements import local_offset
from . import random


@dataclass(frozen=True)
class Kernel:
    """A kernel a strategy (or the fuse pass) names: how to call it, what it sends, what it costs.

    build: `(node, sharding, rank, local_inputs) -> (callable, args, kwargs)`, the call that
      replaces a captured node as its NodeSharding says; None for kernels only the fuse pass inserts.
    traffic: `(node, rank, backward) -> [(collective, bytes)]` of a rewritten node, `backward` the
      inputs whose gradient is needed (empty: no backward pass); None: it sends nothing itself.
    cost: `(node, strategy, ctx, grad) -> (seconds, saved bytes)` replacing the default estimate
      (cost_model/estimate.node_costs), for kernels that communicate or skip work inside; saved
      bytes are what the node keeps for backward besides its outputs (NaN: the default).
    """

    name: str
    build: Callable | None
    traffic: Callable | None = None
    cost: Callable | None = None


_KERNELS: dict[str, Kernel] = {}
_LOCAL_COSTS: dict[object, Callable] = {}  # ATen op -> cost of a "local" strategy running it


def add(kernel: Kernel) -> Kernel:
    """Register `kernel` under its name (once)."""
    if kernel.name in _KERNELS or kernel.name == "local":
        raise ValueError(f"kernel {kernel.name!r} is registered twice; give the new one another name")
    _KERNELS[kernel.name] = kernel
    return kernel


def local_cost(op, fn: Callable) -> None:
    """Price the "local" strategies of `op` (the op itself on local shards) with `fn`, as Kernel.cost
    with one more argument: which tensor inputs need a gradient (None: all)."""
    _LOCAL_COSTS[op] = fn


def registered_kernels() -> dict[str, Kernel]:
    """Every registered kernel by its name (a copy)."""
    return dict(_KERNELS)


def registered_local_costs() -> dict[object, Callable]:
    """The cost of each op's "local" strategies, where registered, by op (a copy)."""
    return dict(_LOCAL_COSTS)


def kernel_call(name: str, node: Node, sharding, rank, local_inputs):
    """(callable, args, kwargs) of kernel `name` for `node` as `sharding` (its NodeSharding) runs it."""
    kernel = _KERNELS.get(name)
    if kernel is None or kernel.build is None:
        raise ValueError(f"node {node.name!r}: the plan names kernel {name!r}, which does not exist; "
                         f"known kernels: {sorted(k.name for k in _KERNELS.values() if k.build)}")
    return kernel.build(node, sharding, rank, local_inputs)


def kernel_traffic(node: Node, rank, backward: frozenset) -> list[tuple[str, int]]:
    """Bytes a rewritten kernel node sends inside (none for local ops and kernels that do not communicate)."""
    kernel = _KERNELS.get(node.meta.get(KERNEL))
    return kernel.traffic(node, rank, backward) if kernel is not None and kernel.traffic else []


def kernel_cost(node: Node, strategy, ctx, grad: bool, operand_grads: tuple[bool, ...] | None = None
                ) -> tuple[float, float] | None:
    """(seconds, bytes) by the cost of the strategy's kernel (of the op, for "local"); None: default."""
    if strategy.kernel == "local":
        fn = _LOCAL_COSTS.get(node.target)
        return fn(node, strategy, ctx, grad, operand_grads) if fn else None
    kernel = _KERNELS.get(strategy.kernel)
    return kernel.cost(node, strategy, ctx, grad) if kernel is not None and kernel.cost else None


def _dropout(node, sharding, rank, local_inputs):
    x = node.args[0].meta["val"]
    offset = local_offset(x.shape, sharding.inputs[0], rank.mesh.sizes, rank.coord)
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    stride = node.meta.get(EAGER_STRIDES, (x.stride(),))[0]
    return random.dropout, (local_inputs[0], p, train), {"shape": tuple(x.shape), "stride": stride, "offset": offset}


add(Kernel("dropout", _dropout))


def _draw(node, sharding, rank, local_inputs):
    out = node.meta["val"]
    offset = local_offset(out.shape, sharding.outputs[0], rank.mesh.sizes, rank.coord)
    args, kwargs = with_local_tensors(node.args, node.kwargs, local_inputs)
    strides = node.meta.get(EAGER_STRIDES) or tuple(tuple(src.meta["val"].stride()) for src, _ in tensor_inputs(node))
    return random.draw, (node.target, args, kwargs), {"shape": tuple(out.shape), "offset": offset,
                                                      "strides": strides}


add(Kernel("draw", _draw))
