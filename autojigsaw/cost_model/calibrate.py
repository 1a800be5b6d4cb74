"""Calibration: measure the live backend and return a DeviceSpec the planner can use.

Per mesh axis, the functional collectives the kernels use (all-reduce, all-gather,
reduce-scatter) run at growing sizes on that axis' process group (all groups of an axis at
once, as in training); a least-squares fit of the ring model
t = rounds x latency + bytes_sent / bandwidth gives the axis' link. Matmuls per dtype give
peak FLOP/s, a large copy the memory bandwidth, a tiny op the launch floor. Every rank
measures and all agree on the slowest rank's numbers, so every rank plans alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from ..ir import bytes_sent
from ..mesh import MeshSpec
from .comm import latency_steps
from .devices import DeviceSpec, LinkSpec, device_spec


def calibrate(mesh, *, base: str | DeviceSpec | None = None, max_bytes: int = 4 * 2**20, repeats: int = 5,
              time_limit_s: float = 30.0) -> DeviceSpec:
    """Measure compute, memory and every mesh axis' link on the live process group.

    `mesh` is a DeviceMesh with named axes (all ranks must call this together). `base`
    supplies what is not measured (memory size, nodes); default: "cpu-gloo" on CPU, the GPU's
    spec on CUDA. Messages grow by 4x from 1 KiB to `max_bytes` (bytes) while one takes less than
    `time_limit_s` (seconds) / 20; each is timed `repeats` times. Returns a DeviceSpec for `device=`.

        measured = autojigsaw.calibrate(mesh)  # on every rank
        pmodel = autojigsaw.parallelize(model, mesh, (x,), device=measured)
    """
    if not dist.is_initialized() or not hasattr(mesh, "get_group"):
        raise ValueError("calibrate needs a live process group and a DeviceMesh with named axes: call "
                         "torch.distributed.init_process_group, then init_device_mesh(..., mesh_dim_names=...)")
    mesh_spec = MeshSpec.of(mesh)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)
    base_spec = device_spec(base if base is not None else _default_base(device))
    deadline = time.perf_counter() + time_limit_s
    links = []
    for a, name in enumerate(mesh_spec.axis_names):
        if mesh_spec.sizes[a] > 1:
            links.append((name, _fit_link(mesh.get_group(name), device, max_bytes, repeats, deadline,
                                          f"{dist.get_backend()} {name}")))
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    dist.barrier()  # every rank computes at once, as in a step: ranks that share cores contend
    rates = _agree([_matmul_rate(dt, device, repeats) for dt in dtypes] + [_copy_rate(device, repeats)]
                   + [link.bandwidth for _, link in links], device, largest=False)
    times = _agree([_floor(device)] + [link.latency_s for _, link in links], device, largest=True)
    flops = tuple((str(dt).removeprefix("torch."), rate) for dt, rate in zip(dtypes, rates))
    links = [(name, LinkSpec(link.name, times[1 + i], rates[len(dtypes) + 1 + i]))
             for i, (name, link) in enumerate(links)]
    fastest = min((link for _, link in links), key=lambda l: l.latency_s, default=base_spec.intra_node)
    slowest = max((link for _, link in links), key=lambda l: l.latency_s, default=base_spec.inter_node)
    return replace(base_spec, name=f"{base_spec.name}-calibrated", flops=flops,
                   memory_bandwidth=rates[len(dtypes)], kernel_floor_s=times[0], intra_node=fastest,
                   inter_node=slowest, axis_links=tuple(links), tree_all_reduce=dist.get_backend() == "nccl",
                   efficiency=())  # measured rates are achieved ones


def _default_base(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device).lower()
    return next((d for d in ("h200", "h100", "a100") if d in name), "h100")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _typical_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median of `repeats` runs: what a step will see on this machine as it is now."""
    fn()  # warm up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


_c10d = torch.ops._c10d_functional


def _collective(kind: str, x: torch.Tensor, n: int, group_name: str) -> Callable[[], object]:
    """One call of the functional collective the kernels run (kernels/collectives.py)."""
    if kind == "all_gather":
        return lambda: _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, n, group_name))
    if kind == "reduce_scatter":
        return lambda: _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", n, group_name))
    return lambda: _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))


def _fit_link(group, device: torch.device, max_bytes: int, repeats: int, deadline: float, name: str) -> LinkSpec:
    """Latency and bandwidth of one axis: all-reduces, all-gathers and reduce-scatters of growing
    sizes, fitted to the ring model (rounds x latency + bytes sent / bandwidth) by least squares."""
    n = dist.get_world_size(group)
    rows, times = [], []
    size = 1024
    while size <= max_bytes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            times.append(_typical_time(_collective(kind, x, n, group.group_name), device, repeats))
            rows.append((latency_steps(kind, n), bytes_sent(kind, size, n)))
        # every rank of the group must agree on continuing, or a collective would hang
        stop = torch.tensor([float(time.perf_counter() > deadline)], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=group)
        if stop.item():
            break
        size *= 4
    rows, times = np.array(rows, dtype=float), np.array(times)
    (latency, inverse_bw), _ = nnls(rows, times)
    if inverse_bw <= 0:  # noise hid the bandwidth term: take it from the largest messages
        inverse_bw = max(times[-1] - latency * rows[-1, 0], times[-1] / 2) / rows[-1, 1]
    return LinkSpec(name, float(latency), 1.0 / float(inverse_bw))


def _matmul_rate(dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """FLOP/s of a run of matmuls long enough (tens of ms on CPU) to see the cores it shares."""
    size, runs = (2048, 4) if device.type == "cuda" else (384, 16)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def matmuls():
        for _ in range(runs):
            a @ b

    return runs * 2 * size**3 / _typical_time(matmuls, device, repeats)


def _copy_rate(device: torch.device, repeats: int) -> float:
    x = torch.empty(2**24 if device.type == "cuda" else 2**22, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _typical_time(lambda: y.copy_(x), device, repeats)


def _floor(device: torch.device) -> float:
    x = torch.ones(4, device=device)
    return _typical_time(lambda: x.add(x), device, 20)


def _agree(values: list[float], device: torch.device, *, largest: bool) -> list[float]:
    """The same numbers on every rank: the largest over ranks (times) or the smallest (rates)."""
    sign = 1.0 if largest else -1.0
    t = torch.tensor([sign * v for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [sign * float(v) for v in t.cpu()]
