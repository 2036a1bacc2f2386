"""Exact power-of-two helpers against math.ldexp (exact on Python floats)."""
import math

import pytest
import torch

from lowp.pow2 import scale_pow2


@pytest.mark.parametrize("dtype, tiny, k", [(torch.float64, 2.0**-1074, 2000), (torch.float32, 2.0**-149, 250)])
def test_scale_pow2_is_exact_where_two_to_the_k_alone_overflows(dtype, tiny, k):
    assert torch.isinf(torch.exp2(torch.tensor(float(k), dtype=dtype)))
    got = scale_pow2(torch.tensor([tiny, -3 * tiny], dtype=dtype), torch.tensor(k))
    assert got.tolist() == [math.ldexp(tiny, k), math.ldexp(-3 * tiny, k)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_pow2_matches_ldexp_for_normal_and_overflowing_results(dtype):
    info = torch.finfo(dtype)
    emax = int(math.log2(info.max))
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-emax, emax, (4000,), generator=gen).double())).to(dtype)
    k = torch.randint(-2 * emax, 2 * emax + 1, (4000,), generator=gen)
    checked = 0
    for a, b, g in zip(x.double().tolist(), k.tolist(), scale_pow2(x, k).double().tolist()):
        want = math.ldexp(a, b) if math.frexp(a)[1] + b <= emax + 1 else math.copysign(math.inf, a)
        if abs(want) >= info.tiny or a == 0:          # normal, overflowing or zero results are exact
            assert g == want, (a, b, g, want)
            checked += 1
    assert checked > 2000


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp6_e3m2", "fp4_e2m1"])
def test_ulp_exponent_is_the_gap_to_the_next_value_for_every_value(name):
    from lowp.codec import all_values
    from lowp.formats import get_format
    from lowp.pow2 import ulp_exponent

    fmt = get_format(name)
    v = all_values(fmt)
    v = v[v >= 0]
    gaps = v[1:] - v[:-1]
    assert torch.equal(torch.exp2(ulp_exponent(v[:-1], fmt).double()), gaps)
    assert int(ulp_exponent(torch.tensor([0.0, -0.0]), fmt).unique()) == fmt.emin - fmt.mantissa_bits
    assert torch.equal(ulp_exponent(-v, fmt), ulp_exponent(v, fmt))


def test_expected_ulp_sq_of_a_point_mass_at_zero_is_the_subnormal_ulp():
    from lowp.distributed.model import expected_ulp_sq
    from lowp.formats import get_format
    from lowp.ulp import ulp

    for name in ("bf16", "fp16"):
        fmt = get_format(name)
        smallest = 2.0 ** (2 * (fmt.emin - fmt.mantissa_bits))
        assert expected_ulp_sq(0.0, fmt, 0.0) == float(ulp(torch.tensor(0.0), fmt)) ** 2 == smallest
        assert expected_ulp_sq(0.0, fmt, 3.0) == float(ulp(torch.tensor(3.0), fmt)) ** 2
