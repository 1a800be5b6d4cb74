"""Sharded input loading: each rank reads exactly the slice of a sample it owns, nothing more.

Jigsaw's samples are gigabyte fields; a rank that read the whole sample to keep a quarter
would need the memory domain parallelism saves. `load_shard` asks the user's reader for one
rectangular slice (numpy memmap, zarr, h5py and torch tensors all index with a tuple of slices),
so `parallelize(..., input_placements=...)` can be fed without any rank seeing the rest; its
example inputs can be `stand_in`s, which have the global shape but hold a single element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.distributed.tensor import Partial

from ..placements import Placement, local_offset, local_shape, normalize


def load_shard(read_fn: Callable[[tuple[slice, ...]], object], global_shape: Sequence[int],
               placements: Sequence[Placement], mesh) -> torch.Tensor:
    """This rank's shard of a tensor of `global_shape` laid out by `placements` over `mesh`.

    `read_fn(index)` gets a tuple of slices, one per dim, and returns that block (a tensor or
    anything numpy can convert, e.g. `np.load(path, mmap_mode="r")[index]`). `placements`: one
    DTensor placement per mesh axis, as in `pmodel.plan.input_placements`; `mesh`: the DeviceMesh.

        field = np.load("field.npy", mmap_mode="r")
        x = autojigsaw.load_shard(lambda index: field[index], field.shape, pmodel.plan.input_placements[0], mesh)
    """
    shape = tuple(int(s) for s in global_shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("load_shard: this rank is not part of the mesh; call it on the ranks of "
                         "the mesh the model is parallelized over")
    sizes = tuple(mesh.mesh.shape)
    placements = _checked(placements, shape, mesh)
    size = local_shape(shape, placements, sizes, coord)
    start = local_offset(shape, placements, sizes, coord)
    index = tuple(slice(o, o + s) for o, s in zip(start, size))
    block = read_fn(index)
    shard = block if isinstance(block, torch.Tensor) else torch.from_numpy(np.array(block))
    if tuple(shard.shape) != size:
        raise ValueError(f"load_shard: read_fn returned shape {tuple(shard.shape)} for index "
                         f"{index} of a tensor of shape {shape}; it must return exactly that slice")
    return shard


def _checked(placements, shape, mesh):
    names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    if len(placements) != mesh.ndim:
        raise ValueError(f"load_shard: {len(placements)} placements for a mesh of {mesh.ndim} axes "
                         f"{tuple(names)}; give one placement per mesh axis")
    for p, axis in zip(placements, names):
        if isinstance(p, Partial):
            raise ValueError(f"load_shard: {p} on axis {axis!r} is not a slice of the data; "
                             "use Shard(dim) or Replicate()")
        if getattr(p, "dim", None) is not None and not -len(shape) <= p.dim < len(shape):
            raise ValueError(f"load_shard: {p} on axis {axis!r} names a dim a tensor of shape "
                             f"{shape} does not have")
    return normalize(placements, len(shape))


def stand_in(global_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `global_shape` that stores one element: an example input to plan with.

    `dtype` as the real input's. Make one per input: torch.export takes one tensor passed twice
    for one input used twice.

        plan = autojigsaw.plan(model, (autojigsaw.stand_in((1, 69, 721, 1440)),), {"domain": 4, "tensor": 2})
    """
    return torch.zeros((), dtype=dtype).expand(*global_shape)
