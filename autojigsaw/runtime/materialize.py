"""Materialize: each rank keeps only its own shard of every parameter, as a DTensor."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..placements import Placements, local_offset, local_shape


def local_view(t: torch.Tensor, placements: Placements, mesh_sizes, coord) -> torch.Tensor:
    """This rank's shard of a whole tensor `t` (a view: no copy)."""
    shape = local_shape(t.shape, placements, mesh_sizes, coord)
    offset = local_offset(t.shape, placements, mesh_sizes, coord)
    for dim in {p.dim for p in placements if isinstance(p, Shard)}:
        t = t.narrow(dim, offset[dim], shape[dim])
    return t


def _owners(model: nn.Module, param: nn.Parameter) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) that holds `param` (tied weights have several)."""
    out = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is param:
                out.append((mod, name))
    return out


def shard_parameters(model: nn.Module, param_placements: dict[str, Placements], device_mesh,
                     coord: tuple[int, ...]) -> None:
    """Replace each planned parameter by a DTensor parameter that holds only this rank's shard."""
    sizes = tuple(device_mesh.mesh.shape)
    for fqn, placements in param_placements.items():
        param = model.get_parameter(fqn)
        if isinstance(param, DTensor):
            raise ValueError(f"parameter {fqn!r} is already a DTensor: parallelize a model once, "
                             "from its plain (single-device) parameters")
        if param.device.type == "meta":
            raise ValueError(
                f"parameter {fqn!r} is on the meta device: load or initialize the model's weights "
                "first (materializing from meta is not supported yet)")
        local = local_view(param.detach(), placements, sizes, coord).clone()
        dt = DTensor.from_local(local, device_mesh, placements, run_check=False,
                                shape=param.shape, stride=param.stride())
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        for mod, name in _owners(model, param):
            setattr(mod, name, new)
