"""Error-free transforms and compensated sums against math.fsum, exact rationals and seed 000's bounds."""
from __future__ import annotations

import doctest
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import lowp.summation as summation
from lowp.arith import Arith
from lowp.codec import all_values
from lowp.formats import custom_format, get_format
from lowp.summation import (METHODS, fast_two_sum, kahan_sum, neumaier_sum, pairwise_sum, sequential_sum, split,
                            two_prod, two_sum)


def _fsum(x: torch.Tensor) -> float:
    return math.fsum(x.double().flatten().tolist())


def _gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def ill_conditioned(n: int, cond_target: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """n terms whose exact sum is about ``sum|x| / cond_target``: n/2 random terms with exponents
    over 2**0..2**20, then their negatives plus small noise, shuffled. The true condition number is
    measured exactly from the data (math.fsum), not assumed."""
    gen = torch.Generator().manual_seed(seed)
    half = n // 2
    a = (torch.rand(half, generator=gen, dtype=torch.float64) * 2 - 1) * torch.exp2(
        torch.randint(0, 21, (half,), generator=gen).double())
    noise = (torch.rand(half, generator=gen, dtype=torch.float64) - 0.3) * a.abs().sum() / cond_target / half * 2
    x = torch.cat([a, -a + noise]).to(dtype)
    return x[torch.randperm(n, generator=gen)]


def _condition(x: torch.Tensor) -> float:
    return _fsum(x.abs()) / abs(_fsum(x))


# ---- the seed 000 doc example ---------------------------------------------------------------
def test_module_doctest_six_digit_decimal_example():
    result = doctest.testmod(summation, verbose=False)
    assert result.attempted >= 6 and result.failed == 0


# ---- error-free transforms ---------------------------------------------------------------------
def _random_fp32(n: int, seed: int, spread: int = 30) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-spread, spread, (n,), generator=gen).float()))


def test_two_sum_is_exact_native_fp32():
    a, b = _random_fp32(3000, 1), _random_fp32(3000, 2)
    s, e = two_sum(a, b)
    assert s.equal(a + b)
    for ai, bi, si, ei in zip(a.tolist(), b.tolist(), s.tolist(), e.tolist()):
        assert Fraction(si) + Fraction(ei) == Fraction(ai) + Fraction(bi)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn"])
def test_two_sum_and_fast_two_sum_exact_in_emulated_formats(name):
    fmt = get_format(name)
    vals = all_values(fmt)
    gen = torch.Generator().manual_seed(3)
    # keep a + b inside the range, and exact in float64 (the reference): bf16 spans 2**-133..2**127
    keep = (vals.abs() <= fmt.max / 2) & ((vals == 0) | (vals.abs() >= 2.0**-20) | (fmt.exponent_bits < 8))
    vals = vals[keep]
    a = vals[torch.randint(len(vals), (50_000,), generator=gen)]
    b = vals[torch.randint(len(vals), (50_000,), generator=gen)]
    s, e = two_sum(a, b, name)
    exact = a + b  # exact in float64 for these formats
    assert s.equal(Arith(name).add(a, b))
    assert (s.double() + e.double()).equal(exact)
    assert Arith(name).round(e).equal(e)  # e is a value of the format
    big, small = torch.where(a.abs() >= b.abs(), a, b), torch.where(a.abs() >= b.abs(), b, a)
    s2, e2 = fast_two_sum(big, small, name)
    assert s2.equal(s) and (s2.double() + e2.double()).equal(exact)


def test_fast_two_sum_checks_its_precondition():
    with pytest.raises(ValueError, match="two_sum"):
        fast_two_sum(torch.tensor([1.0]), torch.tensor([2.0]))


def test_split_halves_are_exact_and_short():
    a = _random_fp32(5000, 4, spread=20)
    hi, lo = split(a)
    assert (hi.double() + lo.double()).equal(a.double())
    assert torch.equal(Arith(custom_format(8, 11)).round(hi.double()).float(), hi)  # 12 bits
    assert bool((lo.abs() <= a.abs() * 2.0**-12).all())


def test_two_prod_is_exact_native_fp32_and_fp64():
    a, b = _random_fp32(5000, 5, spread=20), _random_fp32(5000, 6, spread=20)
    p, e = two_prod(a, b)
    assert p.equal(a * b)
    assert (p.double() + e.double()).equal(a.double() * b.double())  # 48-bit product: exact in fp64
    a64, b64 = a.double() * (1 + 2.0**-40), b.double() / 3
    p64, e64 = two_prod(a64, b64)
    for x, y, pi, ei in list(zip(a64.tolist(), b64.tolist(), p64.tolist(), e64.tolist()))[:500]:
        assert Fraction(pi) + Fraction(ei) == Fraction(x) * Fraction(y)


def test_two_prod_exact_in_emulated_fp16():
    vals = all_values("fp16")
    vals = vals[(vals.abs() >= 1) & (vals.abs() < 128)]  # no overflow in the split, no underflow of e
    gen = torch.Generator().manual_seed(7)
    a = vals[torch.randint(len(vals), (50_000,), generator=gen)]
    b = vals[torch.randint(len(vals), (50_000,), generator=gen)]
    p, e = two_prod(a, b, "fp16")
    assert (p.double() + e.double()).equal(a * b)
    assert p.equal(Arith("fp16").mul(a.float(), b.float()))


# ---- sums: the stagnation example and Kahan in fp16 ----------------------------------------
def test_sequential_fp16_sum_of_uniforms_stagnates_at_2048():
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    exact = _fsum(Arith("fp16").cast(x))
    assert 4900 < exact < 5100
    assert sequential_sum(x, format="fp16").item() == 2048.0
    assert sequential_sum(x.half()).item() == 2048.0  # native fp16 arithmetic agrees


def test_kahan_fp16_within_two_units_of_roundoff():
    u = get_format("fp16").unit_roundoff
    for seed in range(3):
        x = Arith("fp16").cast(torch.rand(10_000, generator=torch.Generator().manual_seed(seed)))
        exact = _fsum(x)
        got = kahan_sum(x, format="fp16").item()
        assert abs(got - exact) / exact <= 2 * u
        assert abs(pairwise_sum(x, format="fp16").item() - exact) / exact <= _gamma(14, u)
        assert abs(summation.fp32_accumulated_sum(x, format="fp16").item() - exact) / exact <= u * 1.01


def test_neumaier_handles_terms_larger_than_the_sum():
    x = torch.tensor([1.0, 1e100, 1.0, -1e100], dtype=torch.float64)
    assert kahan_sum(x).item() == 0.0
    assert neumaier_sum(x).item() == 2.0
    assert pairwise_sum(x).item() == 0.0


def test_neumaier_fails_when_its_compensation_stagnates_in_fp16():
    """Neumaier accumulates the lost low parts separately; in fp16 that compensation itself reaches
    2048 and stagnates (n*u = 4.9 > 1: the O(n u^2) term is no longer small). Kahan feeds the error
    back into every term and does not suffer from this."""
    x = Arith("fp16").cast(torch.rand(10_000, generator=torch.Generator().manual_seed(0)))
    exact = _fsum(x)
    assert abs(neumaier_sum(x, format="fp16").item() - exact) > 500
    assert abs(kahan_sum(x, format="fp16").item() - exact) < 5


# ---- seed 000's bounds, checked on sums with measured condition numbers --------------------
@pytest.mark.parametrize("cond_target", [1e2, 1e4, 1e6])
def test_error_bounds_on_ill_conditioned_fp32_sums(cond_target):
    """Relative errors against math.fsum stay below: naive gamma_{n-1} * cond, pairwise
    gamma_{ceil(log2 n)} * cond, Kahan and Neumaier (2u + 4 n u^2) * cond (the O(n u^2) term of
    seed 000 / Higham (4.8) taken with constant 4). Kahan's bound does not grow with n."""
    n, u = 4000, get_format("fp32").unit_roundoff
    for seed in range(3):
        x = ill_conditioned(n, cond_target, seed)
        exact, cond = _fsum(x), _condition(x)
        assert cond_target / 10 < cond < cond_target * 10

        def rel(y: torch.Tensor) -> float:
            return abs(y.item() - exact) / abs(exact)

        assert rel(sequential_sum(x)) <= _gamma(n - 1, u) * cond
        assert rel(pairwise_sum(x)) <= _gamma(math.ceil(math.log2(n)), u) * cond
        kahan_bound = (2 * u + 4 * n * u * u) * cond
        assert rel(kahan_sum(x)) <= kahan_bound
        assert rel(neumaier_sum(x)) <= kahan_bound


def test_kahan_error_does_not_grow_with_n_while_naive_does():
    """fp32 sums of U(0,1) (cond = 1): Kahan stays within 2u for every n, naive drifts well past it."""
    u = get_format("fp32").unit_roundoff
    worst = {}
    for n in (2**10, 2**14):
        x = torch.rand(4, n, generator=torch.Generator().manual_seed(n))
        exact = torch.tensor([_fsum(row) for row in x], dtype=torch.float64)

        def rel(y: torch.Tensor) -> float:
            return ((y.double() - exact).abs() / exact).max().item()

        worst[n] = rel(sequential_sum(x))
        assert rel(kahan_sum(x)) <= 2 * u
        assert rel(neumaier_sum(x)) <= 2 * u
        assert rel(pairwise_sum(x)) <= _gamma(math.ceil(math.log2(n)), u)
    assert worst[2**14] > 10 * u


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_emulated_low_precision_bounds(name):
    """The same bounds in emulated fp16/bf16 arithmetic, n small enough that n*u < 1."""
    fmt = get_format(name)
    u = fmt.unit_roundoff
    n = 60 if name == "bf16" else 400
    ar = Arith(name)
    for seed in range(4):
        x = ar.cast(torch.randn(n, generator=torch.Generator().manual_seed(seed)) + 0.1)
        exact, cond = _fsum(x), _condition(x)

        def rel(y: torch.Tensor) -> float:
            return abs(y.item() - exact) / abs(exact)

        assert rel(sequential_sum(x, format=name)) <= _gamma(n - 1, u) * cond
        assert rel(pairwise_sum(x, format=name)) <= _gamma(math.ceil(math.log2(n)), u) * cond
        assert rel(kahan_sum(x, format=name)) <= (2 * u + 4 * n * u * u) * cond


# ---- shapes, dims, methods, modes, errors -------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_vectorised_over_other_dims(method):
    x = torch.randn(3, 37, 4, generator=torch.Generator().manual_seed(9))
    got = summation.sum(x, dim=1, method=method, format="bf16")
    assert got.shape == (3, 4) and got.dtype == torch.float32
    for i in range(3):
        for j in range(4):
            assert got[i, j].equal(summation.sum(x[i, :, j], method=method, format="bf16"))
    assert summation.sum(x, dim=-1, method=method).shape == (3, 37)
    assert summation.sum(torch.empty(2, 0), method=method).tolist() == [0.0, 0.0]
    assert summation.sum(torch.tensor(2.5), method=method).item() == 2.5


def test_native_fp32_pairwise_and_sequential_match_plain_loops():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(10))
    acc = torch.tensor(0.0)
    for v in x:
        acc = acc + v
    assert sequential_sum(x).equal(acc)
    assert sequential_sum(x.double()).dtype == torch.float64
    assert sequential_sum(x.half()).dtype == torch.float16


def test_stochastic_rounding_sum_is_unbiased_where_nearest_stagnates():
    """Stochastic rounding in fp16: the sum of 10,000 U(0,1) no longer stagnates; the mean over 20
    seeds lies within 5 standard errors of the exact sum."""
    x = Arith("fp16").cast(torch.rand(10_000, generator=torch.Generator().manual_seed(0)))
    exact = _fsum(x)
    runs = summation.sum(x.expand(20, -1), method="sequential", format="fp16", mode="stochastic",
                         generator=torch.Generator().manual_seed(1))  # 20 independent sums at once
    assert abs(runs.double().mean().item() - exact) <= 5 * runs.double().std().item() / math.sqrt(20) + 4
    assert runs.min().item() > 4000


def test_bad_inputs():
    with pytest.raises(ValueError, match="method"):
        summation.sum(torch.ones(3), method="magic")
    with pytest.raises(TypeError, match="floating-point"):
        summation.sum(torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating-point"):
        two_sum(torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        kahan_sum([1.0, 2.0])
    with pytest.raises(ValueError, match="dim"):
        kahan_sum(torch.ones(3), dim=1)
    with pytest.raises(ValueError, match="unknown format"):
        kahan_sum(torch.ones(3), format="fp9")
    with pytest.raises(ValueError, match="mode"):
        kahan_sum(torch.ones(3), format="fp16", mode="sideways")


def test_inf_and_nan_propagate():
    x = torch.tensor([1.0, float("inf"), 2.0])
    assert sequential_sum(x, format="fp16").item() == float("inf")
    assert math.isnan(kahan_sum(x, format="fp16").item())  # inf - inf in the compensation: IEEE NaN
    assert math.isnan(pairwise_sum(torch.tensor([1.0, float("nan")])).item())
    assert sequential_sum(torch.tensor([60000.0, 60000.0]), format="fp16").item() == float("inf")


def test_docs_summation_doctest():
    path = Path(__file__).resolve().parents[1] / "docs" / "summation.md"
    result = doctest.testfile(str(path), module_relative=False, verbose=False)
    assert result.attempted >= 7 and result.failed == 0


def test_arith_sum_sequential_sum_and_native_sum_are_one_recursive_sum():
    from lowp.arith import Arith, recursive_sum
    from lowp.norms.compute import Native
    from lowp.rounding import quantize

    gen = torch.Generator().manual_seed(5)
    x = quantize(torch.rand(3, 700, 2, generator=gen), "fp16")
    want = torch.zeros(3, 2)
    for i in range(700):                               # the definition, one rounding per addition
        want = quantize(want + x[:, i], "fp16")
    assert torch.equal(Arith("fp16").sum(x, dim=1), want)
    assert torch.equal(sequential_sum(x, dim=1, format="fp16"), want)
    assert torch.equal(Native(torch.float16).sum(x.half(), dim=1).float(), want)
    ones = torch.ones(5000, dtype=torch.float16)
    assert recursive_sum(torch.add, ones) == 2048        # fp16 stagnates: 2048 + 1 rounds to 2048
