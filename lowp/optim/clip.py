"""Gradient-norm clipping that works with fp16/bf16 gradients under :class:`torch.amp.GradScaler`.

torch's recipe is ``scaler.unscale_(opt)`` then ``clip_grad_norm_``, but ``unscale_`` refuses fp16
gradients ("Attempting to unscale FP16 gradients"), which pure-fp16 training has. lowp's
optimizers unscale inside ``step`` instead (they receive ``grad_scale`` from the scaler), so the
gradients may stay scaled: :func:`clip_grad_norm_` measures the norm of the *unscaled*
gradients,

    ``norm = ||g_scaled||_2 / scale``        (per-tensor norms accumulated in fp32, combined in fp64)

and multiplies the still-scaled gradients by ``min(1, max_norm / (norm + 1e-6))`` in place,
exactly what ``clip_grad_norm_`` after ``unscale_`` would do to the unscaled values. A
non-finite norm (an overflowed scaled gradient) leaves the gradients untouched: the scaler then
skips the step and lowers its scale, as it would without clipping.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["clip_grad_norm_", "grad_norm"]


def _local_norm(g: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
    full_tensor = getattr(norm, "full_tensor", None)   # a DTensor gradient: the norm over every shard
    return full_tensor() if full_tensor is not None else norm


def grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, scaler: "torch.amp.GradScaler | None" = None
              ) -> float:
    """The 2-norm of all gradients of ``parameters`` (``None`` gradients ignored), divided by the
    scaler's current scale when ``scaler`` is given and enabled."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise TypeError("parameters: sparse gradients are not supported")
    if not grads:
        return 0.0
    norms = torch.stack([_local_norm(g) for g in grads]).double()
    total = float(torch.linalg.vector_norm(norms))     # fp64: no overflow of fp32 squares of huge norms
    if scaler is not None and scaler.is_enabled():
        total /= float(scaler.get_scale())
    return total


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    scaler: "torch.amp.GradScaler | None" = None) -> float:
    """Clip the gradients of ``parameters`` in place to a total 2-norm of at most ``max_norm``
    (of the unscaled gradients when ``scaler`` is given); returns the norm before clipping.

    Works for fp32, bf16 and fp16 gradients, scaled or not, and for DTensor gradients (the norm
    is taken over the whole tensor). Use it between ``scaler.scale(loss).backward()`` and
    ``scaler.step(opt)`` in place of ``scaler.unscale_(opt)`` + ``torch.nn.utils.clip_grad_norm_``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0 \
            or not math.isfinite(max_norm):
        raise ValueError(f"max_norm: expected a finite number > 0, got {max_norm!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, scaler)
    coef = max_norm / (total + 1e-6)
    if math.isfinite(total) and coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
