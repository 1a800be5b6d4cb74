"""Device specs: peak compute, memory, kernel efficiencies and links of one accelerator (frozen data).

GPU peaks are vendor datasheet numbers (dense, no sparsity); the fraction of them each kind
of kernel reaches, by size, and the fabrics' bus bandwidths and latencies come from published
microbenchmarks, each cited where it is set. The "cpu-gloo" spec ("cpu" for short) was
measured on this project's CI machines (one thread per rank, gloo over loopback) by
`autojigsaw.calibrate`, which measures any live backend the same way and returns a spec with
one link per mesh axis (its rates are achieved ones: efficiency 1).
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


KERNEL_KINDS = ("matmul", "attention", "memory", "optimizer")
COMPILED = "+compile"  # device name suffix: the spec of a torch.compile'd run (DeviceSpec.compiled)
TF32 = "+tf32"  # device name suffix: fp32 matmuls run as TF32 on tensor cores (DeviceSpec.with_tf32)
EXPANDABLE = "+expandable"  # device name suffix: the caching allocator's expandable segments (with_expandable_segments)


@dataclass(frozen=True)
class Efficiency:
    """The fraction of a peak one kind of kernel reaches, by its size (Hockney's r_inf, n_1/2).

    A kernel of size s (FLOPs; bytes for memory-bound kinds) takes (s + half) / (ceiling * peak)
    seconds: `ceiling` of the peak on large kernels, half of that at s = half (a fixed cost of
    half / (ceiling * peak) per kernel: launch, ramp-up, tail). Works on numbers, numpy arrays
    and sympy expressions.
    """

    ceiling: float = 1.0
    half: float = 0.0

    def __post_init__(self):
        if not 0 < self.ceiling <= 1 or self.half < 0:
            raise ValueError(f"efficiency ceiling must be in (0, 1] and half >= 0, got {self}")

    def at(self, size):
        """The fraction of peak reached by a kernel of `size`."""
        return self.ceiling * size / (size + self.half) if self.half else self.ceiling + 0 * size

    def describe(self, unit: str) -> str:
        half = f", half of it at {self.half / 1e9:.3g} G{unit}" if self.half else ""
        return f"{self.ceiling:.1%} of peak{half}"


_AT_PEAK = Efficiency()


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory, and the links to its peers.

    `name` ("h100"); `flops`: (dtype name, peak FLOP/s) pairs; `memory_bytes`: device memory in
    bytes; `memory_bandwidth`: bytes/s; `intra_node` / `inter_node`: LinkSpec (latency in s,
    bandwidth in bytes/s per rank per direction); `devices_per_node`; `kernel_floor_s`: the
    shortest a kernel launch takes (s); `tree_all_reduce`: the backend may all-reduce along a
    tree (NCCL yes, gloo no). The specs by name: "h100", "h100-96gb", "h200", "a100",
    "a100-40gb", "cpu-gloo" ("cpu"); autojigsaw.calibrate measures one.
    `axis_links` (from calibration) names the measured link of each mesh axis; otherwise an
    axis uses the intra-node link while it spans at most `devices_per_node` ranks.
    `efficiency` gives each kernel kind (KERNEL_KINDS) its Efficiency; a kind not listed runs
    at peak. `fused_pointwise`: the run is torch.compile'd, whose Inductor fuses elementwise
    ops into their neighbours' kernels (compute.roofline_time prices them so). `tf32`: fp32
    matmuls and convolutions run on tensor cores as TF32, as after
    `torch.backends.cuda.matmul.allow_tf32 = True` (and cudnn's), at the "tfloat32" peak
    (cuDNN's patchwise convolutions excepted: compute.kind_name). `overlap_slowdown`: how much
    slower compute runs while a collective overlaps it (they share the device; 0.189 on GPUs,
    measured), charged on the FSDP traffic a step hides. `sustained_rate`: the share of the
    microbenchmarked GEMM and attention rates (`efficiency`) a whole training step reaches, which scales
    both kinds' ceilings. `fitted` names the fields fitted on published
    runs, and those runs (benchmarks/published.py reports them apart from the others). `caching_allocator`: the device's memory is
    held by torch's CUDA caching allocator, so a plan's memory is the allocator's reserved peak
    (cost_model/allocations.py; every GPU spec); `expandable_segments`: the allocator runs with
    PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" (torchtitan's setting; `with_expandable_segments`).

        device = dataclasses.replace(autojigsaw.calibrate(mesh), memory_bytes=40 * 2**30)  # an autojigsaw.DeviceSpec
        plan = autojigsaw.plan(model, (x,), {"tensor": 8}, device=device)
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
    efficiency: tuple[tuple[str, Efficiency], ...] = ()  # (kernel kind, efficiency)
    fused_pointwise: bool = False
    tf32: bool = False
    overlap_slowdown: float = 0.0  # compute beside a collective runs this much slower (they share the device)
    caching_allocator: bool = False  # memory is torch's CUDA caching allocator's: plans fit its reserved bytes
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    sustained_rate: float = 1.0  # share of the microbenchmarked tensor-core rates (GEMM, attention) whole steps reach
    fitted: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (field, the published runs it was fitted on)

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0 or self.devices_per_node < 1:
            raise ValueError(f"device {self.name!r}: sizes and bandwidths must be positive")
        if not self.flops or any(v <= 0 for _, v in self.flops):
            raise ValueError(f"device {self.name!r} needs positive peak FLOP/s, one per dtype")
        if self.kernel_floor_s < 0:
            raise ValueError(f"device {self.name!r}: kernel_floor_s must be >= 0")
        if not 0 <= self.overlap_slowdown < 1:
            raise ValueError(f"device {self.name!r}: overlap_slowdown {self.overlap_slowdown} must be in [0, 1)")
        unknown = {k for k, _ in self.efficiency} - set(KERNEL_KINDS)
        if unknown:
            raise ValueError(f"device {self.name!r}: unknown kernel kinds {sorted(unknown)}; known: {KERNEL_KINDS}")
        if not 0 < self.sustained_rate <= 1:
            raise ValueError(f"device {self.name!r}: sustained_rate {self.sustained_rate} must be in (0, 1]")
        if self.expandable_segments and not self.caching_allocator:
            raise ValueError(f"device {self.name!r}: expandable_segments is an option of the CUDA caching allocator; "
                             "set caching_allocator=True too, or leave expandable_segments False")

    def peak_flops(self, dtype: torch.dtype) -> float:
        table = dict(self.flops)
        name = str(dtype).removeprefix("torch.")
        return table.get(name, table.get("float32", next(iter(table.values()))))

    def matmul_peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of a matmul or convolution in `dtype`: fp32 at the TF32 peak when `tf32` is set."""
        if self.tf32 and dtype == torch.float32:
            return dict(self.flops).get("tfloat32", self.peak_flops(dtype))
        return self.peak_flops(dtype)

    def kernel_efficiency(self, kind: str) -> Efficiency:
        """The Efficiency of a kernel kind ("matmul", "attention", "memory", "optimizer"); a tensor-core kind's
        ceiling as whole training steps sustain it (`sustained_rate`)."""
        e = dict(self.efficiency).get(kind, _AT_PEAK)
        if kind in ("matmul", "attention") and self.sustained_rate != 1.0:
            return replace(e, ceiling=e.ceiling * self.sustained_rate)
        return e

    def compiled(self) -> DeviceSpec:
        """This device running a torch.compile'd step: elementwise ops fused (see compute.py)."""
        if self.fused_pointwise:
            return self
        return replace(self, name=self.name + COMPILED, fused_pointwise=True)

    def with_tf32(self) -> DeviceSpec:
        """This device with fp32 matmuls and convolutions on tensor cores, as TF32."""
        if self.tf32:
            return self
        if "tfloat32" not in dict(self.flops):
            raise ValueError(f"device {self.name!r} has no TF32 peak; its dtypes: {[k for k, _ in self.flops]}")
        return replace(self, name=self.name + TF32, tf32=True)

    def with_expandable_segments(self) -> DeviceSpec:
        """This device with the caching allocator's expandable segments (torchtitan's setting)."""
        if self.expandable_segments:
            return self
        if not self.caching_allocator:
            raise ValueError(f"device {self.name!r} has no CUDA caching allocator: expandable segments do not apply")
        return replace(self, name=self.name + EXPANDABLE, expandable_segments=True)

    def axis_link(self, sizes: tuple[int, ...], axis: int, axis_name: str | None = None) -> LinkSpec:
        """The link a mesh axis crosses: as measured for it, else within or between nodes.

        The mesh is row-major, so an axis and the axes after it span prod(sizes[axis:]) ranks.
        Between nodes, a group holding k GPUs of each node runs k rings at once, one per GPU's
        NIC (NCCL's channels on a rail-optimized fabric): k times one NIC, at most the NVLink rate.
        """
        if axis_name is not None:
            for name, link in self.axis_links:
                if name == axis_name:
                    return link
        span = math.prod(sizes[axis:])
        if span <= self.devices_per_node:
            return self.intra_node
        rails = min(sizes[axis], self.devices_per_node // math.prod(sizes[axis + 1:]))
        if rails <= 1:
            return self.inter_node
        return replace(self.inter_node, name=f"{self.inter_node.name} x{rails}",
                       bandwidth=min(rails * self.inter_node.bandwidth, self.intra_node.bandwidth))

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
        rows += [(f"{kind} kernels", self.kernel_efficiency(kind).describe("B" if kind in ("memory", "optimizer")
                                                                          else "FLOP")) for kind in KERNEL_KINDS]
        if self.fused_pointwise:
            rows.append(("elementwise ops", "fused (torch.compile)"))
        if self.overlap_slowdown:
            rows.append(("compute beside FSDP's collectives", f"{self.overlap_slowdown:.1%} slower"))
        if self.tf32:
            rows.append(("fp32 matmuls", "TF32 on tensor cores"))
        if self.sustained_rate != 1.0:
            rows.append(("tensor-core kernels in whole steps", f"{self.sustained_rate:.1%} of their microbenchmarks"))
        rows += [(f"fitted: {name}", ", ".join(runs)) for name, runs in self.fitted]
        if self.caching_allocator:
            rows.append(("memory held by", "CUDA caching allocator" + (", expandable segments" if
                                                                       self.expandable_segments else "")))
        return tabulate(rows, headers=[self.name, ""], tablefmt="simple")

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------- GPU tables
#
# Peaks are datasheet numbers (dense, no sparsity). Kernel efficiencies and fabrics come from
# published microbenchmarks (sources next to each number), never from an end-to-end training
# run: benchmarks/published.py compares the resulting predictions with such runs.

# Fabrics. Latencies: NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc, 2.8): a ring
# call costs a base 3.6 us plus 0.47 us per NVLink hop, 2.7 us per network hop (LL protocol,
# the one small messages use); spread over an 8-rank ring's 7 steps, 1.0 us per NVLink step,
# and 2.7 + 3.6 / 16 ~ 3 us per step of a ring across 16+ ranks over the network. Large
# messages are bandwidth-bound, where the step latency no longer matters.
# Bandwidth is NCCL's "bus bandwidth" (bytes each rank sends per second), per direction.
# NVLink 4 (H100, H200): 900 GB/s both ways, 450 GB/s per direction (H100 SXM datasheet);
# ring collectives reach ~80 % of it: 360 GB/s (NCCL's model caps NVLink 3 at 235 of 300
# GB/s, 78 %, tuning.cc; nccl-tests all_reduce reaches 460-480 GB/s on 8 H100 only with
# NVLink SHARP, which ring all-gather / reduce-scatter do not use).
_NVLINK4 = LinkSpec("NVLink 4", 1.0e-6, 360e9)
# NVLink 3 (A100 SXM): 600 GB/s both ways, 300 per direction (A100 datasheet); 235 GB/s bus
# bandwidth is NCCL's own cap for sm_80 (tuning.cc), nccl-tests report 230-250 GB/s.
_NVLINK3 = LinkSpec("NVLink 3", 1.0e-6, 235e9)
# One 400 Gb/s NIC per GPU (ConnectX-7, NDR InfiniBand or RoCE: DGX H100 / H200, and Meta's
# Grand Teton, torchtitan benchmarks/llama3_h100_202412_torchtitan.md): 50 GB/s per direction,
# ~45 GB/s measured (90 %, ib_write_bw class). An axis whose group holds k GPUs of each node
# runs k rails at once (NCCL: one channel per NIC), see DeviceSpec.axis_link.
_IB_400 = LinkSpec("InfiniBand 400G", 3.0e-6, 45e9)
# HDR 200 Gb/s per GPU (DGX A100): 25 GB/s per direction, ~22 GB/s measured.
_IB_200 = LinkSpec("InfiniBand 200G", 3.0e-6, 22e9)
# Two HDR 200 Gb/s adapters per 4-GPU node (KIT's HoreKa, nhr.kit.edu/userdocs/horeka/hardware):
# half a NIC per GPU, 12.5 GB/s per direction, ~11 GB/s at the same 90 %.
_IB_200_HALF = LinkSpec("InfiniBand 200G, one per 2 GPUs", 3.0e-6, 11e9)

_HOPPER_FLOPS = (("float32", 67e12), ("tfloat32", 494.7e12), ("bfloat16", 989.4e12), ("float16", 989.4e12),
                 ("float64", 67e12))  # H100 SXM / H200 datasheets: 1,979 TFLOP/s bf16 with sparsity

# Kernel efficiencies (Efficiency: ceiling of the peak, size at which half of it is reached).
# GEMM, Hopper: OpenXLA's measured cuBLAS table for sm_90 (openxla/xla and tensorflow/tensorflow,
# xla/service/gpu/model/matmul_interpolator_data.h, bf16): 2048^3 at 632 TFLOP/s, 4096^3 at
# 783 TFLOP/s. Through those two points, time = 6.0 us + FLOPs / 811 TFLOP/s: a ceiling of
# 0.82 of 989.4 and half of it at 6.0 us x 811 TFLOP/s = 4.9 GFLOP. The same table's other
# square-ish shapes (K >= 1024) lie within 5 % of this line (tests/test_device_specs.py); the
# largest-shape search of ml-engineering (stas00/ml-engineering, compute/accelerator/README.md,
# "Maximum Achievable Matmul FLOPS") finds 792 TFLOP/s (80.1 %) on H100 SXM, 821 (83.0 %) on GH200.
_HOPPER_GEMM = Efficiency(811.0 / 989.4, 6.0e-6 * 811e12)
# Attention: torch's SDPA flash backend is FlashAttention-2, which reaches 35 % of the H100's
# peak (Shah et al., FlashAttention-3, arXiv 2407.08608, abstract; FA3 reaches 75 %). The
# per-kernel overhead is taken as the GEMM's, 6 us.
_HOPPER_ATTENTION = Efficiency(0.35, 6.0e-6 * 0.35 * 989.4e12)
# Memory-bound kernels (elementwise, norms, softmax, copies): STREAM-class kernels reach about
# 90 % of HBM peak on A100 / H100 (BabelStream-style copy / triad); smaller ones are held up by
# the launch floor (kernel_floor_s), which gives them their size dependence.
_STREAM = Efficiency(0.90)
# The optimizer step: torch's fused / foreach AdamW streams parameters, gradients and two states
# (7 fp32 passes per parameter) like a copy: the same ceiling.
# Compute that overlaps a collective runs slower: NCCL's kernels take SMs and memory bandwidth from
# the GEMMs beside them. Lee et al., Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning (arXiv 2507.03114, abstract): 18.9 % slower on average (40 % at most), over
# GPT and LLaMA training on 4 A100s, H100s, MI250s and MI210s. Applied to the FSDP traffic a step
# hides (cost_model/regime.py); measured on none of the runs benchmarks/published.py compares with.
_OVERLAP_SLOWDOWN = 0.189
_HOPPER_KERNELS = (("matmul", _HOPPER_GEMM), ("attention", _HOPPER_ATTENTION), ("memory", _STREAM),
                   ("optimizer", _STREAM))
# Hopper's one parameter per device spec, fitted on a published run (benchmarks/published.py,
# docs/predictions.md): whole training steps reach `sustained_rate` of the GEMM and FlashAttention-2 rates the
# microbenchmarks above measure (sustained clocks under a step's power draw are below a microbenchmark's). At
# 700 W (h100, h200) 0.755, fitted on mpt-13b-fsdp128 (MosaicML's MPT 13B on 128 GPUs); at torchtitan's 500 W
# (h100-96gb) 0.629, fitted on torchtitan-8b-fsdp8 (Llama 3.1 8B on 8 GPUs, compiled: 90 % of its predicted
# step in GEMMs and attention). Every other run is a test. The A100's runs were within 12 % unfitted: it keeps
# its microbenchmarks.
_HOPPER_FIT = dict(sustained_rate=0.755, fitted=(("sustained_rate", ("mpt-13b-fsdp128",)),))
_HOPPER_500W_FIT = dict(sustained_rate=0.629, fitted=(("sustained_rate", ("torchtitan-8b-fsdp8",)),))
# A100: ml-engineering's MAMF 267.9 of 312 TFLOP/s (85.9 %); the 6 us per-kernel overhead as on
# Hopper (no size table for sm_80 found). FlashAttention-2 on A100: forward up to 73 %, backward
# up to 63 % of peak (Dao, arXiv 2307.08691); backward runs 2.5x the forward FLOPs, so the pass
# as a whole: 3.5 / (1 / 0.73 + 2.5 / 0.63) = 0.655.
_AMPERE_FLOPS = (("float32", 19.5e12), ("tfloat32", 156e12), ("bfloat16", 312e12), ("float16", 312e12),
                 ("float64", 19.5e12))  # A100 SXM datasheet (40 and 80 GB alike)
_AMPERE_KERNELS = (("matmul", Efficiency(267.9 / 312, 6.0e-6 * 267.9e12)),
                   ("attention", Efficiency(0.655, 6.0e-6 * 0.655 * 312e12)),
                   ("memory", _STREAM), ("optimizer", _STREAM))

DEVICES: dict[str, DeviceSpec] = {
    # H100 SXM5 80 GB HBM3, 3.35 TB/s, 700 W (datasheet).
    "h100": DeviceSpec("h100", flops=_HOPPER_FLOPS, memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
                       intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8, efficiency=_HOPPER_KERNELS,
                       overlap_slowdown=_OVERLAP_SLOWDOWN, caching_allocator=True, **_HOPPER_FIT),
    # H100 SXM with 96 GB HBM2e at 2.4 TB/s, run at 500 W: the GPUs of torchtitan's published
    # runs (benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"). The driver shows ~95 GiB of
    # the six 16 GiB stacks. Its peak is "between SXM and NVL" (ibid.): the SXM peak is kept, as
    # torchtitan's MFU uses it; the lower clocks at 500 W are in its fitted sustained_rate (0.629, 0.83 of the
    # 700 W part's 0.755, fitted on other runs: about the NVL's 835 / 989 = 0.84).
    "h100-96gb": DeviceSpec("h100-96gb", flops=_HOPPER_FLOPS, memory_bytes=95 * GiB, memory_bandwidth=2.4e12,
                            intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8,
                            efficiency=_HOPPER_KERNELS, overlap_slowdown=_OVERLAP_SLOWDOWN, caching_allocator=True,
                            **_HOPPER_500W_FIT),
    # H200 SXM 141 GB HBM3e, 4.8 TB/s; the H100's compute and NVLink 4 (datasheet).
    "h200": DeviceSpec("h200", flops=_HOPPER_FLOPS, memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
                       intra_node=_NVLINK4, inter_node=_IB_400, devices_per_node=8, efficiency=_HOPPER_KERNELS,
                       overlap_slowdown=_OVERLAP_SLOWDOWN, caching_allocator=True, **_HOPPER_FIT),
    # A100 SXM4 80 GB HBM2e, 2.039 TB/s (datasheet).
    "a100": DeviceSpec(
        "a100",
        flops=_AMPERE_FLOPS,
        memory_bytes=80 * GiB, memory_bandwidth=2.039e12,
        intra_node=_NVLINK3, inter_node=_IB_200, devices_per_node=8, efficiency=_AMPERE_KERNELS,
        overlap_slowdown=_OVERLAP_SLOWDOWN, caching_allocator=True,
    ),
    # A100 SXM4 40 GB HBM2, 1.555 TB/s (datasheet), four to a node: the GPUs of the Jigsaw paper's
    # runs (KIT's HoreKa "accelerated" nodes, 4x A100-40, nhr.kit.edu/userdocs/horeka/hardware).
    # The four are linked all-to-all by NVLink 3, priced as the 8-GPU board's ring.
    "a100-40gb": DeviceSpec(
        "a100-40gb",
        flops=_AMPERE_FLOPS,
        memory_bytes=40 * GiB, memory_bandwidth=1.555e12,
        intra_node=_NVLINK3, inter_node=_IB_200_HALF, devices_per_node=4, efficiency=_AMPERE_KERNELS,
        overlap_slowdown=_OVERLAP_SLOWDOWN, caching_allocator=True,
    ),
    # The CI machine (2 shared cores, 1 thread per rank, gloo on 127.0.0.1), rounded: what the tests
    # plan with. Quiet, calibrate measures 0.1 TFLOP/s fp32 per rank (0.05 with 4 ranks on the 2
    # cores) and 33 GB/s. Links: benchmarks/gloo_links.py (all-gathers and all-reduces of 1 KiB ..
    # 16 MiB, the ring model fitted; the machine shared, load average 29-39) measured 0.31 ms per
    # round at 0.64 GB/s on 2 ranks and 1.27 ms at 0.39 GB/s on 4 (a 1 KiB all-gather: 0.42 ms on
    # 2 ranks, 3.0 ms on 4); calibrate finds about 1 ms at 0.8 GB/s. Rounded to 0.5 ms and 0.5 GB/s:
    # a lower latency makes plans of many small collectives, slower here.
    # Between nodes (tcp): assumed twice the latency, half the bandwidth. calibrate(mesh) prices the
    # machine as it is at the moment; with this latency and a tight budget, the MILP loses its
    # integral LP relaxation (planner/milp.py).
    "cpu-gloo": DeviceSpec(
        "cpu-gloo",
        flops=(("float32", 50e9), ("float64", 25e9), ("bfloat16", 10e9)),
        memory_bytes=24 * GiB, memory_bandwidth=10e9,
        intra_node=LinkSpec("gloo loopback", 500e-6, 0.5e9), inter_node=LinkSpec("gloo tcp", 1e-3, 0.25e9),
        devices_per_node=64, kernel_floor_s=5e-6, tree_all_reduce=False,
    ),
}
ALIASES = {"cpu": "cpu-gloo"}


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A DeviceSpec by name ("h100", "h100-96gb", "h200", "a100", "a100-40gb", "cpu-gloo" or "cpu"), or the spec.

    A name ending in "+compile" ("h100+compile") is that device running a torch.compile'd step;
    one ending in "+tf32" ("a100+tf32") runs fp32 matmuls as TF32; one ending in "+expandable"
    ("h100+expandable") runs the caching allocator with expandable segments. Any of them may be given.
    """
    if isinstance(device, DeviceSpec):
        return device
    key = str(device).lower().removeprefix("nvidia-")
    if key.endswith(COMPILED):
        return device_spec(key.removesuffix(COMPILED)).compiled()
    if key.endswith(TF32):
        return device_spec(key.removesuffix(TF32)).with_tf32()
    if key.endswith(EXPANDABLE):
        return device_spec(key.removesuffix(EXPANDABLE)).with_expandable_segments()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        short = sorted(next((a for a, k in ALIASES.items() if k == name), name) for name in DEVICES)
        raise ValueError(f"unknown device {device!r}; known: {short} ('cpu' is 'cpu-gloo'; add '{COMPILED}' "
                         f"for a torch.compile'd step, '{TF32}' for fp32 matmuls as TF32, '{EXPANDABLE}' for the caching "
                         "allocator's expandable segments), or pass a DeviceSpec such as autojigsaw.calibrate(mesh) "
                         "returns")
    return DEVICES[key]
