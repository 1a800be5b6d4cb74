"""Materialize: each rank keeps only its own shard of every parameter, as a DTensor.

A parameter on the meta device that was built under `meta_init` is replayed whole, sliced and
dropped, one at a time (runtime/init.py): the full model never exists on one rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..placements import Placements, local_offset, local_shape
from .init import forget, is_recorded, materialize
from .replaced import mark_replaced


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
    device = torch.device(device_mesh.device_type)
    for fqn, placements in param_placements.items():
        param = model.get_parameter(fqn)
        if isinstance(param, DTensor):
            raise ValueError(f"parameter {fqn!r} is already a DTensor: parallelize a model once, "
                             "from its plain (single-device) parameters")
        full = _whole(param, fqn, "parameter")
        local = local_view(full, placements, sizes, coord).clone().to(device)
        del full  # the whole parameter lived only for this slice
        dt = DTensor.from_local(local, device_mesh, placements, run_check=False,
                                shape=param.shape, stride=param.stride())
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        for mod, name in _owners(model, param):
            setattr(mod, name, new)
        mark_replaced(param, fqn)


def materialize_model(model: nn.Module, param_placements: dict[str, Placements], device_mesh,
                      coord: tuple[int, ...]) -> None:
    """This rank's parameter shards and whole buffers, the meta_init recordings then dropped."""
    recorded = [t for t in (*model.parameters(), *model.buffers()) if t.is_meta]
    shard_parameters(model, param_placements, device_mesh, coord)
    materialize_buffers(model)
    forget(recorded)


def materialize_buffers(model: nn.Module) -> None:
    """Replace every buffer built under `meta_init` by its real (whole) value."""
    for fqn, buf in list(model.named_buffers()):
        if buf.is_meta:
            mod_name, _, name = fqn.rpartition(".")
            model.get_submodule(mod_name)._buffers[name] = _whole(buf, fqn, "buffer")


def _whole(t: torch.Tensor, fqn: str, what: str) -> torch.Tensor:
    """The whole value of a parameter or buffer: itself, or replayed if it is a recorded meta tensor."""
    if not t.is_meta:
        return t.detach()
    if not is_recorded(t):
        raise ValueError(
            f"{what} {fqn!r} is on the meta device but was not built under autojigsaw.meta_init(): "
            "build the model inside `with autojigsaw.meta_init():` (each rank then creates only its "
            "shards, initialized as on one device), converting dtypes inside the block too")
    return materialize(t)
