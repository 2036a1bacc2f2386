"""One fused optimizer step on one flat parameter: load, rule, state stores, write-back.

:func:`fused_step` composes an optimizer's traced rule (:class:`~lowp.optim.rule.Program`,
evaluated by :mod:`~lowp.optim.kernels.torch_rule`) with a write-back mode, written as plain
tensor expressions that :func:`torch.compile` turns into a
single loop (Inductor: vectorised C++ on CPU, Triton on CUDA). Nothing here allocates a
full-size buffer once compiled; run eagerly it is a (slow) readable reference of the same math.

Stochastic rounding draws the counter-based bits of :mod:`lowp.optim.randomness` (the same bits as
every other backend): element ``i`` of stream ``s`` gets ``random16(i, key_s)``. Inside a chunk
everything is int32 (so Inductor keeps 16-wide bf16 vectors on AVX2): :func:`chunk_keys` folds the
high 32 bits of the chunk's global indices into the keys on the host, and a chunk whose indices
cross a multiple of ``2**32`` switches to the next fold at element ``split``::

    j < split:   x = (j + (lo - 2**31)) ^ (key ^ hash32(hi) ^ 2**31)    (= lo + j, xor-ed with the fold)
    j >= split:  x = (j - split) ^ (key ^ hash32(hi + 1))
    bits = random16 of x (the last xor-shift of hash32 skipped: it leaves the top 16 bits alone)

with ``lo, hi`` the low and high halves of the chunk's first global index. Biasing ``lo`` by
``2**31`` keeps every int32 sum in range (no signed overflow); the bias cancels in the xor.
"""
from __future__ import annotations

import torch

from lowp.optim.kernels.torch_rule import evaluate
from lowp.optim.randomness import Stream, as_int32, fold_key, hash32
from lowp.optim.rule import Program
from lowp.optim.storage import stochastic_bf16_patterns

__all__ = ["fused_step", "chunk_keys", "random16", "stochastic_bf16", "nearest", "bf16_of"]

_HALF = 1 << 15
_QUIET = 0x00400000   # the quiet bit of an fp32 NaN
_CLEAR_LOW8 = ~0xFF
_BF16_NAN = 0x7FC0    # a bf16 NaN pattern (torch's scalar fp32 -> bf16 cast gives it)
_BIAS = 1 << 31


def chunk_keys(keys: list[int], first: int, n: int, device: torch.device) -> torch.Tensor:
    """The int32 numbers of one chunk of ``n`` elements whose first global index is ``first``:
    ``[lo - 2**31, split, (fold(hi) ^ 2**31, fold(hi + 1)) per stream]`` (module docstring)."""
    lo, hi = first & 0xFFFFFFFF, first >> 32
    values = [as_int32(lo - _BIAS), min(n, (1 << 32) - lo)]
    for key in keys:
        values += [as_int32(fold_key(key, hi) ^ _BIAS), as_int32(fold_key(key, hi + 1))]
    return torch.tensor(values, dtype=torch.int32, device=device)


def random16(x: torch.Tensor) -> torch.Tensor:
    """The top 16 bits of :func:`~lowp.optim.randomness.hash32` (int32 in ``[0, 2**16)``)."""
    return (hash32(x) >> 16) & 0xFFFF


def _stream_bits(j: torch.Tensor, before: torch.Tensor, keys: torch.Tensor, stream: int) -> torch.Tensor:
    """:func:`random16` of every element of the chunk in stream ``stream`` (see :func:`chunk_keys`)."""
    x = j + torch.where(before, keys[0], -keys[1])
    return random16(x ^ torch.where(before, keys[2 + 2 * stream], keys[3 + 2 * stream]))


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
    up = (low > _HALF) | ((low == _HALF) & ((top & 1) == 1))
    patterns = torch.where(x.isnan(), _BF16_NAN, top + up.to(torch.int32))
    value = (patterns << 16).view(torch.float32)
    return value.to(torch.bfloat16), value


def fused_step(program: Program, mode: str, state_stochastic: tuple[bool, ...], count: bool,
               p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, states: list[torch.Tensor],
               h: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """Update the flat tensors ``p``, ``buf`` and ``states`` in place; return the stalled count.

    ``h[0]`` is the gradient factor (-1 for maximize, times the GradScaler's 1/scale), ``h[1:]``
    the program's numbers; ``keys`` is :func:`chunk_keys` of the chunk (int32; every integer here
    is int32 so that Inductor keeps 16-wide bf16 vectors on AVX2).
    """
    n = p.shape[0]
    j = torch.arange(n, device=p.device, dtype=torch.int32)
    before = j < keys[1]
    if mode in ("exact", "exact8"):
        assert buf is not None
        low = buf.to(torch.int32) if mode == "exact" else buf.to(torch.int32) << 8
        w = (p.float().view(torch.int32) + low).view(torch.float32)  # widening bf16 is exact
    else:
        w = p.float()
    u, new_states = evaluate(program, w, g.float() * h[0], [s.float() for s in states], h[1:])
    for i, (s, x) in enumerate(zip(states, new_states)):
        if state_stochastic[i] and s.dtype == torch.bfloat16:
            s.copy_(stochastic_bf16(x, _stream_bits(j, before, keys, Stream.STATE + i)))
        else:
            s.copy_(x.to(s.dtype))
    stalled = None
    if mode == "kahan":
        assert buf is not None
        v = buf.float() + u
        new, new_value = nearest(w + v, p.dtype)
        change = new_value - w
        buf.copy_(stochastic_bf16(v - change, _stream_bits(j, before, keys, Stream.COMPENSATION)))
        stalled = (change == 0).sum(dtype=torch.int32) if count else None
    elif mode == "exact":
        assert buf is not None
        bits = (w + u).view(torch.int32)
        hi = (bits + _HALF) >> 16
        buf.copy_((bits - (hi << 16)).to(torch.int16))
        new = bf16_of(hi)
        stalled = torch.zeros((), dtype=torch.int32, device=p.device) if count else None
    elif mode == "exact8":
        assert buf is not None
        total = w + u
        bits = total.view(torch.int32)
        noise = _stream_bits(j, before, keys, Stream.WEIGHT) >> 8
        b2 = torch.where(total.isnan(), bits | _QUIET, bits + noise) & _CLEAR_LOW8
        hi = (b2 + _HALF) >> 16
        buf.copy_(((b2 - (hi << 16)) >> 8).to(torch.int8))
        new = bf16_of(hi)
        stalled = (b2 == w.view(torch.int32)).sum(dtype=torch.int32) if count else None
    else:
        if mode == "stochastic":
            new = stochastic_bf16(w + u, _stream_bits(j, before, keys, Stream.WEIGHT))
            new_value = new.float()
        else:
            new, new_value = nearest(w + u, p.dtype)
        stalled = (new_value == w).sum(dtype=torch.int32) if count else None
    p.copy_(new)
    return stalled
