"""RAdam, Adam with a rectified adaptive learning rate.

Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond", 2020, with the
defaults of ``torch.optim.RAdam``. With ``rho_inf = 2 / (1 - beta2) - 1`` and
``rho_t = rho_inf - 2 t beta2**t / (1 - beta2**t)``, the adaptive step is used once ``rho_t > 5``::

    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
    u = -lr * m_hat * r_t * sqrt(1 - beta2**t) / (sqrt(v) + eps)     (else u = -lr * m_hat)

Weight decay is L2 (added to g) unless ``decoupled_weight_decay=True`` (then ``-lr*wd*theta``
joins ``u``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from lowp.arith import sqrt_rn

from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped
from lowp.optim.registry import Example
from lowp.optim.rule import RuleArgs, RuleResult, fma, lerp, sqrt, where
from lowp.optim.spec import OptimizerSpec

__all__ = ["RAdam", "radam_update", "RADAM"]


def radam_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled_weight_decay: bool) -> list[torch.Tensor]:
    """Functional RAdam on fp32 lists: updates the moments in place, returns ``u``."""
    beta1, beta2 = betas
    if weight_decay and not decoupled_weight_decay:
        grads = list(torch._foreach_add(grads, weights, alpha=weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction2 = 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2 ** step / bias_correction2
    updates = list(torch._foreach_mul(exp_avgs, -lr / (1 - beta1 ** step)))
    if rho_t > 5:
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        denom = [sqrt_rn(t) for t in exp_avg_sqs]
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(updates, denom)
        torch._foreach_mul_(updates, rect * math.sqrt(bias_correction2))
    if weight_decay and decoupled_weight_decay:
        torch._foreach_add_(updates, weights, alpha=-lr * weight_decay)
    return updates


def radam_numbers(group: dict[str, Any], step: int) -> dict[str, float]:
    """The step's scalars of :func:`radam_update`, computed as it computes them."""
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    bias_correction2 = 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2 ** step / bias_correction2
    adaptive = rho_t > 5
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) if adaptive else 0
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "step_size": -lr / (1 - beta1 ** step), "adaptive": float(adaptive), "eps": group["eps"],
            "rectification": rect * math.sqrt(bias_correction2), "decay": -lr * wd, "weight_decay": wd}


def radam_rule(r: RuleArgs) -> RuleResult:
    """:func:`radam_update` per element; ``adaptive`` switches the rectified step on once
    ``rho_t > 5`` (a number, so that step does not compile a new variant)."""
    g = r.g
    if r.on.weight_decay and not r.on.decoupled:
        g = fma(r.w, r.n.weight_decay, g)
    m = lerp(r.s.exp_avg, g, r.n.one_minus_beta1)
    v = fma(r.n.one_minus_beta2 * g, g, r.s.exp_avg_sq * r.n.beta2)
    u = m * r.n.step_size
    u = where(r.n.adaptive > 0, u / (sqrt(v) + r.n.eps) * r.n.rectification, u)
    if r.on.weight_decay and r.on.decoupled:
        u = fma(r.w, r.n.decay, u)
    return u, {"exp_avg": m, "exp_avg_sq": v}


RADAM = OptimizerSpec(
    "radam",
    states=lambda group: ("exp_avg", "exp_avg_sq"),
    numbers=radam_numbers,
    switches=lambda group: {"weight_decay": group["weight_decay"] != 0,
                            "decoupled": group["decoupled_weight_decay"]},
    rule=radam_rule, nonnegative=("exp_avg_sq",))


class RAdam(TwoMomentOptimizer):
    """RAdam with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate (default 1e-3); the first steps (``rho_t <= 5``) use ``-lr * m_hat`` alone.
        betas: ``(beta1, beta2)`` in [0, 1) each (default (0.9, 0.999)); ``rho_inf`` follows from beta2.
        eps: added to ``sqrt(v)`` in the rectified step, a finite number >= 0 (default 1e-8).
        weight_decay: decay rate (default 0), L2 (added to the gradient) unless
            ``decoupled_weight_decay``.
        decoupled_weight_decay: ``True`` applies decay as ``-lr * weight_decay * theta`` in the
            update, as AdamW does; default ``False``.
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = RADAM
    examples = (Example("L2 decay added to the gradient", lr=1e-2, weight_decay=0.1),
                Example("decoupled decay, as AdamW", lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True))

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
                 **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay), **options)

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`radam_update`)."""
        return radam_update(weights, grads, states["exp_avg"], states["exp_avg_sq"], step=step, lr=float(group["lr"]),
                            betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                            decoupled_weight_decay=group["decoupled_weight_decay"])
