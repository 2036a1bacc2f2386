"""Bit-level encoding: every code of a format, decoded exactly to float64, and back.

Used wherever lowp must be exhaustive (all 65,536 values of a 16-bit format) or must
count distances in units in the last place.
"""
from __future__ import annotations

import math

import torch

from lowp.formats import FloatFormat, get_format
from lowp.pow2 import scale_pow2, ulp_exponent

__all__ = ["decode", "encode", "all_codes", "all_values"]


def decode(codes: torch.Tensor, format: "str | torch.dtype | FloatFormat") -> torch.Tensor:
    """Values (float64) of integer ``codes`` laid out as sign | exponent | mantissa."""
    fmt = get_format(format)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes: expected an integer torch.Tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes: expected an integer tensor, got dtype {codes.dtype}")
    c = codes.to(torch.int64)
    if ((c < 0) | (c >= 2**fmt.bits)).any():
        raise ValueError(f"codes: values must lie in [0, 2**{fmt.bits}) for {fmt.name}")
    m = fmt.mantissa_bits
    mant = c & (2**m - 1)
    expf = (c >> m) & (2**fmt.exponent_bits - 1)
    sign = (c >> (fmt.bits - 1)) & 1
    f64 = torch.float64
    normal = torch.ldexp(1.0 + mant.to(f64) / 2.0**m, (expf - fmt.bias).to(f64))
    sub = torch.ldexp(mant.to(f64), torch.full_like(mant, fmt.emin - m).to(f64))
    if not fmt.subnormals:
        sub = torch.where(mant == 0, torch.zeros_like(sub), torch.full_like(sub, float("nan")))
    mag = torch.where(expf == 0, sub, normal)
    top = expf == 2**fmt.exponent_bits - 1
    if fmt.special == "ieee":
        mag = torch.where(top & (mant == 0), torch.full_like(mag, math.inf), mag)
        mag = torch.where(top & (mant != 0), torch.full_like(mag, math.nan), mag)
    elif fmt.special == "finite_nan":
        mag = torch.where(top & (mant == 2**m - 1), torch.full_like(mag, math.nan), mag)
    out = torch.where(sign == 1, -mag, mag)
    if fmt.special == "fnuz":
        out = torch.where((sign == 1) & (expf == 0) & (mant == 0), torch.full_like(out, math.nan), out)
    return out


def all_codes(format: "str | torch.dtype | FloatFormat") -> torch.Tensor:
    """Every code of a format of at most 24 bits, as int64."""
    fmt = get_format(format)
    if fmt.bits > 24:
        raise ValueError(f"format: {fmt.name} has {fmt.bits} bits; enumeration is limited to 24")
    return torch.arange(2**fmt.bits, dtype=torch.int64)


def all_values(format: "str | torch.dtype | FloatFormat", *, finite: bool = True) -> torch.Tensor:
    """Every value of the format (float64), sorted, each once; ``finite=False`` keeps ±inf."""
    fmt = get_format(format)
    v = decode(all_codes(fmt), fmt)
    keep = torch.isfinite(v) if finite else ~torch.isnan(v)
    return torch.unique(v[keep])  # -0 and +0 compare equal and merge


def encode(values: torch.Tensor, format: "str | torch.dtype | FloatFormat") -> torch.Tensor:
    """Codes (int64) of ``values``, which must be exactly representable (NaN maps to a NaN code)."""
    fmt = get_format(format)
    if not isinstance(values, torch.Tensor) or values.is_complex():
        got = f"dtype {values.dtype}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise TypeError(f"values: expected a real torch.Tensor, got {got}")
    v = values.to(torch.float64)
    m = fmt.mantissa_bits
    mag = v.abs()
    q = ulp_exponent(mag, fmt)                     # mag = (2**m + frac) * 2**q, or frac * 2**q below min_normal
    is_sub = mag < fmt.min_normal
    expf = torch.where(is_sub, torch.zeros_like(q), q + m + fmt.bias).to(torch.int64)  # type: ignore[operator]
    frac = scale_pow2(mag, -q) - torch.where(is_sub, 0.0, 2.0**m)
    finite = torch.isfinite(v)
    if (finite & (frac != torch.round(frac))).any() or (finite & (mag > fmt.max)).any():
        raise ValueError(f"values: not all exactly representable in {fmt.name}; quantize them first")
    mant = torch.where(finite, frac, torch.zeros_like(frac)).to(torch.int64)
    sign = torch.signbit(v).to(torch.int64) if fmt.has_negative_zero else (v < 0).to(torch.int64)
    code = (sign << (fmt.bits - 1)) | (expf << m) | mant
    top = 2**fmt.exponent_bits - 1
    if fmt.special == "ieee":
        code = torch.where(torch.isinf(v), (sign << (fmt.bits - 1)) | (top << m), code)
        code = torch.where(torch.isnan(v), torch.full_like(code, (top << m) | (1 << max(m - 1, 0))), code)
    elif fmt.has_nan:
        nan_code = 1 << (fmt.bits - 1) if fmt.special == "fnuz" else (top << m) | (2**m - 1)
        if torch.isinf(v).any():
            raise ValueError(f"values: {fmt.name} has no infinity")
        code = torch.where(torch.isnan(v), torch.full_like(code, nan_code), code)
    elif (~finite).any():
        raise ValueError(f"values: {fmt.name} has no NaN or infinity")
    return code
