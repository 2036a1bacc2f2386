"""Error statistics of computed low-precision results against the exact (float64) values.

Ulp errors use :func:`lowp.ulp.ulp_error` (``|computed - exact| / ulp(exact)``; at most 0.5 means
correctly rounded). The absolute and relative errors of PaddlePaddle's low-precision operator guide
are kept for comparison with its tables: ``|computed - exact|`` and that over ``|exact|``, on the
inputs where both are finite (relative: and ``exact != 0``).
"""
from __future__ import annotations

import math

import torch

from lowp.formats import FloatFormat
from lowp.rounding import quantize
from lowp.ulp import ulp_error

__all__ = ["ErrorStats", "error_stats", "correctly_rounded", "near_midpoint", "STAT_FIELDS"]

STAT_FIELDS = ["n", "worst_index", "max_ulp", "mean_ulp", "p99_ulp", "frac_correct", "max_abs", "mean_abs", "max_rel",
               "mean_rel", "overflow", "underflow_to_zero", "nan_mismatch", "inf_mismatch"]

ErrorStats = dict[str, float]


def correctly_rounded(exact: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``exact`` (float64) rounded once to ``fmt`` (never through float32: torch's own
    float64 -> float16/bfloat16 cast rounds twice, via float32, on torch 2.13)."""
    return quantize(exact.to(torch.float64), fmt, native=False)


def near_midpoint(exact: torch.Tensor, fmt: FloatFormat, rel_tol: float = 2.0**-40) -> torch.Tensor:
    """Where a float64 reference lies within ``rel_tol`` (relative) of a midpoint between two
    neighbours of ``fmt``, so a few-ulp float64 error could flip its correct rounding."""
    t = exact.to(torch.float64)
    lo, hi = quantize(t, fmt, "down"), quantize(t, fmt, "up")
    close = (t - (lo + hi) / 2).abs() <= rel_tol * t.abs()
    return close & (lo != hi) & torch.isfinite(lo + hi)


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else 0.0


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


def error_stats(computed: torch.Tensor, exact: torch.Tensor, fmt: FloatFormat,
                correct: torch.Tensor | None = None) -> ErrorStats:
    """Statistics of ``computed`` (values of ``fmt``, any float dtype) against the float64 ``exact``.

    ``frac_correct`` is the fraction equal to the correctly rounded result (NaN matching NaN,
    ±0 equal); ``overflow``: ±inf/NaN computed where the correct result is finite;
    ``underflow_to_zero``: zero computed where the correct result is not zero; ``nan_mismatch`` /
    ``inf_mismatch``: NaN (resp. ±inf) in exactly one of computed and correct, or infinities of
    opposite sign. A result equal to the correctly rounded one counts at most 0.5 ulp even where
    the format flushes to zero (no subnormals) or saturates, which is farther from the exact value.
    ``worst_index`` is the flat position of the largest ulp error. Mean and p99 ulp include infinite
    errors (p99 can be inf), mean_ulp is over finite errors only.
    """
    c = computed.to(torch.float64).flatten()
    t = exact.to(torch.float64).flatten()
    r = (correctly_rounded(t, fmt) if correct is None else correct.to(torch.float64)).flatten()
    n = c.numel()
    if n == 0:
        return {k: 0.0 for k in STAT_FIELDS}
    nan_c, nan_r = torch.isnan(c), torch.isnan(r)
    same = (c == r) | (nan_c & nan_r)
    e = ulp_error(c, t, fmt)
    e = torch.where(same, e.clamp(max=0.5), e)  # the format's own rounding (flush, saturate) is never an error
    finite_e = e[torch.isfinite(e)]
    k = max(1, math.ceil(0.99 * n))
    p99 = float(torch.kthvalue(e, k).values)
    inf_c, inf_r = torch.isinf(c), torch.isinf(r)
    both = torch.isfinite(c) & torch.isfinite(t)
    abs_err = (c - t).abs()[both]
    rel_mask = both & (t != 0)
    rel_err = (c - t).abs()[rel_mask] / t.abs()[rel_mask]
    return {
        "n": n,
        "worst_index": int(torch.argmax(torch.nan_to_num(e, posinf=math.inf))),
        "max_ulp": _max(e),
        "mean_ulp": _mean(finite_e),
        "p99_ulp": p99,
        "frac_correct": float(same.double().mean()),
        "max_abs": _max(abs_err),
        "mean_abs": _mean(abs_err),
        "max_rel": _max(rel_err),
        "mean_rel": _mean(rel_err),
        "overflow": int(((inf_c | nan_c) & torch.isfinite(r)).sum()),
        "underflow_to_zero": int(((c == 0) & (r != 0)).sum()),
        "nan_mismatch": int((nan_c != nan_r).sum()),
        "inf_mismatch": int(((inf_c != inf_r) | (inf_c & inf_r & (c != r))).sum()),
    }
