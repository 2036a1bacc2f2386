"""Adam (Kingma & Ba, 2015) with the defaults of ``torch.optim.Adam``: weight decay is L2,
added to the gradient (``g + weight_decay * theta``) before the moments, unlike AdamW."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from lowp.optim.adamw import ADAMW, AdamW
from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped
from lowp.optim.registry import Example

__all__ = ["Adam"]


class Adam(AdamW):
    """Adam with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Positional order is torch's (``eps`` before ``weight_decay``, unlike optimi; a large ``eps``
    with a tiny ``weight_decay`` warns).

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate (default 1e-3).
        betas: the moments' decay rates (default (0.9, 0.999)).
        eps: the denominator's offset (default 1e-8).
        amsgrad: the running maximum of ``v`` in the denominator (default ``False``).
        weight_decay: L2 penalty: ``weight_decay * theta`` joins the gradient before the moments,
            unlike AdamW's decoupled decay (default 0).
        decoupled_weight_decay: ``True`` decays the weights as AdamW does (``-lr * weight_decay *
            theta`` joins the update), as ``torch.optim.Adam(decoupled_weight_decay=True)``; default
            ``False``. Stored per group.
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer`.
    """

    spec = dataclasses.replace(ADAMW, name="adam", switches=lambda group: {
        "amsgrad": group["amsgrad"], "decoupled": group["decoupled_weight_decay"],
        "weight_decay": group["weight_decay"] != 0})
    decoupled_weight_decay = False
    examples = (Example("L2 decay with amsgrad's running maximum of v", lr=1e-2, weight_decay=0.01, amsgrad=True),
                Example("L2 decay added to the gradient", lr=1e-2, weight_decay=0.1),
                Example("decoupled decay, as AdamW", lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True))

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 decoupled_weight_decay: bool = False, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        TwoMomentOptimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                       amsgrad=amsgrad, decoupled_weight_decay=decoupled_weight_decay),
                                    **options)

    def decoupled(self, group: dict[str, Any]) -> bool:
        """Whether ``group`` decays the weights decoupled (AdamW) or as an L2 penalty (Adam)."""
        return bool(group["decoupled_weight_decay"])
