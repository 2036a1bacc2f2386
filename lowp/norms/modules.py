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
* **shifted, corrected mean** for LayerNorm: ``mu = c + mean(x - c)`` with ``c`` the row's
  first element, ``mu += mean(x - mu)``, then ``var = mean((x - mu)**2)``. Large nearly equal
  values do not cancel as ``E[x^2] - E[x]^2`` does, the shifted sum does not overflow on
  same-sign rows where ``sum x`` does (8 * 1.7e38 in fp32; rows whose differences overflow are
  rescaled), and a row of equal values gets exactly that value as its
  mean (every difference is 0), so its output is exactly the bias. On rescaled rows the mean is
  taken of ``x * 2**-E1`` and the deviations get their own exponent ``E2`` (see
  :func:`_rescaled_statistics`).

The backward is a custom autograd function using the saved ``1/sigma`` and the same scaling:
``dx = 2**-(E1+E2) * r * (g' - mean(g') - xhat * mean(g' * xhat))`` with ``g' = g * weight`` (the
``mean(g')`` term only for LayerNorm), so it never forms ``x**2`` or ``1/sigma**3``.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lowp.formats import get_format
from lowp.norms.compute import ZERO_EXPONENT, logb
from lowp.norms.native import needs_rescale, row_exponent, rows_to_rescale
from lowp.pow2 import scale_pow2
from lowp.rounding import check_float_tensor

__all__ = ["RMSNorm", "LayerNorm", "row_statistics", "normalized"]


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _centered_mean(rows: torch.Tensor) -> torch.Tensor:
    """Per-row mean (keepdim) shifted by the row's first element, then corrected once:
    ``mu = c + mean(x - c)``, ``mu += mean(x - mu)``. A row of identical values gives exactly that
    value (every difference is 0), and the shifted sum cannot overflow where ``sum x`` would."""
    c = rows[..., :1]
    mu = c + (rows - c).mean(-1, keepdim=True)
    return mu + (rows - mu).mean(-1, keepdim=True)


def _stats(rows: torch.Tensor, eps: "float | torch.Tensor", center: bool, opmath: torch.dtype
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(mu, r)`` per row: the shifted, corrected mean (``None`` unless ``center``) and
    ``r = 1/sqrt(mean((rows - mu)**2) + eps)``, in ``opmath``."""
    n = rows.shape[-1]
    if not center:  # torch reduces fp16/bf16 rows in opmath without an opmath copy
        norm = torch.linalg.vector_norm(rows, dim=-1, dtype=opmath)
        return None, torch.rsqrt(norm * norm / n + eps)
    wide = rows.to(opmath)
    mu = _centered_mean(wide)
    d = wide - mu
    return mu.squeeze(-1), torch.rsqrt(torch.linalg.vecdot(d, d) / n + eps)


def _rescaled_statistics(rows: torch.Tensor, eps: float, center: bool
                         ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mu, r, E1, E2)`` of opmath rows after exact power-of-two scaling.

    ``E1`` is the exponent of the largest magnitude (or of ``sqrt eps``), so ``z = x * 2**-E1``
    has ``|z| < 2`` and its mean is safe to form; ``mu`` is that mean, in ``z``'s scale. For
    LayerNorm, ``E1 + E2`` is the exponent of the largest deviation ``max |x - mean|`` (or of
    ``sqrt eps``), found in integers, so ``(z - mu) * 2**-E2`` has its largest value in [1, 2)
    and ``eps * 4**-(E1 + E2)`` neither overflows nor underflows: a row of huge, nearly (or
    exactly) equal values keeps its ``eps``. Neither scaled quantity is ever formed at the scale
    of the other (``mu * 2**-E2`` would overflow when the deviations are tiny)."""
    eps64 = torch.full(rows.shape[:-1], float(eps), dtype=torch.float64, device=rows.device)
    e1 = row_exponent(rows.abs().amax(-1), eps64)
    z = scale_pow2(rows, -e1.unsqueeze(-1))
    e2 = torch.zeros_like(e1)
    mu = None
    if center:
        mu = _centered_mean(z)
        z = z - mu
        mu = mu.squeeze(-1)
        e_dev = logb(z.abs().amax(-1)) + e1  # ZERO_EXPONENT + E1 for a row of equal values
        e_eps = logb(eps64.abs().sqrt())
        top = torch.maximum(e_dev, e_eps)
        e2 = torch.where(top > ZERO_EXPONENT // 2, top - e1, e2)
        z = scale_pow2(z, -e2.unsqueeze(-1))
    eps_scaled = scale_pow2(eps64, -2 * (e1 + e2)).to(rows.dtype)
    r = torch.rsqrt(torch.linalg.vecdot(z, z) / rows.shape[-1] + eps_scaled)
    return mu, r, e1, e2


def row_statistics(rows: torch.Tensor, eps: float, center: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mu, r, E1, E2)`` for rows of any float dtype: ``xhat = ((x * 2**-E1 - mu) * 2**-E2) * r``
    (both scalings exact) is the normalized row. ``E1 = E2 = 0`` except on rows that need rescaling."""
    opmath = _opmath(rows.dtype)
    mu, r = _stats(rows, eps, center, opmath)
    e1 = torch.zeros(rows.shape[:-1], dtype=torch.int64, device=rows.device)
    e2 = e1
    n = rows.shape[-1]
    sumsq = n / (r * r)  # n * (mean square + eps): what squares lost to underflow are compared with
    bad = rows_to_rescale(rows, needs_rescale(sumsq, n, opmath, get_format(rows.dtype)) | (r == 0))
    if bool(bad.any()):
        mu_bad, r_bad, e1_bad, e2_bad = _rescaled_statistics(rows[bad].to(opmath), eps, center)
        r, e1, e2 = r.clone(), e1.clone(), e2.clone()
        r[bad], e1[bad], e2[bad] = r_bad, e1_bad, e2_bad
        if center:
            assert mu is not None and mu_bad is not None   # both computed when center
            mu = mu.clone()
            mu[bad] = mu_bad
    return mu, r, e1, e2


def _scale_rows(z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``z * 2**-e`` per row, in place on the rows where ``e != 0`` (``z`` must be a fresh tensor)."""
    if bool((e != 0).any()):
        sel = e != 0
        z[sel] = scale_pow2(z[sel], -e[sel].unsqueeze(-1))
    return z


def normalized(rows: torch.Tensor, mu: torch.Tensor | None, r: torch.Tensor, e1: torch.Tensor, e2: torch.Tensor
               ) -> torch.Tensor:
    """``xhat = ((x * 2**-E1 - mu) * 2**-E2) * r`` in opmath (the scalings only touch rescaled rows)."""
    z = rows
    if bool((e1 != 0).any()):
        z = _scale_rows(rows.to(r.dtype).clone(), e1)
    if mu is not None:
        z = _scale_rows(z.to(r.dtype) - mu.unsqueeze(-1), e2)
    return torch.mul(z, r.unsqueeze(-1))  # fp16/bf16 * opmath promotes: one pass


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, ndim, center):  # type: ignore[override]
        shape = x.shape
        n = 1
        for s in shape[len(shape) - ndim:]:
            n *= s
        rows = x.reshape(-1, n)
        mu, r, e1, e2 = row_statistics(rows, eps, center)
        y = normalized(rows, mu, r, e1, e2)  # a fresh opmath tensor: update it in place
        if weight is not None:
            y.mul_(weight.reshape(-1))
        if bias is not None:
            y.add_(bias.reshape(-1))
        ctx.save_for_backward(rows, mu, r, e1, e2, weight)
        ctx.center, ctx.shape, ctx.has_bias = center, shape, bias is not None
        return y.to(x.dtype).reshape(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        rows, mu, r, e1, e2, weight = ctx.saved_tensors
        xhat = normalized(rows, mu if ctx.center else None, r, e1, e2)
        e = e1 + e2
        g = grad.reshape(xhat.shape).to(xhat.dtype)
        gw = g * weight.reshape(-1).to(xhat.dtype) if weight is not None else g
        inner = gw - xhat * torch.linalg.vecdot(gw, xhat).unsqueeze(-1) / xhat.shape[-1]
        if ctx.center:
            inner = inner - gw.mean(-1, keepdim=True)
        dx = scale_pow2(inner * r.unsqueeze(-1), -e.unsqueeze(-1)) if bool((e != 0).any()) else inner * r.unsqueeze(-1)
        dx = dx.to(grad.dtype).reshape(ctx.shape)
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = (g * xhat).sum(0).to(weight.dtype).reshape(weight.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = g.sum(0).to(grad.dtype).reshape(weight.shape if weight is not None else (-1,))
        return dx, dweight, dbias, None, None, None


def _check_input(x: torch.Tensor, normalized_shape: tuple[int, ...], *params: "tuple[str, torch.Tensor | None]"
                 ) -> None:
    """The checks of ``forward``: ``input`` must be a dense floating tensor with values
    (:func:`~lowp.rounding.check_float_tensor`: ``TypeError`` for another dtype, ``ValueError``
    for a sparse, nested or meta tensor) whose trailing dimensions are ``normalized_shape``, and
    no parameter may be a meta tensor (a module built on the meta device and never materialised)."""
    check_float_tensor(x, "input")
    k = len(normalized_shape)
    if tuple(x.shape[x.ndim - k:]) != tuple(normalized_shape) or x.ndim < k:
        raise ValueError(f"input: expected trailing dimensions {tuple(normalized_shape)}, got shape {tuple(x.shape)}")
    for name, p in params:
        if p is not None and p.is_meta:
            raise ValueError(f"{name}: a meta tensor has no values; materialise the module first (module.to_empty("
                             f"device=...) then module.reset_parameters() or load_state_dict)")


def _empty_output(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The output for a ``normalized_shape`` with no elements (a 0 among its sizes), as torch's
    modules give it: an empty tensor of x's shape and dtype, in the autograd graph of ``x`` and
    the parameters (whose gradients are then empty, as torch's)."""
    y = x if weight is None else x * weight
    if bias is not None:
        y = y + bias
    return x.clone() if y is x else y.to(x.dtype)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with a safe forward and backward (same arguments and state_dict).

    ``y = x / sqrt(mean(x**2) + eps) * weight``, the mean over the trailing ``normalized_shape``
    dimensions. ``forward`` raises ``TypeError`` for a non-floating input and ``ValueError`` when
    its trailing dimensions are not ``normalized_shape`` or when it or ``weight`` is a meta tensor
    (a sparse or nested input too). A ``normalized_shape`` with a 0 among its sizes gives an empty
    output of the input's shape and dtype, as torch's module does.

    Args:
        normalized_shape: the trailing dimensions normalised over (an int or a shape).
        eps: added to the mean square; default ``None`` means ``torch.finfo(x.dtype).eps`` as in
            torch. With ``eps <= 0`` an all-zero row gives NaN (0/0), and with ``eps < 0`` so does
            every row whose mean square is below ``-eps``, as the formula says.
        elementwise_affine: learn a ``weight`` of shape ``normalized_shape``, initialised to ones
            (default ``True``); ``False`` leaves out the multiplication.
        device: device of ``weight`` (default: torch's default device).
        dtype: dtype of ``weight`` (default: torch's default dtype). The computation is in fp32
            (fp64 for fp64 inputs) whatever the dtypes; the output has the input's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its trailing ``normalized_shape`` dimensions."""
        _check_input(x, self.normalized_shape, ("weight", self.weight))
        if 0 in self.normalized_shape:
            return _empty_output(x, self.weight, None)
        eps = torch.finfo(x.dtype).eps if self.eps is None else float(self.eps)
        return _NormFunction.apply(x, self.weight, None, eps, len(self.normalized_shape), False)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with a safe forward and backward (same arguments and state_dict):
    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with a corrected two-pass mean.

    The statistics are over the trailing ``normalized_shape`` dimensions. ``forward`` raises
    ``TypeError`` for a non-floating input and ``ValueError`` when its trailing dimensions are not
    ``normalized_shape`` or when it, ``weight`` or ``bias`` is a meta tensor (a sparse or nested
    input too). A ``normalized_shape`` with a 0 among its sizes gives an empty output of the
    input's shape and dtype, as torch's module does.

    Args:
        normalized_shape: the trailing dimensions normalised over (an int or a shape).
        eps: added to the variance, a number (default ``1e-5``; ``None`` fails in ``forward``).
            With ``eps <= 0`` a row of equal values gives NaN (0/0), and with ``eps < 0`` so does
            every row whose variance is below ``-eps``, as the formula says.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros) of shape
            ``normalized_shape`` (default ``True``); ``False`` leaves both out.
        bias: learn the ``bias`` when ``elementwise_affine`` (default ``True``).
        device: device of the parameters (default: torch's default device).
        dtype: dtype of the parameters (default: torch's default dtype). The computation is in
            fp32 (fp64 for fp64 inputs) whatever the dtypes; the output has the input's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its trailing ``normalized_shape`` dimensions."""
        _check_input(x, self.normalized_shape, ("weight", self.weight), ("bias", self.bias))
        if 0 in self.normalized_shape:
            return _empty_output(x, self.weight, self.bias)
        return _NormFunction.apply(x, self.weight, self.bias, float(self.eps), len(self.normalized_shape), True)
