"""The Triton functions every generated step kernel (:mod:`~lowp.optim.kernels.triton.source`)
calls: the random bits of :mod:`lowp.optim.randomness` on the 64-bit global index, the bf16
roundings of :mod:`lowp.optim.storage`, and the state stores (imports triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tl_dtype", "widen", "random16", "stochastic_bf16", "round_to", "store_state", "maximum", "sign",
           "decode_code", "encode_code"]
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.int16: tl.int16,
       torch.int8: tl.int8, torch.uint8: tl.uint8}


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of ``dtype`` (float32, bfloat16, float16, int16, int8, uint8)."""
    return _TL[dtype]


@triton.jit
def widen(x, T: tl.constexpr):
    """``x`` of type ``T`` as fp32. bf16 widens on the bits (exact, as on the GPU): the Triton
    interpreter's own conversion loses bf16 subnormals."""
    if T == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


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
    keys ``KEYS`` points at: a half (``index & 1``) of the hash of its pair ``index // 2``."""
    key = tl.load(KEYS + STREAM).to(tl.uint32)
    pair = index >> 1
    lo = (pair & 0xFFFFFFFF).to(tl.uint32)
    hi = (pair >> 32).to(tl.uint32)
    half = ((index & 1) << 4).to(tl.uint32)
    return ((hash32(lo ^ key ^ hash32(hi)) >> half) & 0xFFFF).to(tl.int32)


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


# ---- block-scaled codes (lowp.optim.codes), decoded and encoded inside the step -------------------
# A code's constants arrive as constexprs (written by lowp.optim.kernels.triton.source.code_constants):
# SIGNED, BITS (8 or 4), FLOAT (fp8 storage), M (mantissa bits of the grid), BIAS (fp8 exponent bias),
# MIN_NORMAL = 2**emin, ULP = 2**-M, SUBNORMAL = 2**(emin - M) and its inverse, LOW (the smallest
# code magnitude: 0, or 1 for unsigned codes) and TOP (Q); CB is the code block, SC_T the scale type.
@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _fp8_value(b, M: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL: tl.constexpr):
    """The fp32 value of the fp8 bit patterns ``b`` (int32 in [0, 256)): e4m3fn (``M`` = 3) has
    its NaN at S.1111.111 only, e5m2 IEEE's infinities and NaNs."""
    field = (b >> M) & ((1 << (7 - M)) - 1)
    frac = b & ((1 << M) - 1)
    normal = (((field - BIAS + 127) << 23) | (frac << (23 - M))).to(tl.float32, bitcast=True)
    v = tl.where(field == 0, frac.to(tl.float32) * SUBNORMAL, normal)
    if M == 3:
        v = tl.where((field == 15) & (frac == 7), float("nan"), v)
    else:
        v = tl.where(field == 31, tl.where(frac == 0, float("inf"), float("nan")), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def decode_code(codes, scales, offs, mask, SIGNED: tl.constexpr, BITS: tl.constexpr, FLOAT: tl.constexpr,
                M: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL: tl.constexpr, CB: tl.constexpr):
    """:func:`lowp.optim.codes.decode` of the elements ``offs`` of one tensor: ``codes`` points at
    its code bytes, ``scales`` at its block scales."""
    if BITS == 4:
        byte = tl.load(codes + offs // 2, mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((offs & 1) * 4).to(tl.int32)) & 15
        if SIGNED:   # a two's complement nibble
            nibble = tl.where(nibble >= 8, nibble - 16, nibble)
        q = nibble.to(tl.float32)
    else:
        b = tl.load(codes + offs, mask=mask, other=0).to(tl.int32)
        if FLOAT:
            q = _fp8_value(b, M, BIAS, SUBNORMAL)
        elif SIGNED:
            q = tl.where(b >= 128, b - 256, b).to(tl.float32)
        else:
            q = b.to(tl.float32)
    x = q * widen(tl.load(scales + offs // CB, mask=mask, other=0), scales.dtype.element_ty)
    if not SIGNED:
        x = x * x
    return x


@triton.jit
def _scale_up(s, SC_T: tl.constexpr):
    """(the stored scale, its fp32 value): ``s`` (nonnegative or NaN) rounded up to ``SC_T``."""
    if SC_T == tl.bfloat16:
        up = (s.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
        return up.to(tl.int16).to(tl.bfloat16, bitcast=True), (up << 16).to(tl.float32, bitcast=True)
    elif SC_T == tl.float16:
        near = s.to(tl.float16)
        bits = near.to(tl.int16, bitcast=True) + (near.to(tl.float32) < s).to(tl.int16)
        stored = bits.to(tl.float16, bitcast=True)
        return stored, stored.to(tl.float32)
    else:
        return s, s


@triton.jit
def encode_code(codes, scales, x, start, offs, n, mask, noise, SR: tl.constexpr, SIGNED: tl.constexpr,
                BITS: tl.constexpr, FLOAT: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr,
                MIN_NORMAL: tl.constexpr, ULP: tl.constexpr, PER_SUBNORMAL: tl.constexpr, LOW: tl.constexpr,
                TOP: tl.constexpr, CB: tl.constexpr, SC_T: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`lowp.optim.codes.encode` of the fp32 values ``x`` at elements ``offs``, a
    ``(BLOCK // CB, CB)`` tile from ``start`` (a multiple of ``BLOCK``) with a row per code block,
    of a tensor of ``n`` elements: the block scales, then the codes, rounded with the 16 random
    bits ``noise`` when ``SR``, else to nearest even."""
    t = x if SIGNED else tl.sqrt_rn(x)
    # one reduction per block: a NaN or an infinity counts as +inf, and makes the scale NaN
    peak = tl.max(tl.where(mask, tl.where(_finite(t), tl.abs(t), float("inf")), 0.0), axis=1)
    ratio = tl.div_rn(peak, tl.full(peak.shape, TOP, tl.float32))
    stored, s = _scale_up(tl.where(peak == float("inf"), float("nan"), ratio), SC_T)
    first = start // CB + tl.arange(0, BLOCK // CB)
    tl.store(scales + first, stored, mask=first * CB < n)
    k = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)   # once per block
    y = t * k[:, None]
    if tl.max((~_finite(k)).to(tl.int32), axis=0) > 0:   # a block whose reciprocal is not finite divides
        y = tl.where(_finite(k)[:, None], y, tl.div_rn(t, tl.broadcast_to(s[:, None], t.shape)))
    y = tl.where(_finite(y), y, 0.0)
    a = tl.abs(y)
    binade = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    step = tl.maximum(binade, MIN_NORMAL) * ULP
    # a / step, exactly: step is a power of two in [2**-17, 2**120], so is its reciprocal
    c = a * ((254 << 23) - step.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    low = tl.floor(c)
    if SR:
        up = tl.floor((c - low) * 65536.0) + noise.to(tl.float32) >= 65536.0
    else:
        d = c - low
        up = (d > 0.5) | ((d == 0.5) & ((low.to(tl.int32) & 1) == 1))
    q = tl.minimum(tl.maximum((low + up.to(tl.float32)) * step, LOW), TOP)
    if FLOAT:
        bits = q.to(tl.int32, bitcast=True)
        normal = (((bits >> 23) - 127 + BIAS) << M) | ((bits & 0x7FFFFF) >> (23 - M))
        code = tl.where(q >= MIN_NORMAL, normal, (q * PER_SUBNORMAL).to(tl.int32))
        code = code | tl.where(y.to(tl.int32, bitcast=True) < 0, 128, 0)
    elif SIGNED:
        code = tl.where(y.to(tl.int32, bitcast=True) < 0, -q, q).to(tl.int32) & ((1 << BITS) - 1)
    else:
        code = q.to(tl.int32)
    if BITS == 4:
        pairs = tl.reshape(tl.where(mask, code, 0), (BLOCK // 2, 2))
        byte = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, :], axis=1)
        at = start // 2 + tl.arange(0, BLOCK // 2)
        tl.store(codes + at, byte.to(tl.uint8), mask=at * 2 < n)
    else:
        tl.store(codes + offs, code.to(tl.uint8), mask=mask)
