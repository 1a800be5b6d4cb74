"""Compute cost: FLOPs of a node on local shards, and its roofline time on a device.

Each op belongs to a kind (matmul, conv, attention, softmax, norm, elementwise) with a FLOP
formula in a few local dims (M, N, K for a matmul). A kernel's time is the roofline
max((FLOPs + half) / (ceiling * peak), bytes moved / (memory ceiling * bandwidth), launch
floor), with the device's efficiency of the kind (devices.Efficiency: matmul and conv use the
GEMM table, attention its own, other kinds run on the vector units, memory-bound). Shapes may
be tuples of ints, numpy columns (one entry per strategy: a whole node at once) or sympy
expressions (for Plan.explain); the same code serves all three.

torch.compile (a spec with fused_pointwise): Inductor fuses chains of elementwise ops into one
kernel, or into the reduction next to them, so that an elementwise op writes its output once
and reads nothing back: it is priced at its output bytes (its FLOP count: one per output
element), with no launch floor. Norms, softmax and GEMMs keep their own kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch

from .devices import DeviceSpec, Efficiency
from .formulas import Formula, symbols

aten = torch.ops.aten

CONVS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
         aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}
TRANSPOSED_CONVS = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten.baddbmm.default, aten.matmul.default} | CONVS | TRANSPOSED_CONVS
ATTENTION = {aten.scaled_dot_product_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default}
SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
         aten._fused_rms_norm.default, aten.group_norm.default, aten.native_group_norm.default}

Shape = Sequence  # of ints, numpy arrays (one entry per strategy) or sympy expressions

_M, _N, _K, _BH, _SQ, _SK, _D, _DV, _E, _R = symbols("M N K BH Sq Sk D Dv E R")
_F, _BYTES, _PEAK, _BW, _FLOOR = symbols("flops bytes peak bandwidth floor")
_CEIL, _HALF, _MCEIL, _MHALF = symbols("ceiling half memory_ceiling memory_half")

ROOFLINE = Formula("kernel_time", sympy.Max((_F + _HALF) / (_CEIL * _PEAK), (_BYTES + _MHALF) / (_MCEIL * _BW),
                                            _FLOOR),
                   (_F, _BYTES, _PEAK, _BW, _FLOOR, _CEIL, _HALF, _MCEIL, _MHALF))
_TENSOR_CORE_KINDS = {"matmul": "matmul", "conv": "matmul", "patch_conv": "matmul", "attention": "attention"}
# A convolution over non-overlapping patches (stride == kernel, no padding) through cuDNN is
# priced at the fp32 CUDA-core peak, whatever its dtype. Measured for TF32: on the Jigsaw paper's
# runs (benchmarks/jigsaw_runs.py) TF32 step times come out 1.7-3.8x optimistic priced at the
# tensor-core rate and 0.94-1.11x at this one. bf16 patch Conv3d is reported slower still
# (transformers issue 45750, sglang-omni PR 539); bf16 1-D and 2-D ones are unmeasured. vLLM and
# transformers run patch convolutions as GEMMs, and so does autojigsaw (kernel "patch_gemm"),
# so this price only decides between the two.
_CUDA_CORE_KINDS = {"patch_conv"}


@dataclass(frozen=True)
class OpKind:
    """A family of ops with one FLOP formula; `dims` reads its arguments off local shapes."""

    name: str
    flops: Formula
    dims: Callable[[list[Shape], list[Shape]], tuple]
    backward: float  # backward time as a multiple of forward time


def _contraction(op, ins: list[Shape]):
    return ins[1][-1] if op in (aten.addmm.default, aten.baddbmm.default) else ins[0][-1]


def _matmul_dims(op):
    return lambda ins, outs: (math.prod(outs[0][:-1]), outs[0][-1], _contraction(op, ins))


def _attention_dims(ins, outs):
    q, k, v = ins[0], ins[1], ins[2]
    return math.prod(q[:-2]), q[-2], k[-2], q[-1], v[-1]


_MATMUL_FLOPS = Formula("matmul_flops", 2 * _M * _N * _K, (_M, _N, _K))
# A convolution: every output element is a dot product over one weight filter, W [Cout, Cin / g, k..].
_CONV = OpKind("conv", Formula("conv_flops", 2 * _E * _R, (_E, _R)),
               lambda ins, outs: (math.prod(outs[0]), math.prod(ins[1][1:])), 2.0)
# A transposed convolution scatters every input element through W [Cin, Cout / g, k..].
_TRANSPOSED_CONV = OpKind("conv", _CONV.flops, lambda ins, outs: (math.prod(ins[0]), math.prod(ins[1][1:])), 2.0)
_ATTENTION = OpKind("attention", Formula("attention_flops", 2 * _BH * _SQ * _SK * (_D + _DV),
                                         (_BH, _SQ, _SK, _D, _DV)), _attention_dims, 2.5)
_SOFTMAX = OpKind("softmax", Formula("softmax_flops", 5 * _E, (_E,)),
                  lambda ins, outs: (math.prod(outs[0]),), 1.0)
_NORM = OpKind("norm", Formula("norm_flops", 8 * _E, (_E,)), lambda ins, outs: (math.prod(ins[0]),), 1.0)
_ELEMENTWISE = OpKind("elementwise", Formula("elementwise_flops", _E, (_E,)),
                      lambda ins, outs: (sum(math.prod(o) for o in outs) if outs else 0,), 1.0)


def op_kind(op) -> OpKind:
    """The kind (and so the FLOP formula) of an ATen op."""
    if op in CONVS:
        return _CONV
    if op in TRANSPOSED_CONVS:
        return _TRANSPOSED_CONV
    if op in MATMULS:
        return OpKind("matmul", _MATMUL_FLOPS, _matmul_dims(op), 2.0)
    if op in ATTENTION:
        return _ATTENTION
    if op in SOFTMAX:
        return _SOFTMAX
    if op in NORMS:
        return _NORM
    return _ELEMENTWISE


def _patchwise(op, ins: list[Shape], outs: list[Shape]) -> bool:
    """Is this convolution over non-overlapping patches (stride == kernel > 1, no padding)?"""
    kernel = tuple(ins[1][2:])
    if not kernel or max(kernel) < 2 or not outs:
        return False
    small, large = (ins[0], outs[0]) if op in TRANSPOSED_CONVS else (outs[0], ins[0])
    return all(s * k == big for s, k, big in zip(small[-len(kernel):], kernel, large[-len(kernel):]))


def kind_name(op, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]]) -> str:
    """The op's kind for roofline_time, given its global shapes: a patchwise convolution is "patch_conv"."""
    name = op_kind(op).name
    return "patch_conv" if name == "conv" and _patchwise(op, in_shapes, out_shapes) else name


def flops(op, in_shapes: list[Shape], out_shapes: list[Shape]):
    """FLOPs of `op` given its local input and output shapes (a multiply-add counts 2)."""
    kind = op_kind(op)
    return kind.flops(*kind.dims(in_shapes, out_shapes))


def roofline_time(op_flops, bytes_moved, dtype: torch.dtype, device: DeviceSpec, kind: str = "matmul"):
    """max(compute, memory traffic, launch floor): the time of one kernel of op kind `kind`.

    Numbers and numpy arrays give seconds; a sympy expression among them gives the formula.
    """
    compute = device.kernel_efficiency(_TENSOR_CORE_KINDS[kind]) if kind in _TENSOR_CORE_KINDS else Efficiency()
    memory = device.kernel_efficiency("memory")
    floor = device.kernel_floor_s
    if device.fused_pointwise and kind == "elementwise":
        bytes_moved, floor, memory = op_flops * dtype.itemsize, 0.0, Efficiency(memory.ceiling)
    if kind in _CUDA_CORE_KINDS:
        peak = min(device.peak_flops(dtype), device.peak_flops(torch.float32))
    else:
        peak = device.matmul_peak(dtype) if kind in _TENSOR_CORE_KINDS else device.peak_flops(dtype)
    values = {"flops": op_flops, "bytes": bytes_moved, "peak": peak,
              "bandwidth": device.memory_bandwidth, "floor": floor, "ceiling": compute.ceiling,
              "half": compute.half, "memory_ceiling": memory.ceiling, "memory_half": memory.half}
    if isinstance(op_flops, sympy.Basic) or isinstance(bytes_moved, sympy.Basic):
        return ROOFLINE.subs(values)
    return ROOFLINE(*(values[str(a)] for a in ROOFLINE.args))


def memory_time(nbytes, device: DeviceSpec, kind: str = "memory"):
    """Seconds to stream `nbytes` through memory in a kernel of `kind` ("memory", "optimizer")."""
    e = device.kernel_efficiency(kind)
    return (nbytes + e.half) / (e.ceiling * device.memory_bandwidth)


def backward_factor(op, operand_grads: tuple[bool, ...] | None = None) -> float:
    """Backward time as a multiple of forward time. `operand_grads`: which tensor inputs need a
    gradient (None: all); a matmul computes one product per operand that does (a frozen weight's
    matmul in LoRA fine-tuning computes only its input's gradient, the first layer's only its weight's)."""
    kind = op_kind(op)
    if kind.name != "matmul" or operand_grads is None:
        return kind.backward
    operands = (1, 2) if op in (aten.addmm.default, aten.baddbmm.default) else (0, 1)
    return kind.backward * sum(operand_grads[i] for i in operands if i < len(operand_grads)) / len(operands)
