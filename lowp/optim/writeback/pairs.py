"""The bf16 weight + integer remainder pairs of the ``exact`` and ``exact8`` modes: an fp32 value
split into its top 16 bits (the weight) and the bits below (the remainder)."""
from __future__ import annotations

import torch

__all__ = ["pair_load", "store_pair", "compiled_pair_load", "triton_pair_load", "HALF", "SHIFT16", "SHIFT8",
           "LOW8_CLEAR", "QUIET"]

# 0-dim int32 constants: a Python int argument costs each op a conversion of the scalar to a tensor
HALF, SHIFT16, SHIFT8, LOW8_CLEAR, QUIET = (torch.tensor(v, dtype=torch.int32)
                                            for v in (1 << 15, 16, 8, ~0xFF, 0x00400000))


def pair_load(p: torch.Tensor, r: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 value of a bf16 weight and its remainder: ``(hi << 16) + r`` for exact mode's
    int16 remainder, ``(hi << 16) + (r8 << 8)`` for exact8's int8 one."""
    assert r is not None, "the exact modes always keep a remainder"
    hi = p.view(torch.int16)
    bits = hi.to(torch.int32) if out is None else out.view(torch.int32).copy_(hi)
    low = r if r.dtype == torch.int16 else r.to(torch.int32).bitwise_left_shift_(SHIFT8)
    return bits.bitwise_left_shift_(SHIFT16).add_(low).view(torch.float32)


def store_pair(p: torch.Tensor, r: torch.Tensor, bits: torch.Tensor) -> None:
    """Write the int32 patterns ``bits`` (for an int8 remainder: low 8 bits zero; overwritten) as
    the pair ``hi = (bits + 2**15) >> 16`` (bf16 ``p``) and ``lo = bits - (hi << 16)`` (``r``,
    shifted right by 8 for an int8 remainder), so ``bits = (hi << 16) + lo`` exactly."""
    hi = torch.add(bits, HALF).bitwise_right_shift_(SHIFT16)
    p.view(torch.int16).copy_(hi)           # int32 -> int16 keeps the low 16 bits
    if r.dtype == torch.int16:
        r.copy_(bits)                       # bits - (hi << 16) is bits' low 16 bits as a signed int16
    else:
        r.copy_(bits.sub_(hi.bitwise_left_shift_(SHIFT16)).bitwise_right_shift_(SHIFT8))   # in [-128, 128)


def compiled_pair_load(p: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """:func:`pair_load` as a tensor expression (widening bf16 is exact)."""
    assert r is not None
    low = r.to(torch.int32) if r.dtype == torch.int16 else r.to(torch.int32) << 8
    return (p.float().view(torch.int32) + low).view(torch.float32)


def triton_pair_load(shift: int) -> str:
    """Triton source of :func:`pair_load` for a remainder shifted left by ``shift`` bits."""
    low = "tl.load(b_ptr, mask=mask).to(tl.int32)" + (f" << {shift}" if shift else "")
    return ("top = tl.load(p_ptr, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)\n"
            f"w = ((top << 16) + ({low})).to(tl.float32, bitcast=True)")
