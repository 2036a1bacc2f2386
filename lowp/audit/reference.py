"""Float64 reference functions for the audit (numpy and :mod:`math`, not torch).

torch's CPU kernels are not always correctly rounded even in float64 (its ``sqrt`` is not, on
torch 2.13 with MKL), so the references use numpy's float64 ufuncs (glibc libm, errors well under
one float64 ulp) and Python's :func:`math.erf`/:func:`math.erfc`. Formulas are chosen to avoid
cancellation: ``1 + erf(z)`` is written ``erfc(-z)``, ``1 + tanh(z)`` as ``2 sigmoid(2z)``,
``x - tanh(x)`` by its Taylor series for ``|x| < 1/64``. A float64 value with relative error
``d`` rounds to a 16-bit format correctly unless it lies within ``d`` of a rounding midpoint;
:func:`lowp.audit.metrics.near_midpoint` counts those rare inputs.
"""
from __future__ import annotations

import math

import numpy as np

SQRT_HALF = math.sqrt(0.5)
GELU_TANH_C = math.sqrt(2.0 / math.pi)
GELU_TANH_A = 0.044715

_erf = np.frompyfunc(math.erf, 1, 1)
_erfc = np.frompyfunc(math.erfc, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function in float64, elementwise (:func:`math.erf`)."""
    return _erf(x).astype(np.float64)


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function ``1 - erf(x)`` in float64, without cancellation for large x."""
    return _erfc(x).astype(np.float64)


def erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function on (-1, 1) by Newton's method on ``math.erf``/``math.erfc``.

    Start: Giles' single-precision approximation (Giles, "Approximating the erfinv function",
    GPU Computing Gems, 2011) refined by 4 Newton steps ``x -= r / (2/sqrt(pi) exp(-x^2))``; the
    residual ``r = erf(x) - y`` is formed as ``sign(y) ((1-|y|) - erfc(|x|))`` for ``|y| >= 1/2``,
    where ``1 - |y|`` is exact, so the tail keeps full relative accuracy.
    """
    y = np.asarray(y, dtype=np.float64)
    w = -np.log((1.0 - y) * (1.0 + y))
    small = w < 5.0
    ws = w - 2.5
    wl = np.sqrt(np.maximum(w, 5.0)) - 3.0
    ps = np.polyval([2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                     -0.00125372503, -0.00417768164, 0.246640727, 1.50140941], ws)
    pl = np.polyval([-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                     -0.0076224613, 0.00943887047, 1.00167406, 2.83297682], wl)
    x = np.where(small, ps, pl) * y
    a = np.abs(y)
    for _ in range(4):
        r = np.where(a < 0.5, erf(x) - y, np.sign(y) * ((1.0 - a) - erfc(np.abs(x))))
        x = x - r / (2.0 / math.sqrt(math.pi) * np.exp(-x * x))
    return x


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))``, computed from ``exp(-|x|)`` so that it never overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def logsigmoid(x: np.ndarray) -> np.ndarray:
    """``log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|))``."""
    return np.minimum(x, 0.0) - np.log1p(np.exp(-np.abs(x)))


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|))``."""
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """``x Phi(x) = x erfc(-x/sqrt 2) / 2`` (no cancellation for negative x)."""
    return 0.5 * x * erfc(-x * SQRT_HALF)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """``x (1 + tanh(z)) / 2 = x sigmoid(2z)``, ``z = sqrt(2/pi) (x + 0.044715 x^3)``."""
    z = GELU_TANH_C * (x + GELU_TANH_A * x * x * x)
    return x * sigmoid(2.0 * z)


def tanh_shrink(x: np.ndarray) -> np.ndarray:
    """``x - tanh(x)``; for ``|x| < 1/64`` the series ``x^3/3 - 2x^5/15 + 17x^7/315 - 62x^9/2835``."""
    x2 = x * x
    series = x * x2 * (1.0 / 3 + x2 * (-2.0 / 15 + x2 * (17.0 / 315 - x2 * 62.0 / 2835)))
    return np.where(np.abs(x) < 1.0 / 64, series, x - np.tanh(x))

