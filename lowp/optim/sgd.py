"""SGD with momentum, dampening and Nesterov momentum, as ``torch.optim.SGD``.

The update::

    d = g + weight_decay * theta
    b = d (first step),  b = momentum * b + (1 - dampening) * d (later steps)
    d = d + momentum * b (nesterov)  or  d = b
    u = -lr * d
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch

from lowp.optim.base import LowpOptimizer, check_nonnegative
from lowp.optim.registry import ErrorInput, Example
from lowp.optim.rule import RuleArgs, RuleResult, fma, where
from lowp.optim.spec import OptimizerSpec

__all__ = ["SGD", "sgd_update", "SGD_SPEC"]


def sgd_update(weights: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor] | None,
               *, step: int, lr: float, momentum: float, dampening: float, weight_decay: float,
               nesterov: bool) -> list[torch.Tensor]:
    """Functional SGD on fp32 lists: updates the momentum buffers in place, returns ``u``."""
    d = torch._foreach_add(grads, weights, alpha=weight_decay) if weight_decay else grads
    if momentum_buffers is not None:
        if step == 1:
            torch._foreach_copy_(momentum_buffers, d)
        else:
            torch._foreach_mul_(momentum_buffers, momentum)
            torch._foreach_add_(momentum_buffers, d, alpha=1 - dampening)
        d = torch._foreach_add(d, momentum_buffers, alpha=momentum) if nesterov else momentum_buffers
    return list(torch._foreach_mul(d, -lr))


def sgd_rule(r: RuleArgs) -> RuleResult:
    """:func:`sgd_update` per element (the buffer starts as ``d`` at step 1)."""
    d = fma(r.w, r.n.weight_decay, r.g) if r.on.weight_decay else r.g
    new = {}
    if r.on.momentum:
        b = where(r.n.first_step > 0, d, fma(d, r.n.one_minus_dampening, r.s.momentum_buffer * r.n.momentum))
        new["momentum_buffer"] = b
        d = fma(b, r.n.momentum, d) if r.on.nesterov else b
    return d * r.n.neg_lr, new


SGD_SPEC = OptimizerSpec(
    "sgd",
    states=lambda group: ("momentum_buffer",) if group["momentum"] else (),
    numbers=lambda group, step: {"weight_decay": group["weight_decay"], "momentum": group["momentum"],
                                 "one_minus_dampening": 1 - group["dampening"], "first_step": float(step == 1),
                                 "neg_lr": -float(group["lr"])},
    switches=lambda group: {"momentum": group["momentum"] != 0, "nesterov": group["nesterov"],
                            "weight_decay": group["weight_decay"] != 0},
    rule=sgd_rule)


class SGD(LowpOptimizer):
    """SGD with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate (default 1e-3).
        momentum: momentum factor, a finite number >= 0 (default 0: no momentum buffer).
        dampening: the gradient's weight in the momentum is ``1 - dampening`` after the first
            step, a finite number >= 0 (default 0).
        weight_decay: L2 penalty, ``weight_decay * theta`` is added to the gradient (default 0).
        nesterov: ``True`` uses Nesterov momentum, which needs ``momentum > 0`` and
            ``dampening = 0`` (else ``ValueError``); default ``False``.
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = SGD_SPEC
    examples = (Example("Nesterov momentum with L2 decay", lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
                Example("plain SGD: no momentum buffer", lr=0.05),
                Example("momentum with dampening", lr=0.05, momentum=0.9, dampening=0.3))
    error_inputs: ClassVar[tuple[ErrorInput, ...]] = (
        ErrorInput(dict(momentum=-0.9), ValueError, r"^momentum: expected a finite number >= 0, got -0\.9",
                   "negative momentum"),
        ErrorInput(dict(momentum=True), ValueError, r"^momentum: expected a finite number >= 0, got True",
                   "bool momentum"),
        ErrorInput(dict(dampening=-0.5), ValueError, r"^dampening: expected a finite number >= 0, got -0\.5",
                   "negative dampening"),
        ErrorInput(dict(dampening=False), ValueError, r"^dampening: expected a finite number >= 0, got False",
                   "bool dampening"),
        ErrorInput(dict(nesterov=True), ValueError, r"^nesterov: Nesterov momentum requires momentum > 0 and "
                   r"dampening = 0", "Nesterov without momentum"),
        ErrorInput(dict(nesterov=True, momentum=0.9, dampening=0.1), ValueError, r"^nesterov: Nesterov momentum "
                   r"requires momentum > 0 and dampening = 0", "Nesterov with dampening"),
        ErrorInput(dict(momentum=0.9, state_dtype=torch.uint4), ValueError,  # type: ignore[attr-defined]
                   r"^state_dtype: uint4 codes hold nonnegative states only .*'momentum_buffer' may be negative",
                   "unsigned codes for the momentum buffer"))

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, **options: Any) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), **options)

    def validate(self, group: dict[str, Any]) -> None:
        """Check momentum, dampening and weight decay, and Nesterov needs momentum without dampening."""
        for name in ("momentum", "dampening", "weight_decay"):
            check_nonnegative(name, group[name])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov: Nesterov momentum requires momentum > 0 and dampening = 0")

    def infer_step(self, state):
        """``torch.optim.SGD`` saves no step: a momentum buffer means at least one step was taken
        (the next step then updates the buffer instead of initialising it)."""
        return 1 if "momentum_buffer" in state else 0

    def update(self, group, weights, grads, states, step):
        """The reference update (:func:`sgd_update`)."""
        return sgd_update(weights, grads, states.get("momentum_buffer"), step=step, lr=float(group["lr"]),
                          momentum=group["momentum"], dampening=group["dampening"],
                          weight_decay=group["weight_decay"], nesterov=group["nesterov"])
