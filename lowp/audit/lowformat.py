"""A model of computing *entirely in the low format*, as a vector engine without fp32 would.

Model (documented in docs/audit.md): the engine has correctly rounded elementary operations
(``+ - * /``, ``sqrt``, via :class:`lowp.arith.Arith`) and a small set of correctly rounded
*primitives* — ``exp, exp2, log, log2, sin, cos, atan, tanh, erf, erfinv`` — each returning the
float64 reference rounded once to the format. That is the best case for a hardware
transcendental unit. Every other op is the textbook formula built from those pieces, with every
intermediate rounded to the format; e.g. ``sigmoid = 1 / (1 + exp(-x))`` costs three roundings,
``tan = sin / cos`` two primitive roundings and one division. The audit's ``lowformat`` column is
therefore the error that low-format *intermediates* alone add, not the error of a particular
polynomial. Numerically stable textbook forms are used where the framework uses them
(``logsigmoid = min(x, 0) - log(1 + exp(-|x|))``), so the column isolates rounding, not blunders.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from lowp.arith import Arith
from lowp.audit import reference as ref
from lowp.rounding import quantize

__all__ = ["LowFormatMath", "PRIMITIVES"]

PRIMITIVES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sin": np.sin, "cos": np.cos,
    "atan": np.arctan, "tanh": np.tanh, "erf": ref.erf, "erfinv": ref.erfinv,
}


class LowFormatMath(Arith):
    """:class:`~lowp.arith.Arith` plus correctly rounded primitives and composite formulas.

    The constructor is :class:`~lowp.arith.Arith`'s, with the same checks.

    Args:
        format: the emulated format (name, dtype or :class:`~lowp.formats.FloatFormat`; at most
            25 significand bits, else ``ValueError``).
        mode: rounding of the elementary operations (default ``"nearest_even"``); the primitives
            always round to nearest even.
        generator: random source for ``mode="stochastic"`` (default ``None``: torch's global one).
    """

    def const(self, value: float) -> torch.Tensor:
        """The constant ``value`` rounded to the format, in the container dtype."""
        return self.cast(torch.tensor(value, dtype=torch.float64))

    def primitive(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``name(x)`` correctly rounded to the format (float64 reference, one rounding)."""
        with np.errstate(all="ignore"):
            exact = torch.from_numpy(np.asarray(PRIMITIVES[name](x.to(torch.float64).numpy()), dtype=np.float64))
        return quantize(exact, self.format).to(self.dtype)

    def __getattr__(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if name in PRIMITIVES:
            return lambda x: self.primitive(name, x)
        raise AttributeError(name)

    # -- composite ops, one rounding per step -------------------------------------------------
    def one_plus(self, x: torch.Tensor) -> torch.Tensor:
        """``1 + x``, one rounding."""
        return self.add(self.const(1.0), x)

    def recip(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / x``, one rounding."""
        return self.div(self.const(1.0), x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        """``1 / (1 + exp(-x))``: three roundings after the negation."""
        return self.recip(self.one_plus(self.exp(self.neg(x))))

    def log1p_exp_neg_abs(self, x: torch.Tensor) -> torch.Tensor:
        """``log(1 + exp(-|x|))``, the shared tail of logsigmoid and softplus."""
        return self.log(self.one_plus(self.exp(self.neg(x.abs()))))

    def formula(self, op: str, x: torch.Tensor) -> torch.Tensor:
        """Evaluate unary ``op`` by its textbook formula in the low format."""
        if op in PRIMITIVES:
            return self.primitive(op, x)
        one, half = self.const(1.0), self.const(0.5)
        f = {
            "expm1": lambda: self.sub(self.exp(x), one),
            "log10": lambda: self.mul(self.log2(x), self.const(math.log10(2.0))),
            "log1p": lambda: self.log(self.one_plus(x)),
            "sqrt": lambda: self.sqrt(x),
            "rsqrt": lambda: self.recip(self.sqrt(x)),
            "reciprocal": lambda: self.recip(x),
            "square": lambda: self.square(x),
            "tan": lambda: self.div(self.sin(x), self.cos(x)),
            "sinh": lambda: self.mul(half, self.sub(self.exp(x), self.exp(self.neg(x)))),
            "cosh": lambda: self.mul(half, self.add(self.exp(x), self.exp(self.neg(x)))),
            "asin": lambda: self.atan(self.div(x, self.sqrt(self.sub(one, self.square(x))))),
            "acos": lambda: self.mul(self.const(2.0),
                                     self.atan(self.sqrt(self.div(self.sub(one, x), self.one_plus(x))))),
            "asinh": lambda: self._odd(x, lambda a: self.log(self.add(a, self.sqrt(self.one_plus(self.square(a)))))),
            "acosh": lambda: self.log(self.add(x, self.sqrt(self.sub(self.square(x), one)))),
            "atanh": lambda: self.mul(half, self.log(self.div(self.one_plus(x), self.sub(one, x)))),
            "sigmoid": lambda: self.sigmoid(x),
            "logsigmoid": lambda: self.sub(torch.clamp(x, max=0.0), self.log1p_exp_neg_abs(x)),
            "silu": lambda: self.mul(x, self.sigmoid(x)),
            "gelu": lambda: self.mul(self.mul(half, x),
                                     self.one_plus(self.erf(self.mul(x, self.const(ref.SQRT_HALF))))),
            "gelu_tanh": lambda: self._gelu_tanh(x),
            "softplus": lambda: self.add(torch.clamp(x, min=0.0), self.log1p_exp_neg_abs(x)),
            "softsign": lambda: self.div(x, self.one_plus(x.abs())),
            "tanh_shrink": lambda: self.sub(x, self.tanh(x)),
        }.get(op)
        if f is None:
            raise ValueError(f"op: no low-format formula for {op!r}")
        return f()

    def _odd(self, x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Evaluate an odd function on ``|x|`` and restore the sign (exact)."""
        return torch.where(x < 0, -f(x.abs()), f(x.abs()))

    def _gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        cube = self.mul(self.mul(self.const(ref.GELU_TANH_A), x), self.square(x))
        z = self.mul(self.const(ref.GELU_TANH_C), self.add(x, cube))
        return self.mul(self.mul(self.const(0.5), x), self.one_plus(self.tanh(z)))
