"""Every dtype decision, each class of dtype on purpose: which values carry a gradient, how sums travel."""

import pytest
import torch

from autojigsaw.dtypes import acc_dtype, carries_grad, reduce_dtype, value_carries_grad

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, *FLOAT8,
                                   torch.complex64, torch.complex128])
def test_real_and_complex_floating_values_carry_gradients(dtype):
    assert carries_grad(dtype)
    assert torch.empty(2, dtype=dtype).requires_grad_().requires_grad  # autograd agrees


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_integer_and_bool_values_never_carry_gradients(dtype):
    assert not carries_grad(dtype)
    with pytest.raises(RuntimeError):  # autograd agrees
        torch.empty(2, dtype=dtype).requires_grad_()


def test_value_carries_grad_reads_tensors_only():
    assert value_carries_grad(torch.empty(1, dtype=torch.complex64))
    assert not value_carries_grad(torch.empty(1, dtype=torch.int64))
    assert not value_carries_grad(3.0) and not value_carries_grad(None)


@pytest.mark.parametrize("dtype,sent", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                        (FLOAT8[0], torch.float32), (FLOAT8[1], torch.float32),
                                        (torch.float32, torch.float32), (torch.float64, torch.float64),
                                        (torch.complex32, torch.complex64), (torch.complex64, torch.complex64),
                                        (torch.int64, torch.int64), (torch.bool, torch.bool)])
def test_sums_travel_in_at_least_fp32(dtype, sent):
    assert reduce_dtype(dtype, "sum") == sent
    assert reduce_dtype(dtype, "avg") == sent


@pytest.mark.parametrize("dtype", [torch.bfloat16, FLOAT8[0], torch.int32])
def test_max_and_min_are_exact_in_any_dtype(dtype):
    assert reduce_dtype(dtype, "max") == dtype and reduce_dtype(dtype, "min") == dtype


def test_statistics_accumulate_in_fp32_or_fp64():
    assert acc_dtype(torch.float64) == torch.float64
    assert all(acc_dtype(d) == torch.float32 for d in (torch.float32, torch.bfloat16, torch.float16, *FLOAT8))


def test_byte_counts_are_real_bytes():
    """The cost model multiplies by itemsize: a complex64 element is 8 bytes, complex128 16."""
    assert torch.complex64.itemsize == 8 and torch.complex128.itemsize == 16 and FLOAT8[0].itemsize == 1
