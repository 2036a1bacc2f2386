"""One fused optimizer step on one flat parameter: load, rule, state stores, write-back.

:func:`fused_step` composes an optimizer's traced rule (:class:`~lowp.optim.rule.Program`,
evaluated by :mod:`~lowp.optim.kernels.compiled.rule`) with a write-back mode's compiled fragment
(``compiled_load``, ``compiled_write`` of :mod:`lowp.optim.writeback`), written as plain
tensor expressions that :func:`torch.compile` turns into a
single loop (Inductor: vectorised C++ on CPU, Triton on CUDA). Nothing here allocates a
full-size buffer once compiled; run eagerly it is a (slow) readable reference of the same math.

Stochastic rounding draws the counter-based bits of :mod:`lowp.optim.randomness` (the same bits as
every other backend): element ``i`` of stream ``s`` gets ``random16(i, key_s)``, a half of the hash
of its pair ``i // 2``. Inside a chunk everything is int32 (so Inductor keeps 16-wide bf16
vectors on AVX2): :func:`chunk_keys` folds the high 32 bits of the chunk's global indices into the
keys on the host, and a chunk whose indices cross a multiple of ``2**32`` switches to the next
fold at element ``split``::

    j < split:   y = j + (lo - 2**31),  pair = (y >> 1) + 2**30,  fold = fold_key(key, hi)
    j >= split:  y = j - split,          pair = y >> 1,            fold = fold_key(key, hi + 1)
    bits = (hash32(pair ^ fold) >> 16 * (y & 1)) & 0xFFFF

with ``lo, hi`` the low and high halves of the chunk's first global index. Biasing ``lo`` by
``2**31`` keeps every int32 sum in range (no signed overflow): ``y + 2**31 = lo + j``, whose half
is ``(y >> 1) + 2**30`` (an arithmetic shift) and whose parity is ``y``'s.
"""
from __future__ import annotations

import torch

from lowp.optim.kernels.compiled.rule import evaluate
from lowp.optim.randomness import Stream, as_int32, fold_key, hash32
from lowp.optim.rule import Program
from lowp.optim.writeback import MODES
from lowp.optim.writeback.traced import bf16_of, nearest, stochastic_bf16

__all__ = ["fused_step", "chunk_keys", "stochastic_bf16", "nearest", "bf16_of"]

_BIAS = 1 << 31


def chunk_keys(keys: list[int], first: int, n: int, device: torch.device) -> torch.Tensor:
    """The int32 numbers of one chunk of ``n`` elements whose first global index is ``first``:
    ``[lo - 2**31, split, (fold(hi), fold(hi + 1)) per stream]`` (module docstring)."""
    lo, hi = first & 0xFFFFFFFF, first >> 32
    values = [as_int32(lo - _BIAS), min(n, (1 << 32) - lo)]
    for key in keys:
        values += [as_int32(fold_key(key, hi)), as_int32(fold_key(key, hi + 1))]
    return torch.tensor(values, dtype=torch.int32, device=device)


def _stream_bits(j: torch.Tensor, before: torch.Tensor, keys: torch.Tensor, stream: int) -> torch.Tensor:
    """The random bits of every element of the chunk in stream ``stream`` (see :func:`chunk_keys`)."""
    y = j + torch.where(before, keys[0], -keys[1])
    pair = (y >> 1) + (before.to(torch.int32) << 30)
    h = hash32(pair ^ torch.where(before, keys[2 + 2 * stream], keys[3 + 2 * stream]))
    return (h >> ((y & 1) << 4)) & 0xFFFF


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
    write_back = MODES[mode]
    w = write_back.compiled_load(p, buf)
    u, new_states = evaluate(program, w, g.float() * h[0], [s.float() for s in states], h[1:])
    for i, (s, x) in enumerate(zip(states, new_states)):
        if state_stochastic[i] and s.dtype == torch.bfloat16:
            s.copy_(stochastic_bf16(x, _stream_bits(j, before, keys, Stream.STATE + i)))
        else:
            s.copy_(x.to(s.dtype))
    new, stalled = write_back.compiled_write(p, buf, w, u, lambda stream: _stream_bits(j, before, keys, stream),
                                             count)
    p.copy_(new)
    return stalled
