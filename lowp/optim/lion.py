"""Lion, the sign-momentum optimizer.

Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, with the paper's
defaults (lr=1e-4, betas=(0.9, 0.99), weight_decay=0)::

    u = -lr * (sign(beta1 * m + (1 - beta1) * g) + weight_decay * theta)
    m = beta2 * m + (1 - beta2) * g
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch

from lowp.optim.base import LowpOptimizer, check_betas, check_nonnegative
from lowp.optim.registry import ErrorInput, Example
from lowp.optim.rule import RuleArgs, RuleResult, fma, lerp, sign
from lowp.optim.spec import OptimizerSpec

__all__ = ["Lion", "lion_update", "LION"]


def lion_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
                lr: float, betas: tuple[float, float], weight_decay: float) -> list[torch.Tensor]:
    """Functional Lion on fp32 lists: updates the momentum in place, returns ``u``."""
    beta1, beta2 = betas
    updates = list(torch._foreach_lerp(exp_avgs, grads, 1 - beta1))
    torch._foreach_sign_(updates)
    if weight_decay:
        torch._foreach_add_(updates, weights, alpha=weight_decay)
    torch._foreach_mul_(updates, -lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
    return updates


def lion_rule(r: RuleArgs) -> RuleResult:
    """:func:`lion_update` per element."""
    u = sign(lerp(r.s.exp_avg, r.g, r.n.one_minus_beta1))
    if r.on.weight_decay:
        u = fma(r.w, r.n.weight_decay, u)
    return u * r.n.neg_lr, {"exp_avg": lerp(r.s.exp_avg, r.g, r.n.one_minus_beta2)}


LION = OptimizerSpec(
    "lion",
    states=lambda group: ("exp_avg",),
    numbers=lambda group, step: {"one_minus_beta1": 1 - group["betas"][0], "one_minus_beta2": 1 - group["betas"][1],
                                 "weight_decay": group["weight_decay"], "neg_lr": -float(group["lr"])},
    switches=lambda group: {"weight_decay": group["weight_decay"] != 0},
    rule=lion_rule)


class Lion(LowpOptimizer):
    """Lion with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate, the size of every element's signed step (default 1e-4).
        betas: ``(beta1, beta2)``, each in [0, 1): ``beta1`` mixes momentum and gradient inside
            the sign, ``beta2`` is the momentum's decay rate (default (0.9, 0.99)).
        weight_decay: decoupled decay rate, ``-lr * weight_decay * theta`` joins the update
            (default 0).
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = LION
    examples = (Example("decoupled decay", lr=1e-3, weight_decay=0.1),
                Example("beta1 = 0.6: lerp's weight 1 - beta1 >= 0.5 takes its other branch", lr=1e-3,
                        betas=(0.6, 0.99)))
    error_inputs: ClassVar[tuple[ErrorInput, ...]] = (
        ErrorInput(dict(eps=1e-8), TypeError, r"^eps: Lion got an unexpected keyword argument", "eps (Lion has none)"),
        ErrorInput(dict(betas=(0.9, -0.1)), ValueError, r"^betas\[1\]: expected a number in \[0, 1\), got -0\.1",
                   "negative beta2"))

    optimi_debiased: dict[str, int] = {}   # optimi's Lion momentum is not bias-corrected

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **options: Any) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), **options)

    def validate(self, group: dict[str, Any]) -> None:
        """Check ``betas`` and ``weight_decay``."""
        check_betas(group["betas"])
        check_nonnegative("weight_decay", group["weight_decay"])

    def infer_step(self, state):
        """optimi's Lion saves no step count, and Lion's update does not use one: 0."""
        return 0

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`lion_update`)."""
        return lion_update(weights, grads, states["exp_avg"], lr=float(group["lr"]), betas=group["betas"],
                           weight_decay=group["weight_decay"])
