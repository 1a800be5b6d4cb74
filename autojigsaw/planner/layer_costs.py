"""The costs a pipeline is cut by: each repeated layer's seconds and bytes per microbatch, read off a plan.

From a plan of the whole model on the stage mesh, `layer_costs` sums each layer's nodes (and what runs
before and after the layers): forward and backward seconds (a node's time split by its op's backward
factor; resharding half each way), the weight-gradient share (a matmul that reads a weight computes
its gradient as one more product), the activations held at the peak, the weights and their state, the
per-step work (optimizer, the data axis' exposed traffic) and the bytes crossing a layer boundary.
`balanced_starts` cuts layers into stages where the slowest is fastest, within memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..capture import Captured
from ..capture.stages import cut, layer_stack
from ..cost_model.compute import backward_factor
from ..modules import layer_of
from ..placements import local_shape
from ..plan import Plan


@dataclass(frozen=True)
class LayerCosts:
    """Per microbatch: each repeated layer's seconds and bytes, and what runs before and after them."""

    layers: tuple[str, ...]
    forward: np.ndarray  # [before, layer 0, ..., layer L-1, after]: seconds
    backward: np.ndarray
    weight: np.ndarray
    saved: np.ndarray  # bytes each holds from its forward to its backward
    held: np.ndarray  # bytes of weights, gradients and optimizer state
    per_step: np.ndarray  # seconds once per step: the optimizer's, FSDP's exposed traffic
    weights: np.ndarray  # bytes of this rank's compute copy of the weights
    send: float  # bytes crossing a layer boundary

    def scaled(self, rows: float) -> LayerCosts:
        """The costs at `rows` times the microbatch: its work, saved activations and sends scale; its weights and
        per-step work do not (an estimate: a larger microbatch runs its matmuls no less efficiently)."""
        return replace(self, forward=self.forward * rows, backward=self.backward * rows, weight=self.weight * rows,
                       saved=self.saved * rows, send=self.send * rows)

    def stage(self, first: int, stop: int, count_before: bool, count_after: bool) -> tuple[float, ...]:
        """(forward, backward, weight, saved, held, per_step) of layers [first, stop) with the extras as asked."""
        idx = [0] * count_before + list(range(first + 1, stop + 1)) + [len(self.layers) + 1] * count_after
        return tuple(float(a[idx].sum()) for a in (self.forward, self.backward, self.weight, self.saved, self.held,
                                                   self.per_step))


def layer_costs(plan: Plan, captured: Captured) -> LayerCosts:
    """Per-microbatch seconds and bytes of each repeated layer, and of what runs before and after them."""
    layers = layer_stack(captured)
    slot_of = {name: k + 1 for k, name in enumerate(layers)}
    graph = {n.name: n for n in captured.gm.graph.nodes}
    order = {name: i for i, name in enumerate(graph)}
    first = min((order[n.name] for n in plan.nodes if _layer(n.module) in slot_of), default=0)
    sums = np.zeros((7, len(layers) + 2))
    recomputed = dict(plan.recompute)
    coord = (0,) * plan.mesh.ndim
    for ns in plan.nodes:
        node = graph.get(ns.name)
        slot = slot_of.get(_layer(ns.module))
        if slot is None:
            readers = [order[u.name] for u in node.users] if node is not None else []
            slot = 0 if min(readers + [order.get(ns.name, 0)]) < first else len(layers) + 1
        if ns.kind == "param":
            val = node.meta["val"]
            local = math.prod(local_shape(tuple(val.shape), ns.output, plan.mesh.sizes, coord))
            sums[4:7, slot] += (ns.memory_bytes, ns.compute_s + ns.comm_s, local * val.element_size())
            continue
        f, b, w = node_work(ns, node, recomputed.get(_layer(ns.module)), plan.training, captured.params)
        sums[:4, slot] += (f, b, w, ns.memory_bytes)
    # what the plan's step has beside its nodes (FSDP's hidden traffic taken off) goes with the weights
    rest = plan.step_time - sum(ns.compute_s + ns.comm_s for ns in plan.nodes)
    sums[5] += rest * sums[4] / max(sums[4].sum(), 1.0)
    # the activations held at the peak (what the weights' state leaves of it), shared out as the nodes' own bytes
    sums[3] *= max(plan.memory_per_rank - sums[4].sum(), 0.0) / max(sums[3].sum(), 1.0)
    return LayerCosts(tuple(layers), *sums, send=_boundary_bytes(plan, captured, len(layers)))


def _layer(module: str) -> str | None:
    found = layer_of(module)
    return f"{found[0]}.{found[1]}" if found else None


def node_work(ns, node, recompute: str | None, training: bool, params) -> tuple[float, float, float]:
    """(forward, backward, weight gradient) seconds of one planned node per microbatch: its time split by the
    op's backward factor (a recomputed node's time holds its forward twice), resharding half each way."""
    if not training:
        return ns.compute_s + ns.comm_s, 0.0, 0.0
    factor = backward_factor(node.target) if node is not None and node.op == "call_function" else 0.0
    again = recompute == "full" or (recompute is not None and ns.kind not in ("matmul", "attention"))
    forward = ns.compute_s / (1.0 + factor + again)
    weight = forward if ns.kind == "matmul" and any(a.name in params for a in node.all_input_nodes) else 0.0
    return forward + ns.comm_s / 2, ns.compute_s - forward + ns.comm_s / 2, weight


def _boundary_bytes(plan: Plan, captured: Captured, layers: int) -> float:
    """Bytes one rank sends across a layer boundary per microbatch, as placed in `plan` (read off a cut)."""
    if layers < 2:
        return 0.0
    return float(sent_bytes(plan, captured, cut(captured, [0, layers // 2])[0].sends))


def sent_bytes(plan: Plan, captured: Captured, names: Sequence[str]) -> int:
    """Bytes of this rank's shards of the values `names` (placed as `plan` makes them)."""
    vals = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes}
    coord = (0,) * plan.mesh.ndim
    return sum(math.prod(local_shape(tuple(vals[name].shape), plan.node(name).outputs[0], plan.mesh.sizes, coord))
               * vals[name].dtype.itemsize for name in names)


def stage_work(plan: Plan, captured: Captured) -> tuple[float, float, float, float]:
    """A stage plan's seconds: forward, backward and weight gradient per microbatch, and the rest of its step
    (the optimizer step, FSDP's exposed traffic), once per step."""
    graph = {n.name: n for n in captured.gm.graph.nodes}
    recomputed = dict(plan.recompute)
    forward = backward = weight = busy = 0.0
    for ns in plan.nodes:
        if ns.kind == "param":
            continue
        f, b, w = node_work(ns, graph.get(ns.name), recomputed.get(_layer(ns.module)), plan.training, captured.params)
        forward, backward, weight, busy = forward + f, backward + b, weight + w, busy + ns.compute_s + ns.comm_s
    return forward, backward, weight, plan.step_time - busy


def balanced_starts(costs: LayerCosts, in_flight: Sequence[int], budget: float | None) -> tuple[int, ...] | None:
    """The first layer of each stage, cutting where the slowest stage (forward and backward, the first and
    last with their extras) is fastest, each stage's weights and in-flight activations within `budget`
    (None: any); None if no cut fits."""
    stages, n = len(in_flight), len(costs.layers)
    work = costs.forward + costs.backward
    prefix = np.concatenate([[0.0], np.cumsum(work[1:n + 1])])
    saved = np.concatenate([[0.0], np.cumsum(costs.saved[1:n + 1])])
    held = np.concatenate([[0.0], np.cumsum(costs.held[1:n + 1])])
    best = np.full((stages + 1, n + 1), np.inf)
    cut_at = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(stages):
        extra = (work[0] if s == 0 else 0.0) + (work[n + 1] if s == stages - 1 else 0.0)
        mem_extra = ((costs.held[0] + in_flight[s] * costs.saved[0]) if s == 0 else 0.0) + \
                    ((costs.held[n + 1] + in_flight[s] * costs.saved[n + 1]) if s == stages - 1 else 0.0)
        for j in range(s + 1, n - (stages - s - 1) + 1):
            i = np.arange(s, j)
            time = prefix[j] - prefix[i] + extra
            if budget is not None:
                memory = held[j] - held[i] + in_flight[s] * (saved[j] - saved[i]) + mem_extra
                time = np.where(memory <= budget, time, np.inf)
            total = np.maximum(best[s, i], time)
            k = int(np.argmin(total))
            best[s + 1, j], cut_at[s + 1, j] = total[k], i[k]
    if not np.isfinite(best[stages, n]):
        return None
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = int(cut_at[s, j])
        starts.append(j)
    return tuple(reversed(starts))
