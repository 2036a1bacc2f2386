"""Adam (Kingma & Ba, 2015) with the defaults of ``torch.optim.Adam``: weight decay is L2,
added to the gradient (``g + weight_decay * theta``) before the moments, unlike AdamW."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from lowp.optim.adamw import ADAMW, AdamW

__all__ = ["Adam"]


class Adam(AdamW):
    """``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, ...)``
    (torch's positional order: ``eps`` before ``weight_decay``, unlike optimi)."""

    spec = dataclasses.replace(ADAMW, name="adam", switches=lambda group: {
        "amsgrad": group["amsgrad"], "decoupled": False, "weight_decay": group["weight_decay"] != 0})
    decoupled_weight_decay = False
    examples = (dict(lr=1e-2, weight_decay=0.1),)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, **options: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **options)
