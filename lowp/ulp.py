"""Units in the last place: the spacing of a format at a value, and errors measured in it.

``ulp(x)`` here is the Goldberg/Muller definition on real ``x``: the gap between the two
format values around ``x``, i.e. ``2**(max(floor(log2|x|), emin) - mantissa_bits)``.
A result is *correctly rounded* when its ulp error is at most 0.5 and *faithful* when it is
below 1 (it is one of the two neighbours of the true value).
"""
from __future__ import annotations

import torch

from lowp.formats import FloatFormat, get_format
from lowp.pow2 import ulp_exponent
from lowp.rounding import quantize

__all__ = ["ulp", "ulp_error"]


def ulp(x: torch.Tensor, format: "str | torch.dtype | FloatFormat") -> torch.Tensor:
    """Spacing of ``format`` at the (real, float64) values ``x``; at 0 it is the smallest subnormal gap."""
    fmt = get_format(format)
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.ldexp(torch.ones_like(x), ulp_exponent(x, fmt).to(torch.float64))


def ulp_error(computed: torch.Tensor, exact: torch.Tensor, format: "str | torch.dtype | FloatFormat") -> torch.Tensor:
    """``|computed - exact| / ulp(exact)`` in float64.

    ``exact`` should be the true (float64 or better) value. Infinite or NaN results count as
    ``inf`` error unless ``exact`` is the same special value; an exact value beyond the format's
    range is compared with the format's own rounding of it (inf or max), so a correct overflow
    has error 0.
    """
    fmt = get_format(format)
    c = torch.as_tensor(computed).to(torch.float64)
    t = torch.as_tensor(exact).to(torch.float64)
    err = (c - t).abs() / ulp(t, fmt)
    same_special = (torch.isnan(c) & torch.isnan(t)) | (torch.isinf(c) & torch.isinf(t) & (c == t))
    err = torch.where(same_special, torch.zeros_like(err), err)
    beyond = torch.isfinite(t) & (t.abs() > fmt.max)
    if beyond.any():
        rounded = quantize(t, fmt)
        settled = beyond & ((c == rounded) | (c.abs() > fmt.max) & (c.sign() == t.sign()))
        err = torch.where(settled, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
