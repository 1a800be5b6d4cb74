"""FSDP2 on the data axis: `parallelize` shards the weights over it when the regime says "fsdp"."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

from ..mesh import MeshSpec
from ..training import Regime, data_axes


def shard_over_data_axis(module: torch.nn.Module, device_mesh, regime: Regime, mp_policy=None) -> None:
    """`fully_shard` over the data axis with the run's mixed precision (nothing without FSDP or a data axis).

    The graph leaves each rank's contribution to the weights' gradients unsummed over the data
    axis, so FSDP's reduce-scatter sums them (no division): the gradients are the single-device
    ones, sent once. The weights are gathered for the forward and again for the backward, as
    the plan prices them.
    """
    axes = data_axes(MeshSpec.of(device_mesh))
    if not regime.fsdp or not axes or device_mesh.mesh.shape[axes[0]] == 1:
        return
    _check_one_dtype(module, device_mesh.mesh_dim_names[axes[0]])
    _check_no_scalars(module, device_mesh.mesh_dim_names[axes[0]])
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    with torch.inference_mode(False):  # shards made under inference_mode could never train
        fully_shard(module, mesh=device_mesh,
                    dp_mesh_dims=DataParallelMeshDims(shard=device_mesh.mesh_dim_names[axes[0]]),
                    reshard_after_forward=True, **kwargs)
        # FSDP2 makes its gathered weights' buffers at the first gather: in a first forward under
        # inference_mode (a check before training) they would be inference tensors, and every later
        # step fails. One gather now (as much memory as a forward's) makes them normal ones.
        module.unshard()
        module.reshard()
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def _check_one_dtype(module: torch.nn.Module, axis: str) -> None:
    """FSDP2 shards a module's parameters as one flat group of one dtype (else a bare AssertionError)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in module.named_parameters():
        by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) > 1:
        dtype, names = min(by_dtype.items(), key=lambda kv: len(kv[1]))
        raise ValueError(
            f"data_parallel='fsdp' on mesh axis {axis!r} shards the parameters as one group of one dtype, but they "
            f"have dtypes {sorted(str(d) for d in by_dtype)} ({names[0]!r} is {dtype}). "
            "Give every parameter one dtype (a complex weight as a real one of shape [..., 2], "
            "torch.view_as_complex in the forward), or use data_parallel='ddp'")


def _check_no_scalars(module: torch.nn.Module, axis: str) -> None:
    """FSDP2 shards each parameter's dim 0, and a scalar has none (CLIP's logit_scale): a bare error from
    inside fully_shard otherwise."""
    scalars = [name for name, p in module.named_parameters() if p.ndim == 0]
    if scalars:
        raise ValueError(
            f"data_parallel='fsdp' on mesh axis {axis!r} shards every parameter along its first dim, and "
            f"{scalars[0]!r} is a scalar{f' (and {len(scalars) - 1} more)' if len(scalars) > 1 else ''}. Use "
            "data_parallel='ddp' (the weights whole on that axis, their gradients summed over it), or make it a "
            "tensor of shape [1]")
