"""Scale formats of block formats and the scale roundings in use.

A block of elements ``x_i`` shares one scale ``S``; the stored elements are ``e_i = round(x_i / S)``
in the element format and the block decodes as ``S * e_i``. The scale is chosen from the block's
largest magnitude ``amax`` by a *scale rounding*:

Power-of-two scales (``e8m0``; ``emax`` is the element format's largest exponent, ``max`` its
largest value):

``"floor"``  ``S = 2**(floor(log2 amax) - emax)`` (OCP MX v1.0, section 6.3: the element holding
             ``amax`` lands in the element's top binade; ``amax / S`` may exceed ``max`` and saturate).
``"ceil"``   ``S = 2**(ceil(log2 amax) - emax)`` (never saturates, may waste one binade).
``"rceil"``  ``S = 2**ceil(log2(amax / max))``: the smallest power of two with ``amax / S <= max``
             (Mishra et al. 2025, "Recipes for Pre-training LLMs with MXFP8", arXiv:2506.08027;
             NVIDIA cuBLAS's block-scaling rule).
``"even"``   ``S = 2**(floor(log2 rne_p(amax)) - emax)``: ``amax`` first rounded to the element's
             precision ``p = mantissa_bits + 1`` (nearest-even, unbounded exponent), so a block max
             that would round up out of the top binade moves the scale up one binade
             (torchao's ``ScaleCalculationMode.EVEN``).

Non-power-of-two scales (``e4m3`` as in NVFP4, ``bf16``, ``fp32``) round ``v = amax / (max * t)``
to the scale format, where ``t`` is an optional per-tensor fp32 scale (1 without one): ``"floor"``
rounds ``v`` down, ``"ceil"`` and ``"rceil"`` round it up (so ``amax / S <= max``), ``"even"``
rounds it to nearest-even (NVFP4's rule). ``v`` is computed in fp64 from fp32-or-narrower
operands: its rounding error (``<= 2**-53`` relative) is smaller than the distance from the exact
quotient to any rounding boundary of a format of at most 24 bits that it is not on, so the
rounding is that of the exact quotient.

A scale below the format's smallest positive value (a zero block, or a block far smaller than the
tensor) is clamped up to that value: every element is still the rounding of ``x_i / S``. A scale
above the format's largest value is an error (``ValueError`` naming ``x``): the scale format cannot
hold that block's exponent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize

ScaleRounding = Literal["floor", "ceil", "rceil", "even"]
SCALE_ROUNDINGS: tuple[str, ...] = ("floor", "ceil", "rceil", "even")

E8M0_BIAS = 127
E8M0_NAN = 0xFF

__all__ = ["ScaleFormat", "SCALE_FORMATS", "SCALE_ROUNDINGS", "ScaleRounding", "get_scale_format", "e8m0_encode",
           "e8m0_decode", "block_scales"]


@dataclass(frozen=True)
class ScaleFormat:
    """A format for block scales: ``e8m0`` (``float_format=None``) or the positive values of a float format.

    e8m0 (OCP MX v1.0, section 5.4.1): 8 exponent bits, bias 127, no sign, no mantissa, no zero;
    code ``c`` in [0, 254] is ``2**(c - 127)`` and ``0xFF`` is NaN.

    Args:
        name: the name :func:`get_scale_format` finds it by.
        float_format: the float format whose non-negative values are the scales (``None`` for e8m0).
    """

    name: str
    float_format: FloatFormat | None = None

    def __post_init__(self) -> None:
        if self.float_format is not None and not isinstance(self.float_format, FloatFormat):
            raise ValueError(f"float_format: expected a FloatFormat or None, got {type(self.float_format).__name__}")

    @property
    def power_of_two(self) -> bool:
        """Whether every scale is a power of two (e8m0)."""
        return self.float_format is None

    @property
    def bits(self) -> int:
        """Storage bits per scale (8 for e8m0 and for e4m3, whose sign bit is unused)."""
        return 8 if self.float_format is None else self.float_format.bits

    @property
    def min(self) -> float:
        """Smallest positive scale."""
        return math.ldexp(1.0, -E8M0_BIAS) if self.float_format is None else self.float_format.min_subnormal

    @property
    def max(self) -> float:
        """Largest finite scale."""
        return math.ldexp(1.0, E8M0_BIAS) if self.float_format is None else self.float_format.max


SCALE_FORMATS: dict[str, ScaleFormat] = {
    "e8m0": ScaleFormat("e8m0"),
    "e4m3": ScaleFormat("e4m3", get_format("fp8_e4m3fn")),
    "bf16": ScaleFormat("bf16", get_format("bf16")),
    "fp32": ScaleFormat("fp32", get_format("fp32")),
}


def get_scale_format(spec: "str | ScaleFormat") -> ScaleFormat:
    """A scale format by name (``"e8m0"``, ``"e4m3"``, ``"bf16"``, ``"fp32"``) or passed through."""
    if isinstance(spec, ScaleFormat):
        return spec
    if isinstance(spec, str) and spec.lower() in SCALE_FORMATS:
        return SCALE_FORMATS[spec.lower()]
    raise ValueError(f"scale_format: unknown scale format {spec!r}; expected one of {', '.join(SCALE_FORMATS)}")


def e8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 codes of power-of-two ``scales`` in [2**-127, 2**127] (NaN -> ``0xFF``)."""
    s = scales.to(torch.float64)
    _, e = torch.frexp(torch.nan_to_num(s, nan=1.0))
    finite_pow2 = torch.isnan(s) | (torch.ldexp(torch.ones_like(s), (e - 1).to(torch.float64)) == s)
    if not bool(finite_pow2.all()) or bool(((e - 1 < -E8M0_BIAS) | (e - 1 > E8M0_BIAS)).any()):
        raise ValueError("scales: e8m0 holds only powers of two in [2**-127, 2**127] and NaN")
    return torch.where(torch.isnan(s), E8M0_NAN, e - 1 + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of uint8 e8m0 ``codes``: ``2**(c - 127)``, NaN for ``0xFF``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected a uint8 tensor, got dtype {codes.dtype}")
    c = codes.to(torch.int64)
    v = torch.ldexp(torch.ones(c.shape, dtype=torch.float64), (c - E8M0_BIAS).to(torch.float64))
    return torch.where(c == E8M0_NAN, math.nan, v)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for positive finite float64 ``a`` (exact, via frexp), as int64."""
    return torch.frexp(a)[1].to(torch.int64) - 1


def block_scales(amax: torch.Tensor, element: FloatFormat, scale_format: ScaleFormat, rounding: str,
                 tensor_scale: float = 1.0) -> torch.Tensor:
    """Block scales (float64) for block maxima ``amax`` (finite, non-negative, float64).

    The formulas are those of the module docstring; ``tensor_scale`` divides ``amax`` first and is
    only allowed with non-power-of-two scale formats. Raises ``ValueError`` naming ``x`` when a
    scale exceeds the scale format's largest value.
    """
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding: expected one of {', '.join(SCALE_ROUNDINGS)}, got {rounding!r}")
    positive = amax > 0
    a = torch.where(positive, amax, 1.0)
    if scale_format.power_of_two:
        e = _floor_log2(a)
        if rounding == "floor":
            k = e - element.emax
        elif rounding == "ceil":
            k = e + (torch.ldexp(torch.ones_like(a), e.to(a.dtype)) != a).to(torch.int64) - element.emax
        elif rounding == "even":
            p = element.mantissa_bits + 1
            significand = torch.ldexp(a, (p - 1 - e).to(a.dtype))   # in [2**(p-1), 2**p), exact
            k = e + (torch.round(significand) == 2**p).to(torch.int64) - element.emax
        else:  # rceil: smallest k with amax <= max * 2**k; it is e - emax or one more
            k = e - element.emax
            k = k + (torch.ldexp(a, (-k).to(a.dtype)) > element.max).to(torch.int64)
        k = torch.where(positive, k, -E8M0_BIAS).clamp(min=-E8M0_BIAS)
        too_big = k > E8M0_BIAS
        if bool(too_big.any()):
            worst = int(k.max())
            raise ValueError(f"x: a block needs the scale 2**{worst}, beyond e8m0's largest 2**127 for "
                             f"{element.name} elements; use a wider element format or scale x down")
        return torch.ldexp(torch.ones_like(a), k.to(a.dtype))
    fmt = scale_format.float_format
    assert fmt is not None
    v = amax / (element.max * tensor_scale)
    mode = {"floor": "down", "ceil": "up", "rceil": "up", "even": "nearest_even"}[rounding]
    nearest = quantize(v, fmt.with_overflow("nan" if fmt.has_nan else "saturate"), "nearest_even", native=False)
    s = quantize(v, fmt.with_overflow("nan" if fmt.has_nan else "saturate"), mode, native=False)
    if bool((torch.isnan(s) | torch.isnan(nearest) | torch.isinf(s)).any()):
        raise ValueError(f"x: a block max needs a scale beyond {scale_format.name}'s largest value "
                         f"{scale_format.max:g} for {element.name} elements; use a per-tensor scale "
                         f"(tensor_scale) or a wider scale format")
    return torch.clamp(s, min=scale_format.min)
