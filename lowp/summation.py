"""Error-free transforms and compensated sums, in native or emulated low-precision arithmetic.

Every function takes ``format=None`` (native arithmetic in ``x``'s dtype) or a format name such as
``"fp16"``; with a format, every intermediate operation is rounded to it through
:class:`lowp.arith.Arith`, so "a sum done entirely in fp16" can be measured exactly on a CPU.
Inputs are rounded to the format first (a no-op when they already hold its values).

Error bounds for summing n terms with unit roundoff u and condition number
``cond = sum|x_i| / |sum x_i|`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
ch. 4; Goldberg, "What every computer scientist should know about floating-point", Thm. 8):

====================  ==============================================  =========================
method                relative error bound                            cost along the summed dim
====================  ==============================================  =========================
sequential            ``(n-1) u cond / (1 - (n-1) u)``                 n vector adds (a loop)
pairwise              ``ceil(log2 n) u cond / (1 - ceil(log2 n) u)``   ceil(log2 n) vector adds
kahan                 ``(2u + O(n u**2)) cond``                        4n vector ops (a loop)
neumaier              ``(2u + O(n u**2)) cond``, also when terms      ~7n vector ops (a loop)
                      exceed the running sum
fp32_accumulated      ``(n-1) u32 cond + u`` (one final rounding)      n fp32 adds (a loop)
====================  ==============================================  =========================

The loops run over the summed dimension only; every step is one vector operation over all other
dimensions, so summing a (batch, n) tensor costs n steps whatever the batch size.

The compensation step works for any arithmetic given as two functions. The six-digit decimal
example of the Wikipedia article "Kahan summation algorithm", with Python's ``decimal`` module
as the six-digit machine::

    >>> from decimal import Context, Decimal
    >>> six = Context(prec=6)
    >>> plain = six.add(six.add(Decimal("10000.0"), Decimal("3.14159")), Decimal("2.71828"))
    >>> plain                                   # exact 10005.85987: plain summation loses digits
    Decimal('10005.8')
    >>> total, comp = Decimal("10000.0"), Decimal(0)
    >>> for value in (Decimal("3.14159"), Decimal("2.71828")):
    ...     total, comp = kahan_step(total, comp, value, six.add, six.subtract)
    >>> total                                   # compensated: the correctly rounded 10005.9
    Decimal('10005.9')
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Union

import torch

from lowp.arith import Arith, recursive_sum
from lowp.formats import FloatFormat, get_format

Method = Literal["sequential", "kahan", "neumaier", "pairwise", "fp32_accumulated"]
METHODS: tuple[str, ...] = ("sequential", "kahan", "neumaier", "pairwise", "fp32_accumulated")
FormatSpec = Union[str, torch.dtype, FloatFormat, None]

__all__ = ["two_sum", "fast_two_sum", "split", "two_prod", "kahan_step", "sequential_sum", "kahan_sum",
           "neumaier_sum", "pairwise_sum", "fp32_accumulated_sum", "sum", "METHODS"]


class _Native:
    """The arithmetic of a torch dtype itself (the ``format=None`` case)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.format = get_format(dtype)

    def cast(self, x: Any) -> torch.Tensor:
        return torch.as_tensor(x).to(self.dtype)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def sub(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


def _arith(x: torch.Tensor, format: FormatSpec, mode: str = "nearest_even",
           generator: torch.Generator | None = None) -> "Arith | _Native":
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got dtype {x.dtype}")
    if format is None and mode == "nearest_even":
        return _Native(x.dtype)
    return Arith(x.dtype if format is None else format, mode, generator=generator)


# ---- error-free transforms -------------------------------------------------------------------
def two_sum(a: torch.Tensor, b: torch.Tensor, format: FormatSpec = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: ``s = fl(a + b)`` and ``e`` with ``a + b = s + e`` exactly (6 operations, no
    condition on the operands). Exact in any binary format with round-to-nearest, barring overflow."""
    ar = _arith(torch.as_tensor(a), format)
    a, b = ar.cast(a), ar.cast(b)
    s = ar.add(a, b)
    b_virtual = ar.sub(s, a)
    a_virtual = ar.sub(s, b_virtual)
    return s, ar.add(ar.sub(a, a_virtual), ar.sub(b, b_virtual))


def fast_two_sum(a: torch.Tensor, b: torch.Tensor, format: FormatSpec = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's Fast2Sum: ``s = fl(a + b)``, ``e = b - (s - a)``; exact when ``|a| >= |b|`` (or the
    exponent of a is at least that of b). 3 operations. Raises if the precondition fails."""
    ar = _arith(torch.as_tensor(a), format)
    a, b = ar.cast(a), ar.cast(b)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if bool((finite & (a.abs() < b.abs())).any()):
        raise ValueError("a, b: fast_two_sum needs |a| >= |b| elementwise; use two_sum")
    s = ar.add(a, b)
    return s, ar.sub(b, ar.sub(s, a))


def split(a: torch.Tensor, format: FormatSpec = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Veltkamp's split: ``a = hi + lo`` exactly, hi with ``p - ceil(p/2)`` significant bits and
    ``|lo| <= 2**-ceil(p/2) |a|`` so products of halves are exact. Uses ``c = (2**ceil(p/2) + 1) a``,
    which overflows for ``|a|`` within a factor ``2**ceil(p/2)`` of the format's max."""
    ar = _arith(torch.as_tensor(a), format)
    return _veltkamp_split(ar, ar.cast(a))


def _veltkamp_split(ar: "Arith | _Native", a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split` of ``a``, already a value of ``ar``'s format, in the arithmetic ``ar``."""
    p = ar.format.precision
    factor = ar.cast(float(2 ** ((p + 1) // 2) + 1))
    c = ar.mul(factor, a)
    hi = ar.sub(c, ar.sub(c, a))
    return hi, ar.sub(a, hi)


def two_prod(a: torch.Tensor, b: torch.Tensor, format: FormatSpec = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's TwoProduct without FMA: ``p = fl(a*b)`` and ``e`` with ``a*b = p + e`` exactly
    (17 operations), valid barring overflow, and underflow of the partial products.
    (torch has no correctly rounded FMA on every CPU, so the operands are split instead)."""
    ar = _arith(torch.as_tensor(a), format)
    a, b = ar.cast(a), ar.cast(b)
    prod = ar.mul(a, b)
    a_hi, a_lo = _veltkamp_split(ar, a)
    b_hi, b_lo = _veltkamp_split(ar, b)
    err = ar.sub(ar.mul(a_hi, b_hi), prod)
    err = ar.add(err, ar.mul(a_hi, b_lo))
    err = ar.add(err, ar.mul(a_lo, b_hi))
    return prod, ar.add(err, ar.mul(a_lo, b_lo))


def kahan_step(total: Any, compensation: Any, value: Any, add: Callable[[Any, Any], Any],
               sub: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """One step of Kahan's compensated summation in any arithmetic given by ``add`` and ``sub``:
    ``y = value - c; t = total + y; c = (t - total) - y; total = t``. Returns ``(t, c)``."""
    y = sub(value, compensation)
    t = add(total, y)
    return t, sub(sub(t, total), y)


# ---- sums along a dimension ------------------------------------------------------------------
def _prepare(x: torch.Tensor, dim: int, format: FormatSpec, mode: str,
             generator: torch.Generator | None) -> tuple["Arith | _Native", torch.Tensor, torch.Tensor]:
    ar = _arith(x, format, mode, generator)
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: {dim} is out of range for a tensor with {x.dim()} dimensions")
    values = ar.cast(x.movedim(dim, -1) if x.dim() else x.reshape(1))
    zero = torch.zeros(values.shape[:-1], dtype=values.dtype, device=values.device)
    return ar, values, zero


def sequential_sum(x: torch.Tensor, dim: int = -1, format: FormatSpec = None, *, mode: str = "nearest_even",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Left-to-right recursive summation, rounding after every addition (stagnates once the
    running sum's half-ulp exceeds the terms: fp16 sums of U(0,1) stop at 2048)."""
    ar, values, _ = _prepare(x, dim, format, mode, generator)
    return recursive_sum(ar.add, values)


def kahan_sum(x: torch.Tensor, dim: int = -1, format: FormatSpec = None, *, mode: str = "nearest_even",
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Kahan's compensated summation (Kahan 1965, "Further remarks on reducing truncation errors");
    every operation in ``format``."""
    ar, values, total = _prepare(x, dim, format, mode, generator)
    comp = torch.zeros_like(total)
    for i in range(values.shape[-1]):
        total, comp = kahan_step(total, comp, values[..., i], ar.add, ar.sub)
    return total


def neumaier_sum(x: torch.Tensor, dim: int = -1, format: FormatSpec = None, *, mode: str = "nearest_even",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Kahan-Babuska-Neumaier summation: the error of each addition is recovered by Fast2Sum with
    the larger operand first and accumulated separately; ``total + compensation`` at the end. Unlike
    Kahan it stays accurate when a term is larger than the running sum (e.g. ``[1, 1e100, 1, -1e100]``)."""
    ar, values, total = _prepare(x, dim, format, mode, generator)
    comp = torch.zeros_like(total)
    for i in range(values.shape[-1]):
        v = values[..., i]
        t = ar.add(total, v)
        keep = total.abs() >= v.abs()
        big, small = torch.where(keep, total, v), torch.where(keep, v, total)
        comp = ar.add(comp, ar.add(ar.sub(big, t), small))
        total = t
    return ar.add(total, comp)


def pairwise_sum(x: torch.Tensor, dim: int = -1, format: FormatSpec = None, *, mode: str = "nearest_even",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Pairwise (cascade) summation: add neighbours level by level, ``ceil(log2 n)`` vector steps;
    an odd element out is carried to the next level unchanged."""
    ar, values, zero = _prepare(x, dim, format, mode, generator)
    if values.shape[-1] == 0:
        return zero
    while values.shape[-1] > 1:
        n = values.shape[-1]
        pairs = ar.add(values[..., 0:n - 1:2], values[..., 1::2])
        values = torch.cat([pairs, values[..., n - 1:]], dim=-1) if n % 2 else pairs
    return values[..., 0]


def fp32_accumulated_sum(x: torch.Tensor, dim: int = -1, format: FormatSpec = None, *,
                         mode: str = "nearest_even", generator: torch.Generator | None = None) -> torch.Tensor:
    """Inputs in ``format`` (or x's dtype), accumulated left to right in native fp32, result rounded
    once to the format (Paddle's ``MPType`` recipe: low-precision data, fp32 reductions)."""
    ar, values, _ = _prepare(x, dim, format, mode, generator)
    total = sequential_sum(values.float(), -1)
    return ar.cast(total)


_METHODS: dict[str, Callable[..., torch.Tensor]] = {
    "sequential": sequential_sum, "kahan": kahan_sum, "neumaier": neumaier_sum,
    "pairwise": pairwise_sum, "fp32_accumulated": fp32_accumulated_sum,
}


def sum(x: torch.Tensor, dim: int = -1, method: Method = "kahan", format: FormatSpec = None, *,
        mode: str = "nearest_even", generator: torch.Generator | None = None) -> torch.Tensor:
    """Sum ``x`` along ``dim`` with ``method`` (one of :data:`METHODS`), every operation rounded
    to ``format`` (native arithmetic of ``x``'s dtype when None) with rounding ``mode``."""
    if method not in _METHODS:
        raise ValueError(f"method: unknown summation method {method!r}; expected one of {', '.join(METHODS)}")
    return _METHODS[method](x, dim, format, mode=mode, generator=generator)
