"""Measure a norm method on a :class:`~lowp.norms.cases.Case` against the exact truth."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowp.formats import FloatFormat, get_format
from lowp.norms.cases import Case
from lowp.norms.native import opmath_dtype
from lowp.norms.norm import vector_norm
from lowp.norms.reference import exact_norm
from lowp.rounding import quantize
from lowp.ulp import ulp_error

__all__ = ["Score", "score", "as_input"]


@dataclass(frozen=True)
class Score:
    """Accuracy of one norm method on one case (:func:`score`), against the exact norm.

    Args:
        rows: rows scored.
        max_ulp: largest error in ulps of the input format (``inf`` where a result is inf or NaN
            and the exact norm is not).
        correctly_rounded: fraction of rows equal to the correctly rounded norm.
        faithful: fraction of rows with an error below 1 ulp.
        overflow: rows that came out inf/NaN where the correctly rounded result is finite.
        underflow: rows that came out 0 where the correctly rounded result is not.
    """

    rows: int
    max_ulp: float
    correctly_rounded: float  # fraction of rows
    faithful: float           # fraction of rows with error < 1 ulp
    overflow: int             # inf/NaN where the correctly rounded result is finite
    underflow: int            # 0 where the correctly rounded result is not


def as_input(rows: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, FloatFormat | None]:
    """Rows in the format's torch dtype, or in a float32 container (with the format to pass on)."""
    if fmt.torch_dtype is not None:
        return rows.to(torch.float32).to(fmt.torch_dtype), None
    return rows.to(torch.float32), fmt


def score(case: Case, method: str, format: "str | FloatFormat", compute: "str | torch.dtype | None") -> Score:
    """Run ``vector_norm`` on the case's rows and compare every row with the exact result."""
    fmt = get_format(format)
    x, container_fmt = as_input(case.rows, fmt)
    got = vector_norm(x, eps=case.eps, method=method, compute=compute, format=container_fmt).to(torch.float64)
    cfmt = get_format(compute if compute is not None else opmath_dtype(fmt))  # what vector_norm holds eps in
    eps_held = float(quantize(torch.tensor(case.eps, dtype=torch.float64), cfmt))
    value, rounded = exact_norm(case.rows, eps_held, fmt)
    err = ulp_error(got, value, fmt)
    both_nan = torch.isnan(got) & torch.isnan(rounded)
    cr = (got == rounded) | both_nan
    finite_truth = torch.isfinite(rounded)
    return Score(rows=got.numel(), max_ulp=float(err.max()), correctly_rounded=float(cr.double().mean()),
                 faithful=float(((err < 1) | both_nan).double().mean()),
                 overflow=int((finite_truth & ~torch.isfinite(got)).sum()),
                 underflow=int(((rounded != 0) & finite_truth & (got == 0)).sum()))
