"""Device specs: peak compute, memory and links of one accelerator (frozen data, tables).

Numbers are vendor peaks (dense, no sparsity) and typical measured link figures; the
"cpu" spec describes this project's CI machines (gloo over loopback) and is meant to be
replaced by `autojigsaw.calibrate(mesh)` on the live backend.
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


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory, and the links to its peers."""

    name: str
    flops: tuple[tuple[str, float], ...]  # (dtype name, peak FLOP/s)
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    intra_node: LinkSpec
    inter_node: LinkSpec
    devices_per_node: int
    kernel_floor_s: float = 5e-6  # the shortest a kernel launch can take

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0 or self.devices_per_node < 1:
            raise ValueError(f"device {self.name!r}: sizes and bandwidths must be positive")
        if not self.flops:
            raise ValueError(f"device {self.name!r} needs at least one peak FLOP/s entry")

    def peak_flops(self, dtype: torch.dtype) -> float:
        table = dict(self.flops)
        name = str(dtype).removeprefix("torch.")
        return table.get(name, table.get("float32", next(iter(table.values()))))

    def axis_link(self, sizes: tuple[int, ...], axis: int) -> LinkSpec:
        """The link an axis of a row-major mesh crosses: within a node, or between nodes."""
        span = math.prod(sizes[axis:])  # ranks covered by this axis and the faster ones
        return self.intra_node if span <= self.devices_per_node else self.inter_node

    def with_links(self, intra: LinkSpec | None = None, inter: LinkSpec | None = None) -> DeviceSpec:
        return replace(self, intra_node=intra or self.intra_node, inter_node=inter or self.inter_node)

    def table(self) -> str:
        rows = [(f"peak {k}", f"{v / 1e12:.1f} TFLOP/s") for k, v in self.flops]
        rows += [
            ("memory", f"{self.memory_bytes / GiB:.0f} GiB"),
            ("memory bandwidth", f"{self.memory_bandwidth / 1e9:.0f} GB/s"),
            (f"intra-node ({self.intra_node.name})",
             f"{self.intra_node.bandwidth / 1e9:.1f} GB/s, {self.intra_node.latency_s * 1e6:.1f} us"),
            (f"inter-node ({self.inter_node.name})",
             f"{self.inter_node.bandwidth / 1e9:.1f} GB/s, {self.inter_node.latency_s * 1e6:.1f} us"),
            ("devices per node", self.devices_per_node),
        ]
        return tabulate(rows, headers=[self.name, ""], tablefmt="simple")


_NVLINK4 = LinkSpec("NVLink 4", 3e-6, 360e9)
_IB_400 = LinkSpec("InfiniBand 400G", 8e-6, 45e9)

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "h100",
        flops=(("float32", 67e12), ("tfloat32", 495e12), ("bfloat16", 989e12), ("float16", 989e12),
               ("float64", 67e12)),
        memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
        intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8,
    ),
    "h200": DeviceSpec(
        "h200",
        flops=(("float32", 67e12), ("tfloat32", 495e12), ("bfloat16", 989e12), ("float16", 989e12),
               ("float64", 67e12)),
        memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
        intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8,
    ),
    "a100": DeviceSpec(
        "a100",
        flops=(("float32", 19.5e12), ("tfloat32", 156e12), ("bfloat16", 312e12), ("float16", 312e12),
               ("float64", 19.5e12)),
        memory_bytes=80 * GiB, memory_bandwidth=2.0e12,
        intra_node=LinkSpec("NVLink 3", 3e-6, 240e9), inter_node=LinkSpec("InfiniBand 200G", 8e-6, 22e9),
        devices_per_node=8,
    ),
    "cpu": DeviceSpec(
        "cpu",
        flops=(("float32", 50e9), ("float64", 25e9), ("bfloat16", 10e9)),
        memory_bytes=24 * GiB, memory_bandwidth=10e9,
        intra_node=LinkSpec("gloo loopback", 100e-6, 1e9), inter_node=LinkSpec("gloo tcp", 200e-6, 0.5e9),
        devices_per_node=64, kernel_floor_s=5e-6,
    ),
}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A DeviceSpec by name ("h100", "h200", "a100", "cpu"), or the spec itself."""
    if isinstance(device, DeviceSpec):
        return device
    key = str(device).lower().removeprefix("nvidia-").removesuffix("-gloo")
    if key not in DEVICES:
        raise ValueError(f"unknown device {device!r}; known: {sorted(DEVICES)} or pass a DeviceSpec")
    return DEVICES[key]
