"""A program's inputs as one rank feeds them: its weights, buffers and constants, then the call's inputs.

A weight is this rank's shard of the model's DTensor parameter, in the dtype the graph computes in
(mixed precision casts it, differentiably); under FSDP's units the root's weights come gathered and a
layer's come from its unit (None here). A buffer is the model's own (made real from meta, or loaded)
over export's copy, this rank's view of it. A call's input is this rank's shard of the whole input,
sliced with a gradient path back to it, unless the caller passes its shards itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..ir import GradKind
from ..kernels.collectives import shard_slice
from ..mesh import RankView
from ..placements import chunk_sizes, local_shape
from ..training import Precision
from .materialize import local_view
from .program import Program


def program_feeds(model: nn.Module, program: Program, flat: list, *, local_inputs: bool) -> list:
    """The program's placeholders' values, in order, for the call's flat inputs `flat`."""
    captured, plan, rank = program.captured, program.plan, program.rank
    inputs = iter(call_inputs(program, flat, local_inputs=local_inputs))
    feeds = []
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in captured.params:
            feeds.append(_weight(model, program, node.name))
        elif node.name in captured.buffers and _has_buffer(model, captured.buffers[node.name]):
            buf = model.get_buffer(captured.buffers[node.name])
            if captured.buffers[node.name] in captured.mutated_buffers:
                buf = buf.clone()  # written back after the call, while autograd may still hold the old value
            feeds.append(local_view(buf, plan.node(node.name).output, rank.mesh.sizes, rank.coord))
        elif node.name in captured.constants:
            feeds.append(captured.constants[node.name])
        else:
            feeds.append(next(inputs))
    return feeds


def _weight(model: nn.Module, program: Program, placeholder: str) -> torch.Tensor | None:
    """A weight as the program reads it: this rank's tensor in the compute dtype; under FSDP's units the
    root's gathered one, None for a layer's (its unit feeds it to the layer's piece), and this rank's
    tensor for one FSDP leaves whole (a scalar)."""
    fqn = program.captured.params[placeholder]
    local = local_parameter(model, fqn, program)
    if program.units is not None:
        local = program.units.feed(placeholder, local)
    return None if local is None else compute_copy(program.precision, local)


def local_parameter(model: nn.Module, fqn: str, program: Program) -> torch.Tensor:
    """This rank's shard of parameter `fqn`; a clear error if it was replaced by a plain tensor."""
    p = model.get_parameter(fqn)
    if not isinstance(p, DTensor):
        mesh = program.rank.mesh
        placed = dict(zip(mesh.axis_names, program.plan.param_placements.get(fqn, ())))
        raise ValueError(f"parameter {fqn!r} is a plain {type(p).__name__} of shape {tuple(p.shape)}, not the "
                         f"DTensor parallelize made of it (placed {placed} on the mesh axes): it was assigned "
                         "after parallelize. Assign it before parallelize, or set its values in place "
                         "(pmodel.load_state_dict, or copy_ under torch.no_grad())")
    return p.to_local()


def compute_copy(precision: Precision, t: torch.Tensor) -> torch.Tensor:
    """A floating parameter or input in the dtype the graph computes in (mixed precision)."""
    if precision.mixed and t.is_floating_point():
        return t.to(precision.param_dtype)  # differentiable: the gradient comes back in t's dtype
    return t


def call_inputs(program: Program, flat: list, *, local_inputs: bool) -> list:
    """The user's inputs as the graph wants them: this rank's shards."""
    captured, rank = program.captured, program.rank
    out = []
    for x, name, pl, shape in zip(flat, captured.inputs, program.plan.input_placements, captured.input_shapes):
        if not isinstance(x, torch.Tensor) or pl is None:
            out.append(x)
            continue
        want = local_shape(shape, pl, rank.mesh.sizes, rank.coord) if local_inputs else shape
        if tuple(x.shape) != tuple(want):
            what = "this rank's shard" if local_inputs else "the whole input"
            raise ValueError(f"input {name!r} has shape {tuple(x.shape)} but the plan expects "
                             f"{what} of shape {tuple(want)}: pass inputs shaped like the example "
                             "inputs (other shapes are planned again only for whole inputs)")
        out.append(compute_copy(program.precision, x if local_inputs else _slice(x, pl, rank)))
    return out


def _slice(x: torch.Tensor, placements, rank: RankView) -> torch.Tensor:
    """This rank's shard of a whole input, with a gradient path back to it."""
    if not x.requires_grad:
        return local_view(x, placements, rank.mesh.sizes, rank.coord)
    for a, p in enumerate(placements):
        ax = rank.axis(a)
        if isinstance(p, Shard) and ax.size > 1:
            x = shard_slice(x, dim=p.dim, sizes=chunk_sizes(x.shape[p.dim], ax.size), axis=ax, grad=GradKind.R)
    return x


def _has_buffer(model: nn.Module, fqn: str) -> bool:
    module, _, name = fqn.rpartition(".")
    try:
        return name in model.get_submodule(module)._buffers
    except AttributeError:
        return False
