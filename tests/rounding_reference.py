"""A deliberately simple reference for rounding, used by the tests to judge lowp.rounding.

It shares no method with :func:`lowp.rounding.quantize`: it lists every value of the format
(``all_values``), finds the two neighbours of ``x`` with ``searchsorted`` and picks one by the
definition of each mode. Distances ``x - lo`` and ``hi - x`` are exact in float64 (Sterbenz), so
every comparison is exact. Parity ("even") is the last bit of the code, as in IEEE 754.

Beyond the largest value the grid continues with one more point, ``max + ulp(max)`` (the value the
format would have with an unbounded exponent); picking it means overflow, settled by the policy.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from lowp.codec import all_values, encode
from lowp.formats import FloatFormat

_F64 = torch.float64


@lru_cache(maxsize=64)
def grid(fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted values with the two beyond-range points, and the parity (last code bit) of each."""
    vals = all_values(fmt)
    parity = encode(vals.abs(), fmt) & 1
    beyond = fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits)
    beyond_parity = 1 - (encode(torch.tensor([fmt.max], dtype=_F64), fmt) & 1)
    values = torch.cat([torch.tensor([-beyond], dtype=_F64), vals, torch.tensor([beyond], dtype=_F64)])
    parities = torch.cat([beyond_parity, parity, beyond_parity])
    return values, parities


def neighbours(x: torch.Tensor, fmt: FloatFormat):
    """lo <= x <= hi on the extended grid (x clamped to it), with parities."""
    values, parities = grid(fmt)
    xc = x.to(_F64).clamp(values[0], values[-1])
    i = torch.searchsorted(values, xc, right=True) - 1
    i = i.clamp(0, len(values) - 2)
    exact = values[i] == xc
    j = torch.where(exact, i, i + 1)
    return xc, values[i], values[j], parities[i], parities[j]


def reference_round(x: torch.Tensor, fmt: FloatFormat, mode: str) -> torch.Tensor:
    """The correctly rounded value of ``x`` (float64 result) for a deterministic ``mode``."""
    x64 = x.to(_F64)
    xc, lo, hi, plo, phi = neighbours(x64, fmt)
    d_lo, d_hi = xc - lo, hi - xc
    lo_small = lo.abs() <= hi.abs()
    small = torch.where(lo_small, lo, hi)
    large = torch.where(lo_small, hi, lo)
    if mode in ("nearest_even", "nearest_away"):
        tie_even = torch.where(plo == phi, small, torch.where(plo == 0, lo, hi))
        tie = large if mode == "nearest_away" else tie_even
        out = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, tie))
    elif mode == "toward_zero":
        out = small
    elif mode == "up":
        out = hi
    elif mode == "down":
        out = lo
    elif mode == "odd":
        odd_one = torch.where(plo == 1, lo, torch.where(phi == 1, hi, large))
        out = torch.where(lo == hi, lo, odd_one)
    else:
        raise ValueError(mode)
    return apply_policy(out, x64, fmt, mode)


def overflow_value(x: torch.Tensor, fmt: FloatFormat, mode: str) -> torch.Tensor:
    """What a value beyond the range becomes: the policy value, or ±max where the mode rounds
    toward zero (toward_zero, odd; up for negatives, down for positives)."""
    policy = {"inf": float("inf"), "nan": float("nan"), "saturate": fmt.max}[fmt.overflow]
    negative = x < 0
    always = torch.ones_like(negative)
    rounds_toward_zero = {"toward_zero": always, "odd": always, "up": negative, "down": ~negative}
    to_max = rounds_toward_zero.get(mode, ~always)
    mag = torch.where(to_max, torch.full_like(x, fmt.max), torch.full_like(x, policy))
    return torch.where(negative, -mag, mag)


def apply_policy(out: torch.Tensor, x: torch.Tensor, fmt: FloatFormat, mode: str) -> torch.Tensor:
    """Overflow, the sign of zero, infinities and NaN inputs."""
    out = torch.where(out.abs() > fmt.max, overflow_value(x, fmt, mode), out)
    if fmt.has_negative_zero:
        signed_zero = torch.where(torch.signbit(x), torch.full_like(out, -0.0), torch.zeros_like(out))
        out = torch.where(out == 0, signed_zero, out)
    else:
        out = torch.where(out == 0, torch.zeros_like(out), out)
    if fmt.has_inf:
        out = torch.where(torch.isinf(x), x, out)
    else:
        inf_to = {"nan": float("nan"), "saturate": fmt.max}[fmt.overflow]
        out = torch.where(torch.isinf(x), torch.sign(x) * inf_to, out)
    return torch.where(torch.isnan(x), x, out)


def stochastic_up_probability(x: torch.Tensor, fmt: FloatFormat, rand_bits: int | None = None) -> torch.Tensor:
    """Probability that stochastic rounding picks the neighbour of larger magnitude:
    ``frac = (|x| - |small|) / (|large| - |small|)``, or ``floor(frac * 2**k) / 2**k`` with k bits."""
    xc, lo, hi, _, _ = neighbours(x, fmt)
    gap = (hi - lo).abs()
    frac = torch.where(gap == 0, torch.zeros_like(gap), (xc.abs() - torch.minimum(lo.abs(), hi.abs())) / gap)
    if rand_bits is not None:
        frac = torch.floor(frac * 2.0**rand_bits) / 2.0**rand_bits
    return frac


def probe_points(fmt: FloatFormat, container: torch.dtype) -> torch.Tensor:
    """Every value, every midpoint, one container ulp either side of each midpoint, points around
    and beyond the largest value, ±inf and NaN, all in ``container``."""
    values, _ = grid(fmt)
    mids = (values[1:] + values[:-1]) / 2
    c_vals = values.to(container)
    c_mids = mids.to(container)
    assert torch.equal(c_mids.to(_F64), mids), "midpoints must be exact in the container"
    inf = torch.tensor(float("inf"), dtype=container)
    below = torch.nextafter(c_mids, -inf)
    above = torch.nextafter(c_mids, inf)
    top = torch.tensor([fmt.max * 2, fmt.max * 1e3, float("inf"), float("nan")], dtype=_F64)
    specials = torch.cat([top, -top]).to(container)
    zeros = torch.tensor([0.0, -0.0], dtype=container)
    return torch.cat([c_vals, c_mids, below, above, specials, zeros])


def codes_as(dtype: torch.dtype, fmt: FloatFormat) -> torch.Tensor:
    """Every code of an 8- or 16-bit format reinterpreted as the torch ``dtype`` (bit view)."""
    n = 2**fmt.bits
    raw = torch.arange(n, dtype=torch.int64)
    signed = torch.where(raw >= n // 2, raw - n, raw)
    int_dtype = {8: torch.int8, 16: torch.int16}[fmt.bits]
    return signed.to(int_dtype).view(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same NaN-ness, and otherwise the same bits (so -0 differs from +0)."""
    a64, b64 = a.to(_F64), b.to(_F64)
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    same = (a64 == b64) & (torch.signbit(a64) == torch.signbit(b64))
    return both_nan | same
