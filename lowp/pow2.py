"""Exact power-of-two arithmetic shared by rounding, emulated arithmetic and the norms.

Multiplying by ``2**k`` is exact in binary floating point as long as the result stays in the
normal range (Muller et al., *Handbook of Floating-Point Arithmetic*, 2nd ed., sec. 2.1), but
``2**k`` itself may not be representable even when the product is: ``2**-1074 * 2**1100``
is a normal fp64 number while ``2**1100`` overflows. :func:`scale_pow2` multiplies by two
factors ``2**floor(k/2)`` and ``2**(k - floor(k/2))``, which are representable for
``|k| <= 2 * emax`` (254 in fp32, 2046 in fp64).
"""
from __future__ import annotations

import torch

__all__ = ["scale_pow2"]


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
