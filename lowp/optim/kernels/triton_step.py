"""Multi-tensor Triton kernel for every elementwise rule (SGD, Adam/AdamW with amsgrad, Lion,
RAdam) with every write-back mode (imports triton).

One launch updates many parameters: each program handles ``BLOCK`` elements of one tensor, found
through per-launch tables (data pointers of each role, sizes, the global index of each tensor's
first element, stream keys per tensor, and a block list mapping program ids to (tensor, start)),
so small tensors do not pay a launch each.

The math mirrors :mod:`lowp.optim.kernels.rules` and the write-back of
:func:`lowp.optim.kernels.step.fused_step` operation by operation (ATen's fused multiply-adds
included, as ``tl.fma``); ``H`` holds the compiled backend's numbers (``step_numbers``: the
gradient factor, then the rule's ``hyper``) and ``KEYS`` the stream keys of every tensor
(``[tensor][stream]``), from which it draws the bits of :mod:`lowp.optim.randomness` on the 64-bit
global index, like every backend. Runs on CUDA, or on CPU tensors under the Triton
interpreter (``TRITON_INTERPRET=1``), which the tests use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["step_kernel", "tl_dtype", "MODE_IDS", "RULE_IDS"]

MODE_IDS = {"nearest": 0, "kahan": 1, "stochastic": 2, "exact": 3}
RULE_IDS = {"adam": 0, "adamw": 0, "sgd": 1, "lion": 2, "radam": 3}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.int16: tl.int16}


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of ``dtype`` (float32, bfloat16, float16, int16)."""
    return _TL[dtype]


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _random16(index, KEYS, STREAM: tl.constexpr):
    """randomness.random16 of the int64 global ``index`` in stream ``STREAM`` of the tensor whose
    keys ``KEYS`` points at."""
    key = tl.load(KEYS + STREAM).to(tl.uint32)
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return (_hash32(lo ^ key ^ _hash32(hi)) >> 16).to(tl.int32)


@triton.jit
def _stochastic_bf16(x, noise):
    """fp32 -> bf16 with 16 random bits (lowp.optim.storage): a NaN keeps its top bits, made quiet."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = tl.where(x != x, (bits & -65536) | 0x400000, (bits + noise) & -65536)
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)  # the top halves, NaNs included


@triton.jit
def _round(x, T: tl.constexpr):
    """fp32 -> T rounded to nearest even. For bf16 the rounding is done on the bits (then the cast
    is exact): the Triton interpreter truncates in ``.to(tl.bfloat16)``."""
    if T == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(T)


@triton.jit
def _store_state(ptr, x, mask, index, KEYS, J: tl.constexpr, T: tl.constexpr, SR: tl.constexpr):
    """State ``J``: stochastic rounding with stream ``Stream.STATE + J``."""
    if SR:
        tl.store(ptr, _stochastic_bf16(x, _random16(index, KEYS, 2 + J)), mask=mask)
    else:
        tl.store(ptr, _round(x, T), mask=mask)


@triton.jit
def _lerp(start, end, weight):
    diff = end - start
    return tl.where(weight < 0.5, tl.fma(weight, diff, start), tl.fma(weight - 1.0, diff, end))


@triton.jit
def _rule(w, g, s0, s1, s2, R, RULE: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    """``(u, new s0, new s1, new s2)`` of rules.py's rule ``RULE``; ``R`` points at the rule's
    numbers (h[1:]) and ``(C0, C1, C2)`` is its config tuple."""
    if RULE == 0:  # Adam/AdamW, cfg = (amsgrad, decoupled, has_wd)
        if C2 and not C1:
            g = tl.fma(w, tl.load(R + 7), g)
        s0 = _lerp(s0, g, tl.load(R))
        s1 = tl.fma(tl.load(R + 2) * g, g, s1 * tl.load(R + 1))
        second = s1
        if C0:
            s2 = tl.where((s2 != s2) | (s2 > s1), s2, s1)  # torch.maximum: NaN propagates
            second = s2
        u = s0 / (tl.sqrt_rn(second) / tl.load(R + 3) + tl.load(R + 4)) * tl.load(R + 5)
        if C2 and C1:
            u = tl.fma(w, tl.load(R + 6), u)
    elif RULE == 1:  # SGD, cfg = (has_momentum, nesterov, has_wd)
        d = g
        if C2:
            d = tl.fma(w, tl.load(R), g)
        if C0:
            s0 = tl.where(tl.load(R + 3) > 0, d, tl.fma(d, tl.load(R + 2), s0 * tl.load(R + 1)))
            if C1:
                d = tl.fma(s0, tl.load(R + 1), d)
            else:
                d = s0
        u = d * tl.load(R + 4)
    elif RULE == 2:  # Lion, cfg = (has_wd,)
        x = _lerp(s0, g, tl.load(R))
        u = tl.where(x != x, x, tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)))
        if C0:
            u = tl.fma(w, tl.load(R + 1), u)
        u = u * tl.load(R + 2)
        s0 = _lerp(s0, g, tl.load(R + 3))
    else:  # RAdam, cfg = (has_wd, decoupled)
        if C0 and not C1:
            g = tl.fma(w, tl.load(R + 8), g)
        s0 = _lerp(s0, g, tl.load(R))
        s1 = tl.fma(tl.load(R + 2) * g, g, s1 * tl.load(R + 1))
        u = s0 * tl.load(R + 3)
        u = tl.where(tl.load(R + 4) > 0, u / (tl.sqrt_rn(s1) + tl.load(R + 5)) * tl.load(R + 6), u)
        if C0 and C1:
            u = tl.fma(w, tl.load(R + 7), u)
    return u, s0, s1, s2


@triton.jit
def step_kernel(P, G, B, S0, S1, S2, SIZES, OFFSETS, BLOCK_TENSOR, BLOCK_START, H, KEYS, STALLED,
                P_T: tl.constexpr, G_T: tl.constexpr, B_T: tl.constexpr, S0_T: tl.constexpr, S1_T: tl.constexpr,
                S2_T: tl.constexpr, NSTATES: tl.constexpr, SR0: tl.constexpr, SR1: tl.constexpr,
                SR2: tl.constexpr, RULE: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                MODE: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(SIZES + t)
    index = tl.load(OFFSETS + t) + offs.to(tl.int64)
    keys = KEYS + t * 5  # the tensor's stream keys: weight, compensation, three states
    p_ptr = tl.load(P + t).to(tl.pointer_type(P_T)) + offs
    g_ptr = tl.load(G + t).to(tl.pointer_type(G_T)) + offs
    b_ptr = tl.load(B + t).to(tl.pointer_type(B_T)) + offs
    s0_ptr = tl.load(S0 + t).to(tl.pointer_type(S0_T)) + offs
    s1_ptr = tl.load(S1 + t).to(tl.pointer_type(S1_T)) + offs
    s2_ptr = tl.load(S2 + t).to(tl.pointer_type(S2_T)) + offs

    if MODE == 3:
        hi = tl.load(p_ptr, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)
        w = ((hi << 16) + tl.load(b_ptr, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
    else:
        w = tl.load(p_ptr, mask=mask).to(tl.float32)
    g = tl.load(g_ptr, mask=mask).to(tl.float32) * tl.load(H)
    s0 = tl.zeros([BLOCK], dtype=tl.float32)
    s1 = s0
    s2 = s0
    if NSTATES > 0:
        s0 = tl.load(s0_ptr, mask=mask).to(tl.float32)
    if NSTATES > 1:
        s1 = tl.load(s1_ptr, mask=mask).to(tl.float32)
    if NSTATES > 2:
        s2 = tl.load(s2_ptr, mask=mask).to(tl.float32)
    u, s0, s1, s2 = _rule(w, g, s0, s1, s2, H + 1, RULE, C0, C1, C2)
    if NSTATES > 0:
        _store_state(s0_ptr, s0, mask, index, keys, 0, S0_T, SR0)
    if NSTATES > 1:
        _store_state(s1_ptr, s1, mask, index, keys, 1, S1_T, SR1)
    if NSTATES > 2:
        _store_state(s2_ptr, s2, mask, index, keys, 2, S2_T, SR2)

    stalled = tl.zeros([BLOCK], dtype=tl.int32)
    if MODE == 1:
        c = tl.load(b_ptr, mask=mask).to(tl.float32) + u
        new = _round(w + c, P_T)
        change = new.to(tl.float32) - w
        tl.store(b_ptr, _stochastic_bf16(c - change, _random16(index, keys, 1)), mask=mask)
        stalled = ((change == 0) & mask).to(tl.int32)
    elif MODE == 3:
        bits = (w + u).to(tl.int32, bitcast=True)
        top = (bits + 32768) >> 16
        tl.store(b_ptr, (bits - (top << 16)).to(tl.int16), mask=mask)
        new = top.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        if MODE == 2:
            new = _stochastic_bf16(w + u, _random16(index, keys, 0))
        else:
            new = _round(w + u, P_T)
        stalled = ((new.to(tl.float32) == w) & mask).to(tl.int32)
    tl.store(p_ptr, new, mask=mask)
    if COUNT:
        tl.atomic_add(STALLED, tl.sum(stalled, axis=0).to(tl.int64))
