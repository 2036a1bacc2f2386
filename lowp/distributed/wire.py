"""Wire formats for gradients: 8-bit elements with block scales, or plain 16/32-bit floats.

A :class:`WireFormat` says how a 1-D fp32 tensor travels: :func:`encode` turns it into one
``uint8`` buffer (the element codes followed by the block scales, so a piece travels in one
collective), :func:`decode` turns such a buffer back into fp32, and :func:`wire_bytes` gives the
buffer's size. The 8-bit elements (fp8 e4m3 / e5m2, int8) carry one scale per ``block``
consecutive elements (the last block may be partial); bf16, fp16 and fp32 carry no scale.

Block scales (blockwise quantized gradient communication as in ZeRO++'s qgZ, Wang et al. 2023,
"ZeRO++: Extremely Efficient Collective Communication for Giant Model Training",
arXiv:2306.10209; shared power-of-two scales as in the OCP Microscaling Formats (MX)
Specification v1.0, 2023, whose E8M0 scale type ``e8m0`` follows)::

    amax_b  = max_{i in b} |x_i|
    s_b     = round_up_S(amax_b / M)         M = the element format's largest finite value
    y_i     = fl32(x_i / s_b)                (|y_i| <= M: nothing saturates)
    code_i  = round_E(y_i)                   nearest-even, or stochastic with 16 random bits
    x^_i    = fl32(value(code_i) * s_b)      (decode)

``round_up_S`` rounds up to the scale format ``S``: fp32 or bf16 (the smallest value of that
format at or above the quotient; computed in fp64, where the quotient of an fp32 by ``M`` is
close enough that rounding it up gives the same result), or ``e8m0``: the smallest power of two
``2**e >= amax_b / M``, ``e`` clamped to ``[-127, 127]``, stored as the byte ``e + 127`` (255 is
NaN, as in the MX specification). Because ``s_b * M >= amax_b``, ``fl32(x_i / s_b)`` never
exceeds ``M`` (``M`` is an fp32 value and rounding is monotonic). Special blocks:

- a zero block gets scale 0 (for ``e8m0``, whose smallest code means ``2**-127``, the byte 0) and
  codes 0, so it decodes to exact zeros;
- a block holding a NaN or an infinity gets a NaN scale (``e8m0``: the byte 255) and codes 0, so
  the whole block decodes to NaN: a lowp optimizer's non-finite policy then skips the parameter,
  where a saturated or zeroed block would be a silent, wrong finite gradient.

The 16-bit formats round the value itself (nearest-even or stochastic); fp16 overflows to ±inf
beyond its range, which is non-finite too. fp32 is a copy.

Stochastic rounding rounds ``y`` up to the next representable code with probability
``floor(frac * 2**16) / 2**16`` (``frac``: the position of ``|y|`` between its two neighbouring
codes, in units of their spacing), from 16 random bits ``r`` per element: round up iff
``floor(frac * 2**16) + r >= 2**16``. That is unbiased up to ``2**-16`` of a spacing. The bits are
counter-based (:func:`lowp.optim.randomness.random16`: a function of a 32-bit key and the
element's *global* index), so they do not depend on how a tensor is cut into buckets or shards,
and a resumed run draws the same ones.

What one compression loses, ``x - decode(encode(x))``, is what error feedback (Seide et al. 2014,
"1-Bit Stochastic Gradient Descent and its Application to Data-Parallel Distributed Training of
Speech DNNs", Interspeech; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML) keeps and adds to the next gradient; see
:mod:`lowp.distributed.compressed`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

from lowp.blocks.scales import e8m0_decode, e8m0_encode
from lowp.rounding import quantize

__all__ = ["WireFormat", "ELEMENTS", "SCALES", "ROUNDINGS", "encode", "decode", "wire_bytes", "RandomSource"]

#: element name -> (torch dtype of the code, lowp format name or None for int8, largest finite value M)
_ELEMENTS: dict[str, tuple[torch.dtype, str | None, float]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, "fp8_e4m3fn", 448.0),
    "fp8_e5m2": (torch.float8_e5m2, "fp8_e5m2", 57344.0),
    "int8": (torch.int8, None, 127.0),
    "bf16": (torch.bfloat16, "bf16", float(torch.finfo(torch.bfloat16).max)),
    "fp16": (torch.float16, "fp16", 65504.0),
    "fp32": (torch.float32, "fp32", float(torch.finfo(torch.float32).max)),
}
ELEMENTS: tuple[str, ...] = tuple(_ELEMENTS)
SCALES: tuple[str, ...] = ("fp32", "bf16", "e8m0")
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
_SCALE_BYTES = {"fp32": 4, "bf16": 2, "e8m0": 1}
_BLOCKED = ("fp8_e4m3", "fp8_e5m2", "int8")
_MAX_BLOCK = 1 << 20

#: 16 random bits per element: an int key (counter-based bits of global indices ``first + j``),
#: an int32 tensor of bits in ``[0, 2**16)``, or a seeded ``torch.Generator``
RandomSource = Union[int, torch.Tensor, torch.Generator, None]


@dataclass(frozen=True)
class WireFormat:
    """How a gradient travels.

    Args:
        element: ``"fp8_e4m3"`` (default; OCP E4M3, no infinities, largest 448), ``"fp8_e5m2"``
            (largest 57344), ``"int8"`` (symmetric, codes -127..127), or ``"bf16"``, ``"fp16"``,
            ``"fp32"`` (no scales).
        block: elements per scale, a power of two from 1 to 2**20 (default 32, the MX block);
            ignored (but still checked) for the 16/32-bit elements.
        scale: the scales' format, ``"e8m0"`` (default; a power of two in one byte), ``"bf16"`` or
            ``"fp32"``.
        rounding: ``"nearest"`` (default; ties to even) or ``"stochastic"`` (unbiased, needs
            random bits).

    Bytes per element: 1 + (scale bytes) / block for 8-bit elements (1.03125 with the defaults),
    2 or 4 otherwise (:func:`wire_bytes`).
    """

    element: str = "fp8_e4m3"
    block: int = 32
    scale: str = "e8m0"
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.element not in _ELEMENTS:
            raise ValueError(f"element: expected one of {', '.join(map(repr, ELEMENTS))}, got {self.element!r}")
        block = self.block
        if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
            raise ValueError(f"block: expected a positive power of two (elements per scale, e.g. 32, 64, 128), "
                             f"got {block!r}")
        if block > _MAX_BLOCK:
            raise ValueError(f"block: expected at most {_MAX_BLOCK} elements per scale, got {block}")
        if self.scale not in SCALES:
            raise ValueError(f"scale: expected one of {', '.join(map(repr, SCALES))}, got {self.scale!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding: expected 'nearest' or 'stochastic', got {self.rounding!r}")

    @property
    def blocked(self) -> bool:
        """True for the 8-bit elements, which carry a scale per block."""
        return self.element in _BLOCKED

    @property
    def element_bytes(self) -> int:
        """Bytes of one element code."""
        return _ELEMENTS[self.element][0].itemsize

    @property
    def max(self) -> float:
        """The element format's largest finite value ``M``."""
        return _ELEMENTS[self.element][2]

    def __str__(self) -> str:
        if not self.blocked:
            return f"{self.element}/{self.rounding}"
        return f"{self.element}/{self.block}x{self.scale}/{self.rounding}"


def wire_bytes(fmt: WireFormat, n: int) -> int:
    """Bytes of :func:`encode`'s buffer for ``n`` elements: codes, then one scale per (possibly
    partial) block for the 8-bit elements."""
    if not isinstance(fmt, WireFormat):
        raise TypeError(f"fmt: expected a WireFormat, got {type(fmt).__name__}")
    codes = n * fmt.element_bytes
    return codes + (-(-n // fmt.block) * _SCALE_BYTES[fmt.scale] if fmt.blocked else 0)


def _noise(random: RandomSource, n: int, first: int, device: torch.device) -> torch.Tensor:
    """16 random bits per element as int32 in ``[0, 2**16)``."""
    if random is None:
        raise ValueError("random: stochastic rounding needs random bits (an int key, an int32 tensor of 16-bit "
                         "values, or a torch.Generator), got None")
    if isinstance(random, torch.Generator):
        return torch.randint(0, 1 << 16, (n,), generator=random, dtype=torch.int32, device=random.device).to(device)
    if isinstance(random, torch.Tensor):
        if random.dtype != torch.int32 or random.numel() != n:
            raise ValueError(f"random: expected an int32 tensor of {n} values in [0, 2**16), got {random.dtype} with "
                             f"{random.numel()} elements")
        return random.reshape(-1).to(device)
    if isinstance(random, bool) or not isinstance(random, int):
        raise TypeError(f"random: expected an int key, an int32 tensor or a torch.Generator, got "
                        f"{type(random).__name__}")
    from lowp.optim.randomness import random16_range

    return random16_range(first, n, random & 0xFFFFFFFF, device)


def _check_input(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1 or x.layout != torch.strided:
        raise TypeError(f"x: expected a dense 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)} "
                        f"({x.layout})")
    return x.contiguous()


def _stochastic(y: torch.Tensor, noise: torch.Tensor, emin: int | None, mantissa_bits: int) -> torch.Tensor:
    """``y`` (fp32) rounded stochastically to a grid: integers (``emin is None``) or a binary float
    format with ``mantissa_bits`` and minimum exponent ``emin`` (unbounded above: the caller keeps
    ``|y|`` in range or lets the cast overflow). Every step is exact in fp32."""
    a = y.abs()
    if emin is None:
        q = torch.zeros_like(a)
    else:
        _, e = torch.frexp(a)                                   # a = f * 2**e, f in [0.5, 1)
        q = (torch.clamp(e - 1, min=emin) - mantissa_bits).to(torch.float32)
    n = a * torch.exp2(-q)                                      # exact: q >= emin - m keeps 2**-q finite
    low = torch.floor(n)
    up = (torch.floor((n - low) * 65536.0) + noise.to(torch.float32)) >= 65536.0
    r = (low + up.to(torch.float32)) * torch.exp2(q)
    return torch.where(torch.isnan(y), y, torch.copysign(r, y))


def _round_element(y: torch.Tensor, fmt: WireFormat, noise: torch.Tensor | None) -> torch.Tensor:
    """Element codes (in the element's torch dtype) of ``y`` (fp32, already scaled)."""
    dtype, name, _ = _ELEMENTS[fmt.element]
    if fmt.element == "fp32":
        return y.clone()
    if noise is None:
        if name is None:
            return torch.round(y).to(dtype)                    # half to even
        return quantize(y, name, "nearest").to(dtype)
    if fmt.element == "bf16":                                   # the bf16 bit trick: (bits + r) >> 16
        bits = y.view(torch.int32)
        patterns = torch.where(torch.isnan(y), bits | 0x00400000, bits + noise) >> 16
        return patterns.to(torch.int16).view(torch.bfloat16)
    if name is None:
        return _stochastic(y, noise, None, 0).to(dtype)
    emin, m = {"fp8_e4m3": (-6, 3), "fp8_e5m2": (-14, 2), "fp16": (-14, 10)}[fmt.element]
    return _stochastic(y, noise, emin, m).to(dtype)


def _round_up_scale(t: torch.Tensor, scale: str) -> torch.Tensor:
    """``t`` (fp64, >= 0 or NaN/inf) rounded up to the scale format, as fp32 values
    (e8m0: ``2**e``, ``e`` clamped to [-127, 127])."""
    if scale == "e8m0":
        f, e = torch.frexp(t)                                   # t = f * 2**e
        e = torch.where(f == 0.5, e - 1, e).clamp(-127, 127)
        return torch.ldexp(torch.ones_like(t), e).to(torch.float32)
    return quantize(t, scale, "up").to(torch.float32)


def encode(x: torch.Tensor, fmt: WireFormat, random: RandomSource = None, *, first: int = 0) -> torch.Tensor:
    """Encode the 1-D fp32 tensor ``x`` as one ``uint8`` buffer of :func:`wire_bytes` ``(fmt, n)``
    bytes: the codes, then (8-bit elements) one scale per block of ``fmt.block`` elements.

    Args:
        x: a dense 1-D float32 tensor (any values: NaN/inf blocks decode to NaN).
        fmt: the :class:`WireFormat`.
        random: the random bits of stochastic rounding (unused for nearest): an int key (element
            ``j`` draws :func:`lowp.optim.randomness.random16` of ``first + j`` under that key), an
            int32 tensor of ``n`` values in ``[0, 2**16)``, or a seeded ``torch.Generator``.
        first: the global index of ``x[0]`` for an int key (default 0).
    """
    x = _check_input(x)
    if not isinstance(fmt, WireFormat):
        raise TypeError(f"fmt: expected a WireFormat, got {type(fmt).__name__}")
    n = x.numel()
    noise = _noise(random, n, first, x.device) if fmt.rounding == "stochastic" else None
    if not fmt.blocked:
        return _round_element(x, fmt, noise).view(torch.uint8).reshape(-1)
    nb = -(-n // fmt.block)
    padded = torch.zeros(nb * fmt.block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, fmt.block)
    amax = blocks.abs().amax(dim=1)                            # NaN if a NaN is in the block, inf if an inf
    finite = torch.isfinite(amax)
    s = _round_up_scale(amax.double() / fmt.max, fmt.scale)
    live = finite & (amax > 0)
    y = torch.where(live[:, None], blocks / torch.where(live, s, 1.0)[:, None], 0.0)
    if noise is not None:
        padded_noise = torch.zeros(nb * fmt.block, dtype=torch.int32, device=x.device)
        padded_noise[:n] = noise
        noise = padded_noise
    codes = _round_element(y.reshape(-1), fmt, noise)[:n]
    if fmt.scale == "e8m0":   # a zero block: the byte 0 (2**-127 times codes 0); a NaN block: 0xFF
        scale_bytes = e8m0_encode(torch.where(finite, torch.where(amax > 0, s, 2.0**-127), math.nan))
    else:
        s = torch.where(finite, torch.where(amax > 0, s, 0.0), float("nan"))
        scale_bytes = s.to(torch.float32 if fmt.scale == "fp32" else torch.bfloat16).view(torch.uint8)
    return torch.cat([codes.view(torch.uint8), scale_bytes.reshape(-1)])


def decode(buffer: torch.Tensor, fmt: WireFormat, n: int) -> torch.Tensor:
    """The ``n`` fp32 values of an :func:`encode` buffer: ``fl32(value(code) * scale)`` per
    element; a NaN scale (a block that held NaN/inf) gives NaN over the whole block."""
    if not isinstance(fmt, WireFormat):
        raise TypeError(f"fmt: expected a WireFormat, got {type(fmt).__name__}")
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("buffer: expected a 1-D uint8 tensor (what encode returns)")
    if buffer.numel() != wire_bytes(fmt, n):
        raise ValueError(f"buffer: {buffer.numel()} bytes, but {n} elements of {fmt} take {wire_bytes(fmt, n)}")
    dtype = _ELEMENTS[fmt.element][0]
    size = n * fmt.element_bytes
    values = buffer[:size].clone().view(dtype).to(torch.float32)
    if not fmt.blocked:
        return values
    nb = -(-n // fmt.block)
    raw = buffer[size:].clone()
    if fmt.scale == "e8m0":
        s = e8m0_decode(raw).to(torch.float32)
    else:
        s = raw.view(torch.float32 if fmt.scale == "fp32" else torch.bfloat16).to(torch.float32)
    padded = torch.zeros(nb * fmt.block, dtype=torch.float32, device=buffer.device)
    padded[:n] = values
    return (padded.view(nb, fmt.block) * s[:, None]).reshape(-1)[:n]


def scale_of(amax: float, fmt: WireFormat) -> float:
    """The scale :func:`encode` gives a block whose largest magnitude is ``amax`` (a float; for
    documentation and tests)."""
    if not math.isfinite(amax):
        return math.nan
    if amax == 0:
        return 0.0
    return float(_round_up_scale(torch.tensor([amax / 1.0], dtype=torch.float64) / fmt.max, fmt.scale)[0])
