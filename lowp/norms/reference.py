"""Exact truth for ``sqrt(sum x**2 + eps)``: a float64 value and the correctly rounded result.

Why float64 is enough, and where it is not: inputs have at most 11 significand bits, so every
``x_i**2`` is exact in float64 (22 bits, exponent within range even for bf16's 2**-133), and
``math.fsum`` returns the correctly rounded float64 sum ``S64`` (relative error <= 2**-53). The
square root (numpy's, correctly rounded) then has relative error below ``2**-52``. That is far
below an ulp of any format here, so ulp errors measured against it are exact to ~1e-12 ulp. For
the *correctly rounded* result it is enough unless the true root lies within ``2**-52`` of a
rounding midpoint; such rows (flagged with a wide margin, ``2**-45``) are decided exactly by
comparing the rational sum ``sum x_i**2 + eps`` (``fractions.Fraction``) with the midpoint squared.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize
from lowp.ulp import ulp

__all__ = ["exact_norm"]

_NEAR = 2.0**-45


def exact_norm(rows: torch.Tensor, eps: float, out_format: "str | torch.dtype | FloatFormat"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row (last dimension) of exactly representable values: ``(value, rounded)`` where
    ``value`` is ``sqrt(sum x**2 + eps)`` in float64 (NaN when negative) and ``rounded`` its
    correct rounding (nearest-even) to ``out_format``, both float64 tensors of the row shape."""
    fmt = get_format(out_format)
    flat = rows.reshape(math.prod(rows.shape[:-1]), rows.shape[-1]).to(torch.float64)
    squares = (flat * flat).numpy()
    sums = np.array([math.fsum(list(r) + [eps]) for r in squares])
    with np.errstate(invalid="ignore"):
        value = torch.from_numpy(np.sqrt(sums))
    rounded = quantize(value, fmt)
    lower = quantize(value, fmt, "toward_zero")
    mid = lower + ulp(lower, fmt) / 2
    near = torch.isfinite(value) & ((value - mid).abs() <= _NEAR * mid) & (mid <= fmt.max * 2)
    for i in torch.nonzero(near).flatten().tolist():
        exact = sum(Fraction(v) ** 2 for v in flat[i].tolist()) + Fraction(eps)
        m = Fraction(float(mid[i]))
        if exact == m * m:
            rounded[i] = quantize(mid[i:i + 1], fmt)[0]
        else:
            rounded[i] = quantize(mid[i:i + 1], fmt, "up" if exact > m * m else "down")[0]
    return value.reshape(rows.shape[:-1]), rounded.reshape(rows.shape[:-1])
