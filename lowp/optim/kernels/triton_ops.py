"""The Triton functions every generated step kernel (:mod:`~lowp.optim.kernels.triton_source`)
calls: the random bits of :mod:`lowp.optim.randomness` on the 64-bit global index, the bf16
roundings of :mod:`lowp.optim.storage`, and the state stores (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tl_dtype", "random16", "stochastic_bf16", "round_to", "store_state", "maximum", "sign"]
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.int16: tl.int16,
       torch.int8: tl.int8}


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of ``dtype`` (float32, bfloat16, float16, int16, int8)."""
    return _TL[dtype]


@triton.jit
def hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def random16(index, KEYS, STREAM: tl.constexpr):
    """randomness.random16 of the int64 global ``index`` in stream ``STREAM`` of the tensor whose
    keys ``KEYS`` points at."""
    key = tl.load(KEYS + STREAM).to(tl.uint32)
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return (hash32(lo ^ key ^ hash32(hi)) >> 16).to(tl.int32)


@triton.jit
def stochastic_bf16(x, noise):
    """fp32 -> bf16 with 16 random bits (lowp.optim.storage): a NaN keeps its top bits, made quiet."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = tl.where(x != x, (bits & -65536) | 0x400000, (bits + noise) & -65536)
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)  # the top halves, NaNs included


@triton.jit
def round_to(x, T: tl.constexpr):
    """fp32 -> T rounded to nearest even. For bf16 the rounding is done on the bits (then the cast
    is exact): the Triton interpreter truncates in ``.to(tl.bfloat16)``."""
    if T == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(T)


@triton.jit
def store_state(ptr, x, mask, index, KEYS, J: tl.constexpr, T: tl.constexpr, SR: tl.constexpr):
    """State ``J``: stochastic rounding with stream ``Stream.STATE + J``."""
    if SR:
        tl.store(ptr, stochastic_bf16(x, random16(index, KEYS, 2 + J)), mask=mask)
    else:
        tl.store(ptr, round_to(x, T), mask=mask)


@triton.jit
def maximum(a, b):
    """torch.maximum: NaN propagates."""
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def sign(x):
    """torch.sign on CPU: NaN gives 0."""
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
