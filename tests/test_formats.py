"""FloatFormat properties against torch.finfo, ml_dtypes.finfo, the codes themselves and seed 004."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowp.codec import all_values, decode
from lowp.formats import PRESETS, FloatFormat, custom_format, get_format, register_format
from lowp.rounding import quantize

TORCH_NAMES = ["fp64", "fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"]
ML_NAMES = {"fp8_e4m3fn": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
            "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
            "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
            "fp4_e2m1": ml_dtypes.float4_e2m1fn, "bf16": ml_dtypes.bfloat16, "fp16": np.float16,
            "fp32": np.float32, "fp64": np.float64}


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_properties_match_torch_finfo(name):
    fmt = get_format(name)
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max == info.max
    assert fmt.min_normal == info.smallest_normal == info.tiny
    assert fmt.bits == info.bits
    if name == "fp8_e5m2fnuz" and info.eps == 0.125:
        # torch.finfo(float8_e5m2fnuz).eps is 0.125 (torch 2.13), but 1 + 0.125 is not representable
        # with 2 mantissa bits: the gap above 1 is 0.25 (ml_dtypes agrees; see the next test).
        assert all_values(fmt)[all_values(fmt) > 1].min() - 1 == 0.25 == fmt.eps
    else:
        assert fmt.eps == info.eps


@pytest.mark.parametrize("name", list(ML_NAMES))
def test_properties_match_ml_dtypes_finfo(name):
    fmt = get_format(name)
    info = ml_dtypes.finfo(ML_NAMES[name])
    assert fmt.eps == float(info.eps)
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.mantissa_bits == info.nmant
    assert fmt.exponent_bits == info.nexp
    assert fmt.emin == info.minexp
    assert fmt.bits == info.bits


@pytest.mark.parametrize("name", [n for n, f in PRESETS.items() if f.bits <= 19])
def test_properties_agree_with_the_codes(name):
    fmt = get_format(name)
    vals = all_values(fmt)
    positive = vals[vals > 0]
    assert fmt.max == vals.max() == -vals.min()
    assert fmt.min_subnormal == positive.min()
    assert fmt.eps == positive[positive > 1].min() - 1
    assert fmt.min_normal == decode(torch.tensor([1 << fmt.mantissa_bits]), fmt).item()
    n_finite = 2 ** fmt.bits - (1 if fmt.has_negative_zero else 0)
    assert len(vals) <= n_finite


@pytest.mark.parametrize("e", range(2, 9))
@pytest.mark.parametrize("m", range(0, 11))
def test_custom_format_properties_and_identity(e, m):
    """For every eXmY with e in 2..8 and m in 0..10: quantizing every value is the identity (every
    mode) and max / min_normal / min_subnormal / eps agree with the decoded codes."""
    fmt = custom_format(e, m)
    vals = all_values(fmt, finite=False)
    finite = vals[torch.isfinite(vals)]
    positive = finite[finite > 0]
    assert fmt.max == finite.max()
    assert fmt.min_subnormal == positive.min()
    assert fmt.min_normal == 2.0**fmt.emin
    assert fmt.eps == positive[positive > 1].min() - 1 if fmt.max > 1 else True
    x = vals.float()
    for mode in ("nearest_even", "nearest_away", "toward_zero", "up", "down", "odd", "stochastic"):
        assert quantize(x, fmt, mode).equal(x), mode


def test_seed_004_tables():
    """Seed 004 tables 1-1 and 1-2 (eps and range), with its FP16 max corrected: 65504, not 655."""
    assert f"{get_format('fp32').eps:.8f}" == "0.00000012"
    assert f"{get_format('fp16').eps:.8f}" == "0.00097656"
    assert f"{get_format('bf16').eps:.8f}" == "0.00781250"
    assert f"{get_format('fp32').min_subnormal:.1E}" == "1.4E-45"
    assert f"{get_format('fp32').max:.2E}" == "3.40E+38"
    assert f"{get_format('fp16').min_subnormal:.2E}" == "5.96E-08"
    assert get_format("fp16").max == 65504.0
    assert f"{get_format('bf16').min_subnormal:.1E}" == "9.2E-41"
    assert f"{get_format('bf16').max:.2E}" == "3.39E+38"
    assert round(get_format("fp16").decimal_digits, 3) == 3.311
    assert round(get_format("bf16").decimal_digits, 3) == 2.408


def test_other_presets():
    assert get_format("tf32").eps == 2.0**-10
    assert get_format("tf32").max == get_format("fp32").max * (1 - 2.0**-11) / (1 - 2.0**-24)
    dl = get_format("dlfloat16")
    assert (dl.exponent_bits, dl.mantissa_bits, dl.subnormals, dl.bias) == (6, 9, False, 31)
    assert dl.min_subnormal == dl.min_normal == 2.0**-30
    assert dl.max == 2.0**32 * (2 - 2 * 2.0**-9)
    assert get_format("fp8_e4m3fn").max == 448 and get_format("fp8_e4m3fnuz").max == 240
    assert get_format("fp6_e2m3").max == 7.5 and get_format("fp6_e3m2").max == 28 and get_format("fp4_e2m1").max == 6
    assert get_format("fp32").unit_roundoff == 2.0**-24
    assert get_format("bf16").precision == 8


def test_lookup_by_name_alias_dtype_and_custom():
    assert get_format("BF16") is get_format("bfloat16") is get_format(torch.bfloat16) is PRESETS["bf16"]
    assert get_format("e4m3") is PRESETS["fp8_e4m3fn"]
    assert get_format(torch.float8_e5m2fnuz) is PRESETS["fp8_e5m2fnuz"]
    custom = get_format("e3m4")
    assert (custom.exponent_bits, custom.mantissa_bits, custom.special) == (3, 4, "ieee")
    assert get_format("fp8_e3m4") == custom
    fmt = PRESETS["fp16"]
    assert get_format(fmt) is fmt
    for name, f in PRESETS.items():
        assert get_format(name) is f
        if f.torch_dtype is not None:
            assert get_format(f.torch_dtype) is f


def test_register_format():
    mine = register_format(FloatFormat("my_e3m3", 3, 3, aliases=("mine33",)))
    assert get_format("MINE33") is mine


def test_with_overflow_and_summary():
    sat = get_format("fp16").with_overflow("saturate")
    assert sat.overflow == "saturate" and sat.max == 65504
    s = get_format("fp16").summary()
    assert s["max"] == 65504 and s["torch_dtype"] == "float16" and s["decimal_digits"] == 3.311
    assert str(get_format("bf16")) == "bf16"
    assert math.isclose(get_format("fp16").dynamic_range_log2, 24 + math.log2(65504))


def test_bad_formats_raise():
    with pytest.raises(ValueError, match="unknown format name 'fp7'"):
        get_format("fp7")
    with pytest.raises(ValueError, match="torch dtype"):
        get_format(torch.int32)
    with pytest.raises(TypeError, match="expected a name"):
        get_format(16)
    with pytest.raises(ValueError, match="exponent_bits"):
        custom_format(0, 3)
    with pytest.raises(ValueError, match="mantissa_bits"):
        custom_format(5, 60)
    with pytest.raises(ValueError, match="special"):
        FloatFormat("x", 4, 3, special="weird")
    with pytest.raises(ValueError, match="overflow"):
        FloatFormat("x", 4, 3, overflow="wrap")
    with pytest.raises(ValueError, match="no infinity"):
        get_format("fp8_e4m3fn").with_overflow("inf")
    with pytest.raises(ValueError, match="no NaN"):
        get_format("fp4_e2m1").with_overflow("nan")
    with pytest.raises(ValueError, match="finite_nan"):
        FloatFormat("x", 4, 0, special="finite_nan")
    with pytest.raises(ValueError, match="empty normal range"):
        FloatFormat("x", 1, 2)
    with pytest.raises(dataclasses_error()):
        get_format("fp16").mantissa_bits = 3  # type: ignore[misc]


def dataclasses_error():
    import dataclasses
    return dataclasses.FrozenInstanceError
