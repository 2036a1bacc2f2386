"""Where a norm's arithmetic happens: an emulated format (:class:`lowp.arith.Arith`) or a torch dtype.

Every method in :mod:`lowp.norms.methods` is written once against the small interface shared by
:class:`~lowp.arith.Arith` and :class:`Native` (``cast, add, sub, mul, div, sqrt, scale2, sum``),
so the same algorithm runs on an emulated "fp16-only" machine on the CPU and natively in a torch
dtype. On top of that interface this module gives the error-free transformations the robust
method needs (Knuth's TwoSum and Veltkamp splitting from :mod:`lowp.summation`, Dekker's
FastTwoSum and TwoProduct for a square; see Muller et al., *Handbook of Floating-Point
Arithmetic*, 2nd ed., ch. 4) and ``logb``, the
exact exponent extraction of IEEE 754 (``logB``), which hardware does on the exponent field.
"""
from __future__ import annotations

from typing import Union

import torch

from lowp import summation
from lowp.arith import Arith, recursive_sum
from lowp.formats import FloatFormat, get_format
from lowp.pow2 import scale_pow2

__all__ = ["Native", "Ops", "make_ops", "logb", "two_sum", "fast_two_sum", "two_square",
           "ZERO_EXPONENT"]

#: Exponent given to zeros by :func:`logb`: so small that scaling anything by ``2**(2*ZERO_EXPONENT)``
#: gives 0, yet harmless in integer arithmetic.
ZERO_EXPONENT = -(2**20)


class Native:
    """Arithmetic done by torch in ``dtype`` itself, one rounding per elementwise operation.

    torch computes an fp16/bf16 elementwise op in fp32 and rounds once; fp32 has more than
    ``2p + 2`` bits for both, so +, -, *, / are correctly rounded (same argument as
    :class:`~lowp.arith.Arith`). ``sum`` is sequential in ``dtype`` (not torch's fp32-accumulated
    reduction), so ``Native(torch.float16)`` is a machine whose only type is fp16.

    Args:
        dtype: ``torch.float16``, ``torch.bfloat16``, ``torch.float32`` or ``torch.float64``;
            anything else raises ``ValueError`` naming ``compute``, the argument of
            :func:`lowp.norms.vector_norm` it comes from.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"compute: a native compute dtype must be float16, bfloat16, float32 or float64, "
                             f"got {dtype}")
        self.dtype = dtype
        self.format = get_format(dtype)

    def __repr__(self) -> str:
        return f"Native({self.dtype})"

    def cast(self, x: "torch.Tensor | float") -> torch.Tensor:
        """``x`` rounded once to ``dtype``."""
        return torch.as_tensor(x).to(self.dtype)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a + b``, one rounding."""
        return torch.add(a, b)

    def sub(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a - b``, one rounding."""
        return torch.sub(a, b)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a * b``, one rounding."""
        return torch.mul(a, b)

    def div(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a / b``, one rounding."""
        return torch.div(a, b)

    def sqrt(self, a: torch.Tensor) -> torch.Tensor:
        """Square root rounded once to ``dtype`` (taken in float64, whose result is close enough to
        never cross a rounding boundary of fp32 or narrower; fp64 uses torch's own)."""
        if self.dtype == torch.float64:
            return torch.sqrt(a)
        return torch.sqrt(a.to(torch.float64)).to(self.dtype)

    def scale2(self, a: torch.Tensor, k: "int | torch.Tensor") -> torch.Tensor:
        """``a * 2**k`` rounded once to ``dtype`` (IEEE 754 scaleB)."""
        wide = torch.float64
        return scale_pow2(a.to(wide), torch.as_tensor(k, device=a.device)).to(self.dtype)

    def sum(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Left-to-right sum along ``dim`` rounding to ``dtype`` after every addition."""
        return recursive_sum(torch.add, x, dim, self.dtype)


Ops = Union[Arith, Native]  # anything with the Arith interface


def make_ops(compute: "str | torch.dtype | FloatFormat | Arith | Native") -> "Arith | Native":
    """``Native`` for a torch dtype, ``Arith`` (exact emulation) for a format name or FloatFormat."""
    if isinstance(compute, (Arith, Native)):
        return compute
    if isinstance(compute, torch.dtype):
        return Native(compute)
    if isinstance(compute, (str, FloatFormat)):
        return Arith(get_format(compute))
    raise TypeError(f"compute: expected a torch dtype, a format name or a FloatFormat, got {type(compute).__name__}")


def logb(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2|a|)`` as int64 (exact, IEEE 754 logB); zeros give :data:`ZERO_EXPONENT`."""
    _, e = torch.frexp(a.to(torch.float64))
    return torch.where(a == 0, torch.full_like(e, ZERO_EXPONENT, dtype=torch.int64), e.to(torch.int64) - 1)


def _format_of(ops: Ops) -> "FloatFormat | None":
    """The ``format`` argument of :mod:`lowp.summation` meaning the same arithmetic as ``ops``
    (``None``: native arithmetic in the tensors' own dtype). Error-free transforms are exact only
    under round-to-nearest, which is what :mod:`lowp.summation` uses."""
    return None if isinstance(ops, Native) else ops.format


def two_sum(ops: Ops, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum in ``ops``' arithmetic (:func:`lowp.summation.two_sum`)."""
    return summation.two_sum(a, b, _format_of(ops))


def fast_two_sum(ops: Ops, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's FastTwoSum, exact when ``|a| >= |b|`` (or ``a`` is 0): ``s = fl(a+b)``, ``b - (s - a)``.
    Kept here rather than :func:`lowp.summation.fast_two_sum`, which rejects ``a = 0 < |b|`` and
    checks its precondition with a host sync on every call."""
    s = ops.add(a, b)
    return s, ops.sub(b, ops.sub(s, a))


def two_square(ops: Ops, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's TwoProduct for ``a*a``: ``p = fl(a*a)`` and the exact error ``a*a - p``, valid
    while nothing underflows (``a`` in [1, 2) is always safe for the formats here)."""
    p = ops.mul(a, a)
    hi, lo = summation.split(a, _format_of(ops))
    cross = ops.mul(hi, lo)
    err = ops.add(ops.add(ops.sub(ops.mul(hi, hi), p), ops.add(cross, cross)), ops.mul(lo, lo))
    return p, err
