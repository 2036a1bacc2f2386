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
