"""Emulated arithmetic: every operation correctly rounded to a chosen format.

``Arith("fp16")`` behaves like a machine whose only floating-point type is fp16: each ``add``,
``mul``, ``div``, ``sqrt`` ... is computed once in a wider *container* and rounded once to the
format. This is exact emulation, not an approximation: for +, -, *, / and sqrt, rounding the
correctly rounded container result again to a p-bit format gives the correctly rounded p-bit
result whenever the container has at least ``2p + 2`` significand bits (Figueroa, "When is
double rounding innocuous?", SIGNUM 1995). fp32 (24 bits) therefore serves formats up to 11
bits (fp16, bf16, fp8, DLFloat16) as long as the range fits; fp64 serves up to 25 bits.

Values are plain tensors in the container dtype that hold format values, so an ``Arith`` can be
mixed with torch code that only moves, compares or selects them (those are exact).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lowp.formats import FloatFormat, get_format
from lowp.pow2 import scale_pow2
from lowp.rounding import fits_in, quantize

__all__ = ["Arith", "recursive_sum", "sqrt_rn"]


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float tensor (a new tensor).

    torch's CPU ``sqrt`` of fp32 tensors calls MKL's vector math library, whose default accuracy
    mode is about 1 ulp, not correct rounding (with torch 2.13, 490 of 77,000 values of ``0.001 *
    g**2`` with normal ``g`` differ from the correctly rounded root). On the CPU an fp32 root is
    therefore taken in fp64 and rounded once more, which is correct rounding (53 >= 2 * 24 + 2,
    Figueroa 1995); other dtypes and devices use ``torch.sqrt`` (correctly rounded there)."""
    if x.dtype == torch.float32 and x.is_cpu:
        return torch.sqrt(x.double()).float()
    return torch.sqrt(x)


class Arith:
    """Arithmetic rounded to ``format`` after every operation (round to nearest even by default).

    Args:
        format: the emulated format: a name (``"fp16"``, ``"bf16"``, ``"e4m3"`` ...), a torch
            dtype or a :class:`~lowp.formats.FloatFormat`. The container is fp32 for formats of at
            most 11 significand bits whose range fits fp32, else fp64 (up to 25 bits, e.g. fp32
            itself); a wider format (fp64) raises ``ValueError``, as does an unknown name.
        mode: rounding mode of every operation, one of :data:`lowp.rounding.ROUNDING_MODES` or an alias
            (``"nearest"``, ``"rtz"``, ``"sr"`` ...); default ``"nearest_even"``. An unknown mode
            raises ``ValueError`` at the first rounding.
        generator: random source for ``mode="stochastic"`` (seed it for reproducible results);
            ``None`` (default) uses torch's global generator. Ignored by the other modes.

    Example::

        >>> import torch
        >>> a = Arith("fp16")
        >>> x = a.cast(torch.tensor([60000.0]))
        >>> a.mul(x, x)          # overflows like real fp16
        tensor([inf])
    """

    def __init__(self, format: "str | torch.dtype | FloatFormat", mode: str = "nearest_even", *,
                 generator: torch.Generator | None = None) -> None:
        self.format = get_format(format)
        self.mode = mode
        self.generator = generator
        p = self.format.precision
        fp32 = get_format("fp32")
        if 2 * p + 2 <= fp32.precision and fits_in(self.format, fp32):
            self.dtype = torch.float32
        elif 2 * p + 2 <= get_format("fp64").precision and fits_in(self.format, get_format("fp64")):
            self.dtype = torch.float64
        else:
            raise ValueError(f"format: {self.format.name} is too wide to emulate exactly (needs 2p+2 <= 53)")

    def __repr__(self) -> str:
        return f"Arith({self.format.name!r}, mode={self.mode!r}, container={self.dtype})"

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Round a container value to the format (one rounding)."""
        return quantize(x, self.format, self.mode, generator=self.generator)

    def cast(self, x: "torch.Tensor | float") -> torch.Tensor:
        """Bring any value into the container, rounded once to the format (a float64 input is
        rounded from float64 directly, never through float32)."""
        t = torch.as_tensor(x)
        if not t.is_floating_point():
            t = t.to(torch.float64)
        if t.dtype != torch.float64:
            t = t.to(self.dtype)
        return quantize(t, self.format, self.mode, generator=self.generator).to(self.dtype)

    def _op(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        return self.round(fn(*(torch.as_tensor(a, dtype=self.dtype) for a in args)))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a + b``, one rounding."""
        return self._op(torch.add, a, b)

    def sub(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a - b``, one rounding."""
        return self._op(torch.sub, a, b)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a * b``, one rounding."""
        return self._op(torch.mul, a, b)

    def div(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a / b``, one rounding (IEEE division by zero: ``±inf`` or NaN)."""
        return self._op(torch.div, a, b)

    def sqrt(self, a: torch.Tensor) -> torch.Tensor:
        """Correctly rounded square root. torch's CPU ``sqrt`` is not correctly rounded (seen on
        torch 2.13 with MKL, in fp32 and fp64), so it is taken in float64, whose few-ulp error
        cannot move a result across a rounding boundary of a format of <= 24 bits: the square root
        of a p-bit number lies at least about 2**-2p relative away from every midpoint."""
        a64 = torch.as_tensor(a).to(torch.float64)
        return quantize(torch.sqrt(a64), self.format, self.mode, generator=self.generator).to(self.dtype)

    def square(self, a: torch.Tensor) -> torch.Tensor:
        """``a * a``, one rounding."""
        return self._op(torch.square, a)

    def neg(self, a: torch.Tensor) -> torch.Tensor:
        """``-a`` (exact: no rounding)."""
        return -torch.as_tensor(a, dtype=self.dtype)

    def scale2(self, a: torch.Tensor, k: "int | torch.Tensor") -> torch.Tensor:
        """``a * 2**k`` rounded to the format (exact unless it leaves the normal range)."""
        return self.round(scale_pow2(torch.as_tensor(a, dtype=self.dtype), torch.as_tensor(k, dtype=torch.float64)))

    def sum(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Left-to-right sequential sum along ``dim``, rounding after every addition (stagnates in
        long low-precision sums; see :mod:`lowp.summation` for the compensated ones)."""
        return recursive_sum(self.add, torch.as_tensor(x, dtype=self.dtype), dim)


def recursive_sum(add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int = -1,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Recursive summation (Higham, *Accuracy and Stability*, 2nd ed., sec. 4.1):
    ``(((0 + x_0) + x_1) + ...) + x_{n-1}`` along ``dim``, every addition done by ``add`` (so
    rounded however ``add`` rounds). The running sum starts as zeros of ``dtype`` (default
    ``x.dtype``); one vector ``add`` per element of ``dim``, over all other dimensions at once."""
    x = x.movedim(dim, -1)
    total = torch.zeros(x.shape[:-1], dtype=dtype or x.dtype, device=x.device)
    for i in range(x.shape[-1]):
        total = add(total, x[..., i])
    return total
