"""megamoe.precision: the numerically sensitive dtype, and the non-finite check saves and inspect share."""

import pytest
import torch

from megamoe import precision
from megamoe.precision import compute_dtype, has_non_finite


def test_compute_dtype_is_at_least_fp32_and_never_narrows():
    assert compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float32, torch.float16) == torch.float32
    assert compute_dtype(torch.bfloat16, torch.float64) == torch.float64


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_has_non_finite_sees_nan_and_inf_in_every_float_dtype(dtype, monkeypatch):
    monkeypatch.setattr(precision, "_SCAN_BLOCK", 3)          # several blocks; the bad value in the last one
    clean = torch.arange(10, dtype=torch.float32).to(dtype)
    assert not has_non_finite(clean)
    for bad in (float("nan"), float("inf")):
        if dtype == torch.float8_e4m3fn and bad == float("inf"):
            continue                                          # e4m3fn has no infinity (it saturates to NaN)
        poisoned = clean.clone()
        poisoned[9] = bad
        assert has_non_finite(poisoned.view(2, 5))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu])
def test_fp8_is_read_from_its_bits_as_its_widened_values_say(dtype):
    """fp8 is scanned on its bits (widening costs 50 times more): every one of the 256 values agrees,
    and the counts see the same values."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    for i in range(256):
        assert has_non_finite(values[i:i + 1]) == (not bool(torch.isfinite(values[i:i + 1].float()))), i
    widened = values.float()
    assert precision.count_non_finite(values) == (int(torch.isnan(widened).sum()), int(torch.isinf(widened).sum()))


def test_an_fp64_value_beyond_fp32_range_is_finite():
    assert not has_non_finite(torch.tensor([1.0, 5e38, -1e300], dtype=torch.float64))


def test_integer_tensors_are_never_non_finite():
    assert not has_non_finite(torch.tensor([1, 2, 3]))
