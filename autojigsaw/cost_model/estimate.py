"""Per-strategy costs the planner minimizes: node time and memory, edge resharding time.

Times are seconds of one step (forward, plus backward when training); memory is bytes per
rank that the choice adds to the step's peak (parameters with their gradients and
optimizer state, activations saved for backward). All shapes are those of the rank holding
the largest shards (mesh coordinate 0: torch.chunk puts the larger chunks first).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.distributed.tensor import Replicate
from torch.fx import GraphModule, Node

from ..mesh import MeshSpec
from ..passes.redistribute import adjoint, redistribute_steps, step_input_numel
from ..passes.strategies import Strategy, output_values, tensor_inputs
from ..placements import Placements, local_shape
from .comm import collective_time
from .compute import backward_factor, flops, roofline_time
from .devices import DeviceSpec

@dataclass(frozen=True)
class CostContext:
    """What every cost needs: the mesh, the device, and whether a backward pass follows."""

    mesh: MeshSpec
    device: DeviceSpec
    training: bool
    optimizer_states: int = 2  # Adam: exp_avg and exp_avg_sq

    @property
    def coord0(self) -> tuple[int, ...]:
        return (0,) * self.mesh.ndim


def needs_grad(gm: GraphModule, params: set[str], inputs_with_grad: set[str]) -> dict[str, bool]:
    """For each node: does a gradient flow into its output during backward?"""
    out: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out[node.name] = node.name in params or node.name in inputs_with_grad
        elif node.op == "call_function":
            floating = any(v is not None and v.is_floating_point() for v in output_values(node))
            out[node.name] = floating and any(out[src.name] for src, _ in tensor_inputs(node))
        else:
            out[node.name] = False
    return out


def _bytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def node_cost(node: Node, strategy: Strategy, ctx: CostContext, grad: bool, is_param: bool):
    """(seconds, bytes of memory) of running `node` with `strategy` on the largest rank."""
    sizes = ctx.mesh.sizes
    outs = output_values(node)
    out_shapes = [local_shape(v.shape, p, sizes, ctx.coord0) if v is not None and p is not None else ()
                  for v, p in zip(outs, strategy.outputs)]
    out_bytes = sum(_bytes(s, v.dtype) for s, v in zip(out_shapes, outs) if v is not None)
    if node.op == "placeholder":
        if is_param:
            copies = 2 + ctx.optimizer_states if ctx.training else 1
            step = out_bytes * (3 + 2 * ctx.optimizer_states) / ctx.device.memory_bandwidth
            return (step if ctx.training else 0.0), out_bytes * copies
        return 0.0, out_bytes
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0, 0
    srcs = tensor_inputs(node)
    in_shapes, in_bytes = [], 0
    for (src, i), p in zip(srcs, strategy.inputs):
        val = output_values(src)[i]
        shape = local_shape(val.shape, p, sizes, ctx.coord0)
        in_shapes.append(shape)
        in_bytes += _bytes(shape, val.dtype)
    dtype = next((v.dtype for v in outs if v is not None), torch.float32)
    t = roofline_time(flops(node.target, in_shapes, out_shapes), in_bytes + out_bytes, dtype, ctx.device)
    if ctx.training and grad:
        t *= 1.0 + backward_factor(node.target)
    saved = out_bytes if ctx.training and grad else 0
    return t, saved


def consumer_partial_axes(strategy: Strategy, k: int) -> tuple[bool, ...]:
    """Per axis: does the consumer hand back a partial gradient for its replicated input k?"""
    pl = strategy.inputs[k]
    outs = [o for o in strategy.outputs if o is not None]
    return tuple(
        isinstance(pl[a], Replicate) and any(not isinstance(o[a], Replicate) for o in outs)
        for a in range(len(pl))
    )


def edge_cost(shape: tuple[int, ...], dtype: torch.dtype, src: Placements, dst: Placements,
              partial: tuple[bool, ...], grad: bool, ctx: CostContext) -> float:
    """Seconds to move a tensor from `src` to `dst` (and its gradient back, when training)."""
    return _edge_cost(tuple(shape), dtype, src, dst, partial, grad and ctx.training, ctx)


@lru_cache(maxsize=None)
def _edge_cost(shape, dtype, src, dst, partial, backward, ctx) -> float:
    total = 0.0
    steps = redistribute_steps(src, dst)
    for step in steps:
        total += _step_time(step, shape, dtype, ctx)
        if backward and (adj := adjoint(step, partial[step.axis])) is not None:
            total += _step_time(adj, shape, dtype, ctx)
    if backward:  # replicated on both ends, but the consumer returns a partial gradient
        touched = {s.axis for s in steps}
        for a, is_partial in enumerate(partial):
            if is_partial and a not in touched and isinstance(dst[a], Replicate):
                numel = int(np.prod(local_shape(shape, dst, ctx.mesh.sizes, ctx.coord0)))
                total += _time("all_reduce", numel * dtype.itemsize, a, ctx)
    return total


def _step_time(step, shape, dtype, ctx: CostContext) -> float:
    sized = step_input_numel(step, shape, ctx.mesh.sizes, ctx.coord0)
    if sized is None:
        return 0.0
    kind, numel = sized
    return _time(kind, numel * dtype.itemsize, step.axis, ctx)


def _time(kind: str, nbytes: int, axis: int, ctx: CostContext) -> float:
    link = ctx.device.axis_link(ctx.mesh.sizes, axis)
    return collective_time(kind, nbytes, ctx.mesh.sizes[axis], link.latency_s, link.bandwidth)
