"""``vector_norm``: sqrt(sum x**2 + eps) along a dimension, by a chosen method, in a chosen format."""
from __future__ import annotations

import math

import torch

from lowp.arith import Arith
from lowp.formats import FloatFormat, get_format
from lowp.norms.compute import Native, make_ops
from lowp.norms.methods import METHODS
from lowp.norms.native import opmath_dtype, wide_norm
from lowp.rounding import check_float_tensor, fits_in, quantize

__all__ = ["vector_norm"]


def _input_format(x: torch.Tensor, format: "str | torch.dtype | FloatFormat | None") -> FloatFormat:
    if format is not None:
        return get_format(format)
    try:
        return get_format(x.dtype)
    except ValueError as exc:
        raise TypeError(f"x: dtype {x.dtype} is not a floating-point format lowp knows") from exc


def vector_norm(x: torch.Tensor, dim: int = -1, *, eps: float = 0.0, method: str = "robust",
                compute: "str | torch.dtype | FloatFormat | Arith | Native | None" = None,
                format: "str | torch.dtype | FloatFormat | None" = None) -> torch.Tensor:
    """``sqrt(sum_i x_i**2 + eps)`` along ``dim``, rounded to x's format, returned in ``x.dtype``.

    Args:
        x: a dense floating tensor with values (fp64 ... fp8): an integer, bool or complex dtype
            raises ``TypeError``, a sparse or nested layout or a meta tensor ``ValueError``
            (:func:`lowp.rounding.check_float_tensor`). Its values must be representable in ``compute``. A 0-D
            ``x`` is one element (the result is ``sqrt(x**2 + eps)``, 0-D); an empty ``dim`` has
            an empty sum of squares (the result is ``sqrt(eps)``), as in ``torch.linalg.vector_norm``.
        dim: the reduced dimension (``0`` or ``-1`` for a 0-D ``x``).
        eps: a bias added to the sum of squares, positive or negative (a generalised norm allows both). It
            is held in the compute format (rounded to it once, like a constant on the machine).
            When ``sum x**2 + eps < 0`` the result is NaN, as for the square root of a negative.
        method: ``"naive"``, ``"max_scaled"`` (scaling by the largest magnitude, as LAPACK does),
            ``"two_segment"`` (thresholds at sqrt(max) and sqrt(min subnormal)), ``"blue"`` (reference
            BLAS nrm2) or ``"robust"`` (lowp's; see docs/norms.md).
        compute: where every intermediate operation happens. A torch dtype runs natively (each
            elementwise op rounded to it, sums sequential in it); a format name (``"fp16"``,
            ``"bf16"``, ``"dlfloat16"`` ...) or :class:`~lowp.arith.Arith` emulates that format
            exactly. ``None`` means the opmath dtype (fp32 for fp16/bf16/fp8 inputs, fp64 for fp32).
            ``robust`` with a compute dtype of at least ``2p + 2`` bits (fp32 for fp16/bf16) takes
            the fast path of :mod:`lowp.norms.native`.
        format: the format of x's values when ``x`` is a wider container (e.g. float32 holding
            DLFloat16 values); defaults to ``x.dtype``'s. The result is rounded once to it.
    """
    check_float_tensor(x, "x")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or math.isnan(eps) or math.isinf(eps):
        raise ValueError(f"eps: expected a finite float, got {eps!r}")
    in_fmt = _input_format(x, format)
    ops = make_ops(opmath_dtype(in_fmt) if compute is None else compute)
    if not fits_in(in_fmt, ops.format):
        raise ValueError(f"compute: {ops.format.name} cannot hold every {in_fmt.name} value exactly; "
                         f"choose a compute format at least as wide as the input")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -max(x.ndim, 1) <= dim < max(x.ndim, 1):
        raise ValueError(f"dim: expected an integer in [{-max(x.ndim, 1)}, {max(x.ndim, 1)}) for a {x.ndim}-D x, "
                         f"got {dim!r}")
    # 0-D: one element (as torch.linalg.vector_norm); every method sees 2-D rows (rows, n)
    moved = x.reshape(1) if x.ndim == 0 else x.movedim(dim, -1)
    out_shape = moved.shape[:-1]
    rows = moved.reshape(math.prod(out_shape), moved.shape[-1])
    if rows.shape[0] == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if rows.shape[-1] == 0:  # an empty sum of squares is 0: the norm of one zero
        rows = torch.zeros(rows.shape[0], 1, dtype=x.dtype, device=x.device)
    container = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if method == "robust" and isinstance(ops, Native) and 2 * in_fmt.precision + 2 <= ops.format.precision:
        return wide_norm(rows.to(container) if rows.dtype.itemsize == 1 else rows, float(eps), ops.dtype,
                         in_fmt, x.dtype).reshape(out_shape)
    values = ops.cast(rows.to(container)).abs()
    eps_c = quantize(torch.tensor(float(eps), dtype=torch.float64, device=values.device), ops.format).to(values.dtype)
    if method == "robust":
        finite = torch.isfinite(values)
        result = METHODS[method](ops, torch.where(finite, values, torch.zeros_like(values)), eps_c)
        result = torch.where(torch.isinf(values).any(-1), torch.full_like(result, math.inf), result)
        result = torch.where(torch.isnan(values).any(-1), torch.full_like(result, math.nan), result)
    else:
        result = METHODS[method](ops, values, eps_c)
    return quantize(result, in_fmt).to(x.dtype).reshape(out_shape)
