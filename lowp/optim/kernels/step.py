"""One fused optimizer step on one flat parameter: load, rule, state stores, write-back.

:func:`fused_step` composes an optimizer :class:`~lowp.optim.kernels.rules.Rule` with a
write-back mode, written as plain tensor expressions that :func:`torch.compile` turns into a
single loop (Inductor: vectorised C++ on CPU, Triton on CUDA). Nothing here allocates a
full-size buffer once compiled; run eagerly it is a (slow) readable reference of the same math.

Stochastic rounding draws its bits from a counter-based hash instead of a
:class:`torch.Generator` (which compiled code cannot take): element ``i`` of stream ``s`` gets
one half of ``hash32(i ^ key)`` (two streams per key), where the keys are drawn from the optimizer's generator once per step.
The stream is therefore reproducible from the optimizer's seed and checkpoint, identical between
the compiled and the Triton backends, but different from the eager path's ``torch.randint``
stream (same distribution: uniform 16-bit integers).
"""
from __future__ import annotations

import torch

from lowp.optim.kernels.rules import Rule

__all__ = ["fused_step", "hash32", "random16", "stochastic_bf16"]

_LOW_16_BITS_CLEARED = -65536
_HALF = 1 << 15


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit xor-shift-multiply integer mixer on int32 with wrap-around products; the masks
    make the arithmetic shifts logical, so the bits equal ``_hash32`` on uint32 in the Triton
    kernel. int32 keeps it vectorised on AVX2, which has no 64-bit multiply."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x2C1B3C6D
    return x ^ ((x >> 16) & 0xFFFF)


def random16(index: torch.Tensor, key: torch.Tensor, half: int) -> torch.Tensor:
    """16 random bits per element: the low (``half=0``) or high (``half=1``) half of
    ``hash32(index ^ key)``; two streams share one hash (the compiler merges the two calls)."""
    bits = hash32((index ^ key).to(torch.int32))
    return (bits >> 16) & 0xFFFF if half else bits & 0xFFFF


def stochastic_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of fp32 ``x`` to bf16 with 16 random bits ``noise`` per element: add
    them to the fp32 bit pattern and truncate (see :mod:`lowp.optim.storage`)."""
    bits = (x.view(torch.int32) + noise) & _LOW_16_BITS_CLEARED
    return bits.view(torch.float32).to(torch.bfloat16)


def fused_step(rule: Rule, mode: str, cfg: tuple, state_stochastic: tuple[bool, ...], count: bool,
               p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, states: list[torch.Tensor],
               h: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """Update the flat tensors ``p``, ``buf`` and ``states`` in place; return the stalled count.

    ``h[0]`` is the gradient factor (-1 for maximize, times the GradScaler's 1/scale), ``h[1:]``
    the rule's numbers; ``keys = [index offset, weight key, state keys...]`` (int32; every
    integer here is int32 so that Inductor keeps 16-wide bf16 vectors on AVX2).
    """
    n = p.shape[0]
    index = torch.arange(n, device=p.device, dtype=torch.int32) + keys[0]
    if mode == "exact":
        bits = (p.view(torch.int16).to(torch.int32) << 16) + buf.to(torch.int32)
        w = bits.view(torch.float32)
    else:
        w = p.float()
    u, new_states = rule.fn(w, g.float() * h[0], [s.float() for s in states], h[1:], cfg)
    for i, (s, x) in enumerate(zip(states, new_states)):
        if state_stochastic[i] and s.dtype == torch.bfloat16:  # state i: half i % 2 of key 2 + i // 2
            s.copy_(stochastic_bf16(x, random16(index, keys[2 + i // 2], i % 2)))
        else:
            s.copy_(x.to(s.dtype))
    stalled = None
    if mode == "kahan":
        v = buf.float() + u
        new = (w + v).to(p.dtype)
        change = new.float() - w
        buf.copy_((v - change).to(buf.dtype))
        stalled = (change == 0).sum(dtype=torch.int32) if count else None
    elif mode == "exact":
        bits = (w + u).view(torch.int32)
        hi = (bits + _HALF) >> 16
        buf.copy_((bits - (hi << 16)).to(torch.int16))
        new = hi.to(torch.int16).view(torch.bfloat16)
        stalled = torch.zeros((), dtype=torch.int32, device=p.device) if count else None
    else:
        new = stochastic_bf16(w + u, random16(index, keys[1], 0)) if mode == "stochastic" else (w + u).to(p.dtype)
        stalled = (new.float() == w).sum(dtype=torch.int32) if count else None
    p.copy_(new)
    return stalled
