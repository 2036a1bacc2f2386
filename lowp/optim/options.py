"""The keyword surface of lowp optimizers: what a parameter group may hold, what other libraries'
keywords mean here, and how dtypes travel through checkpoints.

- **Optimizer-wide options in a group.** ``seed``, ``nonfinite``, ``backend``, ``chunk_size``,
  ``diagnostics``, ``foreach``, ``fused``, ``capturable`` and ``differentiable`` act on the whole
  optimizer (one seed and one set of skip counters define its random streams, one backend runs
  its step). Inside a parameter group (trainers such as torchtitan hand every keyword to every
  group) each is accepted when it says what the optimizer already does, and refused with an
  error naming the group and the key otherwise; torch.optim's own group defaults (``foreach=None``,
  ``fused=None``, ``capturable=False``, ``differentiable=False``) always pass. optimi's
  ``kahan_sum`` is honoured per group (it is that group's ``mode``).
- **Misspelt options.** A group key within two letters of a known option (``stat_dtype``) is
  refused with the nearest name; other keys are kept, as torch keeps them (``initial_lr``, names).
- **Other libraries' keywords** (torchao's ``bf16_stochastic_round``, ``block_size``; optimi's
  ``gradient_release``, ``optimizer_accumulation``, ``decouple_lr``; bitsandbytes' ``optim_bits``)
  raise ``TypeError`` naming lowp's equivalent.
- **Checkpoints hold no dtypes**: ``state_dtype`` and ``state_scale_dtype`` are saved as their
  names (``"torch.bfloat16"``), which every torch checkpoint helper accepts (its
  ``_state_dict_utils`` refuses other value types), and read back on load; the constructor and
  parameter groups take the names too (``"int8"``, ``"torch.int8"``), as YAML configurations
  (torchtune's ``_component_``, Hydra's ``_target_``) spell them.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Iterable

import torch

__all__ = ["OPTIMIZER_WIDE", "DTYPE_KEYS", "EXTRAS_KEY", "unknown_keywords", "nearest_name", "group_options",
           "plain_betas",
           "saved_group", "loaded_group", "dtype_value"]

#: Options of the whole optimizer (constructor keywords, not group keys).
OPTIMIZER_WIDE = ("seed", "nonfinite", "backend", "chunk_size", "diagnostics", "foreach", "fused", "capturable",
                  "differentiable")
#: Values torch.optim stores in every group for options lowp has only optimizer-wide.
_TORCH_GROUP_DEFAULTS: dict[str, tuple[Any, ...]] = {"foreach": (None,), "fused": (None, False),
                                                     "capturable": (False,), "differentiable": (False,)}
#: Group keys holding dtypes (saved as their names).
DTYPE_KEYS = ("state_dtype", "state_scale_dtype")
#: The group key that carries the checkpoint extras (seed, skip counters, the optimizer's kind).
EXTRAS_KEY = "lowp"
#: Group keys every group may hold besides the optimizer's options.
_ALWAYS = ("params", "param_names", EXTRAS_KEY, "kahan_sum")

_EQUIVALENTS = {
    "bf16_stochastic_round": "torchao's bf16_stochastic_round=True is mode='stochastic' here (the default, "
                             "mode='kahan', keeps more of each update)",
    "block_size": "torchao's block_size is state_block here (32, 64, 128 or 256), with block-scaled states such as "
                  "state_dtype={'exp_avg': torch.int8, 'exp_avg_sq': torch.uint8}",
    "min_8bit_size": "bitsandbytes' min_8bit_size is coded_min_numel here (parameters with fewer elements keep "
                     "16-bit states where state_dtype asks for block-scaled codes)",
    "optim_bits": "bitsandbytes' optim_bits=8 is state_dtype={'exp_avg': torch.int8, 'exp_avg_sq': torch.uint8} here",
    "gradient_release": "optimi's gradient_release=True is lowp.optim.release_gradients(optimizer) here",
    "optimizer_accumulation": "optimi's optimizer_accumulation is release_gradients(optimizer, accumulation_steps=N, "
                              "accumulate='states') here",
    "decouple_lr": "optimi's decouple_lr=True (fully decoupled weight decay) has no counterpart in lowp; scale "
                   "weight_decay by lr yourself",
    "decouple_wd": "optimi's decouple_wd=True is lowp.optim.AdamW (decoupled decay), decouple_wd=False "
                   "lowp.optim.Adam",
    "is_paged": "bitsandbytes' paged states have no counterpart; lowp keeps states on the parameter's device",
}


def nearest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is most probably a misspelling of (two letters off at most)."""
    close = [k for k in difflib.get_close_matches(name, list(known), n=3, cutoff=0.8) if abs(len(k) - len(name)) <= 2]
    return close[0] if close else None


def unknown_keywords(owner: str, given: Mapping[str, Any], known: Iterable[str]) -> TypeError:
    """The error for constructor keywords ``owner`` does not take: lowp's equivalent of another
    library's keyword, else the nearest known name, else the plain complaint."""
    name = next(iter(given))
    if name in _EQUIVALENTS:
        return TypeError(f"{name}: {owner} takes no such keyword; {_EQUIVALENTS[name]}")
    near = nearest_name(name, known)
    hint = f"; did you mean {near!r}?" if near else ""
    return TypeError(f"{name}: {owner} got an unexpected keyword argument{hint}")


def group_options(group: Mapping[str, Any], wide: Mapping[str, Any], known: Iterable[str], where: str,
                  kahan_mode: Any) -> dict[str, Any]:
    """``group`` as the optimizer keeps it: optimizer-wide options checked against ``wide`` (the
    constructor's values) and dropped, ``kahan_sum`` turned into the group's ``mode`` by
    ``kahan_mode(mode, kahan_sum)``, tensor ``betas`` read as numbers, misspelt option names
    refused (``known``: the group options and constructor keywords)."""
    out = dict(group)
    for key in OPTIMIZER_WIDE:
        if key not in out:
            continue
        value = out.pop(key)
        if any(value is v or value == v for v in _TORCH_GROUP_DEFAULTS.get(key, ())):
            continue
        if key in wide and (value is wide[key] or (type(value) is type(wide[key]) and value == wide[key])):
            continue
        raise ValueError(f"{where}[{key!r}]: {key} is an option of the whole optimizer ({wide.get(key)!r} here) and "
                         f"cannot differ between groups; give it to the constructor")
    if "kahan_sum" in out:
        out["mode"] = kahan_mode(out.get("mode", "auto"), out.pop("kahan_sum"))
    if "betas" in out:
        out["betas"] = plain_betas(out["betas"])
    out = loaded_group(out, where)   # dtype names, as configuration files spell them
    known = set(known)
    for key in out:
        if key in known or key in _ALWAYS or not isinstance(key, str):
            continue
        near = nearest_name(key, known)
        if near is not None:
            raise ValueError(f"{where}[{key!r}]: not an option of this optimizer; did you mean {near!r}?")
    return out


def plain_betas(betas: Any) -> Any:
    """``betas`` with one-element floating-point tensors (torch.optim accepts them) read as numbers;
    anything else as given, for the optimizer's check to judge."""
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        return tuple(float(b) if isinstance(b, torch.Tensor) and b.numel() == 1 and b.is_floating_point() else b
                     for b in betas)
    return betas


def _dtype_name(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _dtype_name(v) for k, v in value.items()}
    return value


def dtype_value(value: Any, where: str) -> Any:
    """``value`` with dtype names (``"bfloat16"``, ``"torch.int8"``, dicts of them) read as dtypes;
    anything else as given, for the optimizer's checks to judge."""
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{where}: expected a torch dtype or its name (such as 'bfloat16', 'int8' or "
                             f"'torch.uint8'), got {value!r}")
        return found
    if isinstance(value, Mapping):
        return {k: dtype_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    return value


def saved_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group of a ``state_dict``: its dtypes as their names."""
    return {k: _dtype_name(v) if k in DTYPE_KEYS else v for k, v in group.items()}


def loaded_group(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A saved group with its dtype names read back (dtypes, as older checkpoints hold them, pass)."""
    return {k: dtype_value(v, f"{where}[{k!r}]") if k in DTYPE_KEYS else v for k, v in group.items()}
