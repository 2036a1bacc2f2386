"""What a lowp optimizer's options, hyper-parameters and parameter groups may be, checked before
any state exists: the constructor's options (:func:`check_optimizer_options`,
:func:`mode_from_kahan_sum`), a new parameter group and its parameters (:func:`checked_group`),
and the options every group has, checked again by ``load_state_dict`` and every step
(:func:`check_group_values`; the subclass's ``validate`` checks its own hyper-parameters with
:func:`check_nonnegative` and :func:`check_betas`). A number is an ``int`` or a ``float``, never a
bool (:func:`real_value`).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from lowp.optim import options, preflight, sharding
from lowp.optim.slices import CodedState
from lowp.optim.preflight import check_flag
from lowp.optim.state_layout import check_options
from lowp.optim.writeback import get_mode, resolve_mode

__all__ = ["NONFINITE_POLICIES", "CONSTRUCTOR_OPTIONS", "real_value", "check_nonnegative", "check_betas",
           "warn_if_swapped", "check_optimizer_options", "mode_from_kahan_sum", "check_group_values",
           "check_state_dtype_names", "checked_group"]

#: What a non-finite gradient does (the ``nonfinite`` option).
NONFINITE_POLICIES = ("skip_param", "skip_step", "off")
#: The constructor keywords of a lowp optimizer besides the subclass's hyper-parameters.
CONSTRUCTOR_OPTIONS = ("mode", "state_dtype", "state_block", "state_scale_dtype", "state_rounding", "coded_min_numel",
                       "maximize",
                       "nonfinite", "foreach", "backend", "chunk_size", "seed", "diagnostics", "fused", "kahan_sum",
                       "capturable", "differentiable")


class LowpOptimizer(Protocol):
    """What a new group's checks read of the optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    #: what a group may repeat of the optimizer-wide options (:func:`lowp.optim.options.group_options`)
    _wide: dict[str, Any]

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a complete group's hyper-parameters."""

    def coded_states(self, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
        """The block-scaled states of ``param`` (checks that their codes can hold them)."""

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param``."""


def real_value(value: Any, allow_tensor: bool = False) -> float | None:
    """``float(value)`` for a real number (int or float; with ``allow_tensor`` also a one-element
    real tensor), else ``None``.

    Bools are not numbers here: ``True`` is an ``int`` in Python, so ``lr=True`` would
    otherwise pass as 1.0.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if not allow_tensor:
            return None
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def check_nonnegative(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number >= 0 (not a bool)."""
    v = real_value(value, allow_tensor=True)
    if v is None or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")


def check_betas(betas: Any, count: int = 2) -> None:
    """Raise ``ValueError`` unless ``betas`` is a tuple of ``count`` numbers in [0, 1) (not bools)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != count:
        raise ValueError(f"betas: expected a tuple of {count} numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        v = real_value(b)
        if v is None or not 0.0 <= v < 1.0:
            raise ValueError(f"betas[{i}]: expected a number in [0, 1), got {b!r}")


def warn_if_swapped(eps: Any, weight_decay: Any) -> None:
    """Warn when ``eps`` and ``weight_decay`` look exchanged: optimi's positional order is
    ``lr, betas, weight_decay, eps``, torch's and lowp's ``lr, betas, eps, weight_decay``."""
    e, wd = real_value(eps, allow_tensor=True), real_value(weight_decay, allow_tensor=True)
    if e is not None and wd is not None and e >= 1e-2 and wd <= 1e-5:
        warnings.warn(f"eps={eps!r} is large and weight_decay={weight_decay!r} tiny: were they passed in optimi's "
                      f"positional order (lr, betas, weight_decay, eps)? lowp follows torch's order (lr, betas, eps, "
                      f"weight_decay); pass them by keyword", UserWarning, stacklevel=3)


def check_optimizer_options(nonfinite: Any, foreach: Any, diagnostics: Any, capturable: Any,
                            differentiable: Any) -> None:
    """Raise naming the first unusable one of these constructor options: ``nonfinite`` one of
    :data:`NONFINITE_POLICIES`, the flags bools (``foreach`` may be ``None``), and torch's
    ``capturable`` and ``differentiable`` ``False`` (accepted for compatibility only)."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite: expected one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
    check_flag("foreach", foreach, allow_none=True)   # fused: checked by backend_for
    check_flag("diagnostics", diagnostics)
    check_flag("capturable", capturable)
    check_flag("differentiable", differentiable)
    if capturable:
        raise ValueError("capturable: capturable=True (CUDA-graph capture of the step) is not supported; the step "
                         "reads its counters on the host. Use capturable=False")
    if differentiable:
        raise ValueError("differentiable: differentiable=True (autograd through the step) is not supported; "
                         "the low-precision write-back is not differentiable. Use differentiable=False")


def mode_from_kahan_sum(mode: str, kahan_sum: bool | None) -> str:
    """optimi's ``kahan_sum``: ``True`` is ``mode="kahan"``, ``False`` ``mode="nearest"``."""
    check_flag("kahan_sum", kahan_sum, allow_none=True)
    if kahan_sum is None:
        return mode
    implied = "kahan" if kahan_sum else "nearest"
    if mode not in ("auto", implied):
        raise ValueError(f"kahan_sum: kahan_sum={kahan_sum} means mode={implied!r}, which conflicts with "
                         f"mode={mode!r}; give one of them")
    return implied


def check_group_values(group: dict[str, Any], flag_keys: tuple[str, ...]) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad option of a complete ``group``
    that every lowp optimizer has: ``lr`` a finite number >= 0, ``mode`` a write-back mode, the
    state options (:func:`~lowp.optim.state_layout.check_options`), each of ``flag_keys`` it
    holds a bool."""
    check_nonnegative("lr", group["lr"])
    if group["mode"] != "auto":
        get_mode(group["mode"])
    check_options(group)
    for key in flag_keys:
        if key in group:
            check_flag(key, group[key])


def check_state_dtype_names(optimizer: LowpOptimizer, group: dict[str, Any]) -> None:
    """A ``state_dtype`` dict names only states the optimizer keeps (for a parameter of any rank:
    Adafactor's differ between vectors and matrices); else ``ValueError`` naming the key, the
    states and the nearest one."""
    asked = group["state_dtype"]
    if not isinstance(asked, Mapping):
        return
    known = {name for shape in ((), (2,), (2, 2))
             for name in optimizer.state_names(group, torch.empty(shape, device="meta"))}
    for key in asked:
        if key not in known:
            near = options.nearest_name(key, known)
            raise ValueError(f"state_dtype: {key!r} is not a state of {type(optimizer).__name__} (its states: "
                             f"{', '.join(sorted(known)) or 'none'})" + (f"; did you mean {near!r}?" if near else ""))


def checked_group(optimizer: LowpOptimizer, param_group: Any) -> dict[str, Any]:
    """``param_group`` as the optimizer keeps it (:func:`lowp.optim.options.group_options`; a
    ``"param_names"`` entry for ``(name, tensor)`` pairs, as ``named_parameters()`` yields them),
    after checking its hyper-parameters and every parameter: layout, mode, coded states, tensor
    type, and that no parameter is another's or shares its memory."""
    if not isinstance(param_group, Mapping) or "params" not in param_group:
        raise TypeError(f"param_group: expected a dict with a 'params' entry, got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, set):
        raise TypeError("params: expected an ordered collection of tensors; sets have no fixed order")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named):   # (name, tensor) pairs, as named_parameters() yields them (torch >= 2.5 convention)
        if not all(named) or not all(len(p) == 2 and isinstance(p[0], str) for p in params):
            raise ValueError("params: expected all tensors or all (name, tensor) pairs")
        names, params = [n for n, _ in params], [t for _, t in params]
        param_group = {**param_group, "param_names": names}
    param_group = options.group_options(param_group, optimizer._wide, [*optimizer.defaults, *CONSTRUCTOR_OPTIONS],
                                        f"param_groups[{len(optimizer.param_groups)}]", mode_from_kahan_sum)
    param_group[options.EXTRAS_KEY] = {}   # a live key, so checkpointers that rebuild groups keep the extras
    merged = {**optimizer.defaults, **param_group}
    optimizer.check_group(merged)
    for i, p in enumerate(params):
        preflight.check_param(p, f"params[{i}]")
        resolve_mode(merged["mode"], p)
        optimizer.coded_states(merged, p)
        if sharding.is_dtensor(p):
            sharding.check_placements(p)
        elif isinstance(p, torch.Tensor) and type(p) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"params[{i}]: a {type(p).__name__}; lowp optimizers take plain tensors, "
                            f"nn.Parameter and DTensor (FSDP2, tensor parallel), whose arithmetic they know")
    preflight.check_distinct([q for g in optimizer.param_groups for q in g["params"]] + params)
    preflight.check_disjoint([q for g in optimizer.param_groups for q in g["params"]] + params)
    return {**param_group, "params": params}
