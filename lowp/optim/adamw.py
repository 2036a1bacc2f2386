"""AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), defaults of
``torch.optim.AdamW``; ``amsgrad`` (Reddi et al. 2018) keeps the running maximum of ``v``.

With ``m_hat = m / (1 - beta1**t)`` and ``v_hat = v / (1 - beta2**t)`` the intended change is::

    u = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * theta)

The decay term is part of ``u``, so the write-back mode compensates it like the gradient step.
``ADAMW`` is the spec every backend reads (:mod:`lowp.optim.spec`); :class:`~lowp.optim.adam.Adam`
reuses it with L2 decay.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable

import torch

from lowp.arith import sqrt_rn

from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped
from lowp.optim.registry import ErrorInput, Example
from lowp.optim.rule import RuleArgs, RuleResult, fma, lerp, maximum, sqrt
from lowp.optim.spec import OptimizerSpec

__all__ = ["AdamW", "adamw_update", "ADAMW", "adam_numbers", "adam_rule"]


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
    denom = [sqrt_rn(t) for t in second]
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    updates = list(torch._foreach_div(exp_avgs, denom))
    torch._foreach_mul_(updates, -lr / (1 - beta1 ** step))
    if weight_decay:
        torch._foreach_add_(updates, weights, alpha=-lr * weight_decay)
    return updates


def adam_numbers(group: dict[str, Any], step: int) -> dict[str, float]:
    """The step's scalars of :func:`adamw_update`, computed as it computes them."""
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "sqrt_bias_correction2": math.sqrt(1 - beta2 ** step), "eps": group["eps"],
            "step_size": -lr / (1 - beta1 ** step), "decay": -lr * wd, "weight_decay": wd}


def adam_rule(r: RuleArgs) -> RuleResult:
    """:func:`adamw_update` per element: ``m = lerp(m, g, 1-b1)``, ``v = fma((1-b2) g, g, v b2)``,
    ``u = m / (sqrt(v) / sqrt(bc2) + eps) * (-lr / bc1)`` (+ ``w * (-lr wd)`` decoupled; L2 decay
    adds ``wd w`` to ``g`` first)."""
    g = r.g
    if r.on.weight_decay and not r.on.decoupled:
        g = fma(r.w, r.n.weight_decay, g)
    m = lerp(r.s.exp_avg, g, r.n.one_minus_beta1)
    v = fma(r.n.one_minus_beta2 * g, g, r.s.exp_avg_sq * r.n.beta2)
    new = {"exp_avg": m, "exp_avg_sq": v}
    second = v
    if r.on.amsgrad:
        second = new["max_exp_avg_sq"] = maximum(r.s.max_exp_avg_sq, v)
    u = m / (sqrt(second) / r.n.sqrt_bias_correction2 + r.n.eps) * r.n.step_size
    if r.on.weight_decay and r.on.decoupled:
        u = fma(r.w, r.n.decay, u)
    return u, new


ADAMW = OptimizerSpec(
    "adamw",
    states=lambda group: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq"),
    numbers=adam_numbers,
    switches=lambda group: {"amsgrad": group["amsgrad"], "decoupled": True, "weight_decay": group["weight_decay"] != 0},
    rule=adam_rule, nonnegative=("exp_avg_sq", "max_exp_avg_sq"))


class AdamW(TwoMomentOptimizer):
    """AdamW with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Positional order is torch's (``eps`` before ``weight_decay``, unlike optimi; a large ``eps``
    with a tiny ``weight_decay`` warns).

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate (default 1e-3).
        betas: ``(beta1, beta2)``, the decay rates of the gradient and squared-gradient averages,
            each in [0, 1) (default (0.9, 0.999)).
        eps: added to the denominator ``sqrt(v_hat)``, a finite number >= 0 (default 1e-8).
        weight_decay: decoupled decay rate, ``-lr * weight_decay * theta`` joins the update
            (default 1e-2).
        amsgrad: ``True`` uses the running maximum of ``v`` (one more state, ``max_exp_avg_sq``)
            in place of ``v`` in the denominator; default ``False``.
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = ADAMW
    examples: ClassVar[tuple[dict[str, Any], ...]] = (
        Example("decoupled decay", lr=1e-2, weight_decay=0.1),
        Example("amsgrad's running maximum of v, maximizing", lr=1e-2, amsgrad=True, maximize=True))
    error_inputs: ClassVar[tuple[ErrorInput, ...]] = (
        ErrorInput(dict(state_dtype={"exp_avg_sq": torch.uint8, "exp_avg": torch.uint4}),  # type: ignore[attr-defined]
                   ValueError, r"^state_dtype\['exp_avg'\]: uint4 codes hold nonnegative states only",
                   "unsigned codes for the first moment by name"),)
    decoupled_weight_decay = True
    optimi_debiased = {"exp_avg": 0, "exp_avg_sq": 1}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         **options)

    def decoupled(self, group: dict[str, Any]) -> bool:
        """Whether ``group`` decays the weights decoupled (always, for AdamW)."""
        return True

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`adamw_update`; L2 decay folded into ``g`` for Adam)."""
        wd = group["weight_decay"]
        decoupled = self.decoupled(group)
        if wd and not decoupled:
            grads = torch._foreach_add(grads, weights, alpha=wd)
        return adamw_update(weights, grads, states["exp_avg"], states["exp_avg_sq"], step=step, lr=float(group["lr"]),
                            betas=group["betas"], eps=group["eps"], weight_decay=wd if decoupled else 0.0,
                            max_exp_avg_sqs=states.get("max_exp_avg_sq"))
