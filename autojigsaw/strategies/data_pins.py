"""Data parallelism: a mesh axis named "data" or "dp" splits the batch, and weights only by their experts.

Such an axis is pure data parallelism: every tensor input whose dim 0 is the batch is sharded
on dim 0 over it, every other input, parameter and buffer is replicated over it, and the planner
chooses freely on the other axes. Weights then stay whole over the data axis, and the gradient
pass all-reduces their gradients over it (activations are sharded there), as DDP does; FSDP2
`fully_shard` can shard them over it afterwards (see ParallelModule). One exception: the weights
of routed experts (modules.EXPERT_WEIGHT) may also be split over it by their experts (dim 0), the
planner's choice: a token dispatch over the data axis then uses them where they are (expert
parallelism on ranks borrowed from the data, as torchtitan's) and FSDP leaves them; kept whole there,
FSDP shards and gathers them as any other weight (Megatron-Core's expert data parallelism). Fewer
experts than data ranks stay whole over the data axes.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from ..capture import Captured
from ..mesh import MeshSpec
from ..modules import EXPERT_WEIGHT
from ..placements import Placements
from ..training import data_axes


def data_pins(captured: Captured, mesh: MeshSpec, fixed: dict[str, Placements]) -> dict[str, Placements]:
    """`fixed` (placeholder -> placements) with the data axes pinned; None leaves an axis free, a tuple of
    placements gives the planner a choice among them."""
    axes = tuple(a for a in data_axes(mesh) if mesh.sizes[a] > 1)  # a size-1 axis splits nothing
    if not axes:
        return fixed
    placeholders = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    values = {name: n.meta.get("val") for name, n in placeholders.items()}
    inputs = [name for name in captured.inputs if isinstance(values[name], torch.Tensor)]
    batch = next((values[n].shape[0] for n in inputs if values[n].ndim), None)
    ranks = math.prod(mesh.sizes[a] for a in axes)
    if batch is not None and batch < ranks:
        names = ", ".join(repr(mesh.axis_names[a]) for a in axes)
        raise ValueError(f"the batch of {batch} is smaller than the {ranks} ranks of data axis {names}: "
                         "give every data-parallel rank at least one sample, or shrink that axis")
    pins = dict(fixed)
    for name in [*inputs, *captured.params, *captured.buffers]:
        val = values[name]
        if not isinstance(val, torch.Tensor):
            continue
        pin = list(fixed.get(name, (None,) * mesh.ndim))
        batched = name in inputs and val.ndim and val.shape[0] == batch
        # fewer experts than data ranks: kept whole there, as every other weight
        experts = placeholders[name].meta.get(EXPERT_WEIGHT, False) and val.shape[0] >= ranks
        for a in axes:
            if pin[a] is None:
                pin[a] = Shard(0) if batched else (Shard(0), Replicate()) if experts else Replicate()
        pins[name] = tuple(pin)
    return pins

