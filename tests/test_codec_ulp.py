"""Codes decode exactly like torch's and ml_dtypes' bit views; encode inverts decode; ulp and ulp_error."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from lowp.codec import all_codes, all_values, decode, encode
from lowp.formats import PRESETS, get_format
from lowp.ulp import ulp, ulp_error
from rounding_reference import bits_equal, codes_as

TORCH_VIEW = ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"]
ML_VIEW = {"fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
           "fp4_e2m1": ml_dtypes.float4_e2m1fn, "fp8_e4m3fn": ml_dtypes.float8_e4m3fn}


@pytest.mark.parametrize("name", TORCH_VIEW)
def test_decode_matches_torch_bit_view_for_every_code(name):
    fmt = get_format(name)
    want = codes_as(fmt.torch_dtype, fmt).double()
    got = decode(all_codes(fmt), fmt)
    assert bool(bits_equal(got, want).all())


@pytest.mark.parametrize("name", list(ML_VIEW))
def test_decode_matches_ml_dtypes_for_every_code(name):
    fmt = get_format(name)
    want = np.arange(2**fmt.bits, dtype=np.uint8).view(ML_VIEW[name]).astype(np.float64)
    assert bool(bits_equal(decode(all_codes(fmt), fmt), torch.from_numpy(want)).all())


@pytest.mark.parametrize("name", [n for n, f in PRESETS.items() if f.bits <= 19])
def test_encode_inverts_decode(name):
    fmt = get_format(name)
    codes = all_codes(fmt)
    values = decode(codes, fmt)
    back = encode(values, fmt)
    keep = ~torch.isnan(values)
    assert back[keep].equal(codes[keep])
    # every NaN code encodes to one canonical NaN code that decodes to NaN
    if fmt.has_nan:
        assert torch.isnan(decode(back[~keep], fmt)).all()


def test_all_values_sorted_unique_and_counted():
    v = all_values("fp16")
    assert bool((v[1:] > v[:-1]).all())
    assert len(v) == 2 * (31 * 1024) - 1  # 31 finite binades per sign, one shared zero
    assert len(all_values("fp16", finite=False)) == len(v) + 2
    assert len(all_values("fp8_e4m3fnuz")) == 255
    assert len(all_values("fp4_e2m1")) == 15


def test_codec_errors():
    with pytest.raises(TypeError, match="integer"):
        decode(torch.tensor([1.0]), "fp16")
    with pytest.raises(ValueError, match="codes"):
        decode(torch.tensor([256]), "fp8_e4m3fn")
    with pytest.raises(ValueError, match="24"):
        all_codes("fp32")
    with pytest.raises(ValueError, match="representable"):
        encode(torch.tensor([0.1], dtype=torch.float64), "fp16")
    with pytest.raises(ValueError, match="representable"):
        encode(torch.tensor([1e6], dtype=torch.float64), "fp16")
    with pytest.raises(ValueError, match="infinity"):
        encode(torch.tensor([float("inf")]), "fp8_e4m3fn")
    with pytest.raises(ValueError, match="NaN"):
        encode(torch.tensor([float("nan")]), "fp4_e2m1")


def test_ulp_values():
    x = torch.tensor([1.0, 1.5, 2.0, 65504.0, 0.0, 2.0**-20, -3.0], dtype=torch.float64)
    assert ulp(x, "fp16").tolist() == [2.0**-10, 2.0**-10, 2.0**-9, 32.0, 2.0**-24, 2.0**-24, 2.0**-9]
    assert ulp(torch.tensor([1.0]), "bf16").item() == 2.0**-7


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn"])
def test_ulp_is_the_gap_to_the_next_value(name):
    fmt = get_format(name)
    v = all_values(fmt)
    pos = v[v >= 0]
    assert ulp(pos[:-1], fmt).equal(pos[1:] - pos[:-1])


def test_ulp_error():
    exact = torch.tensor([1.0, 1.0, 1e6, 0.1, float("nan"), float("inf")], dtype=torch.float64)
    computed = torch.tensor([1.0 + 2.0**-10, 1.0 + 2.0**-11, float("inf"), 0.0999755859375, float("nan"), float("inf")])
    err = ulp_error(computed, exact, "fp16")
    assert err.tolist()[:2] == [1.0, 0.5]
    assert err[2] == 0  # a correct overflow
    assert abs(err[3].item() - abs(0.0999755859375 - 0.1) / 2.0**-14) < 1e-12
    assert err[4] == 0 and err[5] == 0
    assert ulp_error(torch.tensor([float("nan")]), torch.tensor([1.0]), "fp16").item() == float("inf")
    assert ulp_error(torch.tensor([-float("inf")]), torch.tensor([1e6]), "fp16").item() == float("inf")


def test_codec_rejects_non_tensors_naming_the_argument():
    with pytest.raises(TypeError, match="codes"):
        decode([0, 1], "fp16")
    with pytest.raises(TypeError, match="values"):
        encode([1.0], "fp16")
    with pytest.raises(TypeError, match="values"):
        encode(torch.tensor([1 + 1j]), "fp16")
