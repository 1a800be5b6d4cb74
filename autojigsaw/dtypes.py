"""Every decision made from a dtype, in one place: gradients, reductions, accumulation, precision.

Complex values carry gradients (RoPE as `view_as_complex`), integer and bool values never do,
float8 values do but are never summed in float8. Byte counts use `dtype.itemsize`, which is
the real size (a complex64 element is 8 bytes).
"""

from __future__ import annotations

import torch

LOW_PRECISION = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                           torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def carries_grad(dtype: torch.dtype) -> bool:
    """Whether autograd can differentiate a value of this dtype: real or complex floating point."""
    return dtype.is_floating_point or dtype.is_complex


def value_carries_grad(value) -> bool:
    """carries_grad for a tensor (fake or real); False for anything else (ints, None, symbols)."""
    return isinstance(value, torch.Tensor) and carries_grad(value.dtype)


def reduce_dtype(dtype: torch.dtype, op: str = "sum") -> torch.dtype:
    """The dtype a reduction sends: low-precision partial sums in fp32 (complex32 in complex64).

    max/min are exact in any dtype, so only sum and avg widen.
    """
    if op not in ("sum", "avg"):
        return dtype
    if dtype in LOW_PRECISION:
        return torch.float32
    return torch.complex64 if dtype == torch.complex32 else dtype


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics accumulate in: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
