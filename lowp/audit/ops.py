"""The op registry: for each audited op its torch function, float64 reference and input domain.

Unary ops are audited on every finite value of a format inside ``domain`` (a predicate on the
float64 inputs); binary ops on a grid; reductions on random vectors (see their runners).
``exact_reference`` marks ops whose float64 reference is itself correctly rounded or exact (so it
can never sit on the wrong side of a rounding midpoint of a 16-bit format).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lowp.audit import reference as ref

__all__ = ["UnaryOp", "BinaryOp", "UNARY_OPS", "BINARY_OPS", "SEED_FAMILIES", "get_unary", "get_binary"]

Domain = Callable[[np.ndarray], np.ndarray]


def _everywhere(x: np.ndarray) -> np.ndarray:
    return np.ones_like(x, dtype=bool)


@dataclass(frozen=True)
class UnaryOp:
    """One audited unary op.

    Args:
        name: the op's name in the audit tables and in ``--ops`` (also the key of its mpmath
            function in :data:`lowp.audit.ties.MP_UNARY`, used to settle near-midpoint cases).
        torch_fn: torch's implementation, called on a tensor of the audited dtype.
        reference: the float64 reference on a numpy array (the "exact" value).
        domain: predicate on the float64 inputs (a boolean array); only inputs where it is true
            are audited. Default: every finite input.
        exact_reference: ``True`` when ``reference`` is itself exact or correctly rounded in
            float64, so no result needs settling with mpmath. Default ``False`` (the safe choice:
            near-midpoint references are checked).
    """

    name: str
    torch_fn: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[np.ndarray], np.ndarray]
    domain: Domain = _everywhere
    exact_reference: bool = False


@dataclass(frozen=True)
class BinaryOp:
    """One audited binary op.

    Args:
        name: the op's name in the audit tables and in ``--ops`` (also the key of its mpmath
            function in :data:`lowp.audit.ties.MP_BINARY`).
        torch_fn: torch's implementation, called on two tensors of the audited dtype.
        reference: the float64 reference on two numpy arrays.
        domain: predicate on the two float64 input arrays (a boolean array); only grid pairs
            where it is true are audited (no default: the grid is chosen per op).
        exact_reference: ``True`` when ``reference`` is itself exact or correctly rounded in
            float64, so no result needs settling with mpmath. Default ``False``.
    """

    name: str
    torch_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    reference: Callable[[np.ndarray, np.ndarray], np.ndarray]
    domain: Callable[[np.ndarray, np.ndarray], np.ndarray]
    exact_reference: bool = False


_U = UnaryOp
UNARY_OPS: dict[str, UnaryOp] = {op.name: op for op in [
    _U("exp", torch.exp, np.exp),
    _U("exp2", torch.exp2, np.exp2),
    _U("expm1", torch.expm1, np.expm1),
    _U("log", torch.log, np.log, lambda x: x > 0),
    _U("log2", torch.log2, np.log2, lambda x: x > 0),
    _U("log10", torch.log10, np.log10, lambda x: x > 0),
    _U("log1p", torch.log1p, np.log1p, lambda x: x > -1),
    _U("sqrt", torch.sqrt, np.sqrt, lambda x: x >= 0, exact_reference=True),
    _U("rsqrt", torch.rsqrt, lambda x: 1.0 / np.sqrt(x), lambda x: x > 0),
    _U("reciprocal", torch.reciprocal, lambda x: 1.0 / x, lambda x: x != 0, exact_reference=True),
    _U("square", torch.square, np.square, exact_reference=True),
    _U("sin", torch.sin, np.sin),
    _U("cos", torch.cos, np.cos),
    _U("tan", torch.tan, np.tan),
    _U("sinh", torch.sinh, np.sinh),
    _U("cosh", torch.cosh, np.cosh),
    _U("tanh", torch.tanh, np.tanh),
    _U("asin", torch.asin, np.arcsin, lambda x: np.abs(x) <= 1),
    _U("acos", torch.acos, np.arccos, lambda x: np.abs(x) <= 1),
    _U("atan", torch.atan, np.arctan),
    _U("asinh", torch.asinh, np.arcsinh),
    _U("acosh", torch.acosh, np.arccosh, lambda x: x >= 1),
    _U("atanh", torch.atanh, np.arctanh, lambda x: np.abs(x) < 1),
    _U("erf", torch.erf, ref.erf),
    _U("erfinv", torch.erfinv, ref.erfinv, lambda x: np.abs(x) < 1),
    _U("sigmoid", torch.sigmoid, ref.sigmoid),
    _U("logsigmoid", F.logsigmoid, ref.logsigmoid),
    _U("silu", F.silu, lambda x: x * ref.sigmoid(x)),
    _U("gelu", F.gelu, ref.gelu_erf),
    _U("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), ref.gelu_tanh),
    _U("softplus", F.softplus, ref.softplus),
    _U("softsign", F.softsign, lambda x: x / (1.0 + np.abs(x))),
    _U("tanh_shrink", F.tanhshrink, ref.tanh_shrink),
]}


def _positive_base(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return x > 0


def _all_pairs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.ones(np.broadcast(x, y).shape, dtype=bool)


def _nonzero_divisor(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.broadcast_to(y != 0, np.broadcast(x, y).shape).copy()


_B = BinaryOp
BINARY_OPS: dict[str, BinaryOp] = {op.name: op for op in [
    _B("add", torch.add, np.add, _all_pairs, exact_reference=True),
    _B("sub", torch.sub, np.subtract, _all_pairs, exact_reference=True),
    _B("mul", torch.mul, np.multiply, _all_pairs, exact_reference=True),
    _B("div", torch.div, np.divide, _nonzero_divisor, exact_reference=True),
    _B("pow", torch.pow, np.power, _positive_base),
    _B("atan2", torch.atan2, np.arctan2, _all_pairs),
    _B("hypot", torch.hypot, np.hypot, _all_pairs),
]}

# Appendix 3.3 of PaddlePaddle's low-precision operator guide groups its ops into these families
# (its own grouping, kept verbatim).
SEED_FAMILIES: dict[str, list[str]] = {
    "sin/cos/atan/acosh/asinh/tanh/acos/asin/atanh": ["sin", "cos", "atan", "acosh", "asinh", "tanh", "acos", "asin",
                                                      "atanh"],
    "log2/log10/log1p": ["log2", "log10", "log1p"],
    "sqrt/rsqrt": ["sqrt", "rsqrt"],
    "exp/expm1/tan/cosh/sinh/reciprocal/square/tanh_shrink": ["exp", "expm1", "tan", "cosh", "sinh", "reciprocal",
                                                               "square", "tanh_shrink"],
    "logsigmoid/sigmoid/silu/softsign": ["logsigmoid", "sigmoid", "silu", "softsign"],
}


def _lookup(table: dict, names: "list[str] | None", kind: str) -> list:
    if names is None:
        return list(table.values())
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"ops: unknown {kind} op(s) {', '.join(unknown)}; expected some of {', '.join(table)}")
    return [table[n] for n in names]


def get_unary(names: "list[str] | None" = None) -> list[UnaryOp]:
    """The registered unary ops named in ``names`` (all when None); unknown names raise ValueError."""
    return _lookup(UNARY_OPS, names, "unary")


def get_binary(names: "list[str] | None" = None) -> list[BinaryOp]:
    """The registered binary ops named in ``names`` (all when None); unknown names raise ValueError."""
    return _lookup(BINARY_OPS, names, "binary")
