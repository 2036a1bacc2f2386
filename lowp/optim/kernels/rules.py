"""Each optimizer's update as one elementwise rule on fp32 tensors, for the fused backends.

A :class:`Rule` is the optimizer's math written once, without lists or Python scalars, so that a
compiler can fuse it with the loads, the state stores and the write-back into one loop:

- ``hyper(group, step)``: the step's numbers (lr, betas, bias corrections, ...) computed on the
  host in float64 exactly as the reference ``*_update`` computes them; the backend packs them into
  a small fp32 tensor ``h``, so a new LR or step number changes data, never the compiled code.
- ``config(group)``: the structural switches (amsgrad, nesterov, weight decay on/off); one
  compiled variant per distinct value.
- ``fn(w, g, states, h, cfg) -> (u, new_states)``: the update on fp32 tensors of one parameter;
  ``h[i]`` are 0-d tensors. Operations mirror the reference's ATen CPU kernels rounding by
  rounding, fused multiply-adds included: ATen's vectorised ``lerp`` is ``fma(w, end - start,
  start)`` (``fma(w - 1, end - start, end)`` for w >= 0.5), ``addcmul(v, g, g, value=c)`` is
  ``fma(c*g, g, v)`` and ``add(a, b, alpha=s)`` is ``fma(b, s, a)``; Inductor on CPU does not
  contract ``a*b + c`` by itself, so :func:`fma` asks for it explicitly. With these the compiled
  step is bit-identical to the ``foreach`` reference on CPU (tested).

Optimizers whose update is not elementwise have no ``fn``: StableAdamW's per-tensor RMS is a
pre-pass of the native kernel only, Adafactor's factored moments have no rule at all; the other
backends run their reference pipeline for them.
"""
from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Rule", "RULES", "rule_for"]

Tensors = list[torch.Tensor]
RuleFn = Callable[[torch.Tensor, torch.Tensor, Tensors, torch.Tensor, tuple], tuple[torch.Tensor, Tensors]]


@dataclass(frozen=True)
class Rule:
    """One optimizer's fused update: host-side numbers, structural switches and the tensor math
    (``fn``; ``None`` for a rule only the native kernel implements, see StableAdamW below)."""

    name: str
    hyper: Callable[[dict[str, Any], int], list[float]]
    config: Callable[[dict[str, Any]], tuple]
    fn: RuleFn | None


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a*b + c`` rounded once (Inductor's fma prim: ``std::fma``/``fmadd`` on CPU, ``tl.fma`` on
    CUDA). Only meaningful under :func:`torch.compile`; eagerly it rounds twice. Imported lazily:
    ``torch._inductor`` takes seconds to import."""
    from torch._inductor import inductor_prims

    return inductor_prims.fma(a, b, c)


def lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ATen's vectorised CPU ``lerp``: ``fma(w, end - start, start)`` for ``w < 0.5`` else
    ``fma(w - 1, end - start, end)`` (the weight is one number per step)."""
    diff = end - start
    return torch.where(weight < 0.5, fma(weight, diff, start), fma(weight - 1, diff, end))


# ---- AdamW / Adam ------------------------------------------------------------------------------
def _adam_hyper(group: dict[str, Any], step: int) -> list[float]:
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    return [1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2 ** step), group["eps"], -lr / (1 - beta1 ** step),
            -lr * wd, wd]


def _adam_config(group: dict[str, Any], decoupled: bool) -> tuple:
    return (bool(group["amsgrad"]), decoupled, group["weight_decay"] != 0)


def _adam_fn(w, g, states, h, cfg):
    """m = lerp(m, g, 1-b1); v = v*b2 + (1-b2)*g*g; u = m/(sqrt(v)/sqrt(bc2) + eps) * (-lr/bc1)
    (+ w * (-lr*wd) decoupled; L2 decay adds wd*w to g first)."""
    amsgrad, decoupled, has_wd = cfg
    if has_wd and not decoupled:
        g = fma(w, h[7], g)
    m = lerp(states[0], g, h[0])
    v = fma(h[2] * g, g, states[1] * h[1])
    new = [m, v]
    second = v
    if amsgrad:
        second = torch.maximum(states[2], v)
        new.append(second)
    u = m / (torch.sqrt(second) / h[3] + h[4]) * h[5]
    if has_wd and decoupled:
        u = fma(w, h[6], u)
    return u, new


# ---- SGD ---------------------------------------------------------------------------------------
def _sgd_hyper(group: dict[str, Any], step: int) -> list[float]:
    return [group["weight_decay"], group["momentum"], 1 - group["dampening"], float(step == 1), -float(group["lr"])]


def _sgd_config(group: dict[str, Any]) -> tuple:
    return (group["momentum"] != 0, bool(group["nesterov"]), group["weight_decay"] != 0)


def _sgd_fn(w, g, states, h, cfg):
    """d = g + wd*w; b = d (first step) or b*momentum + (1-dampening)*d; d = d + momentum*b
    (Nesterov) or b; u = -lr * d."""
    has_momentum, nesterov, has_wd = cfg
    d = fma(w, h[0], g) if has_wd else g
    new = []
    if has_momentum:
        b = torch.where(h[3] > 0, d, fma(d, h[2], states[0] * h[1]))
        new.append(b)
        d = fma(b, h[1], d) if nesterov else b
    return d * h[4], new


# ---- Lion --------------------------------------------------------------------------------------
def _lion_hyper(group: dict[str, Any], step: int) -> list[float]:
    beta1, beta2 = group["betas"]
    return [1 - beta1, group["weight_decay"], -float(group["lr"]), 1 - beta2]


def _lion_config(group: dict[str, Any]) -> tuple:
    return (group["weight_decay"] != 0,)


def _lion_fn(w, g, states, h, cfg):
    """u = -lr * (sign(lerp(m, g, 1-b1)) + wd*w); m = lerp(m, g, 1-b2)."""
    u = torch.sign(lerp(states[0], g, h[0]))
    if cfg[0]:
        u = fma(w, h[1], u)
    return u * h[2], [lerp(states[0], g, h[3])]


# ---- RAdam -------------------------------------------------------------------------------------
def _radam_hyper(group: dict[str, Any], step: int) -> list[float]:
    beta1, beta2 = group["betas"]
    lr, wd = float(group["lr"]), group["weight_decay"]
    bias_correction2 = 1 - beta2 ** step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2 ** step / bias_correction2
    adaptive = rho_t > 5
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) if adaptive else 0
    return [1 - beta1, beta2, 1 - beta2, -lr / (1 - beta1 ** step), float(adaptive), group["eps"],
            rect * math.sqrt(bias_correction2), -lr * wd, wd]


def _radam_config(group: dict[str, Any]) -> tuple:
    return (group["weight_decay"] != 0, bool(group["decoupled_weight_decay"]))


def _radam_fn(w, g, states, h, cfg):
    """Adam moments; u = -lr/bc1 * m, times r_t*sqrt(bc2)/(sqrt(v)+eps) once rho_t > 5 (``h[4]``
    switches, so the step where rectification starts does not recompile)."""
    has_wd, decoupled = cfg
    if has_wd and not decoupled:
        g = fma(w, h[8], g)
    m = lerp(states[0], g, h[0])
    v = fma(h[2] * g, g, states[1] * h[1])
    u = m * h[3]
    u = torch.where(h[4] > 0, u / (torch.sqrt(v) + h[5]) * h[6], u)
    if has_wd and decoupled:
        u = fma(w, h[7], u)
    return u, [m, v]


# ---- StableAdamW (native kernel only) ------------------------------------------------------------
def _stable_hyper(group: dict[str, Any], step: int) -> list[float]:
    """Numbers for the native kernel, which first sums g^2 / max(v_hat, eps^2) per tensor and
    then takes lr_t = lr / max(1, RMS) (lowp/optim/stableadamw.py): lr, bc1 and wd stay float64
    there, as in the reference."""
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    return [1 - beta1, beta2, 1 - beta2, 1 - beta2 ** step, eps, float(group["lr"]), 1 - beta1 ** step,
            group["weight_decay"], eps * eps]


RULES: dict[str, Rule] = {
    "adamw": Rule("adamw", _adam_hyper, lambda group: _adam_config(group, True), _adam_fn),
    "adam": Rule("adam", _adam_hyper, lambda group: _adam_config(group, False), _adam_fn),
    "sgd": Rule("sgd", _sgd_hyper, _sgd_config, _sgd_fn),
    "lion": Rule("lion", _lion_hyper, _lion_config, _lion_fn),
    "radam": Rule("radam", _radam_hyper, _radam_config, _radam_fn),
    # a per-tensor RMS, not elementwise: no torch.compile form (fn=None), a pre-pass in the native kernel
    "stableadamw": Rule("stableadamw", _stable_hyper, lambda group: (group["weight_decay"] != 0,), None),
}


def rule_for(optimizer: Any) -> Rule | None:
    """The rule of ``optimizer``'s class (``None``: no elementwise rule, use the reference path).

    Matched by exact class so that a user subclass with its own ``update`` is never silently
    replaced by the stock math.
    """
    name = _rule_names().get(type(optimizer))
    return RULES[name] if name else None


@lru_cache(maxsize=None)
def _rule_names() -> dict[type, str]:
    """Optimizer class -> rule name, built once (imported lazily: lowp.optim imports this module)."""
    from lowp.optim import SGD, Adam, AdamW, Lion, RAdam, StableAdamW

    return {AdamW: "adamw", Adam: "adam", SGD: "sgd", Lion: "lion", RAdam: "radam", StableAdamW: "stableadamw"}
