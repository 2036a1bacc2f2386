"""Drop-in ``RMSNorm`` and ``LayerNorm`` whose forward and backward stay finite and accurate in
fp16/bf16 where the plain formula overflows, underflows or cancels.

Both are subclasses of torch's modules (same constructor, parameter names and state_dict) that
only replace ``forward``. The computation is in fp32 opmath (fp64 for fp64 inputs), with two
safeguards:

* **exact power-of-two row scaling** (:mod:`lowp.norms.native`): a row whose sum of squares is
  not finite or small enough to have lost squares to underflow is scaled by ``2**-E`` (``E`` the
  exponent of its largest magnitude or of ``sqrt(eps)``) and ``eps`` by ``4**-E``, which leaves
  ``x / sqrt(mean x**2 + eps)`` unchanged; the statistics are then computed on values near 1.
  Only rows that need it are rescaled, so ordinary rows cost what torch's do. fp16 rows never
  need it in fp32; bf16 rows above about 2**60 or below 2**-40 do.
* **two-pass, corrected mean** for LayerNorm: ``mu = mean(x)``, ``mu += mean(x - mu)``, then
  ``var = mean((x - mu)**2)``, so large nearly equal values do not cancel as ``E[x^2] - E[x]^2`` does.

The backward is a custom autograd function using the saved ``1/sigma`` and the same scaling:
``dx = 2**-E * r * (g' - mean(g') - xhat * mean(g' * xhat))`` with ``g' = g * weight`` (the
``mean(g')`` term only for LayerNorm), so it never forms ``x**2`` or ``1/sigma**3``.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lowp.formats import get_format
from lowp.norms.native import ldexp, needs_rescale, row_exponent

__all__ = ["RMSNorm", "LayerNorm", "normalize_rows"]


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stats(rows: torch.Tensor, eps: float, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Centered (or not) rows and ``r = 1/sqrt(mean(rows**2) + eps)`` in rows' dtype."""
    if center:
        mu = rows.mean(-1, keepdim=True)
        mu = mu + (rows - mu).mean(-1, keepdim=True)
        rows = rows - mu
    ms = torch.linalg.vecdot(rows, rows) / rows.shape[-1]
    return rows, torch.rsqrt(ms + eps)


def normalize_rows(rows: torch.Tensor, eps: float, center: bool, in_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xhat, r, E)``: ``xhat = (x - mu) * r`` (``mu = 0`` unless ``center``) for the opmath
    rows ``rows``, with ``r`` the reciprocal root of the row statistics of ``x * 2**-E``."""
    d, r = _stats(rows, eps, center)
    e = torch.zeros(rows.shape[:-1], dtype=torch.int64, device=rows.device)
    ms_n = rows.shape[-1] / (r * r) if rows.numel() else r
    bad = (needs_rescale(ms_n, rows.shape[-1], rows.dtype, get_format(in_dtype)) | (r == 0)) \
        & torch.isfinite(rows).all(-1)
    if bool(bad.any()):
        sub = rows[bad]
        e_bad = row_exponent(sub.abs().amax(-1), eps)
        eps_scaled = ldexp(torch.full(e_bad.shape, float(eps), dtype=torch.float64), -2 * e_bad)
        d_bad, r_bad = _stats(ldexp(sub, -e_bad.unsqueeze(-1)), 0.0, center)
        r_bad = torch.rsqrt(1 / (r_bad * r_bad) + eps_scaled.to(rows.dtype))
        d, r, e = d.clone(), r.clone(), e.clone()
        d[bad], r[bad], e[bad] = d_bad, r_bad, e_bad
    return d * r.unsqueeze(-1), r, e


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, ndim, center):  # type: ignore[override]
        shape = x.shape
        n = 1
        for s in shape[len(shape) - ndim:]:
            n *= s
        opmath = _opmath(x.dtype)
        rows = x.reshape(-1, n).to(opmath)
        xhat, r, e = normalize_rows(rows, eps, center, x.dtype)
        y = xhat
        if weight is not None:
            y = y * weight.reshape(-1).to(opmath)
        if bias is not None:
            y = y + bias.reshape(-1).to(opmath)
        ctx.save_for_backward(xhat, r, e, weight)
        ctx.center, ctx.shape, ctx.has_bias = center, shape, bias is not None
        return y.to(x.dtype).reshape(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        xhat, r, e, weight = ctx.saved_tensors
        g = grad.reshape(xhat.shape).to(xhat.dtype)
        gw = g * weight.reshape(-1).to(xhat.dtype) if weight is not None else g
        inner = gw - xhat * torch.linalg.vecdot(gw, xhat).unsqueeze(-1) / xhat.shape[-1]
        if ctx.center:
            inner = inner - gw.mean(-1, keepdim=True)
        dx = ldexp(inner * r.unsqueeze(-1), -e.unsqueeze(-1)).to(grad.dtype).reshape(ctx.shape)
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = (g * xhat).sum(0).to(weight.dtype).reshape(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = g.sum(0).to(grad.dtype).reshape(weight.shape if weight is not None else (-1,))
        return dx, dweight, dbias, None, None, None


def _check_shape(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"input: expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    k = len(normalized_shape)
    if tuple(x.shape[x.ndim - k:]) != tuple(normalized_shape) or x.ndim < k:
        raise ValueError(f"input: expected trailing dimensions {tuple(normalized_shape)}, got shape {tuple(x.shape)}")


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with a safe forward and backward (same arguments and state_dict).

    ``y = x / sqrt(mean(x**2) + eps) * weight``; ``eps=None`` means ``torch.finfo(x.dtype).eps``
    as in torch.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_shape(x, self.normalized_shape)
        eps = torch.finfo(x.dtype).eps if self.eps is None else float(self.eps)
        return _NormFunction.apply(x, self.weight, None, eps, len(self.normalized_shape), False)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with a safe forward and backward (same arguments and state_dict):
    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with a corrected two-pass mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_shape(x, self.normalized_shape)
        return _NormFunction.apply(x, self.weight, self.bias, float(self.eps), len(self.normalized_shape), True)
