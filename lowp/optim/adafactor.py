"""Adafactor with the conventions and defaults of ``torch.optim.Adafactor``.

Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018, with
torch's defaults (lr=1e-2,
beta2_decay=-0.8, eps=(None, 1e-3), d=1, no first moment). For a matrix gradient the second
moment is factored into row and column means ``R`` and ``C`` (memory ``rows + cols``)::

    beta2_t = 1 - t**beta2_decay;   R = lerp(R, mean_cols(g**2), 1 - beta2_t);  C likewise
    V = R C / mean(R);   U = g / sqrt(max(V, eps1**2))
    alpha = max(eps2, RMS(theta)) * min(lr, 1/sqrt(t))
    u = -alpha * U / max(1, RMS(U) / d) - lr * weight_decay * theta

``eps1=None`` means fp32's machine epsilon (the compute dtype). Factoring needs whole tensors,
so parameters are never cut into chunks.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable

import torch

from lowp.optim.base import LowpOptimizer, check_nonnegative, real_value
from lowp.optim.registry import ErrorInput, Example, Skip

__all__ = ["Adafactor", "adafactor_update"]


def _rms(t: torch.Tensor) -> float:
    return float(t.norm(2)) / math.sqrt(t.numel()) if t.numel() else 0.0


def adafactor_update(weight: torch.Tensor, grad: torch.Tensor, factors: dict[str, torch.Tensor], *, step: int,
                     lr: float, beta2_decay: float, eps1: float, eps2: float, d: float,
                     weight_decay: float) -> torch.Tensor:
    """Functional Adafactor for one fp32 tensor: updates ``factors`` (``row_var`` and ``col_var``,
    or ``variance`` for vectors) in place, returns ``u``."""
    one_minus_beta2_t = step ** beta2_decay
    alpha = max(eps2, _rms(weight)) * min(lr, 1 / math.sqrt(step))
    if grad.dim() > 1:
        row_var, col_var = factors["row_var"], factors["col_var"]
        row_var.lerp_(grad.norm(dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2_t)
        col_var.lerp_(grad.norm(dim=-2, keepdim=True).square_().div_(grad.size(-2)), one_minus_beta2_t)
        var_estimate = (row_var @ col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        factors["variance"].lerp_(grad * grad, one_minus_beta2_t)
        var_estimate = factors["variance"].clone()
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
    update.mul_(-alpha / max(1.0, _rms(update) / d))
    if weight_decay:
        update.add_(weight, alpha=-lr * weight_decay)
    return update


class Adafactor(LowpOptimizer):
    """Adafactor with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: the relative step size; the step is ``max(eps2, RMS(theta)) * min(lr, 1/sqrt(t))``
            (default 1e-2).
        beta2_decay: the exponent of the second-moment decay ``beta2_t = 1 - t**beta2_decay``, a
            number <= 0 (default -0.8).
        eps: ``(eps1, eps2)``: ``eps1`` floors the second moment at ``eps1**2`` (``None``, the
            default: fp32's machine epsilon), ``eps2`` floors the parameter scale ``RMS(theta)``;
            each a finite number >= 0 (default ``(None, 1e-3)``).
        d: the clipping threshold of the update's RMS, a number >= 1 (default 1.0).
        weight_decay: decoupled decay rate, ``-lr * weight_decay * theta`` joins the update
            (default 0).
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    elementwise = False
    examples = (Example("torch's defaults: factored moments for matrices, a full one for vectors"),
                Example("decoupled decay, clipping threshold 2, eps1 given, maximizing", lr=3e-2, weight_decay=0.1,
                        d=2.0, eps=(1e-20, 1e-3), maximize=True))
    error_inputs: ClassVar[tuple[ErrorInput, ...]] = (
        ErrorInput(dict(beta2_decay=0.5), ValueError, r"^beta2_decay: expected a number <= 0, got 0\.5",
                   "positive beta2_decay"),
        ErrorInput(dict(beta2_decay=False), ValueError, r"^beta2_decay: expected a number <= 0, got False",
                   "bool beta2_decay"),
        ErrorInput(dict(eps=1e-3), ValueError, r"^eps: expected a pair \(eps1 or None, eps2\), got 0\.001",
                   "one eps"),
        ErrorInput(dict(eps=(-1.0, 1e-3)), ValueError, r"^eps\[0\]: expected a finite number >= 0, got -1\.0",
                   "negative eps1"),
        ErrorInput(dict(eps=(True, 1e-3)), ValueError, r"^eps\[0\]: expected a finite number >= 0, got True",
                   "bool eps1"),
        ErrorInput(dict(eps=(None, -1.0)), ValueError, r"^eps\[1\]: expected a finite number >= 0, got -1\.0",
                   "negative eps2"),
        ErrorInput(dict(d=0.5), ValueError, r"^d: expected a clipping threshold >= 1, got 0\.5", "d below 1"),
        ErrorInput(dict(d=float("nan")), ValueError, r"^d: expected a clipping threshold >= 1, got nan", "nan d"),
        ErrorInput(dict(d=True), ValueError, r"^d: expected a clipping threshold >= 1, got True", "bool d"),
        ErrorInput(dict(betas=(0.9, 0.999)), TypeError, r"^betas: Adafactor got an unexpected keyword argument",
                   "betas (Adafactor has none)"))
    skips = (Skip("test_examples_with_block_scaled_codes", "the factored moments (row_var, col_var) are not shaped "
                  "like the parameter, and block-scaled codes hold elementwise states only", ValueError),)

    def __init__(self, params: Iterable, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                 **options: Any) -> None:
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay),
                         **options)

    def validate(self, group: dict[str, Any]) -> None:
        """Check ``beta2_decay``, ``d``, ``eps`` and ``weight_decay``."""
        beta2_decay, d = real_value(group["beta2_decay"]), real_value(group["d"])
        if beta2_decay is None or not beta2_decay <= 0:
            raise ValueError(f"beta2_decay: expected a number <= 0, got {group['beta2_decay']!r}")
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps: expected a pair (eps1 or None, eps2), got {eps!r}")
        if eps[0] is not None:
            check_nonnegative("eps[0]", eps[0])
        check_nonnegative("eps[1]", eps[1])
        if d is None or not d >= 1:
            raise ValueError(f"d: expected a clipping threshold >= 1, got {group['d']!r}")
        check_nonnegative("weight_decay", group["weight_decay"])

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Factored second moments for matrices (``row_var``, ``col_var``), a full one otherwise."""
        return ("row_var", "col_var") if param.dim() > 1 else ("variance",)

    def state_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """Row and column factors drop the last and second-to-last dimension."""
        shape = list(param.shape)
        if name == "row_var":
            shape[-1] = 1
        elif name == "col_var":
            shape[-2] = 1
        return torch.Size(shape)

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`adafactor_update`)."""
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(torch.float32).eps if eps1 is None else eps1
        return [adafactor_update(w, g, {k: v[i] for k, v in states.items()}, step=step, lr=float(group["lr"]),
                                 beta2_decay=group["beta2_decay"], eps1=eps1, eps2=eps2, d=group["d"],
                                 weight_decay=group["weight_decay"])
                for i, (w, g) in enumerate(zip(weights, grads))]
