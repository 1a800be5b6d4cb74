"""Per-strategy costs the planner minimizes: node time per strategy, edge resharding time and bytes.

Times are seconds of one step (forward, plus backward when training). A node's costs come
for all its strategies at once, as numpy arrays: local shapes per strategy, then the
compiled formulas of compute.py. Memory is liveness.py's. Shapes are those of the rank
holding the largest shards (mesh coordinate 0: torch.chunk puts the larger chunks first).

Kernels that communicate inside, or do other work than their op, price themselves: the `cost`
of their `kernels.registry.Kernel` replaces the default time (and saved bytes).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from torch.distributed.tensor import Replicate
from torch.fx import Node

from ..ir import Strategy, adjoint, bytes_sent, output_values, redistribute_steps, step_input_numel, tensor_inputs
from ..kernels import registry
from ..mesh import MeshSpec
from ..modules import data_sums, fsdp_shards
from ..placements import Placements, local_shape
from ..training import Regime, data_axes, splits_data
from .comm import collective_time
from .compute import backward_factor, kind_name, memory_time, op_kind, roofline_time
from .devices import DeviceSpec
from .liveness import ParamMemory
from .memory import OPTIMIZERS, Optimizer, is_view


@dataclass(frozen=True)
class CostContext:
    """What every cost needs: the mesh, the device, whether a backward pass and which optimizer."""

    mesh: MeshSpec
    device: DeviceSpec
    training: bool
    optimizer: Optimizer = field(default=OPTIMIZERS["adam"])
    regime: Regime = field(default=Regime())
    moe_imbalance: float = 1.0  # routed experts priced with the busiest rank's tokens this times the mean
    fsdp_layers: int = 0  # > 0: FSDP prefetches over this many layers; its traffic is priced apart (NodeCosts.data_s)

    @property
    def coord0(self) -> tuple[int, ...]:
        return (0,) * self.mesh.ndim

    @property
    def fsdp_axis(self) -> int | None:
        """The data axis FSDP shards the weights over (None: no FSDP, or one rank)."""
        axes = data_axes(self.mesh) if self.regime.fsdp else ()
        return axes[0] if axes and self.mesh.sizes[axes[0]] > 1 else None

    def param_memory(self, placeholder: Node, placements: Placements | None = None) -> ParamMemory:
        """What a parameter (its graph placeholder: dtype and shape) keeps in `placements`, under this regime."""
        axis, itemsize = self.fsdp_axis, placeholder.meta["val"].dtype.itemsize
        sharded = axis is not None and fsdp_shards(placeholder, split=self._split(placements))
        return ParamMemory.of(itemsize, mixed=self.regime.precision.mixed,
                              fsdp_ranks=self.mesh.sizes[axis] if sharded else 1,
                              reduce_itemsize=self.regime.precision.reduce_itemsize(itemsize),
                              kept_gathered=self.regime.fsdp_once, accumulated=self.regime.accumulates)

    @property
    def summed_axis(self) -> int | None:
        """The data axis over which the weights' gradients are summed outside the graph (FSDP's, each
        microbatch's; DDP's under gradient accumulation, once per step); None: in the graph, or no data axis."""
        axes = data_axes(self.mesh) if self.regime.data_sums_once else ()
        return axes[0] if axes and self.mesh.sizes[axes[0]] > 1 else None

    def _split(self, placements: Placements | None) -> bool:
        return placements is not None and splits_data(placements, self.mesh)

    def data_comm(self, nbytes, placeholder: Node, placements: Placements | None = None, trained: bool = True):
        """(seconds, bytes sent) of the data axis' own traffic for a parameter (its graph placeholder) of `nbytes`
        local compute bytes in `placements`, per step: FSDP gathers it for forward and again for backward
        (once under `regime.fsdp_once`) and reduce-scatters its gradient; DDP under gradient accumulation
        all-reduces its gradient once; nothing else here (the graph sums gradients itself, and those of the
        weights the plan splits over the data axis: routed experts dispatched there)."""
        axis, itemsize = self.summed_axis, placeholder.meta["val"].dtype.itemsize
        split = self._split(placements)
        if axis is None or not self.training or not data_sums(placeholder, fsdp=self.regime.fsdp, split=split):
            return 0.0, 0
        n, link = self.mesh.sizes[axis], self.link(axis)
        grad_bytes = nbytes * self.regime.precision.reduce_itemsize(itemsize) / itemsize if trained else 0.0

        def one(kind, b):
            return collective_time(kind, b, n, link.latency_s, link.bandwidth, tree=self.device.tree_all_reduce)

        if not self.regime.fsdp:
            return one("all_reduce", grad_bytes), bytes_sent("all_reduce", grad_bytes, n)
        gathers = 1 if self.regime.fsdp_once else 2  # forward and again backward, or once for the step
        time = gathers * one("all_gather", nbytes / n) + (one("reduce_scatter", grad_bytes) if trained else 0.0)
        sent = gathers * nbytes * (n - 1) / n + grad_bytes * (n - 1) / n
        return time, sent

    def link(self, axis: int):
        return self.device.axis_link(self.mesh.sizes, axis, self.mesh.axis_names[axis])

    def collective_time(self, kind: str, nbytes, axis: int) -> float:
        """Seconds of one collective of `nbytes` input over mesh axis `axis`, on its link."""
        link = self.link(axis)
        return float(collective_time(kind, nbytes, self.mesh.sizes[axis], link.latency_s, link.bandwidth,
                                     tree=self.device.tree_all_reduce))


@lru_cache(maxsize=None)
def _local(shape: tuple[int, ...], placements: tuple, sizes: tuple[int, ...]) -> np.ndarray:
    """[strategies, ndim]: the local shape of one tensor under each strategy's placements."""
    coord = (0,) * len(sizes)
    return np.array([local_shape(shape, p, sizes, coord) if p is not None else shape for p in placements],
                    dtype=np.int64).reshape(len(placements), len(shape))


def _columns(matrix: np.ndarray) -> list[np.ndarray]:
    return [matrix[:, d].astype(float) for d in range(matrix.shape[1])]


@dataclass(frozen=True)
class NodeCosts:
    """Seconds per strategy, and the bytes kernels' own cost functions say they save (NaN: default)."""

    time: np.ndarray
    kernel_saved: np.ndarray | None = None
    data_s: np.ndarray | None = None  # a weight's FSDP traffic, not in `time`, where CostContext.fsdp_layers


def node_costs(node: Node, strategies: list[Strategy], ctx: CostContext, grad: bool, is_param: bool,
               operand_grads: tuple[bool, ...] | None = None) -> NodeCosts:
    """The time of every strategy of `node` on the largest rank, one step. `grad`: its output gets a
    gradient (a parameter's: it is trained); `operand_grads`: which tensor inputs get one (None: all)."""
    zeros = np.zeros(len(strategies))
    if node.op == "placeholder":
        val = node.meta.get("val")
        if not (is_param and ctx.training and isinstance(val, torch.Tensor)):
            return NodeCosts(zeros)
        sizes = ctx.mesh.sizes
        local = _local(tuple(val.shape), tuple(s.outputs[0] for s in strategies), sizes)
        nbytes = np.prod(local, axis=1) * val.dtype.itemsize
        placements = [s.outputs[0] for s in strategies]
        masters = nbytes * np.array([ctx.param_memory(node, p).state for p in placements])  # the optimizer's reads
        step = (memory_time(masters * ctx.optimizer.step_passes, ctx.device, "optimizer") if grad
                else np.zeros_like(nbytes))
        comm = np.array([ctx.data_comm(b, node, p, trained=grad)[0] for b, p in zip(nbytes, placements)], dtype=float)
        return NodeCosts(step, data_s=comm) if ctx.fsdp_layers else NodeCosts(step + comm)
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return NodeCosts(zeros)
    time = _default_times(node, tuple(strategies), ctx, grad, operand_grads)
    hooked = [registry.kernel_cost(node, s, ctx, grad, operand_grads) for s in strategies]
    if not any(h is not None for h in hooked):
        return NodeCosts(time)
    time = np.array([h[0] if h is not None else t for h, t in zip(hooked, time)], dtype=float)
    saved = np.array([h[1] if h is not None else np.nan for h in hooked], dtype=float)
    return NodeCosts(time, saved)


def _default_times(node: Node, strategies: tuple[Strategy, ...], ctx: CostContext, grad: bool,
                   operand_grads: tuple[bool, ...] | None) -> np.ndarray:
    sizes = ctx.mesh.sizes
    in_shapes, global_in, nbytes = [], [], 0.0
    for j, (src, i) in enumerate(tensor_inputs(node)):
        val = output_values(src)[i]
        global_in.append(tuple(val.shape))
        local = _local(tuple(val.shape), tuple(s.inputs[j] for s in strategies), sizes)
        in_shapes.append(_columns(local))
        nbytes = nbytes + np.prod(local, axis=1) * val.dtype.itemsize
    out_shapes = []
    for o, val in enumerate(output_values(node)):
        if val is None:
            continue
        local = _local(tuple(val.shape), tuple(s.outputs[o] for s in strategies), sizes)
        out_shapes.append(_columns(local))
        nbytes = nbytes + np.prod(local, axis=1) * val.dtype.itemsize
    dtype = next((v.dtype for v in output_values(node) if v is not None), torch.float32)
    kind = op_kind(node.target)
    n = len(strategies)
    flops = np.broadcast_to(np.asarray(kind.flops(*kind.dims(in_shapes, out_shapes)), dtype=float), (n,))
    global_out = [tuple(v.shape) for v in output_values(node) if v is not None]
    t = roofline_time(flops, np.broadcast_to(np.asarray(nbytes, dtype=float), (n,)), dtype, ctx.device,
                      kind_name(node.target, global_in, global_out))
    if ctx.training and grad:
        t = t * (1.0 + backward_factor(node.target, operand_grads))
    return np.asarray(t, dtype=float)


def consumer_partial_axes(strategy: Strategy, k: int) -> tuple[bool, ...]:
    """Per axis: does the consumer hand back a partial gradient for its replicated input k?"""
    pl = strategy.inputs[k]
    outs = [o for o in strategy.outputs if o is not None]
    return tuple(
        isinstance(pl[a], Replicate) and any(not isinstance(o[a], Replicate) for o in outs)
        for a in range(len(pl))
    )


@dataclass(frozen=True)
class EdgeCosts:
    """Producer strategy x consumer strategy: seconds and bytes sent per rank to reshard."""

    time: np.ndarray
    bytes: np.ndarray


def edge_costs(val: torch.Tensor, src: tuple[Placements, ...], dst: tuple[Placements, ...],
               partial: tuple[tuple[bool, ...], ...], grad: bool, ctx: CostContext) -> EdgeCosts:
    """Costs of moving `val` from each producer placement to each consumer one (and back)."""
    return _edge_costs(tuple(val.shape), val.dtype, src, dst, partial, grad and ctx.training, ctx)


@lru_cache(maxsize=None)
def _edge_costs(shape, dtype, src, dst, partial, backward, ctx) -> EdgeCosts:
    rows, row_of = _unique(src)
    cols, col_of = _unique(tuple(zip(dst, partial)))
    time = np.empty((len(rows), len(cols)))
    sent = np.empty((len(rows), len(cols)))
    for r, s in enumerate(rows):
        for c, (d, p) in enumerate(cols):
            time[r, c], sent[r, c] = _pair_cost(shape, dtype, s, d, p, backward, ctx)
    return EdgeCosts(time[np.ix_(row_of, col_of)], sent[np.ix_(row_of, col_of)])


def _unique(items: tuple) -> tuple[list, np.ndarray]:
    first: dict = {}
    of = np.array([first.setdefault(x, len(first)) for x in items], dtype=np.int64)
    return list(first), of


@lru_cache(maxsize=None)
def _pair_cost(shape, dtype, src: Placements, dst: Placements, partial: tuple[bool, ...], backward: bool,
              ctx: CostContext) -> tuple[float, int]:
    """(seconds, bytes sent) to move a tensor from `src` to `dst`, and its gradient back."""
    time, sent = 0.0, 0
    for kind, nbytes, axis in collective_steps(shape, dtype.itemsize, src, dst, partial, backward, ctx.mesh):
        time += ctx.collective_time(kind, nbytes, axis)
        sent += bytes_sent(kind, nbytes, ctx.mesh.sizes[axis])
    return time, sent


def collective_steps(shape, itemsize: int, src: Placements, dst: Placements, partial: tuple[bool, ...],
                     backward: bool, mesh: MeshSpec) -> list[tuple[str, int, int]]:
    """(collective, input bytes, axis) of each collective a redistribution runs, forward then backward."""
    coord = (0,) * mesh.ndim
    out = []
    steps = _steps(src, dst)
    for step in steps:
        for s in [step] + ([a] if backward and (a := _adjoint(step, partial[step.axis])) is not None else []):
            sized = _numel(s, tuple(shape), mesh.sizes, coord)
            if sized is not None and mesh.sizes[s.axis] > 1:
                out.append((sized[0], sized[1] * itemsize, s.axis))
    if backward:  # replicated on both ends, but the consumer returns a partial gradient
        touched = {s.axis for s in steps}
        for a, is_partial in enumerate(partial):
            if is_partial and a not in touched and isinstance(dst[a], Replicate) and mesh.sizes[a] > 1:
                numel = int(np.prod(local_shape(shape, dst, mesh.sizes, coord)))
                out.append(("all_reduce", numel * itemsize, a))
    return out


# The same steps recur across the pairs of every edge: work each out once.
_steps = lru_cache(maxsize=None)(redistribute_steps)
_adjoint = lru_cache(maxsize=None)(adjoint)
_numel = lru_cache(maxsize=None)(step_input_numel)

