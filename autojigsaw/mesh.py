"""The mesh: its named axes and sizes (MeshSpec, all that planning needs) and one rank's place in it (RankView)."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes of a (possibly abstract) device mesh, outermost axis first.

    `axis_names`: e.g. ("domain", "tensor"): labels, except "data"/"dp" (pure data parallelism);
    `sizes`: ranks per axis. `MeshSpec.of` takes a DeviceMesh, a dict or a MeshSpec.

        mesh = autojigsaw.MeshSpec(("domain", "tensor"), (8, 8))
        plan = autojigsaw.plan(model, (x,), mesh)
    """

    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.axis_names) != len(self.sizes) or not self.sizes:
            raise ValueError(
                f"a mesh needs one size per axis name, got names {self.axis_names} "
                f"and sizes {self.sizes}"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names must be unique, got {self.axis_names}")
        for name, size in zip(self.axis_names, self.sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints")

    @classmethod
    def of(cls, mesh) -> MeshSpec:
        """A MeshSpec from a DeviceMesh, a MeshSpec, or a mapping such as {"domain": 8, "tensor": 8}."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, Mapping):
            return cls(tuple(str(k) for k in mesh), tuple(_exact_int(v) for v in mesh.values()))
        names = getattr(mesh, "mesh_dim_names", None)
        if names is None:
            if hasattr(mesh, "mesh"):
                raise ValueError(
                    "the DeviceMesh has no axis names: create it with "
                    "init_device_mesh(..., mesh_dim_names=('domain', 'tensor'))"
                )
            raise ValueError(
                f"mesh must be a torch DeviceMesh or a mapping of axis name to size, got {mesh!r}"
            )
        return cls(tuple(names), tuple(int(s) for s in mesh.mesh.shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def axis_index(self, axis: str | int) -> int:
        """The position of `axis` (a name or an index), with an error that lists the axes."""
        if isinstance(axis, int) and 0 <= axis < self.ndim:
            return axis
        if axis in self.axis_names:
            return self.axis_names.index(axis)
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {self.axis_names}")

    def size(self, axis: str | int) -> int:
        return self.sizes[self.axis_index(axis)]

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.sizes))

    @property
    def fake_device_mesh(self):
        """A DeviceMesh of this shape with no process group behind it (for DTensor's rules)."""
        return _fake_device_mesh(self, (0,) * self.ndim)


class MeshAxis(NamedTuple):
    """One mesh axis as a kernel sees it: its name, size, process group and this rank's position.

    A NamedTuple rather than a dataclass: it is a kernel's argument in rewritten graphs, and FX
    writes NamedTuples into `gm.code` (and torch.compile traces them) as they are.
    """

    name: str
    size: int
    group: str | None  # None: planning only, never run
    coord: int


@dataclass(frozen=True)
class RankView:
    """One rank's place in the mesh: its coordinate and the process group of each axis."""

    mesh: MeshSpec
    coord: tuple[int, ...]
    groups: tuple[str | None, ...]  # None: planning only, the graph is never run
    device_mesh: object = field(default=None, compare=False, repr=False)  # the live DeviceMesh (None: planning)

    @classmethod
    def planning(cls, mesh: MeshSpec) -> RankView:
        """Rank 0 of an abstract mesh: what planning counts traffic on."""
        return cls(mesh, (0,) * mesh.ndim, (None,) * mesh.ndim)

    @classmethod
    def of(cls, device_mesh, mesh: MeshSpec) -> RankView:
        """This process's place in a live DeviceMesh."""
        groups = tuple(device_mesh.get_group(a).group_name for a in mesh.axis_names)
        return cls(mesh, tuple(device_mesh.get_coordinate()), groups, device_mesh)

    def axis(self, a: int) -> MeshAxis:
        return MeshAxis(self.mesh.axis_names[a], self.mesh.sizes[a], self.groups[a], self.coord[a])

    def axes(self, axes: tuple[int, ...]) -> MeshAxis:
        """Several mesh axes as one, their ranks in row-major order (the first outermost): the group of
        the DeviceMesh's flattened axes, made once by every rank (DeviceMesh._flatten caches it)."""
        if len(axes) == 1:
            return self.axis(axes[0])
        names = tuple(self.mesh.axis_names[a] for a in axes)
        coord = 0
        for a in axes:
            coord = coord * self.mesh.sizes[a] + self.coord[a]
        group = None
        if self.device_mesh is not None:
            group = self.device_mesh[names]._flatten("+".join(names)).get_group().group_name
        return MeshAxis("+".join(names), math.prod(self.mesh.sizes[a] for a in axes), group, coord)

    @property
    def fake_device_mesh(self):
        """A DeviceMesh of the mesh's shape seen from this rank, with no process group behind it."""
        return _fake_device_mesh(self.mesh, self.coord)


@functools.cache
def _fake_device_mesh(mesh: MeshSpec, coord: tuple[int, ...]):
    # Cached outside the instances, so a MeshSpec (and a Plan holding one) stays picklable.
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(mesh.world_size, device="cpu").reshape(mesh.sizes)  # cpu under torch.device("meta") too
    return DeviceMesh("cpu", ranks, mesh_dim_names=mesh.axis_names, _init_backend=False, _rank=int(ranks[coord]))


def _exact_int(size):
    """`size` as an int when it is one (numpy's too); else unchanged, for MeshSpec to refuse
    (int() would turn 2.5 into 2 and True into 1)."""
    if isinstance(size, bool):
        return size
    try:
        return operator.index(size)
    except TypeError:
        return size
