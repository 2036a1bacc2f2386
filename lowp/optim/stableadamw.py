"""StableAdamW (Wortsman et al., "Stable and low-precision training for large-scale
vision-language models", 2023): AdamW whose step size is divided per tensor by the RMS of
``g**2 / v_hat``, which clips the update when the second moment is stale (their Algorithm 2,
without the optional beta2 warm-up)::

    RMS_t = sqrt(mean(g**2 / max(v_hat, eps**2)))
    lr_t = lr / max(1, RMS_t)
    u = -lr_t * (m_hat / (sqrt(v_hat) + eps) + weight_decay * theta)

Defaults follow the paper: betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2 (decoupled).
The RMS is per tensor, so parameters are never cut into chunks.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped

__all__ = ["StableAdamW", "stableadamw_update"]


def stableadamw_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                       eps: float, weight_decay: float) -> list[torch.Tensor]:
    """Functional StableAdamW on fp32 lists of whole tensors: updates the moments, returns ``u``."""
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction2 = 1 - beta2 ** step
    updates = []
    for w, g, m, v in zip(weights, grads, exp_avgs, exp_avg_sqs):
        v_hat = v / bias_correction2
        rms = float((g * g).div_(v_hat.clamp(min=eps * eps)).mean().sqrt()) if g.numel() else 0.0
        lr_t = lr / max(1.0, rms)
        u = m.div(v_hat.sqrt_().add_(eps)).mul_(-lr_t / (1 - beta1 ** step))
        if weight_decay:
            u.add_(w, alpha=-lr_t * weight_decay)
        updates.append(u)
    return updates


class StableAdamW(TwoMomentOptimizer):
    """``StableAdamW(params, lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2, ...)``."""

    elementwise = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 1e-2, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **options)

    def update(self, group, weights, grads, states, step):
        return stableadamw_update(weights, grads, states["exp_avg"], states["exp_avg_sq"], step=step,
                                  lr=float(group["lr"]), betas=group["betas"], eps=group["eps"],
                                  weight_decay=group["weight_decay"])
