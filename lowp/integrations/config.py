"""lowp optimizers chosen by configuration: optimizer names, keyword values given as text, dtype names.

Configuration files and command lines carry strings, numbers, lists and dicts, never
``torch.dtype`` objects or classes. This module turns them into what lowp's constructors take:

- **Names** (:func:`optimizer_class`): a lowp optimizer's class name in any case, with or without
  a ``lowp.``, ``lowp.optim.`` or ``lowp_`` prefix: ``"AdamW"``, ``"lowp.AdamW"``,
  ``"lowp_adamw"`` all name :class:`lowp.optim.AdamW`.
- **Dtypes** (:func:`configured_kwargs`): ``state_dtype`` and ``state_scale_dtype`` may be dtype
  names (``"bfloat16"``, ``"torch.int8"``); ``state_dtype`` may also be a dict of them keyed by
  state name, or several names in the order of the optimizer's states, written
  ``"int8/uint8"`` (a list or tuple works too): for Adam and AdamW that is
  ``{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}``, the 5-byte configuration with
  ``mode="exact8"``. ``"exp_avg:int8/exp_avg_sq:uint8"`` names the states explicitly. ``betas``
  given as a list becomes a tuple.
- **Text** (:func:`parse_optim_args`): ``"mode=exact8,state_dtype=int8/uint8,betas=0.9/0.95"``,
  split as Hugging Face ``TrainingArguments.optim_args`` is split (on commas, then on the first
  ``=``, spaces removed), each value read as a bool, ``None``, an int, a float, a ``/``-separated
  tuple of those, or else kept as a string.
- :func:`build_optimizer`: ``build_optimizer(params, optimizer="AdamW", **kwargs)`` for
  configuration systems that call a dotted path with the parameters as the first argument
  (torchtune's ``_component_``, Hydra's ``_target_``).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Iterable

import torch

from lowp.optim.base import LowpOptimizer
from lowp.optim.options import dtype_value
from lowp.optim.registry import optimizers

__all__ = ["optimizer_names", "optimizer_class", "is_lowp_name", "configured_kwargs", "parse_optim_args",
           "parse_value", "configured_groups", "build_optimizer"]

_PREFIXES = ("lowp.optim.", "lowp.", "lowp_")


def optimizer_names() -> dict[str, type[LowpOptimizer]]:
    """Every lowp optimizer by its lower-case class name (``"adamw"``: :class:`lowp.optim.AdamW`)."""
    return {cls.__name__.lower(): cls for cls in optimizers()}


def _bare(name: str) -> str:
    for prefix in _PREFIXES:
        if name.lower().startswith(prefix):
            return name[len(prefix):].lower()
    return name.lower()


def is_lowp_name(name: Any) -> bool:
    """Whether ``name`` is a string naming a lowp optimizer with a ``lowp.``, ``lowp.optim.`` or
    ``lowp_`` prefix (``"lowp_adamw"``, ``"lowp.AdamW"``), the names that cannot be mistaken for
    another library's optimizer."""
    return isinstance(name, str) and name.lower().startswith(_PREFIXES) and _bare(name) in optimizer_names()


def optimizer_class(name: str | type[LowpOptimizer]) -> type[LowpOptimizer]:
    """The lowp optimizer class ``name`` names (see the module docstring); a lowp class passes.

    Args:
        name: a class name such as ``"AdamW"``, ``"lowp.AdamW"`` or ``"lowp_adamw"`` (any case), or
            a :class:`~lowp.optim.base.LowpOptimizer` subclass.

    Returns:
        The optimizer class.

    Raises:
        ValueError: ``name`` names no lowp optimizer (the message lists them).
    """
    if isinstance(name, type) and issubclass(name, LowpOptimizer):
        return name
    known = optimizer_names()
    if isinstance(name, str) and _bare(name) in known:
        return known[_bare(name)]
    names = ", ".join(cls.__name__ for cls in known.values())
    raise ValueError(f"optimizer: {name!r} names no lowp optimizer; expected one of {names} (optionally prefixed "
                     f"with 'lowp.' or 'lowp_')")


def parse_value(text: str) -> Any:
    """A configuration value written as text: ``true``/``false`` (any case) a bool, ``none``/``null``
    ``None``, then an int, a float, a ``/``-separated tuple of such values (``0.9/0.95``), or else
    the text itself.

    Args:
        text: the value as written.

    Returns:
        The value.
    """
    if "/" in text:
        return tuple(parse_value(part) for part in text.split("/"))
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Keyword arguments written as ``"key=value,key=value"`` (Hugging Face's ``optim_args``
    format: spaces are removed, pairs split on commas, each pair on its first ``=``), each value
    read by :func:`parse_value`.

    Args:
        text: the arguments; ``None`` or ``""`` for none.

    Returns:
        The keyword arguments, in their order.

    Raises:
        ValueError: a pair without ``=``, or without a key.
    """
    out: dict[str, Any] = {}
    if not text:
        return out
    for pair in text.replace(" ", "").split(","):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"optim_args: expected 'key=value' pairs separated by commas, got {pair!r} in {text!r}")
        out[key] = parse_value(value)
    return out


def _dtype(value: Any, where: str) -> Any:
    """A dtype, its name (:func:`lowp.optim.options.dtype_value`), or ``"none"``/``"null"``/``""``
    for ``None``, as configuration files spell it."""
    if isinstance(value, str) and value.lower() in ("none", "null", ""):
        return None
    if value is not None and not isinstance(value, (str, torch.dtype)):
        raise ValueError(f"{where}: expected a torch dtype or its name (such as 'bfloat16', 'int8' or 'torch.uint8'), "
                         f"got {value!r}")
    return dtype_value(value, where)


def _hyper_parameters(cls: type[LowpOptimizer], given: Mapping[str, Any]) -> dict[str, Any]:
    """The group ``cls`` would make from ``given``: its constructor's defaults updated by ``given``."""
    group = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}
    return {**group, **given}


def _state_dtype(cls: type[LowpOptimizer], value: Any, given: Mapping[str, Any]) -> Any:
    """``state_dtype`` with names read as dtypes; positional names assigned to the states in order."""
    if isinstance(value, str) and "/" in value:
        value = tuple(value.split("/"))
    if isinstance(value, Mapping):
        return {str(k): _dtype(v, f"state_dtype[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        parts = [str(v) if not isinstance(v, torch.dtype) else v for v in value]
        named = [isinstance(p, str) and ":" in p for p in parts]
        if all(named):
            pairs = [str(p).split(":", 1) for p in parts]
            return {k: _dtype(v, f"state_dtype[{k!r}]") for k, v in pairs}
        if any(named):
            raise ValueError(f"state_dtype: either name every state ('exp_avg:int8/exp_avg_sq:uint8') or none "
                             f"('int8/uint8'), got {value!r}")
        if cls.spec is None:
            raise ValueError(f"state_dtype: {cls.__name__} has no declared state order; name the states "
                             f"('name:dtype/name:dtype') or give one dtype")
        names = cls.spec.states(_hyper_parameters(cls, given))
        if len(parts) > len(names):
            raise ValueError(f"state_dtype: {len(parts)} dtypes for {cls.__name__}'s {len(names)} states "
                             f"({', '.join(names) or 'none'}): {value!r}")
        return {name: _dtype(v, f"state_dtype[{name!r}]") for name, v in zip(names, parts)}
    return _dtype(value, "state_dtype")


def configured_kwargs(optimizer: str | type[LowpOptimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``optimizer``'s constructor (or one of its parameter groups) with the
    configuration spellings read (see the module docstring): dtype names, ``state_dtype`` per state
    in order, ``betas`` as a tuple. Other keys pass unchanged; the constructor judges them.

    Args:
        optimizer: the optimizer (a name or class, see :func:`optimizer_class`).
        kwargs: keyword arguments as configured.

    Returns:
        A new dict.

    Raises:
        ValueError: a dtype name torch does not know, or positional ``state_dtype`` names that
            cannot be matched to the optimizer's states.
    """
    cls = optimizer_class(optimizer)
    out = dict(kwargs)
    if "state_dtype" in out:
        out["state_dtype"] = _state_dtype(cls, out["state_dtype"], out)
    if "state_scale_dtype" in out:
        out["state_scale_dtype"] = _dtype(out["state_scale_dtype"], "state_scale_dtype")
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def configured_groups(optimizer: str | type[LowpOptimizer], params: Iterable[Any]) -> list[Any]:
    """``params`` with every parameter group's configuration spellings read (:func:`configured_kwargs`);
    tensors and ``(name, tensor)`` pairs pass unchanged."""
    return [{**configured_kwargs(optimizer, {k: v for k, v in p.items() if k != "params"}), "params": p["params"]}
            if isinstance(p, Mapping) else p for p in params]


def build_optimizer(params: Iterable[Any], optimizer: str | type[LowpOptimizer] = "AdamW",
                    **kwargs: Any) -> LowpOptimizer:
    """A lowp optimizer over ``params``, configured with text-friendly values.

    Args:
        params: what the optimizer's constructor takes (tensors, ``(name, tensor)`` pairs or
            parameter groups; each group's options are read like ``kwargs``).
        optimizer: which optimizer (a name or class, see :func:`optimizer_class`); default AdamW.
        **kwargs: its keyword arguments, read by :func:`configured_kwargs` (``state_dtype`` may be
            ``"int8/uint8"``, a dict of dtype names, ...).

    Returns:
        The optimizer.
    """
    cls = optimizer_class(optimizer)
    return cls(configured_groups(cls, params), **configured_kwargs(cls, kwargs))
