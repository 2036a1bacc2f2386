"""Block-scaled low-bit codes for optimizer states: 8-bit and 4-bit integers, fp8 e4m3 and e5m2.

A coded state of ``n`` elements keeps one small code ``q`` per element and one scale ``s`` per
block of ``B`` consecutive elements (row-major order of the whole tensor; the last block may be
short), in the spirit of block-wise quantization (Dettmers et al., "8-bit Optimizers via
Block-wise Quantization", ICLR 2022)::

    encode:  t = T(x)                          T(x) = x (signed codes), sqrt(x) (unsigned codes)
             s = up(max_block |t| / Q)         Q: the largest code; up: rounded up to the scale dtype
             k = fl(1 / s)                     once per block, in fp32
             q = R(t * k), clamped to [-Q, Q]  R: onto the code grid, stochastically or to nearest
                                               (unsigned codes: to [1, Q], never 0)
    decode:  x = T^-1(q * s)                   one fp32 multiply (and a square for unsigned codes)

``t * k`` stands for ``t / s``: it differs from the correctly rounded quotient by at most two fp32
ulps (two roundings instead of one, a relative change below ``3 * 2**-24``) before it is rounded
to a grid of 3 to 8 bits, so the codes are those of ``t / s`` except where ``t / s`` lies within
those ulps of a rounding boundary (to nearest: a tie; stochastically: a boundary of the 16-bit
draw), and the rounding is as unbiased as before. It saves a division per element, the most
expensive operation of the encoder. Where ``k`` is not finite (``s`` is 0 or NaN, or below about
``2**-128`` so that ``1 / s`` overflows) the block divides, ``t / s``.

Unsigned codes hold nonnegative states (Adam's second moment) through a square root, which
halves their dynamic range in bits; signed codes hold any state linearly. Unsigned codes never
store 0 in a block with a nonzero scale: a second moment decoded as 0 turns Adam's step
``m / (sqrt(v) + eps)`` into ``m / eps``, a step many orders of magnitude too large (Li et al.,
"Memory Efficient Optimizers with 4-bit States", NeurIPS 2023, exclude zero from their
second-moment map for this reason). A value below one code step is stored as one step instead,
a small overestimate of ``v`` that only shortens the step; measured on the demo model, 4-bit
second moments that may round to zero diverge to NaN within 60 steps. Rounding the scale up
keeps ``|t| / s <= Q`` (up to the roundings of ``t * k``, which the clamp absorbs), so no code
saturates; unsigned codes carry no sign (a ``-0.0`` state is stored as ``+0.0``). A block holding
a NaN or an infinity gets a NaN scale: it decodes to NaN everywhere (the value is lost either
way; this way the loss is visible).

The code grid (:class:`~lowp.optim.encodings.code.Code`, one module per encoding in
:mod:`lowp.optim.encodings`) is that of a small float format: its spacing at magnitude ``a``
is ``2**(max(e(a), emin) - m)`` with ``e(a) = floor(log2 a)``. Integer codes are the case
``emin = m``: spacing 1 everywhere below ``2**(m + 1)``. So ``q`` is computed the same way for
every code, from ``c = a / spacing`` (exact: a power-of-two scaling)::

    nearest:     R(a) = round_half_even(c) * spacing
    stochastic:  R(a) = (floor(c) + [floor(frac(c) * 2**16) + r >= 2**16]) * spacing

with ``r`` the 16 random bits of the element (:mod:`lowp.optim.randomness`), as lowp's 16-bit
stochastic rounding does (:mod:`lowp.optim.storage`): ``P(up) = frac(c)`` to 16 bits. Rounded
to nearest, a state whose change per step is below half a code step never moves: with
``beta2 = 0.999`` a second moment decays by 0.1% per step, far below an 8-bit step, so it
stops decaying; stochastic rounding keeps it unbiased (``E[R(a)] = a``).

The functions here are the definition, and the path for devices and layouts the native codec
does not take: the native codec (:mod:`lowp.optim.kernels.native.codec`) and the native step's
in-kernel decode and encode give the same bits, and every backend steps decoded states
(:mod:`lowp.optim.coded`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from lowp.arith import sqrt_rn
from lowp.optim.encodings import CODES, Code, code_for

__all__ = ["Code", "CODES", "code_for", "SCALE_DTYPES", "BLOCK_SIZES", "check_block", "codes_shape", "scales_shape",
           "stored_shapes", "encode", "decode", "scale_name"]

#: The dtypes a block scale may be stored in.
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The block sizes a group may ask for (``state_block``).
BLOCK_SIZES = (32, 64, 128, 256)


def scale_name(state: str) -> str:
    """The state-dict key of the block scales of coded state ``state``."""
    return f"{state}_scale"


def codes_shape(code: Code, shape: torch.Size) -> torch.Size:
    """The shape of the codes of a state of ``shape``: the same for 8-bit codes, a flat
    ``ceil(n / 2)`` bytes for 4-bit ones."""
    return shape if code.bits == 8 else torch.Size([(math.prod(shape) + 1) // 2])


def check_block(block: object, where: str = "block") -> None:
    """Raise ``ValueError`` naming ``where`` unless ``block`` is one of :data:`BLOCK_SIZES` (an int)."""
    if type(block) is not int or block not in BLOCK_SIZES:
        raise ValueError(f"{where}: expected one of {', '.join(map(str, BLOCK_SIZES))}, got {block!r}")


def scales_shape(numel: int, block: int) -> torch.Size:
    """The shape of the scales of ``numel`` elements in blocks of ``block``."""
    return torch.Size([(numel + block - 1) // block])


def stored_shapes(code: Code, shape: Sequence[int], block: int) -> tuple[torch.Size, torch.Size]:
    """The shapes of the codes and of the block scales that a state of ``shape`` keeps (the same
    bytes as the flat :func:`codes_shape` and :func:`scales_shape`, in the same order).

    When the last dimension holds whole blocks (``shape[-1] % block == 0``), both keep the leading
    dimensions: codes ``shape`` (4-bit codes: the last dimension halved), scales ``shape[:-1] +
    (shape[-1] // block,)``. Then a box of the state that takes whole rows, or whole-block ranges
    of the last dimension, has its codes and scales in the same box of theirs; that is how a
    parameter sharded along any dimension keeps whole blocks per shard
    (:func:`lowp.optim.sharding.coded_placements`). Otherwise both are flat. ``block`` must be one
    of :data:`BLOCK_SIZES` (``ValueError``)."""
    check_block(block)
    shape = torch.Size(shape)
    if len(shape) == 0 or shape[-1] % block:
        return codes_shape(code, shape), scales_shape(math.prod(shape), block)
    last = shape[-1] // 2 if code.bits == 4 else shape[-1]
    return torch.Size([*shape[:-1], last]), torch.Size([*shape[:-1], shape[-1] // block])


def _round_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The nonnegative fp32 ``s`` (or NaN) rounded up to ``dtype``: the smallest value of
    ``dtype`` at least ``s`` (bf16: ``(bits + 0xFFFF) >> 16`` on the bit pattern)."""
    if dtype == torch.float32:
        return s.clone()
    if dtype == torch.bfloat16:
        nan = s.isnan()
        up = ((s.view(torch.int32) + 0xFFFF) >> 16).to(torch.int16).view(torch.bfloat16)
        return torch.where(nan, torch.full_like(up, math.nan), up)
    near = s.to(dtype)
    below = near.float() < s                  # positive values: the next one up has bits + 1
    return torch.where(below, (near.view(torch.int16) + 1).view(dtype), near)


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """The flat ``t`` as rows of ``block`` elements, the last one padded with zeros."""
    pad = -t.numel() % block
    if pad:
        t = torch.cat([t, t.new_zeros(pad)])
    return t.view(-1, block)


def encode(x: torch.Tensor, code: Code, block: int, codes: torch.Tensor, scales: torch.Tensor,
           noise: torch.Tensor | None) -> None:
    """Write the codes and block scales of the fp32 values ``x`` (any shape, taken row-major)
    into ``codes`` (:func:`codes_shape`, ``code.storage``) and ``scales`` (:func:`scales_shape`,
    one of :data:`SCALE_DTYPES`); the module docstring has the formulas.

    ``noise`` (int32 in ``[0, 2**16)``, ``x``'s element count) rounds stochastically; ``None``
    rounds to nearest (ties to even)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    t = flat if code.signed else sqrt_rn(flat)
    rows = _blocks(t, block)
    peak = rows.abs().amax(dim=1)
    # a tensor divisor: CUDA divides by a Python number as a product with its rounded reciprocal
    top = torch.full_like(peak, code.top)
    scale = _round_up(torch.where(peak.isfinite(), peak / top, math.nan), scales.dtype)
    scales.copy_(scale)
    s = scale.float()[:, None]
    k = 1.0 / s                                    # the reciprocal, rounded once per block
    y = torch.where(k.isfinite(), rows * k, rows / s).reshape(-1)[:n]
    y = torch.where(y.isfinite(), y, 0.0)          # zero blocks (0 / 0) and non-finite ones
    a = y.abs()
    step = code.spacing(a)
    c = a / step
    if noise is None:
        m = torch.round(c)
    else:
        low = torch.floor(c)
        up = torch.floor((c - low) * 65536.0) + noise.reshape(-1).float() >= 65536.0
        m = low + up
    q = torch.clamp(m * step, 0.0 if code.signed else 1.0, code.top)
    if code.signed:
        q = q.copysign(y)
    codes.view(-1).copy_(code.pack(q))             # on the grid: the storage holds it exactly


def decode(codes: torch.Tensor, scales: torch.Tensor, code: Code, block: int, numel: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``numel`` coded elements (flat; into ``out`` when given): ``q * s``,
    squared for unsigned codes."""
    q = code.unpack(codes, numel)
    s = scales.float().repeat_interleave(block)[:numel]
    y = torch.mul(q, s) if out is None else torch.mul(q, s, out=out)
    return y if code.signed else y.mul_(y)
