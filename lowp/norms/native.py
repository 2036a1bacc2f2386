"""The fast native path: exact power-of-two row scaling, then a wide accumulator (fp32 opmath).

For an input format with ``p`` significand bits, squares are exact in a compute dtype with at
least ``2p`` bits (fp16 and bf16 in fp32), so only range can go wrong: the squares of large
bf16 values overflow fp32 and those of tiny ones underflow. Scaling a row by ``2**-E``, ``E`` the
exponent of its largest magnitude (or of ``sqrt|eps|`` when larger), is exact and puts the
largest scaled magnitude in [1, 2); then the sum of squares is at most ``4n`` and any square
that still underflows is below ``2**-126`` of the total. Rows that cannot go wrong skip the
scaling: the path first tries the unscaled sum and rescales only rows whose sum is not finite
or too small to rule out underflow loss (see :func:`needs_rescale`).
"""
from __future__ import annotations

import torch

from lowp.formats import FloatFormat, get_format
from lowp.norms.compute import logb
from lowp.pow2 import scale_pow2
from lowp.rounding import quantize

__all__ = ["row_exponent", "needs_rescale", "rows_to_rescale", "wide_norm", "opmath_dtype"]


def opmath_dtype(fmt: FloatFormat) -> torch.dtype:
    """float32 when its 24 bits hold an exact square of ``fmt`` plus guard bits (``2p + 2 <= 24``), else float64."""
    return torch.float32 if 2 * fmt.precision + 2 <= get_format("fp32").precision else torch.float64


def row_exponent(absmax: torch.Tensor, eps: "float | torch.Tensor") -> torch.Tensor:
    """Per row, ``E = floor(log2(max(absmax, sqrt|eps|)))`` (0 for an all-zero row with eps = 0);
    ``eps`` is a float or a float64 tensor with one value per row."""
    root = torch.as_tensor(eps, dtype=torch.float64, device=absmax.device).abs().sqrt()
    ref = torch.maximum(absmax.to(torch.float64), root)
    e = logb(ref)
    return torch.where(ref == 0, torch.zeros_like(e), e)


def needs_rescale(sumsq: torch.Tensor, n: int, compute: torch.dtype, out_fmt: FloatFormat) -> torch.Tensor:
    """Rows whose unscaled sum of squares can be wrong: not finite, or so small that squares lost to
    underflow (each below the compute format's smallest normal) could reach ``2**-(2p+6)`` of it."""
    cfmt = get_format(compute)
    floor = n * cfmt.min_normal * 2.0 ** (2 * out_fmt.precision + 6)
    return ~torch.isfinite(sumsq) | (sumsq < floor)


def rows_to_rescale(rows: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``candidates`` minus the rows holding inf or NaN (those results are already right). Only
    candidate rows are inspected: a full ``isfinite`` pass costs as much as the norm itself."""
    if not bool(candidates.any()):
        return candidates
    idx = torch.nonzero(candidates).flatten()
    keep = torch.isfinite(rows[idx]).all(-1)
    out = torch.zeros_like(candidates)
    out[idx[keep]] = True
    return out


def _round_out(value: torch.Tensor, out_fmt: FloatFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """One rounding of ``value`` to the output format (lowp's exact quantize, which uses torch's
    cast only where it is known to match), returned in ``out_dtype``."""
    return quantize(value, out_fmt).to(out_dtype)


def wide_norm(rows: torch.Tensor, eps: float, compute: torch.dtype, out_fmt: FloatFormat,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``sqrt(sum rows**2 + eps)`` along the last dimension, computed in ``compute`` (fp32 for
    fp16/bf16 rows) with exact row scaling where needed; one rounding to ``out_fmt`` at the end."""
    n = rows.shape[-1]
    eps_c = torch.tensor(eps, dtype=compute, device=rows.device)
    norm = torch.linalg.vector_norm(rows, dim=-1, dtype=compute)  # no widened copy of the rows
    # squaring the fp32 root again costs ~2**-23 relative, far below an fp16/bf16 ulp
    sumsq = norm * norm + eps_c
    bad = rows_to_rescale(rows, needs_rescale(sumsq, n, compute, out_fmt))
    root = norm if eps == 0 else torch.sqrt(sumsq)
    if not bool(bad.any()):
        return _round_out(root, out_fmt, out_dtype)
    out = root.to(torch.float64)
    sub = rows[bad].to(compute)
    e = row_exponent(sub.abs().amax(-1), eps)
    scaled = scale_pow2(sub, -e.unsqueeze(-1))
    eps_scaled = scale_pow2(torch.full(e.shape, float(eps), dtype=torch.float64, device=e.device), -2 * e).to(compute)
    root = torch.sqrt(torch.linalg.vecdot(scaled, scaled) + eps_scaled)
    out[bad] = scale_pow2(root.to(torch.float64), e)
    return _round_out(out, out_fmt, out_dtype)
