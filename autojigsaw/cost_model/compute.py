"""Compute cost: FLOPs of a node on local shards, and its roofline time on a device."""

from __future__ import annotations

import math

import torch

from .devices import DeviceSpec

aten = torch.ops.aten

# Ops whose backward costs about twice their forward (two matmuls per matmul).
MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten.baddbmm.default, aten.matmul.default, aten.convolution.default, aten.conv2d.default}
ATTENTION = {aten.scaled_dot_product_attention.default}


def flops(op, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]]) -> float:
    """FLOPs of `op` given its local input and output shapes (a multiply-add counts 2)."""
    out = out_shapes[0] if out_shapes else ()
    if op in (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
              aten.baddbmm.default, aten.matmul.default):
        contraction = in_shapes[0][-1] if op is not aten.addmm.default else in_shapes[1][-1]
        if op is aten.baddbmm.default:
            contraction = in_shapes[1][-1]
        return 2.0 * math.prod(out) * contraction
    if op in (aten.convolution.default, aten.conv2d.default):
        weight = in_shapes[1]
        return 2.0 * math.prod(out) * math.prod(weight[1:])
    if op in ATTENTION:
        q, k = in_shapes[0], in_shapes[1]
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    return float(sum(math.prod(s) for s in out_shapes))  # elementwise-like: one op per element


def roofline_time(op_flops: float, bytes_moved: float, dtype: torch.dtype, device: DeviceSpec) -> float:
    """max(compute, memory traffic, launch floor): the time of one kernel."""
    return max(op_flops / device.peak_flops(dtype), bytes_moved / device.memory_bandwidth,
               device.kernel_floor_s)


def backward_factor(op) -> float:
    """Backward time as a multiple of forward time."""
    return 2.0 if op in MATMULS or op in ATTENTION else 1.0
