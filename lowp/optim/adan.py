"""Adan, the adaptive Nesterov momentum optimizer, with four states per parameter.

Xie et al., "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models",
2022 (TPAMI 2024), with the defaults of the authors' implementation: lr=1e-3,
betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0. With ``d = g - g_prev`` (0 at the first
step) and bias corrections ``bc_i = 1 - beta_i**t``::

    m = lerp(m, g, 1 - beta1)              v = lerp(v, d, 1 - beta2)
    n = beta3 n + (1 - beta3) (g + beta2 d)**2
    s = (m / bc1 + beta2 v / bc2) / (sqrt(n) / sqrt(bc3) + eps)
    u = -lr (s + weight_decay theta)                     (no_prox=True: decoupled decay)
    u = -lr (s + weight_decay theta) / (1 + lr weight_decay)    (default: the proximal step
                                                          theta' = (theta - lr s) / (1 + lr wd))

Four states per parameter (``exp_avg``, ``exp_avg_diff``, ``exp_avg_sq``, ``prev_grad``); the
write-back mode compensates ``u``, decay included. The spec below is all the fused kernels need.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable

import torch

from lowp.arith import sqrt_rn

from lowp.optim.base import LowpOptimizer, check_betas, check_nonnegative, warn_if_swapped
from lowp.optim.registry import ErrorInput, Example
from lowp.optim.rule import RuleArgs, RuleResult, fma, lerp, sqrt, where
from lowp.optim.spec import OptimizerSpec

__all__ = ["Adan", "adan_update", "ADAN"]

_STATES = ("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad")


def adan_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_diffs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], prev_grads: list[torch.Tensor],
                *, step: int, lr: float, betas: tuple[float, float, float], eps: float, weight_decay: float,
                no_prox: bool) -> list[torch.Tensor]:
    """Functional Adan on fp32 lists: updates the states in place, returns the changes ``u``."""
    beta1, beta2, beta3 = betas
    diffs = torch._foreach_sub(grads, prev_grads)
    if step == 1:
        torch._foreach_zero_(diffs)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_lerp_(exp_avg_diffs, diffs, 1 - beta2)
    mixed = torch._foreach_add(grads, diffs, alpha=beta2)
    torch._foreach_mul_(exp_avg_sqs, beta3)
    torch._foreach_addcmul_(exp_avg_sqs, mixed, mixed, 1 - beta3)
    torch._foreach_copy_(prev_grads, grads)
    denom = [sqrt_rn(t) for t in exp_avg_sqs]
    torch._foreach_div_(denom, math.sqrt(1 - beta3 ** step))
    torch._foreach_add_(denom, eps)
    updates = list(torch._foreach_div(exp_avgs, 1 - beta1 ** step))
    torch._foreach_add_(updates, torch._foreach_div(exp_avg_diffs, 1 - beta2 ** step), alpha=beta2)
    torch._foreach_div_(updates, denom)
    torch._foreach_mul_(updates, -lr)
    if weight_decay:
        torch._foreach_add_(updates, weights, alpha=-lr * weight_decay)
        if not no_prox:
            torch._foreach_div_(updates, 1 + lr * weight_decay)
    return updates


def adan_numbers(group: dict[str, Any], step: int) -> dict[str, float]:
    """The step's scalars of :func:`adan_update`, computed as it computes them."""
    beta1, beta2, beta3 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    return {"first_step": float(step == 1), "one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2,
            "beta2": beta2, "beta3": beta3, "one_minus_beta3": 1 - beta3,
            "sqrt_bias_correction3": math.sqrt(1 - beta3 ** step), "eps": group["eps"],
            "bias_correction1": 1 - beta1 ** step, "bias_correction2": 1 - beta2 ** step, "neg_lr": -lr,
            "decay": -lr * wd, "prox": 1 + lr * wd}


def adan_rule(r: RuleArgs) -> RuleResult:
    """:func:`adan_update` per element."""
    d = where(r.n.first_step > 0, 0.0, r.g - r.s.prev_grad)
    m = lerp(r.s.exp_avg, r.g, r.n.one_minus_beta1)
    v = lerp(r.s.exp_avg_diff, d, r.n.one_minus_beta2)
    mixed = fma(d, r.n.beta2, r.g)
    n = fma(r.n.one_minus_beta3 * mixed, mixed, r.s.exp_avg_sq * r.n.beta3)
    denom = sqrt(n) / r.n.sqrt_bias_correction3 + r.n.eps
    u = fma(v / r.n.bias_correction2, r.n.beta2, m / r.n.bias_correction1) / denom * r.n.neg_lr
    if r.on.weight_decay:
        u = fma(r.w, r.n.decay, u)
        if not r.on.no_prox:
            u = u / r.n.prox
    return u, {"exp_avg": m, "exp_avg_diff": v, "exp_avg_sq": n, "prev_grad": r.g}


ADAN = OptimizerSpec(
    "adan",
    states=lambda group: _STATES,
    numbers=adan_numbers,
    switches=lambda group: {"weight_decay": group["weight_decay"] != 0, "no_prox": group["no_prox"]},
    rule=adan_rule, nonnegative=("exp_avg_sq",))


class Adan(LowpOptimizer):
    """Adan with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate (default 1e-3).
        betas: ``(beta1, beta2, beta3)`` for the gradient, gradient-difference and squared-term
            averages, each in [0, 1) (default (0.98, 0.92, 0.99)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decay rate (default 0).
        no_prox: ``False`` (default) applies decay as the proximal step ``theta / (1 + lr wd)``;
            ``True`` as plain decoupled decay ``-lr wd theta``.
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = ADAN
    examples = (Example("proximal decay (the default)", lr=1e-2, weight_decay=0.1),
                Example("decoupled decay (no_prox)", lr=1e-2, weight_decay=0.1, no_prox=True))
    error_inputs: ClassVar[tuple[ErrorInput, ...]] = (
        ErrorInput(dict(betas=(0.98, 1.0, 0.99)), ValueError, r"^betas\[1\]: expected a number in \[0, 1\), got 1\.0",
                   "beta2 1"),
        ErrorInput(dict(betas=(0.98, 0.92, 0.99, 0.9)), ValueError, r"^betas: expected a tuple of 3 numbers",
                   "four betas"))
    flag_keys = (*LowpOptimizer.flag_keys, "no_prox")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
                 eps: float = 1e-8, weight_decay: float = 0.0, no_prox: bool = False, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_prox=no_prox),
                         **options)

    def validate(self, group: dict[str, Any]) -> None:
        """Check the three betas, ``eps`` and ``weight_decay``."""
        check_betas(group["betas"], count=3)
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`adan_update`)."""
        return adan_update(weights, grads, states["exp_avg"], states["exp_avg_diff"], states["exp_avg_sq"],
                           states["prev_grad"], step=step, lr=float(group["lr"]), betas=group["betas"],
                           eps=group["eps"], weight_decay=group["weight_decay"], no_prox=group["no_prox"])
