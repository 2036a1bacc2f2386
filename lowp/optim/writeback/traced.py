"""Roundings written as elementwise tensor expressions, for the ``torch.compile`` kernel.

:func:`lowp.optim.kernels.compiled.step.fused_step` and the modes' compiled fragments build one loop from
these; run eagerly they are a (slow) readable reference of the same bits as
:mod:`lowp.optim.storage`. Every integer is int32, so Inductor keeps 16-wide bf16 vectors on AVX2.
"""
from __future__ import annotations

import torch

from lowp.optim.storage import stochastic_bf16_patterns

__all__ = ["bf16_of", "stochastic_bf16", "nearest", "HALF", "QUIET", "CLEAR_LOW8"]

HALF = 1 << 15
QUIET = 0x00400000   # the quiet bit of an fp32 NaN
CLEAR_LOW8 = ~0xFF
_BF16_NAN = 0x7FC0    # a bf16 NaN pattern (torch's scalar fp32 -> bf16 cast gives it)


def bf16_of(patterns: torch.Tensor) -> torch.Tensor:
    """The bf16 tensor of int32 ``patterns`` (bf16 bit patterns, sign-extended): the fp32 value
    ``patterns << 16`` cast to bf16, which is exact, except that torch's cast rewrites a NaN
    (0x7FC0, or 0xFFFF in its vectorized CPU code). Not ``.to(torch.int16).view(torch.bfloat16)``:
    Inductor vectorizes a CPU loop only when every dtype in it is one it vectorizes, and int16 is
    not (torch 2.11-2.13), so one int16 made the whole step a scalar loop (25 ns per element)."""
    return (patterns << 16).view(torch.float32).to(torch.bfloat16)


def stochastic_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``SR_bf16(x)`` with 16 random bits ``noise`` per element: the patterns
    :func:`~lowp.optim.storage.stochastic_bf16_patterns` defines, as bf16 (:func:`bf16_of`: a NaN
    is rewritten)."""
    return bf16_of(stochastic_bf16_patterns(x, noise))


def nearest(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.to(dtype), x.to(dtype).float())``: fp32 ``x`` rounded to the nearest ``dtype`` value
    (ties to even), and that value read back as fp32.

    Inductor's CPU code generator before torch 2.13 drops the round trip ``.to(bf16).float()``
    even under ``emulate_precision_casts`` (measured on 2.11: Kahan's ``theta' - theta`` became
    ``v`` and the compensation the rounding error of ``v``), so bf16 rounds in integers on the
    bit pattern: the top half plus one where the low half exceeds half an ulp, or equals it and
    the top half is odd; a NaN stays a NaN (:func:`bf16_of`). No intermediate leaves int32's
    range."""
    if dtype != torch.bfloat16:
        rounded = x.to(dtype)
        return rounded, rounded.float()
    bits = x.view(torch.int32)
    top, low = bits >> 16, bits & 0xFFFF
    up = (low > HALF) | ((low == HALF) & ((top & 1) == 1))
    patterns = torch.where(x.isnan(), _BF16_NAN, top + up.to(torch.int32))
    value = (patterns << 16).view(torch.float32)
    return value.to(torch.bfloat16), value
