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

- heavyball (``AdamW``, 1.x/2.x ``ForeachAdamW``): heavyball keeps every state under a view index
  (``state[key][0]``, one view per parameter unless ``merge_dims``/``split`` cut it) and names
  it after its transform (``update_by_adam_exp_avg_0``; ``update_by_adam_exp_avg`` before 3.0).
  ``exp_avg`` and ``exp_avg_sq`` are taken; the group's step (``step_count``, or the ``step``
  heavyball keeps in one view's state) becomes every parameter's ``step``; heavyball's betas
  fold the bias correction in as optimi's do, so the moments are multiplied back the same way;
  ``lr`` is the group's ``base_lr`` (the rate before heavyball's warmup). What lowp does not
  implement is refused, naming the group or entry: caution, cautious weight decay, MARS, PaLM's
  beta2 schedule, error-corrected storage (``ecc``/``param_ecc``), a parameter cut into several
  views, a warmup that is not over, and any state of another transform (SOAP, PSGD, Muon,
  schedule-free, a parameter EMA, ...); only lowp's Adam and AdamW take it. heavyball divides
  by ``max(sqrt(v_hat), eps)``, lowp by ``sqrt(v_hat) + eps``: the steps differ where
  ``sqrt(v_hat)`` is within a few ``eps`` of 0.
- Tensor subclasses (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` keep their states as
  ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``: codes, block scales and a code
  table behind a tensor of the parameter's shape): a state whose type is not exactly
  ``torch.Tensor``, ``nn.Parameter`` or ``DTensor`` (nor a DTensor whose local tensor is of such
  a type) is decoded with its class's own ``dequantize()`` into a plain fp32 tensor, and so is a
  tensor of torch's quantized dtypes; the loader then stores it as the group's ``state_dtype``
  says (fp32 when it names none, or lowp's own codes). A subclass without its own
  ``dequantize`` (or whose ``dequantize`` fails or gives no floating-point tensor of its shape)
  is refused, naming the entry. torchao saves no weight decay kind: load an ``AdamW*`` checkpoint
  into lowp's ``AdamW`` and an ``Adam*`` one into ``Adam``. torchao's ``_AdamW`` saves plain
  tensors (its bf16 stochastic rounding is a flag of the optimizer, not of the checkpoint).

Group keys lowp knows but the checkpoint lacks (``mode``, ``state_dtype``, ...) keep the
optimizer's current values (the constructor's); buffers a mode needs but the checkpoint lacks
are created at the first step.

:func:`to_torch_state_dict` is the way back: a ``torch.optim`` state dict (fp32 states, tensor
steps, no lowp buffers or keys) for the fp32 weights of
:func:`lowp.optim.convert.full_precision_state_dict`.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Protocol

import torch

from lowp.optim import sharding
from lowp.optim.preflight import step_count
from lowp.optim.writeback import BUFFER_NAMES

__all__ = ["FOREIGN_GROUP_KEYS", "check_optimizer_state_dict", "to_lowp_layout", "dense_state", "to_torch_state_dict"]

#: Group keys of torch.optim and optimi that configure their implementations, not the math.
FOREIGN_GROUP_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay",
                                "kahan_sum", "triton", "gradient_release", "setup", "step", "decouple_wd",
                                "decouple_lr", "max_lr", "torch_init"})
_LOWP_GROUP_KEYS = ("mode", "state_dtype", "state_block", "state_scale_dtype", "state_rounding", "coded_min_numel",
                    "lowp")


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


def _decoupled(optimizer: LowpOptimizer) -> bool | None:
    """Whether ``optimizer`` decays decoupled: its ``decoupled_weight_decay`` option (Adam, RAdam),
    else its class's (AdamW); ``None`` when it has neither."""
    return optimizer.defaults.get("decoupled_weight_decay", getattr(type(optimizer), "decoupled_weight_decay", None))


def _check_weight_decay_kind(optimizer: LowpOptimizer, group: Mapping[str, Any], decoupled: Any, where: str) -> None:
    """Adam (L2) and AdamW (decoupled) checkpoints are not interchangeable when weight decay acts."""
    ours = _decoupled(optimizer)
    if ours is None or decoupled is None or not group.get("weight_decay"):
        return
    if bool(decoupled) != bool(ours):
        kind = "decoupled (AdamW-style)" if decoupled else "L2 (Adam-style)"
        raise ValueError(f"state_dict: {where} uses {kind} weight decay, {type(optimizer).__name__} the other "
                         f"kind; load it into {'AdamW' if decoupled else 'Adam'}")


#: What a checkpoint holds instead of one optimizer's state dict, and whose it is.
_WRAPPERS = {"offloaded": "torchao's CPUOffloadOptimizer (load each of its 'offloaded' state dicts into the "
                          "optimizer of those parameters)",
             "optimizers": "heavyball's SplitOpt (load each of its 'optimizers' state dicts into the optimizer of "
                           "those parameters)",
             "wrapped": "heavyball's SAMWrapper (its 'wrapped' entry is the inner optimizer's state dict)"}


def check_optimizer_state_dict(state_dict: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``state_dict`` has an optimizer state dict's ``state`` (a dict) and
    ``param_groups`` (a list), naming the wrapper whose state dict it is where it is one. A load
    checks this before any collective: torch's ``broadcast_from_rank0`` route can hand one rank
    a dict without ``state`` while the other ranks fail inside torch's helper and never load."""
    if not isinstance(state_dict.get("param_groups"), (list, tuple)) or not isinstance(state_dict.get("state"),
                                                                                       Mapping):
        wrapper = next((why for key, why in _WRAPPERS.items() if key in state_dict), None)
        raise ValueError("state_dict: expected an optimizer state_dict() with 'state' (a dict) and 'param_groups' "
                         "(a list) entries" + (f"; this is the state dict of {wrapper}" if wrapper else ""))


def to_lowp_layout(optimizer: LowpOptimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``{"state", "param_groups", "lowp"}`` for ``optimizer.load_state_dict`` (see the module
    docstring), every state tensor a plain dense one (or a DTensor of one). Raises ``ValueError``
    or ``TypeError`` naming the entry for layouts and tensors it cannot translate."""
    check_optimizer_state_dict(state_dict)
    groups = list(state_dict["param_groups"])
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), (list, tuple)):
            raise ValueError(f"state_dict: param_groups[{i}]: expected a dict with a 'params' list")
    saved_state: Mapping[Any, Any] = state_dict["state"]
    for key, entry in saved_state.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"state_dict['state'][{key!r}]: expected a dict of states, got {type(entry).__name__}")
    heavyball = _is_heavyball(state_dict)
    group_steps: dict[Any, int] = {}
    if heavyball:
        groups, saved_state, group_steps = _from_heavyball(optimizer, groups, saved_state)
    optimi = not heavyball and _is_optimi(groups)
    foreign = heavyball or optimi or not any("mode" in g for g in groups)
    extras = state_dict.get("lowp")
    out_groups = []
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
        elif foreign and not heavyball:
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
    for key, entry in saved_state.items():
        where = f"state_dict['state'][{key!r}]"
        entry = {k: v if not isinstance(v, torch.Tensor) else dense_state(v, f"{where}[{k!r}]")
                 for k, v in entry.items() if v is not None}
        if optimi or heavyball:
            entry = _from_optimi(optimizer, entry, group_steps.get(key), betas.get(key), key)
        if entry and "step" not in entry:
            inferred = optimizer.infer_step(entry)
            if inferred is None:
                raise ValueError(f"{where}: has no 'step' entry")
            entry["step"] = inferred
        states[key] = entry
    return {"state": states, "param_groups": out_groups, "lowp": extras}


def dense_state(value: torch.Tensor, where: str) -> torch.Tensor:
    """A saved state tensor as one the loader can copy: ``value`` itself when it is a plain
    tensor, an ``nn.Parameter`` or a DTensor of one; a tensor subclass decoded with its class's
    own ``dequantize()`` (torchao's ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``:
    fp32), inside a DTensor too (each rank decodes its local tensor); a tensor of torch's
    quantized dtypes dequantized. Never modifies ``value``.

    Args:
        value: the saved tensor.
        where: the checkpoint entry it was read from, for errors
            (``"state_dict['state'][0]['exp_avg']"``).

    Returns:
        ``value``, or a new plain floating-point tensor (a DTensor of one) of its shape.

    Raises:
        TypeError: ``value`` is a subclass without a ``dequantize`` of its own.
        ValueError: its ``dequantize()`` failed, or gave no plain floating-point tensor of its shape.
    """
    if sharding.is_dtensor(value):
        from torch.distributed.tensor import DTensor
        if type(value) is not DTensor:
            return _decoded(value, where)
        local = value.to_local()
        if type(local) in (torch.Tensor, torch.nn.Parameter) and not local.is_quantized:
            return value
        return DTensor.from_local(_decoded(local, f"{where} (its local tensor)"), value.device_mesh,
                                  value.placements, run_check=False, shape=value.shape, stride=value.stride())
    if type(value) in (torch.Tensor, torch.nn.Parameter) and not value.is_quantized:
        return value
    return _decoded(value, where)


def _decoded(value: torch.Tensor, where: str) -> torch.Tensor:
    """``value`` (a tensor subclass or a quantized tensor) decoded by its own ``dequantize()``."""
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if not value.is_quantized and getattr(kind, "dequantize", torch.Tensor.dequantize) is torch.Tensor.dequantize:
        raise TypeError(f"{where}: a tensor subclass {name}, which lowp cannot read: expected a plain dense tensor, "
                        f"or a subclass that decodes itself with a dequantize() method (as torchao's "
                        f"OptimState8bit, OptimState4bit and OptimStateFp8 do)")
    try:
        with torch.no_grad():
            out = value.dequantize()
    except Exception as e:   # a third-party decoder may raise anything; the load must fail with the entry's name
        raise ValueError(f"{where}: decoding the {name} state with its dequantize() failed "
                         f"({type(e).__name__}: {e})") from e
    if type(out) is not torch.Tensor or not out.is_floating_point() or out.shape != value.shape:
        got = (f"a {type(out).__name__}" if not isinstance(out, torch.Tensor) else
               f"a {type(out).__name__} of dtype {out.dtype} and shape {tuple(out.shape)}")
        raise ValueError(f"{where}: dequantize() of the {name} state gave {got}, expected a plain floating-point "
                         f"tensor of shape {tuple(value.shape)}")
    return out


#: heavyball's names of AdamW's moments (``update_by_adam``, or ``scale_by_adam`` is not taken:
#: heavyball unfuses it only to clip or chain the update), with the transform's index since 3.0.
_HEAVYBALL_MOMENTS = re.compile(r"update_by_adam_(exp_avg|exp_avg_sq)(?:_[0-9]+)?")
#: Entries of a heavyball view state that are bookkeeping, not optimizer states.
_HEAVYBALL_BOOKKEEPING = frozenset({"step", "is_initialized"})
#: heavyball switches that change AdamW's math, which lowp does not implement.
_HEAVYBALL_SWITCHES = {"caution": "cautious updates", "cautious_weight_decay": "cautious weight decay",
                       "mars": "MARS gradient correction", "palm": "PaLM's beta2 schedule"}


def _is_heavyball(state_dict: Mapping[str, Any]) -> bool:
    """heavyball's state dict: its ``heavyball`` extras (2.0 on), or states kept per view index."""
    if isinstance(state_dict.get("heavyball"), Mapping):
        return True
    return any(entry and all(isinstance(k, int) and not isinstance(k, bool) and isinstance(v, Mapping)
                             for k, v in entry.items())
               for entry in state_dict["state"].values())


def _from_heavyball(optimizer: LowpOptimizer, groups: list[Mapping[str, Any]], saved: Mapping[Any, Any]
                    ) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]], dict[Any, int]]:
    """heavyball's groups and states in torch's layout (moments still debiased, as optimi's) and
    the group step of each parameter key; refuses what lowp does not implement."""
    debiased = optimizer.optimi_debiased or {}
    if debiased.get("exp_avg") != 0 or debiased.get("exp_avg_sq") != 1:
        raise ValueError(f"state_dict: a heavyball checkpoint can be loaded into lowp's AdamW (or Adam), not "
                         f"{type(optimizer).__name__}")
    for i, g in enumerate(groups):   # the groups first: their switches explain the states they add
        where = f"state_dict: param_groups[{i}]"
        for switch, what in _HEAVYBALL_SWITCHES.items():
            if g.get(switch) not in (None, False):
                raise ValueError(f"{where} uses heavyball's {switch}={g[switch]!r} ({what}), which lowp does not "
                                 f"implement")
        for ecc in ("ecc", "param_ecc"):
            if g.get(ecc):   # heavyball reads None and '' as off
                raise ValueError(f"{where} uses heavyball's {ecc}={g[ecc]!r} (error-corrected storage), which lowp "
                                 f"does not read")
    states = {key: _heavyball_entry(entry, f"state_dict['state'][{key!r}]") for key, entry in saved.items()}
    out_groups, steps = [], {}
    for i, g in enumerate(groups):
        where = f"state_dict: param_groups[{i}]"
        step = _heavyball_step(g, [saved.get(key) for key in g["params"]], where)
        warmup = g.get("warmup_steps") or 0
        if not isinstance(warmup, (int, float)) or step < warmup:
            raise ValueError(f"{where} is at step {step} of heavyball's {warmup!r}-step learning-rate warmup, which "
                             f"lowp does not implement; load a checkpoint taken after the warmup")
        _check_weight_decay_kind(optimizer, g, True, f"param_groups[{i}]")
        out = {k: v for k, v in g.items() if k in optimizer.defaults or k == "params"}
        if "base_lr" in g:   # heavyball 1.x saves the warmed-up rate as lr
            out["lr"] = g["base_lr"]
        out_groups.append(out)
        steps.update({key: step for key in g["params"] if states.get(key)})
    for key, entry in states.items():
        if entry:
            entry["step"] = steps.get(key, 0)
    return out_groups, states, steps


def _heavyball_entry(entry: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """One parameter's heavyball state (``{view index: {name: value}}``) as ``exp_avg`` and
    ``exp_avg_sq`` (empty when it holds none)."""
    views = {k: v for k, v in entry.items() if v}
    if not views:
        return {}
    if any(not isinstance(k, int) or not isinstance(v, Mapping) for k, v in entry.items()):
        raise ValueError(f"{where}: expected heavyball's states of each view of the parameter, {{0: {{name: "
                         f"tensor}}}}, got the keys {sorted(map(repr, entry))}")
    if list(views) != [0]:
        raise ValueError(f"{where}: heavyball cut this parameter into the views {sorted(views)} (merge_dims or "
                         f"split), which lowp does not keep; load a checkpoint saved with merge_dims=False")
    out: dict[str, Any] = {}
    for name, value in views[0].items():
        if name in _HEAVYBALL_BOOKKEEPING:
            continue
        match = _HEAVYBALL_MOMENTS.fullmatch(name) if isinstance(name, str) else None
        if match is None and isinstance(name, str) and name.startswith("scale_by_adam_"):
            raise ValueError(f"{where}[0][{name!r}]: heavyball's unfused Adam (scale_by_adam: its update is clipped "
                             f"by update_clipping or passed on to another transform), whose step lowp does not "
                             f"reproduce")
        if match is None:
            raise ValueError(f"{where}[0][{name!r}]: a heavyball state that lowp has no counterpart for (it "
                             f"converts heavyball's AdamW, whose states are update_by_adam's exp_avg and "
                             f"exp_avg_sq); is this another heavyball optimizer's checkpoint?")
        if match.group(1) in out:
            raise ValueError(f"{where}[0][{name!r}]: a second heavyball {match.group(1)} (two Adam transforms in "
                             f"one chain), which lowp does not implement")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}[0][{name!r}]: expected a tensor, got {type(value).__name__}")
        out[match.group(1)] = dense_state(value, f"{where}[0][{name!r}]")
    return out


def _heavyball_step(group: Mapping[str, Any], entries: list[Any], where: str) -> int:
    """The step count of a heavyball group: ``step_count`` (3.0 on), else the ``step`` heavyball
    keeps in the state of the first view it stepped."""
    if group.get("step_count") is not None:
        return step_count(group["step_count"], f"{where}['step_count']")
    found = {step_count(view["step"], f"{where}: a view's 'step'") for entry in entries if isinstance(entry, Mapping)
             for view in entry.values() if isinstance(view, Mapping) and view.get("step") is not None}
    if len(found) > 1:
        raise ValueError(f"{where}: its parameters' heavyball states hold the different steps {sorted(found)}, "
                         f"expected one step count per group")
    return found.pop() if found else 0


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
    decoupled = _decoupled(optimizer)
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
