"""Reading and writing low-precision tensors through fp32 working copies.

Every optimizer computes in fp32. A tensor stored in bf16/fp16 is read into an fp32 working
copy and written back with one rounding, either to nearest (``copy_``) or stochastically with
16 random bits ``r`` per element from :mod:`lowp.optim.randomness` (every backend rounds with the
same bits, so the definitions below are the reference the fused kernels match bit for bit).

Stochastic rounding of an fp32 value ``x`` to bf16 needs no float arithmetic: bf16 is the top
half of fp32's bit pattern, so adding ``r`` in ``[0, 2**16)`` to the bits of ``x`` and clearing
the low 16 bits rounds the magnitude up with probability ``(low 16 bits of x) / 2**16``, which
is exactly ``(|x| - trunc(|x|)) / ulp``. Past the largest bf16 the carry reaches the exponent
field and gives infinity; infinities stay themselves. A NaN keeps its sign and top payload bits
with the quiet bit set (the carry could otherwise turn it into ``-0.0`` or an infinity).

Stochastic rounding to fp16, with ``t`` = ``|x|`` truncated to fp16 (saturating at 65504), ``ulp``
the fp16 spacing above ``t`` (``2**(e - 10)``, at least ``2**-24`` among subnormals) and
``frac = (|x| - t) / ulp`` (exact: ``t`` and ``|x|`` share a binade and ``ulp`` is a power of two)::

    SR_fp16(x) = sign(x) * (t + ulp  if floor(frac * 2**16) + r >= 2**16  else  t)

so ``P(up) = frac`` whenever ``frac`` has at most 16 bits (always, for normal fp16 results: fp32
keeps 13 more bits than fp16). From ``65504 + ulp`` on the result is ``65536``, stored as
infinity; infinities and NaNs stay themselves.
"""
from __future__ import annotations

import torch

from lowp.optim.randomness import RandomStreams

__all__ = ["STATE_ROUNDINGS", "working_copy", "store", "stochastic_round_bf16", "stochastic_bf16_patterns",
           "store_stochastic_bf16",
           "stochastic_round_fp16", "stochastic_round"]

STATE_ROUNDINGS = ("nearest", "stochastic")
_QUIET = torch.tensor(0x00400000, dtype=torch.int32)   # the quiet bit of an fp32 NaN
_SHIFT16 = torch.tensor(16, dtype=torch.int32)          # 0-dim: no scalar conversion per call
_SIGN = -(1 << 31)             # 0x80000000 as a signed int32
_FP16_MAX = 65504.0


def working_copy(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` as fp32 (fp64 stays fp64): the tensor itself when no cast is needed, so in-place math
    on the working copy writes through; else a new tensor, or ``out`` (fp32, ``t``'s shape)."""
    if t.dtype in (torch.float32, torch.float64):
        return t
    return t.float() if out is None else out.copy_(t)


def stochastic_round_bf16(src: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``SR_bf16(src)`` of an fp32 tensor with 16 random bits per element (int32 ``noise`` in
    ``[0, 2**16)``, overwritten); see the module docstring."""
    out = torch.empty(src.shape, dtype=torch.bfloat16, device=src.device)
    store_stochastic_bf16(out, src, noise)
    return out


def stochastic_bf16_patterns(src: torch.Tensor, noise: torch.Tensor, nans: bool = True) -> torch.Tensor:
    """The definition of ``SR_bf16`` that every Python path runs (the reference and the
    ``torch.compile`` kernel): int32 values whose low 16 bits are the bf16 patterns of the
    stochastically rounded fp32 ``src`` (int32 ``noise`` of ``src``'s shape in ``[0, 2**16)``,
    overwritten).

    Integer arithmetic only: ``(bits + r) >> 16`` (sign-extended, so an int32 to int16 conversion
    keeps the pattern exactly). A NaN takes the quiet bit instead of the carry,
    ``(bits | 0x00400000) >> 16``: the carry could turn it into ``-0.0`` or an infinity.
    ``nans=False`` skips that select, for a caller that knows ``src`` holds no NaN."""
    bits = src.contiguous().view(torch.int32)
    out = noise.add_(bits) if noise.shape == bits.shape else noise.view(bits.shape).add_(bits)
    if nans:
        out = torch.where(src.isnan(), bits.bitwise_or(_QUIET), out)
    return out.bitwise_right_shift_(_SHIFT16)


def store_stochastic_bf16(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor) -> None:
    """Write ``SR_bf16(src)`` (:func:`stochastic_bf16_patterns`) into the bf16 tensor ``dst``, the
    int32 to int16 conversion fused into the copy (one contiguous pass; a strided copy of the top
    halves costs about four). On the CPU an fp32 sum looks for NaNs first (a NaN makes it NaN)
    and the NaN select runs only when one is there; elsewhere it always runs (no host sync)."""
    dst.view(torch.int16).copy_(stochastic_bf16_patterns(src, noise, nans=not src.is_cpu or _has_nan(src)))


def _has_nan(src: torch.Tensor) -> bool:
    """True when the fp32 sum of ``src`` is NaN: always with a NaN in ``src``, else only for
    ``inf - inf`` (a false alarm that costs the NaN fix-up's pass, never a wrong bit)."""
    total = float(src.sum())
    return total != total


def stochastic_round_fp16(src: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``SR_fp16(src)`` of an fp32 tensor with 16 random bits per element (int32 ``noise``); see
    the module docstring. Every operation is exact or correctly rounded fp32 arithmetic, as in
    the native kernel's ``stochastic_f16``."""
    x = src.contiguous()
    ax = x.abs()
    # |x| truncated to fp16: the fp16 spacing of |x|'s binade, floor, and saturation at 65504
    binade = (ax.view(torch.int32) & 0x7F800000).view(torch.float32)
    step = torch.clamp_min(binade * 2.0 ** -10, 2.0 ** -24)
    t = torch.where(ax < 65536.0, torch.floor(ax / step) * step, torch.where(ax.isinf(), ax, _FP16_MAX))
    spacing = (t.view(torch.int32) & 0x7F800000).view(torch.float32) * 2.0 ** -10
    ulp = torch.where(spacing > 2.0 ** -24, spacing, 2.0 ** -24)
    drawn = torch.floor((ax - t) / ulp * 65536.0) + noise.float()
    r = torch.where(drawn >= 65536.0, t + ulp, t)
    signed = (r.view(torch.int32) | (x.view(torch.int32) & _SIGN)).view(torch.float32)
    return torch.where(x.isnan(), x, signed).to(torch.float16)


def stochastic_round(src: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """``src`` (fp32) rounded stochastically to ``dtype`` (bf16 or fp16; other dtypes: a plain cast)
    with the 16-bit ``noise``."""
    if dtype == torch.bfloat16:
        return stochastic_round_bf16(src, noise)
    if dtype == torch.float16:
        return stochastic_round_fp16(src, noise)
    return src.to(dtype)


def store(dst: torch.Tensor, src: torch.Tensor, rounding: str, streams: RandomStreams | None = None,
          stream: int = 0) -> None:
    """Write the fp32 working copy ``src`` into ``dst`` (any float dtype) with ``rounding``; a 16-bit
    ``dst`` rounded stochastically draws its bits from ``streams``' stream ``stream``."""
    if rounding not in STATE_ROUNDINGS:
        raise ValueError(f"rounding: expected one of {', '.join(STATE_ROUNDINGS)}, got {rounding!r}")
    if dst is src:
        return
    if rounding == "stochastic" and dst.dtype in (torch.bfloat16, torch.float16):
        if streams is None:
            raise ValueError("streams: stochastic rounding needs the random streams of the tensor, got None")
        noise = streams.bits(stream, src.shape, src.device)
        if dst.dtype == torch.bfloat16:
            store_stochastic_bf16(dst, src, noise)
        else:
            dst.copy_(stochastic_round_fp16(src, noise))
    else:
        dst.copy_(src)
