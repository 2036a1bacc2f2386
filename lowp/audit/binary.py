"""Audit of binary ops on a dense grid of format values (every pair for 8-bit formats).

The grid takes ``points`` values spread evenly over the sorted list of all finite values of the
format (so every binade is represented in proportion to its codes) and audits every pair
(x, y). Methods as in :mod:`lowp.audit.unary`; the low-format model is one rounded operation for
+ - * /, ``exp(y * log(x))`` for pow, ``sqrt(x*x + y*y)`` for hypot (overflows in the squares as
a naive engine would) and a correctly rounded atan2.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from lowp.audit.lowformat import LowFormatMath
from lowp.audit.metrics import error_stats
from lowp.audit.ops import BinaryOp, get_binary
from lowp.audit.ties import MP_BINARY, correct_results
from lowp.audit.unary import METHODS, check_methods, native_result, opmath_result
from lowp.codec import all_values
from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize

__all__ = ["audit_binary", "grid"]


def grid(fmt: FloatFormat, points: int) -> torch.Tensor:
    """``points`` finite values of ``fmt`` evenly spaced in code order (all of them if fewer)."""
    if not isinstance(points, int) or points < 2:
        raise ValueError(f"points: expected an int >= 2, got {points!r}")
    v = all_values(fmt)
    if v.numel() <= points:
        return v
    return v[torch.linspace(0, v.numel() - 1, points).round().long().unique()]


def _lowformat(op: str, x: torch.Tensor, y: torch.Tensor, low: LowFormatMath) -> torch.Tensor:
    if op == "pow":
        return low.exp(low.mul(y, low.log(x)))
    if op == "hypot":
        return low.sqrt(low.add(low.square(x), low.square(y)))
    if op == "atan2":
        return quantize(torch.atan2(x.double(), y.double()), low.format).to(low.dtype)
    return getattr(low, op)(x, y)


def audit_binary(ops: "list[str] | None" = None, formats: Iterable["str | FloatFormat"] = ("fp16", "bf16"),
                 methods: Iterable[str] = METHODS, points: int = 384,
                 progress: bool = False) -> list[dict[str, object]]:
    """One row per (op, format, method) over all grid pairs in the op's domain; near-midpoint
    references are settled in high precision as in :func:`lowp.audit.unary.audit_unary`."""
    from tqdm import tqdm

    methods = check_methods(methods)
    rows: list[dict[str, object]] = []
    jobs = [(op, get_format(f)) for f in formats for op in get_binary(ops)]
    for op, fmt in tqdm(jobs, desc="binary audit", unit="op", disable=not progress):
        g = grid(fmt, points)
        xs, ys = torch.meshgrid(g, g, indexing="ij")
        keep = torch.from_numpy(np.asarray(op.domain(xs.numpy(), ys.numpy())))
        x, y = xs[keep], ys[keep]
        with np.errstate(all="ignore"):
            exact = torch.from_numpy(np.asarray(op.reference(x.numpy(), y.numpy()), dtype=np.float64))
        correct, doubtful = correct_results(MP_BINARY[op.name], (x, y), exact, fmt, op.exact_reference)
        for method in methods:
            got = _compute(op, method, x, y, fmt)
            if got is None:
                continue
            stats = error_stats(got, exact, fmt, correct)
            worst = int(stats.pop("worst_index"))
            rows.append({"kind": "binary", "op": op.name, "format": fmt.name, "method": method, **stats,
                         "near_midpoint": int(doubtful.sum()),
                         "worst_input": f"({float(x[worst])!r}, {float(y[worst])!r})",
                         "worst_got": float(got[worst]), "worst_want": float(correct[worst])})
    return rows


def _compute(op: BinaryOp, method: str, x: torch.Tensor, y: torch.Tensor, fmt: FloatFormat) -> torch.Tensor | None:
    if method == "native":
        return native_result(op.torch_fn, (x, y), fmt)
    if method == "opmath":
        return opmath_result(op.torch_fn, (x, y), fmt)
    if method == "lowformat":
        low = LowFormatMath(fmt)
        return _lowformat(op.name, x.to(low.dtype), y.to(low.dtype), low).double()
    raise ValueError(f"methods: unknown {method!r}; expected some of {METHODS}")
