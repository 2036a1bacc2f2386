"""Moving models between fp32 and low precision without losing what the optimizer holds.

- :func:`cast_model`: cast a model to bf16/fp16 but keep normalization layers (torch's, and those
  of other libraries recognised by class name, such as Hugging Face's ``LlamaRMSNorm`` or
  ``T5LayerNorm``) and rotary embeddings in fp32, with a forward that stays dtype-safe.
- :func:`load_full_precision`: put fp32 master weights into a low-precision model whose
  optimizer keeps a compensation (``k = t - rn(t)``) or remainder, so nothing is lost at the
  switch; optionally take over the moments of a ``torch.optim`` checkpoint.
- :func:`full_precision_weights` / :func:`full_precision_state_dict`: the fp32 weights the
  optimizer really holds (``theta + k`` for kahan, the weight/remainder pair for exact and exact8).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lowp.optim.base import LowpOptimizer
from lowp.optim.randomness import RandomStreams, Stream
from lowp.optim.storage import store
from lowp.optim.writeback import MODES, resolve_mode

__all__ = ["KEEP_FP32_TYPES", "KEEP_FP32_NAMES", "NORM_CLASS_PATTERN", "cast_model", "is_norm_layer",
           "load_full_precision", "full_precision_weights", "full_precision_state_dict"]

KEEP_FP32_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
KEEP_FP32_NAMES: tuple[str, ...] = ("rotary", "rope")
#: Class names of normalization layers of other libraries: Hugging Face's ``LlamaRMSNorm``,
#: ``MistralRMSNorm``, ``T5LayerNorm``, ``Qwen2RMSNorm``, apex's ``FusedLayerNorm``/``FusedRMSNorm``,
#: timm's ``LayerNorm2d``, Megatron's ``MixedFusedLayerNorm``... (whole class name, case-insensitive).
NORM_CLASS_PATTERN = re.compile(r".*(layer|rms|group|batch|instance)_?norm(\d+d)?", re.IGNORECASE)
#: torch classes whose forward already accepts a low-precision input with fp32 parameters (they
#: compute in fp32 and return the input's dtype); every other kept module gets dtype-safe hooks.
_MIXED_DTYPE_SAFE: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_HOOKED = "_lowp_fp32_hooks"


def is_norm_layer(module: nn.Module) -> bool:
    """True for torch's normalization layers and, by class name (:data:`NORM_CLASS_PATTERN`), for
    those of other libraries."""
    return isinstance(module, KEEP_FP32_TYPES) or bool(NORM_CLASS_PATTERN.fullmatch(type(module).__name__))


def _kept(name: str, module: nn.Module, types: tuple[type, ...], names: tuple[str, ...], norms: bool) -> bool:
    return isinstance(module, types) or (norms and is_norm_layer(module)) or any(s in name.lower() for s in names)


def _map_floats(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every floating-point tensor inside tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_floats(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_floats(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_floats(v, fn) for k, v in value.items()}
    return value


def _first_float_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return None


def _fp32_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    module.__dict__["_lowp_input_dtype"] = _first_float_dtype(args, kwargs)   # popped by _fp32_post_hook
    return _map_floats(args, _to_fp32), _map_floats(kwargs, _to_fp32)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _fp32_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    dtype = module.__dict__.pop("_lowp_input_dtype", None)
    if dtype not in (torch.bfloat16, torch.float16):
        return output
    return _map_floats(output, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


def _make_dtype_safe(module: nn.Module) -> None:
    """Run ``module`` in fp32 whatever its input: bf16/fp16 floating inputs are cast to fp32 on
    the way in and fp32 outputs back to the input's dtype on the way out (once per module)."""
    if isinstance(module, _MIXED_DTYPE_SAFE) or getattr(module, _HOOKED, False):
        return
    module.register_forward_pre_hook(_fp32_pre_hook, with_kwargs=True)
    module.register_forward_hook(_fp32_post_hook, with_kwargs=True)
    setattr(module, _HOOKED, True)


def cast_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *,
               keep_types: tuple[type, ...] = KEEP_FP32_TYPES, keep_names: Iterable[str] = KEEP_FP32_NAMES,
               keep_norms: bool | None = None) -> nn.Module:
    """Cast floating-point parameters and buffers of ``model`` to ``dtype`` in place, except in
    modules that are instances of ``keep_types``, normalization layers of any library when
    ``keep_norms`` (:func:`is_norm_layer`; ``None``: when ``keep_types`` is left at its default,
    so ``keep_types=()`` still casts everything), or whose qualified name contains one of
    ``keep_names`` (case-insensitive); those, and everything inside them, stay fp32.

    A kept module whose forward would mix dtypes (e.g. Hugging Face's ``LlamaRMSNorm`` returns
    ``fp32 weight * bf16 x``, an fp32 tensor the next bf16 layer refuses) is made dtype-safe: it
    computes in fp32 and returns its input's dtype. torch's own norm layers already do.
    Returns ``model``."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    names = tuple(s.lower() for s in keep_names)
    norms = keep_types is KEEP_FP32_TYPES if keep_norms is None else bool(keep_norms)
    kept = [(n, m) for n, m in model.named_modules() if n and _kept(n, m, keep_types, names, norms)]
    outermost = [(n, m) for n, m in kept if not any(n.startswith(k + ".") for k, _ in kept)]
    prefixes = [n for n, _ in outermost]
    for name, module in model.named_modules():
        inside = any(name == k or name.startswith(k + ".") for k in prefixes)
        target = torch.float32 if inside else dtype
        for _, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t is not None and t.is_floating_point() and t.dtype != target:
                t.data = t.data.to(target)
    if dtype != torch.float32:
        for _, module in outermost:
            _make_dtype_safe(module)
    return model


def _param_states(optimizer: LowpOptimizer) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
    return ((g, p) for g in optimizer.param_groups for p in g["params"])


@torch.no_grad()
def load_full_precision(optimizer: LowpOptimizer, weights: Iterable[torch.Tensor],
                        torch_state: Mapping[str, Any] | None = None) -> None:
    """Set the optimizer's parameters from fp32 ``weights`` (same order as the optimizer's
    parameters) so that weight plus compensation/remainder equals them: kahan stores
    ``rn(t)`` and ``k = t - rn(t)``, exact splits ``t`` exactly, exact8 stores the nearest pair
    (16 significant bits, ties away from zero), other modes round to nearest.

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
        p.copy_(t)   # rounded to nearest; a mode with a buffer keeps what the weight cannot hold
        if mode.keep is not None and mode.buffer_name is not None:
            mode.keep(p, state[mode.buffer_name], t)
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
    the weight/remainder pair for exact and exact8 modes, the weight itself otherwise)."""
    out = []
    for _, p in _param_states(optimizer):
        state = optimizer.state.get(p, {})
        held = next(((m.held, state[m.buffer_name]) for m in MODES.values()
                     if m.held is not None and m.buffer_name is not None and m.buffer_name in state), None)
        if held is not None:
            out.append(held[0](p.detach(), held[1]).clone())
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
