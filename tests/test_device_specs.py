"""Device specs: kernel efficiency by size, fabrics, torch.compile, against published microbenchmarks."""

import dataclasses

import numpy as np
import pytest
import sympy
import torch

from autojigsaw.cost_model.compute import memory_time, roofline_time
from autojigsaw.cost_model.devices import DEVICES, KERNEL_KINDS, DeviceSpec, Efficiency, device_spec

GPUS = ("h100", "h100-96gb", "h200", "a100", "a100-40gb")
SIZES = np.logspace(3, 15, 49)


def _tflops(m: int, n: int, k: int, device: str, batch: int = 1, *, in_a_step: bool = False) -> float:
    """Predicted bf16 TFLOP/s of one (batched) GEMM: its FLOPs over roofline_time; alone, as the
    microbenchmarks measure it, or (`in_a_step`) as a whole training step sustains it."""
    f = 2 * batch * m * n * k
    moved = batch * (m * k + k * n + m * n) * 2
    spec = device_spec(device) if in_a_step else dataclasses.replace(device_spec(device), sustained_rate=1.0)
    return f / roofline_time(f, moved, torch.bfloat16, spec, "matmul") / 1e12


@pytest.mark.parametrize("name", list(DEVICES))
def test_efficiency_is_monotone_in_size_and_within_0_1(name):
    spec = device_spec(name)
    for kind in KERNEL_KINDS:
        e = spec.kernel_efficiency(kind).at(SIZES)
        assert np.all((e > 0) & (e <= 1)), (name, kind)
        assert np.all(np.diff(e) >= 0), (name, kind)
    # the whole kernel (floor and memory traffic included) also gets faster per FLOP as it grows
    seconds = roofline_time(SIZES, SIZES / 100, torch.bfloat16, spec, "matmul")
    achieved = SIZES / seconds / spec.peak_flops(torch.bfloat16)
    assert np.all((achieved > 0) & (achieved <= 1)) and np.all(np.diff(achieved) >= -1e-12)


@pytest.mark.parametrize("name", GPUS)
def test_specs_print_their_efficiencies_and_fabrics(name):
    text = str(device_spec(name))
    assert "matmul kernels" in text and "attention kernels" in text and "optimizer kernels" in text
    assert "NVLink" in text and "InfiniBand" in text
    assert "fused" in str(device_spec(name + "+compile"))


# OpenXLA's measured cuBLAS bf16 table for sm_90 (xla/service/gpu/model/matmul_interpolator_data.h):
# (batch, m, n, k, TFLOP/s). The spec's line goes through 2048^3 and 4096^3; the others test it.
XLA_SM90 = [(1, 4096, 4096, 4096, 783.3), (1, 2048, 2048, 2048, 632.0), (2, 4096, 2048, 4096, 783.2),
            (2, 4096, 1024, 4096, 750.6), (4, 2048, 2048, 2048, 725.7), (2, 2048, 4096, 1024, 678.7),
            (4, 1024, 2048, 2048, 712.7), (1, 2048, 1024, 2048, 523.3), (1, 1024, 2048, 2048, 524.3)]


@pytest.mark.parametrize("batch, m, n, k, measured", XLA_SM90)
def test_h100_gemm_matches_the_measured_table_within_10_percent(batch, m, n, k, measured):
    assert _tflops(m, n, k, "h100", batch) == pytest.approx(measured, rel=0.10)


def test_big_gemms_at_the_published_maximum_achievable_throughput():
    # stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS":
    # H100 SXM 792.1 TFLOP/s at 6144x17920x2816, A100 SXM 267.9 at 6912x16384x2048 (bf16)
    assert _tflops(6144, 17920, 2816, "h100") == pytest.approx(792.1, rel=0.10)
    assert _tflops(6912, 16384, 2048, "a100") == pytest.approx(267.9, rel=0.10)
    # small GEMMs are far from it: a 256 x 512 x 256 one (the table: 11.5 TFLOP/s)
    assert _tflops(256, 512, 256, "h100") < 0.03 * 989.4


def test_the_cpu_spec_is_the_plain_roofline():
    """Plans on "cpu" must not change: efficiency 1, no per-kernel overhead, no fusion."""
    cpu = device_spec("cpu")
    assert all(cpu.kernel_efficiency(k) == Efficiency() for k in KERNEL_KINDS) and not cpu.fused_pointwise
    for f, b in [(1e3, 1e3), (1e9, 1e6), (1e6, 1e9)]:
        for kind in ("matmul", "attention", "norm", "elementwise"):
            plain = max(f / cpu.peak_flops(torch.float32), b / cpu.memory_bandwidth, cpu.kernel_floor_s)
            assert roofline_time(f, b, torch.float32, cpu, kind) == plain
    assert memory_time(1e9, cpu, "optimizer") == 1e9 / cpu.memory_bandwidth


def test_roofline_on_ints_arrays_and_formulas_agree():
    spec = device_spec("h100")
    x = sympy.Symbol("x", positive=True)
    for kind in ("matmul", "attention", "softmax"):
        expr = roofline_time(x * 1e9, x * 1e6, torch.bfloat16, spec, kind)
        assert isinstance(expr, sympy.Expr)
        arr = roofline_time(np.array([3.0, 300.0]) * 1e9, np.array([3.0, 300.0]) * 1e6, torch.bfloat16, spec, kind)
        for i, v in enumerate((3, 300)):
            assert float(expr.subs(x, v)) == pytest.approx(arr[i])
            assert roofline_time(v * 10**9, v * 10**6, torch.bfloat16, spec, kind) == pytest.approx(arr[i])


def test_attention_runs_below_gemm_efficiency_on_hopper():
    spec = device_spec("h100")
    f = 1e12
    gemm = roofline_time(f, 1e8, torch.bfloat16, spec, "matmul")
    attention = roofline_time(f, 1e8, torch.bfloat16, spec, "attention")
    assert attention / gemm == pytest.approx(0.82 / 0.35, rel=0.02)  # FlashAttention-2: 35 % of peak


def test_memory_bound_ops_at_90_percent_of_hbm_and_cheaper_when_compiled():
    eager, compiled = device_spec("h100"), device_spec("h100+compile")
    numel = 16 * 8192 * 4096
    moved = 3 * numel * 2  # an add: two bf16 inputs, one output
    t = roofline_time(numel, moved, torch.bfloat16, eager, "elementwise")
    assert t == pytest.approx(moved / (0.9 * 3.35e12))
    fused = roofline_time(numel, moved, torch.bfloat16, compiled, "elementwise")
    assert fused == pytest.approx(t / 3)  # only its output is written
    assert roofline_time(numel, moved, torch.bfloat16, compiled, "norm") == t  # reductions keep their kernel
    assert roofline_time(1, 6, torch.bfloat16, compiled, "elementwise") < eager.kernel_floor_s


def test_an_axis_across_nodes_uses_one_nic_per_gpu_of_the_node_in_it():
    h100 = device_spec("h100")
    assert h100.axis_link((8,), 0).name == "NVLink 4"
    whole_nodes = h100.axis_link((128,), 0)  # 8 rails per node, capped at NVLink's rate
    assert whole_nodes.bandwidth == h100.intra_node.bandwidth
    assert h100.axis_link((32, 4), 0).bandwidth == 2 * h100.inter_node.bandwidth
    assert h100.axis_link((16, 8), 0) == h100.inter_node  # one GPU per node: one NIC


def test_bad_efficiencies_are_rejected():
    with pytest.raises(ValueError, match="ceiling"):
        Efficiency(1.5)
    with pytest.raises(ValueError, match="unknown kernel kinds"):
        DeviceSpec("x", flops=(("float32", 1e12),), memory_bytes=1, memory_bandwidth=1.0,
                   intra_node=device_spec("h100").intra_node, inter_node=device_spec("h100").inter_node,
                   devices_per_node=1, efficiency=(("gemm", Efficiency()),))
    assert device_spec("h100+compile").compiled() == device_spec("h100+compile")


def test_tf32_prices_fp32_matmuls_and_convs_at_the_tensor_core_peak_only():
    plain, tf32 = device_spec("a100-40gb"), device_spec("a100-40gb+tf32")
    f, moved = 2 * 8192**3, 3 * 8192**2 * 4
    for kind in ("matmul", "conv"):
        assert roofline_time(f, moved, torch.float32, plain, kind) / roofline_time(f, moved, torch.float32, tf32, kind) \
            == pytest.approx(156 / 19.5, rel=0.01)
    for dtype, kind in ((torch.bfloat16, "matmul"), (torch.float32, "elementwise")):  # untouched
        assert roofline_time(f, moved, dtype, plain, kind) == roofline_time(f, moved, dtype, tf32, kind)
    assert device_spec("a100-40gb+tf32+compile") == tf32.compiled() and "TF32" in tf32.table()
    with pytest.raises(ValueError, match=r"device 'cpu-gloo' has no TF32 peak; its dtypes: \['float32'"):
        device_spec("cpu+tf32")


def test_gpu_specs_hold_memory_as_the_caching_allocator_and_expandable_segments_are_a_suffix():
    """Every GPU spec prices memory as torch's CUDA caching allocator reserves it; "+expandable" is
    PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", combinable with "+compile"; the CPU has no such allocator."""
    assert all(DEVICES[name].caching_allocator for name in DEVICES if name != "cpu-gloo")
    assert not device_spec("cpu").caching_allocator
    spec = device_spec("h100-96gb+expandable+compile")
    assert spec.expandable_segments and spec.fused_pointwise and spec.name == "h100-96gb+expandable+compile"
    assert "expandable segments" in spec.table() and not device_spec("h100").expandable_segments
    with pytest.raises(ValueError, match="no CUDA caching allocator"):
        device_spec("cpu+expandable")
    with pytest.raises(ValueError, match="set caching_allocator=True"):
        dataclasses.replace(device_spec("cpu"), expandable_segments=True)


@pytest.mark.parametrize("name", ["h100", "h100-96gb", "h200"])
def test_whole_steps_sustain_a_fitted_share_of_the_microbenchmarked_tensor_core_rates(name):
    """Hopper's GEMMs and attention in a training step run at sustained_rate of their microbenchmarks, fitted
    on a published run the spec names; memory-bound kernels and the A100 (within 7 % unfitted) keep theirs."""
    spec = device_spec(name)
    assert spec.sustained_rate < 1 and dict(spec.fitted)["sustained_rate"]
    assert _tflops(6144, 17920, 2816, name, in_a_step=True) == pytest.approx(
        spec.sustained_rate * _tflops(6144, 17920, 2816, name), rel=1e-3)
    assert spec.kernel_efficiency("attention").ceiling == pytest.approx(0.35 * spec.sustained_rate)
    assert spec.kernel_efficiency("memory").ceiling == 0.90
    assert device_spec("a100").sustained_rate == 1.0 and device_spec("a100").fitted == ()
