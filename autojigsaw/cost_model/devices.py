"""Device specs: peak compute, memory and links of one accelerator (frozen data, tables).

GPU numbers are vendor peaks (dense, no sparsity) and typical measured link figures. The
"cpu-gloo" spec ("cpu" for short) was measured on this project's CI machines (one thread per
rank, gloo over loopback) by `autojigsaw.calibrate`, which measures any live backend the same
way and returns a spec with one link per mesh axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from tabulate import tabulate

GiB = 1024**3


@dataclass(frozen=True)
class LinkSpec:
    """A link between two ranks: latency per message and bandwidth per rank per direction."""

    name: str
    latency_s: float
    bandwidth: float  # bytes/s

    def __post_init__(self):
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 and bandwidth > 0")

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:.2f} GB/s, {self.latency_s * 1e6:.1f} us"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory, and the links to its peers.

    `axis_links` (from calibration) names the measured link of each mesh axis; otherwise an
    axis uses the intra-node link while it spans at most `devices_per_node` ranks.
    """

    name: str
    flops: tuple[tuple[str, float], ...]  # (dtype name, peak FLOP/s)
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node: LinkSpec
    inter_node: LinkSpec
    devices_per_node: int
    kernel_floor_s: float = 5e-6  # the shortest a kernel launch can take
    tree_all_reduce: bool = True  # the backend may all-reduce along a tree (NCCL: yes, gloo: no)
    axis_links: tuple[tuple[str, LinkSpec], ...] = ()  # (mesh axis name, measured link)

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0 or self.devices_per_node < 1:
            raise ValueError(f"device {self.name!r}: sizes and bandwidths must be positive")
        if not self.flops or any(v <= 0 for _, v in self.flops):
            raise ValueError(f"device {self.name!r} needs positive peak FLOP/s, one per dtype")
        if self.kernel_floor_s < 0:
            raise ValueError(f"device {self.name!r}: kernel_floor_s must be >= 0")

    def peak_flops(self, dtype: torch.dtype) -> float:
        table = dict(self.flops)
        name = str(dtype).removeprefix("torch.")
        return table.get(name, table.get("float32", next(iter(table.values()))))

    def axis_link(self, sizes: tuple[int, ...], axis: int, axis_name: str | None = None) -> LinkSpec:
        """The link a mesh axis crosses: as measured for it, else within or between nodes.

        The mesh is row-major, so an axis and the axes after it span prod(sizes[axis:]) ranks.
        """
        if axis_name is not None:
            for name, link in self.axis_links:
                if name == axis_name:
                    return link
        span = math.prod(sizes[axis:])
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    def with_links(self, intra: LinkSpec | None = None, inter: LinkSpec | None = None) -> DeviceSpec:
        return replace(self, intra_node=intra or self.intra_node, inter_node=inter or self.inter_node)

    def table(self) -> str:
        rows = [(f"peak {k}", f"{v / 1e12:.3f} TFLOP/s") for k, v in self.flops]
        rows += [
            ("memory", f"{self.memory_bytes / GiB:.1f} GiB"),
            ("memory bandwidth", f"{self.memory_bandwidth / 1e9:.1f} GB/s"),
            ("kernel floor", f"{self.kernel_floor_s * 1e6:.1f} us"),
            (f"intra-node ({self.intra_node.name})", self.intra_node.describe()),
            (f"inter-node ({self.inter_node.name})", self.inter_node.describe()),
            ("devices per node", self.devices_per_node),
        ]
        rows += [(f"axis {axis!r} ({link.name})", link.describe()) for axis, link in self.axis_links]
        return tabulate(rows, headers=[self.name, ""], tablefmt="simple")

    def __str__(self) -> str:
        return self.table()


_NVLINK4 = LinkSpec("NVLink 4", 3e-6, 360e9)
_IB_400 = LinkSpec("InfiniBand 400G", 8e-6, 45e9)
_HOPPER_FLOPS = (("float32", 67e12), ("tfloat32", 495e12), ("bfloat16", 989e12), ("float16", 989e12),
                 ("float64", 67e12))

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", flops=_HOPPER_FLOPS, memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
                       intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8),
    "h200": DeviceSpec("h200", flops=_HOPPER_FLOPS, memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
                       intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8),
    "a100": DeviceSpec(
        "a100",
        flops=(("float32", 19.5e12), ("tfloat32", 156e12), ("bfloat16", 312e12), ("float16", 312e12),
               ("float64", 19.5e12)),
        memory_bytes=80 * GiB, memory_bandwidth=2.0e12,
        intra_node=LinkSpec("NVLink 3", 3e-6, 240e9), inter_node=LinkSpec("InfiniBand 200G", 8e-6, 22e9),
        devices_per_node=8,
    ),
    # The CI machine (2 shared cores, 1 thread per rank, gloo on 127.0.0.1), rounded: what the tests
    # plan with. Quiet, calibrate measures 0.1 TFLOP/s fp32 per rank (0.05 with 4 ranks on the 2
    # cores), 33 GB/s, and gloo rounds of about 1 ms at 0.8 GB/s (0.7 ms at 4 ranks): 10x the latency
    # here. Plan with calibrate(mesh) to price collectives as this machine runs them; with that
    # latency and a tight budget, the MILP loses its integral LP relaxation (planner/milp.py).
    "cpu-gloo": DeviceSpec(
        "cpu-gloo",
        flops=(("float32", 50e9), ("float64", 25e9), ("bfloat16", 10e9)),
        memory_bytes=24 * GiB, memory_bandwidth=10e9,
        intra_node=LinkSpec("gloo loopback", 100e-6, 1.0e9), inter_node=LinkSpec("gloo tcp", 200e-6, 0.5e9),
        devices_per_node=64, kernel_floor_s=5e-6, tree_all_reduce=False,
    ),
}
ALIASES = {"cpu": "cpu-gloo"}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A DeviceSpec by name ("h100", "h200", "a100", "cpu-gloo" or "cpu"), or the spec itself."""
    if isinstance(device, DeviceSpec):
        return device
    key = str(device).lower().removeprefix("nvidia-")
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        short = sorted(next((a for a, k in ALIASES.items() if k == name), name) for name in DEVICES)
        raise ValueError(f"unknown device {device!r}; known: {short} ('cpu' is 'cpu-gloo'), "
                         "or pass a DeviceSpec such as autojigsaw.calibrate(mesh) returns")
    return DEVICES[key]
