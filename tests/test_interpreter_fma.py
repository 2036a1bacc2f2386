"""The correctly rounded fp32 fma that the tests give Triton's interpreter where it rounds twice
(tests/interpreter_fma.py), against exact rational arithmetic."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from interpreter_fma import fma32


def _round32(v: Fraction) -> np.float32:
    """The exact rational ``v`` rounded to the nearest float32, ties to even (normal range)."""
    if v == 0:
        return np.float32(0.0)
    sign, a = (-1 if v < 0 else 1), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    unit = Fraction(2) ** (e - 23)  # the spacing of float32 in [2^e, 2^(e+1))
    q, r = divmod(a, unit)
    q += 1 if (r > unit / 2 or (r == unit / 2 and q % 2)) else 0
    return np.float32(sign * float(q * unit))


def _exact(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    return np.array([_round32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
                     for a, b, c in zip(x, y, z)], dtype=np.float32)


def test_midpoints_that_fp64_rounding_would_miss():
    """x * x is an fp32 midpoint and z moves the sum off it by less than an fp64 ulp: a product
    and sum in fp64 lands on the midpoint and rounds to even; the fma rounds to z's side."""
    x = np.float32(1 + 2.0**-12)  # x^2 = 1 + 2^-11 + 2^-24: halfway between two fp32 values
    xs = np.full(4, x, dtype=np.float32)
    z = np.array([2.0**-60, -(2.0**-60), 2.0**-70, -(2.0**-70)], dtype=np.float32)
    naive = (xs.astype(np.float64) * xs + z).astype(np.float32)
    want = _exact(xs, xs, z)
    assert not np.array_equal(naive.view(np.uint32), want.view(np.uint32))  # the case is a hard one
    assert np.array_equal(fma32(xs, xs, z).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("seed", [0, 1])
def test_random_and_cancelling_operands(seed):
    """Random operands, and z = -fl(x * y) + small, where most of the product cancels."""
    rng = np.random.default_rng(seed)
    n = 4000
    x = rng.standard_normal(n).astype(np.float32)
    y = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    z = rng.standard_normal(n).astype(np.float32)
    z[: n // 2] = -(x[: n // 2] * y[: n // 2]) + z[: n // 2] * np.float32(2.0**-30)
    got, want = fma32(x, y, z), _exact(x, y, z)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # two roundings differ from the fma on these operands, so the comparison can fail
    assert not np.array_equal((x * y + z).view(np.uint32), want.view(np.uint32))


def test_infinities_and_nans_pass_through():
    x = np.array([np.inf, np.nan, 3e38, 1.0], dtype=np.float32)
    y = np.array([1.0, 1.0, 10.0, 0.0], dtype=np.float32)
    z = np.array([-1.0, 0.0, 0.0, -0.0], dtype=np.float32)
    got = fma32(x, y, z)
    assert np.isposinf(got[0]) and np.isnan(got[1]) and np.isposinf(got[2]) and got[3] == 0
