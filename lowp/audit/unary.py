"""Exhaustive audit of unary ops: every finite value of a format, three ways of computing.

Methods (each compared with the float64 reference rounded once to the format):

``native``
    torch's own kernel on a tensor of the format's torch dtype (fp16, bf16; skipped where torch
    has no such dtype or no kernel for it).
``opmath``
    the op on float32 copies, rounded once to the format (Paddle's ``MPTypeTrait`` rule).
``lowformat``
    the op's textbook formula with every step rounded to the format
    (:mod:`lowp.audit.lowformat`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from lowp.audit.lowformat import LowFormatMath
from lowp.audit.metrics import error_stats
from lowp.audit.ops import UnaryOp, get_unary
from lowp.audit.ties import MP_UNARY, correct_results
from lowp.codec import all_values
from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize

__all__ = ["METHODS", "check_methods", "audit_unary", "unary_inputs", "native_result", "opmath_result"]

METHODS = ("native", "opmath", "lowformat")


def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    """The methods as a tuple; ValueError naming the unknown ones."""
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"methods: unknown {bad}; expected some of {METHODS}")
    return methods


def unary_inputs(op: UnaryOp, fmt: FloatFormat) -> torch.Tensor:
    """Every finite value of ``fmt`` (float64, sorted) inside the op's domain."""
    x = all_values(fmt)
    return x[torch.from_numpy(op.domain(x.numpy()))]


def reference(op: UnaryOp, x: torch.Tensor) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.asarray(op.reference(x.numpy()), dtype=np.float64))


def native_result(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...],
                  fmt: FloatFormat) -> torch.Tensor | None:
    """torch's ``fn`` on ``args`` in the format's own dtype (float64 result), or None where torch
    has no dtype or kernel for it."""
    if fmt.torch_dtype is None:
        return None
    try:
        return fn(*(a.to(fmt.torch_dtype) for a in args)).to(torch.float64)
    except (RuntimeError, NotImplementedError):
        return None


def opmath_result(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], fmt: FloatFormat) -> torch.Tensor:
    """``fn`` on float32 copies of ``args``, rounded once to ``fmt`` (float64 result)."""
    return quantize(fn(*(a.to(torch.float32) for a in args)), fmt).to(torch.float64)


def _results(op: UnaryOp, x: torch.Tensor, fmt: FloatFormat,
             methods: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for method in methods:
        if method == "native":
            got = native_result(op.torch_fn, (x,), fmt)
            if got is not None:
                yield method, got
        elif method == "opmath":
            yield method, opmath_result(op.torch_fn, (x,), fmt)
        else:
            low = LowFormatMath(fmt)
            yield method, low.formula(op.name, x.to(low.dtype)).to(torch.float64)


def audit_unary(ops: "list[str] | None" = None, formats: Iterable["str | FloatFormat"] = ("fp16", "bf16"),
                methods: Iterable[str] = METHODS, stride: int = 1, progress: bool = False) -> list[dict[str, object]]:
    """Audit unary ops exhaustively (``stride > 1``: every stride-th input only).

    One row per (op, format, method) with the :func:`error_stats` fields, the input with the
    largest ulp error (``worst_input``, ``worst_got``, ``worst_want``) and ``near_midpoint``: the
    inputs whose float64 reference lay too close to a rounding midpoint to decide the correct
    rounding, which :func:`lowp.audit.ties.settle_ties` then decided in high precision (0 for ops
    whose float64 reference is exact or correctly rounded).
    """
    from tqdm import tqdm

    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride: expected a positive int, got {stride!r}")
    methods = check_methods(methods)
    fmts = [get_format(f) for f in formats]
    chosen = get_unary(ops)
    rows: list[dict[str, object]] = []
    jobs = [(op, fmt) for fmt in fmts for op in chosen]
    for op, fmt in tqdm(jobs, desc="unary audit", unit="op", disable=not progress):
        x = unary_inputs(op, fmt)[::stride]
        exact = reference(op, x)
        correct, doubtful = correct_results(MP_UNARY[op.name], (x,), exact, fmt, op.exact_reference)
        for method, got in _results(op, x, fmt, methods):
            stats = error_stats(got, exact, fmt, correct)
            worst = int(stats.pop("worst_index"))
            rows.append({"kind": "unary", "op": op.name, "format": fmt.name, "method": method, **stats,
                         "near_midpoint": int(doubtful.sum()), "worst_input": float(x[worst]),
                         "worst_got": float(got[worst]), "worst_want": float(correct[worst])})
    return rows
