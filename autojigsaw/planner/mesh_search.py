"""The mesh as a decision: the GPUs factored into pipe x data x tensor axes, each factoring estimated.

A factoring keeps the tensor axis within a node, the pipe axis within the model's repeated layers and
the data axis a divisor of the batch. Its estimate comes from one whole-model plan per tensor size
(on that axis alone, at one sample per rank): each layer's seconds and bytes, scaled to the rows a
microbatch gives each rank, the data axis' traffic added (FSDP's gathers and reduce-scatters, or
DDP's all-reduce, over its link) and its weights sharded over it under FSDP; with a pipe axis, every
schedule is replayed as a pipelined plan's candidates are (planner/pipeline.py). A factoring whose
weights and optimizer state miss the budget even sharded over every rank is pruned before any plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ..cost_model.comm import collective_time
from ..cost_model.devices import DeviceSpec
from ..mesh import MeshSpec
from ..training import Regime
from .layer_costs import LayerCosts
from .pipeline import PipelineChoice, estimated

AXES = ("pipe", "data", "tensor")  # outermost first: the tensor axis varies fastest, within a node


@dataclass(frozen=True)
class MeshEstimate:
    """A factoring's estimated step (seconds) and peak memory per rank (bytes), and whether it fits."""

    mesh: MeshSpec
    step_time: float
    memory: float
    fits: bool


def factorings(world: int, per_node: int, layers: int, batch: int) -> list[MeshSpec]:
    """Every pipe x data x tensor of `world` ranks with the tensor axis within a node, the pipe axis at most the
    layers and the data axis dividing the batch (axes of one rank left out)."""
    out = []
    for tensor in (t for t in range(1, per_node + 1) if per_node % t == 0 and world % t == 0):
        for pipe in (p for p in range(1, min(layers, world // tensor) + 1) if (world // tensor) % p == 0):
            data = world // (tensor * pipe)
            if batch % data == 0:
                sizes = dict(zip(AXES, (pipe, data, tensor)))
                kept = {k: v for k, v in sizes.items() if v > 1} or {"tensor": 1}
                out.append(MeshSpec(tuple(kept), tuple(kept.values())))
    return out


def lower_bound_memory(weights: float, held: float, mesh: MeshSpec, fsdp: bool) -> float:
    """Bytes per rank its weights and optimizer state need at least: `held` (all of them on one rank, the
    whole model's) spread over the pipe and tensor axes, and over the data axis under FSDP."""
    spread = mesh.size("tensor") if "tensor" in mesh.axis_names else 1
    spread *= mesh.size("pipe") if "pipe" in mesh.axis_names else 1
    spread *= mesh.size("data") if fsdp and "data" in mesh.axis_names else 1
    return held / spread


def estimate_mesh(costs_at: Callable[[int], LayerCosts], mesh: MeshSpec, regime: Regime, choice: PipelineChoice, *,
                  budget: int, batch: int, device: DeviceSpec) -> MeshEstimate | None:
    """A factoring's step and memory from the layer costs of its tensor size (`costs_at(rows)`: at `rows`
    samples per rank and microbatch), or None where no schedule can run it."""
    data = mesh.size("data") if "data" in mesh.axis_names else 1
    link = device.axis_link(mesh.sizes, mesh.axis_index("data"), "data") if data > 1 else None

    pipelined = "pipe" in mesh.axis_names

    def on_mesh(m: int) -> LayerCosts:
        return with_data_axis(costs_at(batch // data // m), data, regime, link, device, pipelined=pipelined)

    if not pipelined:
        m = choice.microbatches or 1
        costs = on_mesh(m)
        step = m * float((costs.forward + costs.backward).sum()) + float(costs.per_step.sum())
        memory = float(costs.held.sum() + costs.saved.sum())
        return MeshEstimate(mesh, step, memory, memory <= budget)
    try:
        candidates = estimated(on_mesh, mesh, choice, budget=budget, batch=batch, device=device)
    except ValueError:  # no microbatches or schedule this mesh allows
        return None
    if not candidates:
        return None
    best = candidates[0].estimate
    return MeshEstimate(mesh, best.step_time, best.memory, best.fits)


def with_data_axis(costs: LayerCosts, data: int, regime: Regime, link, device: DeviceSpec, *,
                   pipelined: bool) -> LayerCosts:
    """Layer costs planned without a data axis, on one of `data` ranks: the weights' state sharded over it
    under FSDP (a stage keeps its compute copy and gradients whole), and its traffic once per step."""
    if data == 1:
        return costs
    reduce_ratio = regime.precision.reduce_itemsize(2) / 2 if regime.precision.mixed else 1.0

    def seconds(kind: str, nbytes: np.ndarray) -> np.ndarray:
        return np.asarray(collective_time(kind, nbytes, data, link.latency_s, link.bandwidth,
                                          tree=device.tree_all_reduce), dtype=float)

    grads = costs.weights * reduce_ratio
    if not regime.fsdp:
        return replace(costs, per_step=costs.per_step + seconds("all_reduce", grads))
    traffic = seconds("all_gather", costs.weights / data) * (1 if pipelined else 2) + seconds("reduce_scatter", grads)
    kept = costs.weights * (1 + reduce_ratio) if pipelined else 0.0
    hidden = 0.5 if pipelined else 1 - 1 / max(len(costs.layers), 1)  # under compute: the gathers, not the sums
    return replace(costs, held=costs.held / data + kept, per_step=costs.per_step + traffic * (1 - hidden))
