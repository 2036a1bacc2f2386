"""Test vectors for norms: families of rows that stress range, cancellation and length.

Each :class:`Case` holds float64 rows whose values are exactly representable in the input
format, and the eps to use. Shared by the tests and ``lowp norm-check``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowp.codec import all_values
from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize

__all__ = ["Case", "case_families", "log_uniform"]


@dataclass(frozen=True)
class Case:
    """Input rows of one case family, with the ``eps`` they are normalised with.

    Args:
        family: the family's name (``"pairs"``, ``"huge"`` ..., see :func:`case_families`).
        rows: float64 tensor ``(rows, n)`` whose values are all values of the input format.
        eps: the bias added to the sum of squares (default 0.0).
    """

    family: str
    rows: torch.Tensor  # float64, (rows, n), values of the input format
    eps: float = 0.0


def log_uniform(shape: tuple[int, ...], lo: float, hi: float, fmt: FloatFormat, gen: torch.Generator,
                signed: bool = True) -> torch.Tensor:
    """Values of ``fmt`` with log2-uniform magnitudes in [lo, hi] and random signs (float64)."""
    e = torch.rand(shape, generator=gen, dtype=torch.float64) * (math.log2(hi) - math.log2(lo)) + math.log2(lo)
    v = quantize(torch.exp2(e), fmt).clamp(max=fmt.max)
    if signed:
        v = torch.where(torch.rand(shape, generator=gen) < 0.5, -v, v)
    return v


def case_families(format: "str | FloatFormat", *, rows: int = 2000, n_long: int = 4096, seed: int = 0,
                  exhaustive: bool = True) -> list[Case]:
    """The case families for input format ``format``, one :class:`Case` each.

    ``n=1 all`` (only with ``exhaustive``): every finite value (n = 1 so the answer is ``|x|``);
    ``pairs``: random pairs over the whole range (log-uniform magnitudes);
    ``same-scale``: n = 16, every row drawn near one random power of two anywhere in the range
    (so the sum sits anywhere, including where squares overflow or underflow);
    ``huge``: n = 2..8 magnitudes in [sqrt(max)/2, max], including [255, 255] (the two-segment method
    overflows on it in fp16);
    ``tiny``: n = 16 magnitudes between the smallest subnormal and sqrt(smallest normal);
    ``mixed``: n = 64, one huge value and log-uniform others over the whole range;
    ``long``: n = ``n_long``: ones, uniform [0, 1), and one large value among small ones;
    ``eps+``/``eps-``: same-scale rows near 1 with eps = 2**-10 and eps = -0.75.
    """
    fmt = get_format(format)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = fmt.min_subnormal, fmt.max
    cases: list[Case] = []
    if exhaustive:
        cases.append(Case("n=1 all", all_values(fmt).unsqueeze(-1)))
    cases.append(Case("pairs", log_uniform((rows, 2), lo, hi, fmt, gen)))
    scale_exp = torch.randint(fmt.emin - fmt.mantissa_bits, fmt.emax, (rows, 1), generator=gen).to(torch.float64)
    near = torch.rand((rows, 16), generator=gen, dtype=torch.float64) * 1.5 + 0.5
    cases.append(Case("same-scale", quantize(torch.ldexp(near, scale_exp), fmt).clamp(max=fmt.max)))
    root_max = math.sqrt(fmt.max)
    big = log_uniform((rows // 4, 8), root_max / 2, hi, fmt, gen)
    big[0, :2] = quantize(torch.tensor([root_max - 1.0] * 2, dtype=torch.float64), fmt)
    big[0, 2:] = 0
    cases.append(Case("huge", big))
    cases.append(Case("tiny", log_uniform((rows // 4, 16), lo, math.sqrt(fmt.min_normal), fmt, gen)))
    mixed = log_uniform((rows // 4, 64), lo, hi, fmt, gen)
    mixed[:, 0] = log_uniform((rows // 4,), hi / 64, hi / 8, fmt, gen)
    cases.append(Case("mixed", mixed))
    ones = torch.ones(1, n_long, dtype=torch.float64)
    uniform = quantize(torch.rand((4, n_long), generator=gen, dtype=torch.float64), fmt)
    spike = log_uniform((4, n_long), lo, 2.0 ** (fmt.emin / 2), fmt, gen)
    spike[:, n_long // 2] = 1.0
    cases.append(Case("long", torch.cat([ones, uniform, spike])))
    unit = quantize(torch.rand((rows // 4, 16), generator=gen, dtype=torch.float64) * 0.5, fmt)
    cases.append(Case("eps+", unit, eps=2.0**-10))
    cases.append(Case("eps-", unit, eps=-0.75))
    return cases
