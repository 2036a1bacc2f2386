"""Moving models between fp32 and low precision without losing what the optimizer holds.

- :func:`cast_model`: cast a model to bf16/fp16 but keep chosen modules (normalization layers,
  rotary embeddings) in fp32, as seed 001 recommends.
- :func:`load_full_precision`: put fp32 master weights into a low-precision model whose
  optimizer keeps a compensation (``k = t - rn(t)``) or remainder, so nothing is lost at the
  switch; optionally take over the moments of a ``torch.optim`` checkpoint.
- :func:`full_precision_weights` / :func:`full_precision_state_dict`: the fp32 weights the
  optimizer really holds (``theta + k`` for kahan, the exact pair for exact mode).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lowp.optim.base import LowpOptimizer
from lowp.optim.randomness import RandomStreams, Stream
from lowp.optim.storage import store
from lowp.optim.writeback import MODES, resolve_mode

__all__ = ["KEEP_FP32_TYPES", "KEEP_FP32_NAMES", "cast_model", "load_full_precision", "full_precision_weights",
           "full_precision_state_dict"]

KEEP_FP32_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
KEEP_FP32_NAMES: tuple[str, ...] = ("rotary", "rope")


def _kept(name: str, module: nn.Module, types: tuple[type, ...], names: tuple[str, ...]) -> bool:
    return isinstance(module, types) or any(s in name.lower() for s in names)


def cast_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *,
               keep_types: tuple[type, ...] = KEEP_FP32_TYPES, keep_names: Iterable[str] = KEEP_FP32_NAMES) -> nn.Module:
    """Cast floating-point parameters and buffers of ``model`` to ``dtype`` in place, except in
    modules that are instances of ``keep_types`` or whose qualified name contains one of
    ``keep_names`` (case-insensitive); those, and everything inside them, stay fp32.
    Returns ``model``."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    names = tuple(s.lower() for s in keep_names)
    kept_prefixes = [n for n, m in model.named_modules() if n and _kept(n, m, keep_types, names)]
    for name, module in model.named_modules():
        inside = any(name == k or name.startswith(k + ".") for k in kept_prefixes)
        target = torch.float32 if inside else dtype
        for key, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t is not None and t.is_floating_point() and t.dtype != target:
                t.data = t.data.to(target)
    return model


def _param_states(optimizer: LowpOptimizer) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
    return ((g, p) for g in optimizer.param_groups for p in g["params"])


@torch.no_grad()
def load_full_precision(optimizer: LowpOptimizer, weights: Iterable[torch.Tensor],
                        torch_state: Mapping[str, Any] | None = None) -> None:
    """Set the optimizer's parameters from fp32 ``weights`` (same order as the optimizer's
    parameters) so that weight plus compensation/remainder equals them: kahan stores
    ``rn(t)`` and ``k = t - rn(t)``, exact splits ``t`` exactly, other modes round to nearest.

    ``torch_state``: a ``torch.optim`` ``state_dict()`` over the same parameters; its
    per-parameter tensors (moments, momentum buffers) are stored in this optimizer's state
    dtypes and its step counts kept."""
    pairs = list(_param_states(optimizer))
    weights = list(weights)
    if len(weights) != len(pairs):
        raise ValueError(f"weights: expected {len(pairs)} tensors (one per parameter), got {len(weights)}")
    for index, ((_, p), t) in enumerate(zip(pairs, weights)):  # all checked before anything is written
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{index}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != p.shape:
            raise ValueError(f"weights[{index}]: shape {tuple(t.shape)} does not match the parameter's "
                             f"{tuple(p.shape)}")
    if torch_state is not None and not (isinstance(torch_state, Mapping) and "state" in torch_state):
        raise ValueError("torch_state: expected a torch.optim state_dict() (a mapping with a 'state' entry)")
    saved = torch_state["state"] if torch_state is not None else {}
    for index, ((group, p), t) in enumerate(zip(pairs, weights)):
        mode = resolve_mode(group["mode"], p)
        state = optimizer.init_state(group, p, mode)
        t = t.detach().to(device=p.device, dtype=torch.float32 if p.dtype != torch.float64 else torch.float64)
        if mode is MODES["exact"]:
            mode.apply(p, torch.full_like(t, -0.0), t.clone(), state["remainder"], None, False)
        else:
            p.copy_(t)
            if mode is MODES["kahan"]:
                state["compensation"].copy_(t - p.float())
        names = optimizer.state_names(group, p)
        values = saved.get(index, {})
        if "step" in values:
            state["step"] = int(values["step"])
        # the streams of the step the saved states belong to (the optimizer's next step draws step + 1)
        streams = RandomStreams(optimizer.seed, state["step"], index)
        for j, name in enumerate(names):
            if isinstance(values.get(name), torch.Tensor):
                store(state[name], values[name].float().to(p.device), group["state_rounding"], streams,
                      Stream.STATE + j)


@torch.no_grad()
def full_precision_weights(optimizer: LowpOptimizer) -> list[torch.Tensor]:
    """The fp32 value of every parameter as the optimizer holds it (``theta + k`` for kahan,
    the exact weight/remainder pair for exact mode, the weight itself otherwise)."""
    out = []
    for group, p in _param_states(optimizer):
        state = optimizer.state.get(p, {})
        if "remainder" in state:
            out.append(MODES["exact"].load(p, state["remainder"]).clone())
        elif "compensation" in state:
            out.append(p.float() + state["compensation"].float())
        else:
            out.append(p.detach().float() if p.dtype != torch.float64 else p.detach().clone())
    return out


def full_precision_state_dict(model: nn.Module, optimizer: LowpOptimizer) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every parameter the optimizer updates replaced by its
    :func:`full_precision_weights` value (buffers and other entries unchanged)."""
    full = {id(p): w for (_, p), w in zip(_param_states(optimizer), full_precision_weights(optimizer))}
    names = {id(p): n for n, p in model.named_parameters()}
    sd = model.state_dict()
    for pid, w in full.items():
        if pid in names:
            sd[names[pid]] = w
    return sd
