"""StableAdamW, AdamW with a per-tensor update clip.

Wortsman et al., "Stable and low-precision training for large-scale vision-language models",
2023: AdamW whose step size is divided per tensor by the RMS of
``g**2 / v_hat``, which clips the update when the second moment is stale (their Algorithm 2,
without the optional beta2 warm-up)::

    RMS_t = sqrt(mean(g**2 / max(v_hat, eps**2)))
    lr_t = lr / max(1, RMS_t)
    u = -lr_t * (m_hat / (sqrt(v_hat) + eps) + weight_decay * theta)

Defaults follow the paper: betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2 (decoupled).
The RMS is per tensor, so parameters are never cut into chunks.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch

from lowp.arith import sqrt_rn

from lowp.optim.base import TwoMomentOptimizer, warn_if_swapped
from lowp.optim.registry import Example
from lowp.optim.ordered_sum import ordered_sum
from lowp.optim.rule import Expr, RuleArgs, RuleResult, fma, fp32, lerp, maximum, sqrt
from lowp.optim.spec import Numbers, OptimizerSpec

__all__ = ["StableAdamW", "stableadamw_update", "stable_terms", "STABLEADAMW"]


def stableadamw_update(weights: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                       eps: float, weight_decay: float,
                       sums: Sequence[tuple[float | None, int] | None] | None = None) -> list[torch.Tensor]:
    """Functional StableAdamW on fp32 (or fp64) lists of tensors: updates the moments, returns ``u``.

    A tensor's ``RMS**2`` is the sum of its fp32 terms ``g**2 / max(v_hat, eps**2)``
    (:func:`stable_terms`) in :func:`~lowp.optim.ordered_sum.ordered_sum`'s order (the native
    kernel's) over its element count, and ``lr_t`` comes from that sum by
    :func:`stable_tensor_numbers`, as in the kernel, so every backend takes the same ``lr_t``.
    fp64 tensors (of fp64 parameters, which no kernel runs) take the mean and ``RMS`` in fp64.
    ``sums`` (default: none) gives, per tensor, its whole tensor's ``(total, numel)`` when the
    tensor is a shard of it (:mod:`lowp.optim.sharded_sums`), or ``None``."""
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction2 = 1 - beta2 ** step
    numbers = {"lr": lr, "bias_correction1": 1 - beta1 ** step, "weight_decay": weight_decay}
    updates = []
    for i, (w, g, m, v) in enumerate(zip(weights, grads, exp_avgs, exp_avg_sqs)):
        v_hat = v / bias_correction2
        whole = sums[i] if sums is not None else None
        if whole is not None:
            total, numel = whole
            if total is None:
                raise RuntimeError("stableadamw_update: a shard's whole-tensor sum was not exchanged before its step")
            t = stable_tensor_numbers(numbers, total, numel)
        elif g.dtype == torch.float64:
            terms = _terms(g, v_hat, eps)
            t = _lr_numbers(numbers, float(terms.mean().sqrt()) if terms.numel() else 0.0)
        else:
            t = stable_tensor_numbers(numbers, ordered_sum(_terms(g, v_hat, eps)), g.numel())
        u = m.div(sqrt_rn(v_hat).add_(eps)).mul_(t["step_size"])
        if weight_decay:
            u.add_(w, alpha=t["decay"])
        updates.append(u)
    return updates


def _terms(g: torch.Tensor, v_hat: torch.Tensor, eps: float) -> torch.Tensor:
    """``g**2 / max(v_hat, eps**2)`` elementwise (:func:`stable_ratio`)."""
    return (g * g).div_(v_hat.clamp(min=eps * eps))


def stable_terms(grads: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *, step: int,
                 betas: tuple[float, float], eps: float) -> list[torch.Tensor]:
    """The terms whose sum over a tensor is its ``RMS**2`` times its element count, from fp32
    gradients and second moments *before* the step, which stay unchanged: the same operations as
    :func:`stableadamw_update`'s, bit for bit."""
    beta2 = betas[1]
    second = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(second, grads, grads, 1 - beta2)
    bias_correction2 = 1 - beta2 ** step
    return [_terms(g, v / bias_correction2, eps) for g, v in zip(grads, second)]


def _second_moment(r: RuleArgs) -> Expr:
    return fma(r.n.one_minus_beta2 * r.g, r.g, r.s.exp_avg_sq * r.n.beta2)


def stable_ratio(r: RuleArgs) -> Expr:
    """The term whose mean over a tensor is ``RMS_t**2``: ``g**2 / max(v_hat, eps**2)``."""
    return (r.g * r.g) / maximum(_second_moment(r) / r.n.bias_correction2, r.n.eps_squared)


def stable_tensor_numbers(numbers: Numbers, total: float, numel: int) -> Numbers:
    """``lr_t = lr / max(1, RMS)`` from the tensor's sum ``total`` of :func:`stable_ratio` (added in
    :func:`~lowp.optim.ordered_sum.ordered_sum`'s order) over ``numel`` elements:
    ``RMS = fp32(sqrt(fp32(total / numel)))``, the rest in float64. The reference and the native
    kernel both take their per-tensor numbers from here."""
    return _lr_numbers(numbers, fp32(math.sqrt(fp32(total / numel))) if numel else 0.0)


def _lr_numbers(numbers: Numbers, rms: float) -> Numbers:
    """The step's ``step_size`` and ``decay`` from ``lr_t = lr / max(1, rms)``."""
    lr_t = numbers["lr"] / max(1.0, rms)
    return {"step_size": -lr_t / numbers["bias_correction1"], "decay": -lr_t * numbers["weight_decay"]}


def stable_rule(r: RuleArgs) -> RuleResult:
    """:func:`stableadamw_update` per element, with the tensor's ``lr_t`` in ``r.t``."""
    m = lerp(r.s.exp_avg, r.g, r.n.one_minus_beta1)
    v = _second_moment(r)
    u = m / (sqrt(v / r.n.bias_correction2) + r.n.eps) * r.t.step_size
    if r.on.weight_decay:
        u = fma(r.w, r.t.decay, u)
    return u, {"exp_avg": m, "exp_avg_sq": v}


def _stable_numbers(group: dict[str, Any], step: int) -> Numbers:
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    return {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "bias_correction2": 1 - beta2 ** step, "eps": eps, "eps_squared": eps * eps, "lr": float(group["lr"]),
            "bias_correction1": 1 - beta1 ** step, "weight_decay": group["weight_decay"]}


STABLEADAMW = OptimizerSpec(
    "stableadamw",
    states=lambda group: ("exp_avg", "exp_avg_sq"),
    numbers=_stable_numbers,
    switches=lambda group: {"weight_decay": group["weight_decay"] != 0},
    rule=stable_rule, tensor_sum=stable_ratio, tensor_numbers=stable_tensor_numbers,
    nonnegative=("exp_avg_sq",))


class StableAdamW(TwoMomentOptimizer):
    """StableAdamW with bf16/fp16 weights compensated per :mod:`lowp.optim.writeback` mode.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr: learning rate before the per-tensor clip ``lr / max(1, RMS_t)`` (default 1e-3).
        betas: ``(beta1, beta2)``, the decay rates of the gradient and squared-gradient averages,
            each in [0, 1) (default (0.9, 0.99)).
        eps: added to the denominator ``sqrt(v_hat)``, and ``eps**2`` floors ``v_hat`` in the
            RMS; a finite number >= 0 (default 1e-6).
        weight_decay: decoupled decay rate, ``-lr_t * weight_decay * theta`` joins the update
            (default 1e-2).
        **options: the common options of :class:`~lowp.optim.base.LowpOptimizer` (``mode``,
            ``state_dtype``, ``fused``...).
    """

    spec = STABLEADAMW
    examples = (Example("decoupled decay, the learning rate clipped by each tensor's RMS", lr=1e-2, weight_decay=0.1),)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 1e-2, **options: Any) -> None:
        warn_if_swapped(eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), **options)

    def update(self, group, weights, grads, states, step, sums=None):
        """The reference update (:func:`stableadamw_update`); ``sums``: the whole-tensor sums of
        shards (:mod:`lowp.optim.sharded_sums`)."""
        return stableadamw_update(weights, grads, states["exp_avg"], states["exp_avg_sq"], step=step,
                                  lr=float(group["lr"]), betas=group["betas"], eps=group["eps"],
                                  weight_decay=group["weight_decay"], sums=sums)

    def tensor_terms(self, group: dict[str, Any], grads: list[torch.Tensor], states: dict[str, list[torch.Tensor]],
                     step: int) -> list[torch.Tensor]:
        """The per-tensor sum's terms of each tensor before its step (:func:`stable_terms`), from
        the fp32 working copies ``update`` reads; nothing is written."""
        return stable_terms(grads, states["exp_avg_sq"], step=step, betas=group["betas"], eps=group["eps"])
