"""The appendix tables of PaddlePaddle's low-precision operator guide, measured: 3.3 (math functions in
fp16 vs fp32) and 3.4 (fp32 -> fp16).

3.3 compares, per function, torch's fp16 result with its fp32 result (the seed's own yardstick,
not the exact value) over every finite fp16 input in the function's domain where both results
are finite, and reports max/mean absolute and relative errors, grouped in the seed's families as
``min ~ max`` over the family's members.

3.4 enumerates every float32 value in ``[2**-24, 65504]`` (with subnormal results) or
``[2**-14, 65504]`` (normal results only), rounds it to fp16 and reports the same four errors.
The mean over fp32 *values* weights each binade equally (about log-uniform); the mean with
``uniform_in_value`` weights each value by the fp32 spacing there (a uniform real on the range).
Facts the numbers show: the largest absolute error is half an ulp in fp16's top binade
[32768, 65504], 32/2 = 16; the largest relative error of a normal result is the unit roundoff
``2**-11 / (1 + 2**-11) = 4.88e-4``; with subnormals it is 1/3, at ``1.5 * 2**-24`` (rounds to
``2**-23``).
"""
from __future__ import annotations

import numpy as np
import torch

from lowp.audit.ops import SEED_FAMILIES, get_unary
from lowp.audit.unary import unary_inputs
from lowp.formats import get_format

__all__ = ["math_vs_fp32", "family_table", "conversion_errors", "SEED_33", "SEED_34"]

# The guide's printed numbers, for side-by-side display.
SEED_33 = {
    "sin/cos/atan/acosh/asinh/tanh/acos/asin/atanh": ("0.000244~0.003905", "0.000486~0.000517", "5.85E-05~0.001138",
                                                      "0.000115~0.000179"),
    "log2/log10/log1p": ("0.001953~0.0033905", "0.000482~0.000487", "0.0004~0.001258", "0.000171~0.000175"),
    "sqrt/rsqrt": ("0.031227~0.062485", "0.000488", "0.002071~0.004158", "0.000172~0.000179"),
    "exp/expm1/tan/cosh/sinh/reciprocal/square/tanh_shrink": ("1~16", "0.000486~1", "0.000786~0.378427",
                                                               "9.18E-05~0.082869"),
    "logsigmoid/sigmoid/silu/softsign": ("0.000701~0.002665", "0.000486~0.000945", "6.55E-05~9.96E-05",
                                         "0.000104~0.000203"),
}
SEED_34 = {"with_subnormals": (16.0, 0.33289, 0.38871, 0.008834), "normals_only": (16.0, 0.00048, 0.51876, 0.000175)}

ERROR_FIELDS = ("max_abs", "max_rel", "mean_abs", "mean_rel")


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    ok = torch.isfinite(got) & torch.isfinite(want)
    d = (got - want).abs()[ok]
    nz = ok & (want != 0)
    rel = (got - want).abs()[nz] / want.abs()[nz]
    return {"max_abs": float(d.max()), "max_rel": float(rel.max()), "mean_abs": float(d.mean()),
            "mean_rel": float(rel.mean())}


def math_vs_fp32(ops: "list[str] | None" = None) -> dict[str, dict[str, float]]:
    """Per op: errors of torch's fp16 kernel against its fp32 kernel over every fp16 input in the domain
    (``ops``: unary op names, default every op of the seed's families; unknown names raise ValueError)."""
    fmt = get_format("fp16")
    names = ops if ops is not None else [n for fam in SEED_FAMILIES.values() for n in fam]
    out = {}
    for op in get_unary(names):
        x = unary_inputs(op, fmt)
        got = op.torch_fn(x.to(torch.float16)).to(torch.float64)
        want = op.torch_fn(x.to(torch.float32)).to(torch.float64)
        out[op.name] = _errors(got, want)
    return out


def family_table(per_op: dict[str, dict[str, float]]) -> list[list[str]]:
    """Rows ``[family, max_abs, max_rel, mean_abs, mean_rel]``, each cell ``min~max`` over the family."""
    rows = []
    for family, members in SEED_FAMILIES.items():
        cells = []
        for field in ERROR_FIELDS:
            vals = [per_op[m][field] for m in members if m in per_op]
            cells.append(f"{min(vals):.4g}~{max(vals):.4g}" if vals else "-")
        rows.append([family, *cells])
    return rows


def conversion_errors(subnormals: bool = True, stride: int = 1, chunk: int = 1 << 23) -> dict[str, float]:
    """fp32 -> fp16 rounding errors over every ``stride``-th float32 value of the seed's range.

    Returns the seed's four errors (means over fp32 values) plus ``mean_abs_uniform`` and
    ``mean_rel_uniform`` (weighted by the fp32 spacing, i.e. a uniform real input) and ``n``.
    """
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride: expected a positive int, got {stride!r}")
    lo = 2.0**-24 if subnormals else 2.0**-14
    first = int(np.float32(lo).view(np.int32))
    last = int(np.float32(65504.0).view(np.int32))
    n = 0
    sums = dict.fromkeys(("abs", "rel", "wabs", "wrel", "w"), 0.0)
    max_abs = max_rel = 0.0
    for start in range(first, last + 1, chunk * stride):
        codes = torch.arange(start, min(start + chunk * stride, last + 1), stride, dtype=torch.int32)
        x = codes.view(torch.float32)
        err = (x - x.half().float()).abs()  # exact: x and its rounding are within a factor 2
        rel = err.double() / x.double()
        w = (torch.nextafter(x, torch.full_like(x, float("inf"))) - x).double()
        n += x.numel()
        max_abs = max(max_abs, float(err.max()))
        max_rel = max(max_rel, float(rel.max()))
        sums["abs"] += float(err.double().sum())
        sums["rel"] += float(rel.sum())
        sums["wabs"] += float((err.double() * w).sum())
        sums["wrel"] += float((rel * w).sum())
        sums["w"] += float(w.sum())
    return {"n": n, "max_abs": max_abs, "max_rel": max_rel, "mean_abs": sums["abs"] / n, "mean_rel": sums["rel"] / n,
            "mean_abs_uniform": sums["wabs"] / sums["w"], "mean_rel_uniform": sums["wrel"] / sums["w"]}
