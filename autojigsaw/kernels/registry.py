"""What the other stages know of a kernel: the call it builds (by name), its traffic (by function), its cost (by name or op)."""

from __future__ import annotations

from collections.abc import Callable

from ..placements import local_offset
from . import random

_BUILDERS: dict[str, Callable] = {}


def register(name: str):
    """Decorator: `fn(node, spec, rank, local_inputs) -> (callable, args, kwargs)` for kernel `name`."""

    def wrap(fn):
        _BUILDERS[name] = fn
        return fn

    return wrap


def kernel_call(name: str, node, spec, rank, local_inputs):
    if name not in _BUILDERS:
        raise ValueError(f"node {node.name!r}: the plan names kernel {name!r}, which does not exist; "
                         f"known kernels: {sorted(_BUILDERS)}")
    return _BUILDERS[name](node, spec, rank, local_inputs)


@register("dropout")
def _dropout(node, spec, rank, local_inputs):
    x = node.args[0].meta["val"]
    offset = local_offset(x.shape, spec.inputs[0], rank.mesh.sizes, rank.coord)
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return random.dropout, (local_inputs[0], p, train), {"shape": tuple(x.shape), "offset": offset}


_TRAFFIC: dict[Callable, Callable] = {}


def traffic(fn: Callable):
    """Decorator: `count(node, rank, backward) -> [(collective, bytes)]` for kernel function `fn`.

    `backward`: the node's inputs whose gradient is needed (empty: no backward pass).
    """

    def wrap(count):
        _TRAFFIC[fn] = count
        return count

    return wrap


def kernel_traffic(node, rank, backward: frozenset) -> list[tuple[str, int]]:
    """Bytes a kernel call sends inside (none for kernels that do not communicate)."""
    count = _TRAFFIC.get(node.target)
    return count(node, rank, backward) if count else []


_COSTS: dict[object, Callable] = {}


def cost(key):
    """Decorator: `fn(node, strategy, ctx, grad) -> (seconds, saved bytes)` for a kernel name or an op.

    It replaces the default estimate (cost_model/estimate.node_costs) for strategies running
    that kernel (or, for "local" ones, that op): kernels that communicate or skip work inside
    need it. Saved bytes: what the node keeps for backward besides its outputs (NaN: the default).
    """

    def wrap(fn):
        _COSTS[key] = fn
        return fn

    return wrap


def kernel_cost(node, strategy, ctx, grad: bool) -> tuple[float, float] | None:
    """(seconds, bytes) by the cost function of the strategy's kernel, else of its op; None: default."""
    fn = _COSTS.get(strategy.kernel) or _COSTS.get(node.target)
    return fn(node, strategy, ctx, grad) if fn else None
