"""AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), defaults of
``torch.optim.AdamW``; ``amsgrad`` (Reddi et al. 2018) keeps the running maximum of ``v``.

With ``m_hat = m / (1 - beta1**t)`` and ``v_hat = v / (1 - beta2**t)`` the intended change is::

    u = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * theta)

The decay term is part of ``u``, so the write-back mode compensates it like the gradient step.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped

__all__ = ["AdamW", "adamw_update"]


def adamw_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, max_exp_avg_sqs: list[torch.Tensor] | None = None
                 ) -> list[torch.Tensor]:
    """Functional AdamW on fp32 lists: updates the moments in place, returns the changes ``u``."""
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    second = exp_avg_sqs
    if max_exp_avg_sqs is not None:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        second = max_exp_avg_sqs
    denom = torch._foreach_sqrt(second)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(updates, -lr / (1 - beta1 ** step))
    if weight_decay:
        torch._foreach_add_(updates, weights, alpha=-lr * weight_decay)
    return updates


class AdamW(TwoMomentOptimizer):
    """AdamW with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    ``AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
    mode="auto", state_dtype=None, ...)``; common options: :class:`LowpOptimizer`.
    """

    decoupled_weight_decay = True
    optimi_debiased = {"exp_avg": 0, "exp_avg_sq": 1}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         **options)

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def update(self, group, weights, grads, states, step):
        wd = group["weight_decay"]
        if wd and not self.decoupled_weight_decay:
            grads = torch._foreach_add(grads, weights, alpha=wd)
        return adamw_update(weights, grads, states["exp_avg"], states["exp_avg_sq"], step=step, lr=float(group["lr"]),
                            betas=group["betas"], eps=group["eps"],
                            weight_decay=wd if self.decoupled_weight_decay else 0.0,
                            max_exp_avg_sqs=states.get("max_exp_avg_sq"))
