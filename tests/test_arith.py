"""Arith: every operation correctly rounded to the format, against torch's native half/bfloat16
arithmetic, exact float64 results with the reference rounding, exact rationals and exact squares."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import math

import torch

from lowp.arith import Arith
from lowp.codec import all_values
from lowp.formats import get_format
from lowp.rounding import quantize
from rounding_reference import bits_equal, reference_round


def _pairs(values: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    i = torch.randint(len(values), (n,), generator=gen)
    j = torch.randint(len(values), (n,), generator=gen)
    return values[i], values[j]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_matches_torch_native_low_precision_arithmetic(name, op):
    """torch's CPU half/bfloat16 ops compute in fp32 and round once, which is correctly rounded for
    +-*/ (24 >= 2*11+2 bits, Figueroa 1995). Checked on 200k random pairs of all finite values, plus
    every value against a few fixed operands."""
    fmt = get_format(name)
    vals = all_values(fmt).float()
    a, b = _pairs(vals, 200_000, seed=1)
    fixed = torch.tensor([1.0, -3.0, 0.1, 1e-3, 300.0]).to(fmt.torch_dtype).float()
    a = torch.cat([a, vals.repeat(len(fixed))])
    b = torch.cat([b, fixed.repeat_interleave(len(vals))])
    arith = Arith(name)
    got = getattr(arith, op)(a, b)
    native = getattr(torch, op)(a.to(fmt.torch_dtype), b.to(fmt.torch_dtype)).float()
    assert bool(bits_equal(got, native).all())


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e5m2", "fp6_e3m2", "dlfloat16"])
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_exact_results_rounded_once(name, op):
    """For these formats a+b, a-b and a*b are exact in float64; round them with the reference."""
    fmt = get_format(name)
    vals = all_values(fmt)
    if len(vals) <= 256:
        a, b = vals.repeat_interleave(len(vals)), vals.repeat(len(vals))  # every pair
    else:
        a, b = _pairs(vals, 200_000, seed=2)
    exact = getattr(torch, op)(a, b)
    want = reference_round(exact, fmt, "nearest_even")
    got = getattr(Arith(fmt), op)(a.float(), b.float())
    assert bool(bits_equal(got, want).all())


def _round_rational(q: Fraction, sorted_vals: list[Fraction], fmt) -> float:
    """Round a positive rational to nearest-even by bisection over the exact values."""
    import bisect
    i = bisect.bisect_right(sorted_vals, q) - 1
    lo = sorted_vals[i]
    if lo == q or i + 1 == len(sorted_vals):
        return float(lo) if lo == q else float("nan")
    hi = sorted_vals[i + 1]
    if q - lo != hi - q:
        return float(lo if q - lo < hi - q else hi)
    return float(reference_round(torch.tensor([float(q)], dtype=torch.float64), fmt, "nearest_even").item())


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp16"])
def test_division_against_exact_rationals(name):
    fmt = get_format(name)
    vals = all_values(fmt)
    positive = vals[vals > 0]
    a, b = _pairs(positive, 3000, seed=3)
    exact_vals = [Fraction(float(v)) for v in positive]
    want = []
    for x, y in zip(a.tolist(), b.tolist()):
        q = Fraction(x) / Fraction(y)
        if q > Fraction(fmt.max):
            want.append(float(quantize(torch.tensor([float(q)], dtype=torch.float64), fmt)))
        elif q < Fraction(fmt.min_subnormal) / 2:
            want.append(0.0)
        else:
            want.append(_round_rational(q, [Fraction(0)] + exact_vals, fmt))
    got = Arith(fmt).div(a.float(), b.float()).double()
    assert bool(bits_equal(got, torch.tensor(want, dtype=torch.float64)).all())


def _correct_sqrt(v: torch.Tensor, fmt) -> torch.Tensor:
    """Nearest value to sqrt(v), decided with exact squares: for values of <= 26 significant bits,
    r*r is exact in float64. Ties cannot happen (a midpoint's square has too many bits)."""
    grid = all_values(fmt)
    grid = grid[grid >= 0]
    i = torch.searchsorted(grid * grid, v, right=True) - 1  # grid[i]^2 <= v < grid[i+1]^2
    lo = grid[i]
    hi = grid[(i + 1).clamp(max=len(grid) - 1)]
    mid = (lo + hi) / 2
    return torch.where(v < mid * mid, lo, hi)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn"])
def test_sqrt_is_correctly_rounded_for_every_value(name):
    fmt = get_format(name)
    vals = all_values(fmt)
    v = vals[vals >= 0]
    got = Arith(fmt).sqrt(v.float()).double()
    assert got.equal(_correct_sqrt(v, fmt))


def test_sqrt_fp32_correctly_rounded_where_torch_float32_sqrt_is_not():
    """Arith('fp32') (float64 container) is correctly rounded; torch's own float32 CPU sqrt is not
    (it differs from the exact nearest on many inputs with torch 2.13 + MKL)."""
    gen = torch.Generator().manual_seed(4)
    v = (torch.rand(200_000, generator=gen) * 100).double()
    got = Arith("fp32").sqrt(v)
    r = got
    up = torch.nextafter(r.float(), torch.tensor(float("inf"))).double()
    down = torch.nextafter(r.float(), torch.tensor(0.0)).double()
    # got is nearest: v lies between the squares of the midpoints on either side (exact in float64)
    assert bool(((v >= ((r + down) / 2) ** 2) & (v <= ((r + up) / 2) ** 2)).all())
    numpy_sqrt = torch.from_numpy(np.sqrt(v.float().numpy())).double()
    assert got.equal(numpy_sqrt)
    torch_sqrt = torch.sqrt(v.float()).double()
    print("torch float32 sqrt differs from the correctly rounded one on", int((torch_sqrt != got).sum()), "of", len(v))


def test_cast_from_float64_rounds_once_and_overflow():
    a = Arith("fp16")
    x = torch.tensor([65488.00000000001], dtype=torch.float64)  # just above a midpoint
    assert a.cast(x).item() == 65504.0  # via float32 it would tie to 65472
    assert a.cast(2.0).dtype == torch.float32
    assert a.cast(torch.tensor([1, 2])).tolist() == [1.0, 2.0]
    big = a.cast(torch.tensor([60000.0]))
    assert torch.isinf(a.mul(big, big)).all()
    assert a.square(big).isinf().all() and a.neg(big).item() == -60000.0


def test_scale2_and_modes():
    a = Arith("fp16")
    x = a.cast(torch.tensor([1.5, 3.0, 1.0]))
    assert a.scale2(x, torch.tensor([-24, 16, 200])).tolist() == [2.0**-24 * 2, float("inf"), float("inf")]
    assert a.scale2(x, -3).tolist() == [1.5 / 8, 3.0 / 8, 1.0 / 8]
    one, three = torch.tensor([1.0]), torch.tensor([3.0])
    third_up, third_down = Arith("fp16", "up").div(one, three).item(), Arith("fp16", "down").div(one, three).item()
    assert third_down < 1 / 3 < third_up and third_up - third_down == 2.0**-12
    sr = Arith("bf16", "stochastic", generator=torch.Generator().manual_seed(0))
    draws = sr.add(torch.full((20000,), 256.0), torch.full((20000,), 0.5))
    assert set(draws.unique().tolist()) == {256.0, 258.0}
    assert abs(draws.double().mean().item() - 256.5) < 5 * 2 * 0.433 / 20000**0.5


def test_sequential_sum_stagnates_like_fp16():
    a = Arith("fp16")
    assert a.sum(torch.ones(3000)).item() == 2048.0
    x = torch.ones(2, 3000)
    assert a.sum(x, dim=1).tolist() == [2048.0, 2048.0]


def test_containers_and_errors():
    assert Arith("fp16").dtype == torch.float32
    assert Arith("fp8_e4m3fn").dtype == torch.float32
    assert Arith("tf32").dtype == torch.float32     # 2p+2 = 24 bits: exactly fp32
    assert Arith("fp32").dtype == torch.float64
    assert Arith("e5m11").dtype == torch.float64    # 2p+2 = 26 > 24
    assert "fp16" in repr(Arith("fp16"))
    with pytest.raises(ValueError, match="too wide"):
        Arith("fp64")
    with pytest.raises(ValueError, match="unknown format"):
        Arith("fp12")


def test_sqrt_rn_is_correctly_rounded():
    """Every result lies within half an ulp of the true root: ``(r -+ ulp/2)**2`` bracket ``x``
    (50-bit squares, exact in fp64); torch's own CPU sqrt misses this for some inputs."""
    from lowp.arith import sqrt_rn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen).square() * 10.0 ** torch.empty(200_000).uniform_(-30, 30, generator=gen)
    r = sqrt_rn(x)
    assert r.dtype == torch.float32
    half = (torch.nextafter(r, torch.full_like(r, math.inf)) - r).double() / 2
    lo, hi = (r.double() - half) ** 2, (r.double() + half) ** 2
    assert ((lo <= x.double()) & (x.double() <= hi)).all()
