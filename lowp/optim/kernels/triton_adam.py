"""Multi-tensor Triton kernel for Adam/AdamW with every write-back mode (imports triton).

One launch updates many parameters: each program handles ``BLOCK`` elements of one tensor, found
through per-launch tables (data pointers of each role, sizes, element offsets, and a block list
mapping program ids to (tensor, start)), so small tensors do not pay a launch each.

The math mirrors :func:`lowp.optim.kernels.rules._adam_fn` and the write-back of
:func:`lowp.optim.kernels.step.fused_step` operation by operation (ATen's fused multiply-adds
included, as ``tl.fma``); stochastic rounding uses the same hash, so this kernel and the compiled
backend draw identical random bits. Runs on CUDA, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``), which the tests use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["adam_kernel", "tl_dtype", "MODE_IDS"]

MODE_IDS = {"nearest": 0, "kahan": 1, "stochastic": 2, "exact": 3}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.int16: tl.int16}


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of ``dtype`` (float32, bfloat16, float16, int16)."""
    return _TL[dtype]


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _stochastic_bf16(x, index, key, HALF: tl.constexpr):
    noise = _hash32((index ^ key).to(tl.uint32))
    if HALF:
        noise = noise >> 16
    noise = noise & 0xFFFF
    bits = (x.to(tl.int32, bitcast=True) + noise.to(tl.int32)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


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
def _store_state(ptr, x, mask, index, key, HALF: tl.constexpr, T: tl.constexpr, SR: tl.constexpr):
    if SR:
        tl.store(ptr, _stochastic_bf16(x, index, key, HALF), mask=mask)
    else:
        tl.store(ptr, _round(x, T), mask=mask)


@triton.jit
def _lerp(start, end, weight):
    diff = end - start
    return tl.where(weight < 0.5, tl.fma(weight, diff, start), tl.fma(weight - 1.0, diff, end))


@triton.jit
def adam_kernel(P, G, M, V, B, SIZES, OFFSETS, BLOCK_TENSOR, BLOCK_START, H, KEYS, STALLED,
                P_T: tl.constexpr, G_T: tl.constexpr, M_T: tl.constexpr, V_T: tl.constexpr, B_T: tl.constexpr,
                MODE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_WD: tl.constexpr, SR_M: tl.constexpr,
                SR_V: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(SIZES + t)
    index = tl.load(OFFSETS + t) + offs
    p_ptr = tl.load(P + t).to(tl.pointer_type(P_T)) + offs
    g_ptr = tl.load(G + t).to(tl.pointer_type(G_T)) + offs
    m_ptr = tl.load(M + t).to(tl.pointer_type(M_T)) + offs
    v_ptr = tl.load(V + t).to(tl.pointer_type(V_T)) + offs
    b_ptr = tl.load(B + t).to(tl.pointer_type(B_T)) + offs

    if MODE == 3:
        hi = tl.load(p_ptr, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)
        w = ((hi << 16) + tl.load(b_ptr, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
    else:
        w = tl.load(p_ptr, mask=mask).to(tl.float32)
    g = tl.load(g_ptr, mask=mask).to(tl.float32) * tl.load(H)
    if HAS_WD and not DECOUPLED:
        g = tl.fma(w, tl.load(H + 8), g)
    m = _lerp(tl.load(m_ptr, mask=mask).to(tl.float32), g, tl.load(H + 1))
    v = tl.fma(tl.load(H + 3) * g, g, tl.load(v_ptr, mask=mask).to(tl.float32) * tl.load(H + 2))
    _store_state(m_ptr, m, mask, index, tl.load(KEYS + 2), 0, M_T, SR_M)
    _store_state(v_ptr, v, mask, index, tl.load(KEYS + 2), 1, V_T, SR_V)
    u = m / (tl.sqrt_rn(v) / tl.load(H + 4) + tl.load(H + 5)) * tl.load(H + 6)
    if HAS_WD and DECOUPLED:
        u = tl.fma(w, tl.load(H + 7), u)

    stalled = tl.zeros([BLOCK], dtype=tl.int32)
    if MODE == 1:
        c = tl.load(b_ptr, mask=mask).to(tl.float32) + u
        new = _round(w + c, P_T)
        change = new.to(tl.float32) - w
        tl.store(b_ptr, _round(c - change, B_T), mask=mask)
        stalled = ((change == 0) & mask).to(tl.int32)
    elif MODE == 3:
        bits = (w + u).to(tl.int32, bitcast=True)
        top = (bits + 32768) >> 16
        tl.store(b_ptr, (bits - (top << 16)).to(tl.int16), mask=mask)
        new = top.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        if MODE == 2:
            new = _stochastic_bf16(w + u, index, tl.load(KEYS + 1), 0)
        else:
            new = _round(w + u, P_T)
        stalled = ((new.to(tl.float32) == w) & mask).to(tl.int32)
    tl.store(p_ptr, new, mask=mask)
    if COUNT:
        tl.atomic_add(STALLED, tl.sum(stalled, axis=0).to(tl.int64))
