"""``exact8``: a bf16 weight plus an int8 remainder (3 bytes per parameter).

Together they are an fp32 value whose low 8 bits are zero, 16 significant bits (the size of
FlashOptim's int8 error term). With
``hi`` the bf16 bit pattern and ``r8`` the remainder, both sign-extended::

    load:   w = float32 from bits (hi << 16) + (r8 << 8)
    apply:  b  = int32 bits of rn_fp32(w + u)
            b2 = (b + (random16 >> 8)) & ~0xFF            (NaN: b2 = (b | 0x00400000) & ~0xFF)
            hi = (b2 + 2**15) >> 16,   r8 = (b2 - (hi << 16)) >> 8   in [-128, 128)

``random16`` are the 16 bits of stream ``Stream.WEIGHT``; their top 8 bits round the low 8 bits of
``b`` stochastically, up with probability ``(b & 0xFF) / 256``, so ``E[pair'] = rn_fp32(w + u)``: an
update below the remainder's unit (about ``2**-16`` of the weight, e.g. decoupled weight decay
``lr * wd = 1e-5``) moves the pair on average instead of stalling (rounded to nearest it would be
lost every step, or biased by the same rounding error step after step). The quiet bit keeps a NaN
a NaN (the carry could turn it into an infinity). ``hi`` is ``b2`` rounded to nearest bf16 (ties
away, as in exact mode), and ``(hi, r8)`` holds ``b2`` exactly. An element is stalled when its pair
did not change. A value taken over from another mode (or a master weight) is rounded to the
nearest pair, ties away from zero (``b2 = (b + 0x80) & ~0xFF``, no random bits: a fold is not a
step): :func:`store_nearest_pair8`.
"""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.randomness import Stream
from lowp.optim.writeback.mode import WriteBack
from lowp.optim.writeback.pairs import (LOW8_CLEAR, QUIET, SHIFT8, compiled_pair_load, pair_load, store_pair,
                                        triton_pair_load)
from lowp.optim.writeback.traced import CLEAR_LOW8, HALF, QUIET as QUIET_BIT, bf16_of

__all__ = ["EXACT8", "store_nearest_pair8"]


def _buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=torch.int8, device=p.device)


def _nan_quiet(b2: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``b2`` with the NaNs of ``x`` (fp32, bit patterns ``bits``) replaced by ``bits | 0x00400000``
    (both cleared of their low 8 bits afterwards)."""
    if x.is_cpu and not bool(x.isnan().any()):   # the common case on the CPU: no select pass
        return b2
    return torch.where(x.isnan(), bits.bitwise_or(QUIET), b2)


def _apply(p, w, u, r8, streams, count, scratch=None):
    new = torch.add(w, u, out=u)                       # rn_fp32(w + u)
    bits = new.view(torch.int32)
    noise = streams.bits(Stream.WEIGHT, bits.shape, bits.device)
    b2 = _nan_quiet(noise.bitwise_right_shift_(SHIFT8).add_(bits), new, bits).bitwise_and_(LOW8_CLEAR)
    stalled = torch.eq(b2, w.view(torch.int32)).sum(dtype=torch.int64) if count else None
    store_pair(p, r8, b2)
    return stalled


def store_nearest_pair8(p: torch.Tensor, r8: torch.Tensor, held: torch.Tensor) -> None:
    """Store the fp32 value ``held`` in exact8 mode's pair (bf16 ``p``, int8 ``r8``), rounded to
    the nearest pair, ties away from zero (``b2 = (b + 0x80) & ~0xFF``; NaNs made quiet)."""
    held = held.float().contiguous()
    bits = held.view(torch.int32)
    store_pair(p, r8, _nan_quiet(torch.add(bits, 0x80), held, bits).bitwise_and_(LOW8_CLEAR))


def _compiled_write(p: torch.Tensor, r8: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert r8 is not None
    total = w + u
    pattern = total.view(torch.int32)
    b2 = torch.where(total.isnan(), pattern | QUIET_BIT, pattern + (bits(Stream.WEIGHT) >> 8)) & CLEAR_LOW8
    hi = (b2 + HALF) >> 16
    r8.copy_(((b2 - (hi << 16)) >> 8).to(torch.int8))
    return bf16_of(hi), (b2 == w.view(torch.int32)).sum(dtype=torch.int32) if count else None


EXACT8 = WriteBack(
    "exact8", (torch.bfloat16,), "remainder8", _buffer, pair_load, _apply, lambda buffer: (Stream.WEIGHT,),
    held=pair_load, keep=store_nearest_pair8, buffer_dtypes=lambda weight: (torch.int8,),
    nan_guard=lambda buffer: True,
    stochastic_weight_dtype=False, compiled_load=compiled_pair_load, compiled_write=_compiled_write,
    triton_load=triton_pair_load(8),
    triton_write="total = w + u\n"
                 "bits = total.to(tl.int32, bitcast=True)\n"
                 "noise = random16(index, keys, 0) >> 8\n"
                 "b2 = tl.where(total != total, bits | 0x400000, bits + noise) & -256\n"
                 "top = (b2 + 32768) >> 16\n"
                 "tl.store(b_ptr, ((b2 - (top << 16)) >> 8).to(tl.int8), mask=mask)\n"
                 "new = top.to(tl.int16).to(tl.bfloat16, bitcast=True)\n"
                 "stalled = ((b2 == w.to(tl.int32, bitcast=True)) & mask).to(tl.int32)",
    native_header="exact8.h")
