"""Powers of two shared by rounding, encoding, ulps, emulated arithmetic and the norms.

:func:`ulp_exponent` gives the exponent of a format's spacing at ``x`` (the one formula behind
:func:`lowp.ulp.ulp`, :func:`lowp.rounding.quantize` below the normal range and
:func:`lowp.codec.encode`).

Multiplying by ``2**k`` is exact in binary floating point as long as the result stays in the
normal range (Muller et al., *Handbook of Floating-Point Arithmetic*, 2nd ed., sec. 2.1), but
``2**k`` itself may not be representable even when the product is: ``2**-1074 * 2**1100``
is a normal fp64 number while ``2**1100`` overflows. :func:`scale_pow2` multiplies by two
factors ``2**floor(k/2)`` and ``2**(k - floor(k/2))``, which are representable for
``|k| <= 2 * emax`` (254 in fp32, 2046 in fp64).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lowp.formats import FloatFormat

__all__ = ["scale_pow2", "ulp_exponent"]


def scale_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2**k`` in ``x``'s dtype (IEEE ``scaleB``).

    Exact when the result is a normal number and ``|k| <= 2 * emax`` of the dtype; a result
    beyond the range overflows to ±inf, one below it may round twice (once per factor).
    ``k`` (integer-valued, any numeric tensor) broadcasts against ``x``; it is handled in fp64
    for fp64 ``x`` and in fp32 otherwise.
    """
    k = k.to(x.dtype if x.dtype == torch.float64 else torch.float32)
    half = torch.floor(k / 2)
    return x * torch.exp2(half).to(x.dtype) * torch.exp2(k - half).to(x.dtype)


def ulp_exponent(x: torch.Tensor, fmt: "FloatFormat") -> torch.Tensor:
    """The exponent ``q`` of ``ulp(x) = 2**q`` in ``fmt`` (Goldberg/Muller definition):
    ``q = max(floor(log2|x|), emin) - mantissa_bits``, clamped at the subnormal spacing, and
    ``emin - mantissa_bits`` at 0. An integer tensor shaped like ``x`` (float32 or float64);
    the value at ±inf and NaN is meaningless."""
    _, e = torch.frexp(x.abs())                    # |x| = f * 2**e, f in [0.5, 1)
    e = torch.where(x == 0, torch.full_like(e, fmt.emin), torch.clamp(e - 1, min=fmt.emin))
    return e - fmt.mantissa_bits
