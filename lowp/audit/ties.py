"""Settle the correct rounding of inputs whose float64 reference sits on or next to a midpoint.

A float64 reference that lies within ``2**-40`` (relative) of a midpoint between two neighbours
of the format could round the wrong way (:func:`lowp.audit.metrics.near_midpoint` finds them).
For those few inputs the op is evaluated again with mpmath at 256 bits, and, while the value
still equals the midpoint, at 4x the precision up to 65,536 bits (``tanh_shrink(-4096) =
-4095 - 2/(e^8192 + 1)`` would need ~12,000 bits, so it is evaluated as an exact sum of its two
parts instead). A value equal to the midpoint at the
largest precision is taken as an exact tie (e.g. ``exp2(-25) = 2**-25``) and rounds to even.
mpmath comes with torch (torch -> sympy -> mpmath).
"""
from __future__ import annotations

from collections.abc import Callable

import mpmath
import torch

from lowp.audit.metrics import correctly_rounded, near_midpoint
from lowp.formats import FloatFormat
from lowp.rounding import quantize

__all__ = ["MP_UNARY", "MP_BINARY", "settle_ties", "correct_results"]

_mp = mpmath.mp
MpFn = Callable[..., mpmath.mpf]


def _sigmoid(x: mpmath.mpf) -> mpmath.mpf:
    return 1 / (1 + _mp.exp(-x))


def _tanh_shrink(x: mpmath.mpf) -> mpmath.mpf:
    """``x - tanh(x)``; for |x| >= 1 as ``(x - s) + 2s / (e^(2|x|) + 1)`` (s = sign x) added exactly, so
    the tiny tail survives next to ``x - s`` without thousands of bits of working precision."""
    if abs(x) < 1:
        return x - _mp.tanh(x)
    s = _mp.sign(x)
    return mpmath.fadd(x - s, 2 * s / (_mp.exp(2 * abs(x)) + 1), exact=True)


def _gelu_tanh(x: mpmath.mpf) -> mpmath.mpf:
    z = _mp.sqrt(2 / _mp.pi) * (x + _mp.mpf("0.044715") * x**3)
    return x / 2 * (1 + _mp.tanh(z))


MP_UNARY: dict[str, MpFn] = {
    "exp": _mp.exp, "exp2": lambda x: _mp.power(2, x), "expm1": _mp.expm1, "log": _mp.log,
    "log2": lambda x: _mp.log(x, 2), "log10": _mp.log10, "log1p": _mp.log1p, "sqrt": _mp.sqrt,
    "rsqrt": lambda x: 1 / _mp.sqrt(x), "reciprocal": lambda x: 1 / x, "square": lambda x: x * x,
    "sin": _mp.sin, "cos": _mp.cos, "tan": _mp.tan, "sinh": _mp.sinh, "cosh": _mp.cosh, "tanh": _mp.tanh,
    "asin": _mp.asin, "acos": _mp.acos, "atan": _mp.atan, "asinh": _mp.asinh, "acosh": _mp.acosh,
    "atanh": _mp.atanh, "erf": _mp.erf, "erfinv": _mp.erfinv, "sigmoid": _sigmoid,
    "logsigmoid": lambda x: -_mp.log1p(_mp.exp(-x)), "silu": lambda x: x * _sigmoid(x),
    "gelu": lambda x: x / 2 * _mp.erfc(-x / _mp.sqrt(2)), "gelu_tanh": _gelu_tanh,
    "softplus": lambda x: _mp.log1p(_mp.exp(x)), "softsign": lambda x: x / (1 + abs(x)),
    "tanh_shrink": _tanh_shrink,
}

MP_BINARY: dict[str, Callable[[mpmath.mpf, mpmath.mpf], mpmath.mpf]] = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
    "pow": _mp.power, "atan2": _mp.atan2, "hypot": _mp.hypot,
}


def _side(fn: MpFn, args: tuple[float, ...], mid: float, max_bits: int) -> int:
    """Sign of ``fn(args) - mid`` (0 for an exact tie up to ``max_bits``)."""
    bits = 256
    while True:
        with mpmath.workprec(bits):
            diff = mpmath.fsub(fn(*(mpmath.mpf(a) for a in args)), mpmath.mpf(mid), exact=True)
        if diff != 0 or bits >= max_bits:
            return int(mpmath.sign(diff))
        bits *= 4


def settle_ties(fn: MpFn, inputs: tuple[torch.Tensor, ...], exact: torch.Tensor, fmt: FloatFormat,
                max_bits: int = 65536) -> torch.Tensor:
    """Correctly rounded results (float64) for the given inputs, decided in high precision.

    ``inputs`` are float64 tensors of equal length, ``exact`` their float64 references (used only
    to find the two neighbours of the format around the true value).
    """
    lo = quantize(exact, fmt, "down")
    hi = quantize(exact, fmt, "up")
    mid = (lo + hi) / 2  # exact in float64 for formats of <= 52 bits
    even = quantize(mid, fmt, native=False)
    out = even.clone()
    for i in range(exact.numel()):
        side = _side(fn, tuple(float(t[i]) for t in inputs), float(mid[i]), max_bits)
        if side:
            out[i] = hi[i] if side > 0 else lo[i]
    return out


def correct_results(fn: MpFn, inputs: tuple[torch.Tensor, ...], exact: torch.Tensor, fmt: FloatFormat,
                    exact_reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correctly rounded results, near-midpoint mask)``: ``exact`` rounded once to ``fmt``, with
    the references near a midpoint (none when ``exact_reference``) settled by :func:`settle_ties`."""
    correct = correctly_rounded(exact, fmt)
    doubtful = torch.zeros_like(exact, dtype=torch.bool) if exact_reference else near_midpoint(exact, fmt)
    if doubtful.any():
        correct[doubtful] = settle_ties(fn, tuple(t[doubtful] for t in inputs), exact[doubtful], fmt)
    return correct, doubtful
