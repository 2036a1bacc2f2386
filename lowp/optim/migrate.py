"""Checkpoints from and to other optimizer libraries.

:func:`to_lowp_layout` translates what ``load_state_dict`` receives into lowp's layout, without
modifying its input; lowp checkpoints pass through (older ones kept the extras at the top level,
newer ones in every group):

- ``torch.optim`` (Adam, AdamW, SGD, ...): flags lowp does not have (``foreach``, ``fused``,
  ``capturable``, ...) are dropped, a 0-dim tensor ``step`` is accepted (converted by the
  loader), an SGD state without ``step`` counts as one step taken when it has a momentum buffer.
  torch's ``decoupled_weight_decay`` must agree with the lowp optimizer's (Adam vs AdamW).
- optimi (Adam, AdamW, Lion): ``beta1``/``beta2`` become ``betas``, the per-group ``step``
  becomes every parameter's ``step``, a Kahan buffer ``kahan_comp`` becomes ``compensation``
  (its placeholders, ``None`` or a one-element uint8 tensor, are dropped), and optimi's
  debiased moments (its betas fold the bias correction in, so ``exp_avg`` holds
  ``m / (1 - beta1**t)``) are multiplied back to torch's convention, ``m = exp_avg * (1 -
  beta1**t)`` and ``v = exp_avg_sq * (1 - beta2**t)``, in fp32.

Group keys lowp knows but the checkpoint lacks (``mode``, ``state_dtype``, ...) keep the
optimizer's current values (the constructor's); buffers a mode needs but the checkpoint lacks
are created at the first step.

:func:`to_torch_state_dict` is the way back: a ``torch.optim`` state dict (fp32 states, tensor
steps, no lowp buffers or keys) for the fp32 weights of
:func:`lowp.optim.convert.full_precision_state_dict`.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from lowp.optim.preflight import step_count
from lowp.optim.writeback import BUFFER_NAMES

__all__ = ["FOREIGN_GROUP_KEYS", "to_lowp_layout", "to_torch_state_dict"]

#: Group keys of torch.optim and optimi that configure their implementations, not the math.
FOREIGN_GROUP_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay",
                                "kahan_sum", "triton", "gradient_release", "setup", "step", "decouple_wd",
                                "decouple_lr", "max_lr", "torch_init"})
_LOWP_GROUP_KEYS = ("mode", "state_dtype", "state_block", "state_scale_dtype", "state_rounding", "lowp")


class LowpOptimizer(Protocol):
    """What the translations read of a lowp optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    defaults: dict[str, Any]
    optimi_debiased: dict[str, int] | None

    def infer_step(self, state: Mapping[str, Any]) -> int | None:
        """The step count of a loaded state that has none."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's checkpoint."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint."""


def _is_optimi(groups: list[Mapping[str, Any]]) -> bool:
    return any("kahan_sum" in g and "mode" not in g for g in groups)


def _check_weight_decay_kind(optimizer: LowpOptimizer, group: Mapping[str, Any], decoupled: Any, where: str) -> None:
    """Adam (L2) and AdamW (decoupled) checkpoints are not interchangeable when weight decay acts."""
    ours = getattr(type(optimizer), "decoupled_weight_decay", None)
    if ours is None or decoupled is None or not group.get("weight_decay"):
        return
    if bool(decoupled) != bool(ours):
        kind = "decoupled (AdamW-style)" if decoupled else "L2 (Adam-style)"
        raise ValueError(f"state_dict: {where} uses {kind} weight decay, {type(optimizer).__name__} the other "
                         f"kind; load it into {'AdamW' if decoupled else 'Adam'}")


def to_lowp_layout(optimizer: LowpOptimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``{"state", "param_groups", "lowp"}`` for ``optimizer.load_state_dict`` (see the module
    docstring). Raises ``ValueError`` for layouts it cannot translate."""
    if not isinstance(state_dict.get("param_groups"), (list, tuple)) or not isinstance(state_dict.get("state"),
                                                                                       Mapping):
        raise ValueError("state_dict: expected an optimizer state_dict() with 'state' (a dict) and 'param_groups' "
                         "(a list) entries")
    groups = list(state_dict["param_groups"])
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise ValueError(f"state_dict: param_groups[{i}]: expected a dict with a 'params' list")
    optimi = _is_optimi(groups)
    foreign = optimi or not any("mode" in g for g in groups)
    extras = state_dict.get("lowp")
    out_groups, group_steps = [], {}
    for i, g in enumerate(groups):
        g = dict(g)
        if isinstance(g.get("lowp"), Mapping):
            extras = g["lowp"] if extras is None else extras
        g.pop("lowp", None)
        if optimi:
            if g.get("decouple_lr"):
                raise ValueError(f"state_dict: param_groups[{i}] uses optimi's decouple_lr=True (fully decoupled "
                                 f"weight decay), which lowp does not implement")
            _check_weight_decay_kind(optimizer, g, g.get("decouple_wd"), f"param_groups[{i}]")
            if "beta1" in g:
                g["betas"] = (g.pop("beta1"), g.pop("beta2")) if "beta2" in g else (g.pop("beta1"),)
            if "step" in g:
                step = step_count(g["step"], f"state_dict: param_groups[{i}]['step']")
                group_steps.update({key: step for key in g["params"]})
        elif foreign:
            _check_weight_decay_kind(optimizer, g, g.get("decoupled_weight_decay"), f"param_groups[{i}]")
        if foreign:
            for key in FOREIGN_GROUP_KEYS - set(optimizer.defaults):
                g.pop(key, None)
        out_groups.append(g)
    if optimi and optimizer.optimi_debiased is None:
        raise ValueError(f"state_dict: an optimi checkpoint can be loaded into lowp's Adam, AdamW and Lion, not "
                         f"{type(optimizer).__name__}")
    betas = {key: g.get("betas") for g in out_groups for key in g["params"]}
    states = {}
    for key, entry in state_dict["state"].items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"state_dict['state'][{key!r}]: expected a dict of states, got {type(entry).__name__}")
        entry = {k: v for k, v in entry.items() if v is not None}
        if optimi:
            entry = _from_optimi(optimizer, entry, group_steps.get(key), betas.get(key), key)
        if entry and "step" not in entry:
            inferred = optimizer.infer_step(entry)
            if inferred is None:
                raise ValueError(f"state_dict['state'][{key!r}]: has no 'step' entry")
            entry["step"] = inferred
        states[key] = entry
    return {"state": states, "param_groups": out_groups, "lowp": extras}


def _from_optimi(optimizer: LowpOptimizer, entry: dict[str, Any], step: int | None, betas: Any,
                 key: Any) -> dict[str, Any]:
    comp = entry.pop("kahan_comp", None)
    if isinstance(comp, torch.Tensor) and comp.is_floating_point():
        entry["compensation"] = comp
    if step is not None and "step" not in entry:
        entry["step"] = step
    if "step" in entry:
        t = step_count(entry["step"], f"state_dict['state'][{key!r}]['step']")
        for name, beta_index in (optimizer.optimi_debiased or {}).items():
            value = entry.get(name)
            if isinstance(value, torch.Tensor) and t > 0 and isinstance(betas, (tuple, list)) \
                    and len(betas) > beta_index and isinstance(betas[beta_index], (int, float)):
                entry[name] = (value.float() * (1 - float(betas[beta_index]) ** t)).to(value.dtype)
    return entry


def to_torch_state_dict(optimizer: LowpOptimizer) -> dict[str, Any]:
    """``optimizer``'s state dict in ``torch.optim``'s layout: states as fp32 copies (``torch.optim``
    casts them to the parameter's dtype on load, so load it into an optimizer over fp32
    parameters), ``step`` as a float32 0-dim tensor, without the write-back buffers
    (their value is in :func:`lowp.optim.convert.full_precision_weights`) and without lowp's
    group keys and extras. Adam and AdamW groups get torch's ``decoupled_weight_decay`` (torch
    would otherwise take a group without it for Adam's L2 decay)."""
    sd = optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k not in _LOWP_GROUP_KEYS} for g in sd["param_groups"]]
    decoupled = getattr(type(optimizer), "decoupled_weight_decay", None)
    if decoupled is not None:
        for g in groups:
            g["decoupled_weight_decay"] = decoupled
    state = {}
    for key, entry in sd["state"].items():
        out = {}
        for name, value in entry.items():
            if name == "step":
                out["step"] = torch.tensor(float(value), dtype=torch.float32)
            elif name not in BUFFER_NAMES and isinstance(value, torch.Tensor):
                out[name] = value.to(torch.float32, copy=True)
        state[key] = out
    return {"state": state, "param_groups": groups}
