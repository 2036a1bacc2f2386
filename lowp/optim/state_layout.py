"""What the optimizer states of a parameter are: their names, shapes, dtypes and storage.

An optimizer names the states of a parameter (``state_names``, by default its spec's) and their
shapes (``state_shape``, by default the parameter's); its parameter group's options say how each
is stored, and this module is the one place that reads them:

- ``state_dtype``: one dtype for every state, or a dict ``{state name: dtype or None}``; ``None``
  is :func:`default_state_dtype` of the weight, and fp64 parameters always keep fp64 states;
- a block-scaled code of :mod:`lowp.optim.codes` (:func:`coded_states`) stores a state as codes
  plus one scale of ``state_scale_dtype`` per ``state_block`` elements, shaped by
  :func:`~lowp.optim.codes.stored_shapes` and, for a DTensor parameter, sharded like it where its
  shards hold whole blocks, else replicated (:func:`~lowp.optim.sharding.coded_placements`);
- ``coded_min_numel``: a parameter of fewer elements keeps 16-bit states where ``state_dtype`` asks
  for codes (:func:`codes_apply`);
- ``state_rounding``: how a step stores a 16-bit or coded state (:mod:`lowp.optim.storage`);
- besides the states, a parameter keeps its step count and its write-back mode's buffer
  (``compensation``, ``remainder`` or ``remainder8``, :mod:`lowp.optim.writeback`).

:func:`check_state` checks the entries a parameter has, :func:`init_state` creates the missing
ones; the optimizer binds both (and :func:`state_dtypes`, :func:`coded_states`) as its methods.
"""
from __future__ import annotations

import sys
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from lowp.optim import preflight, sharding
from lowp.optim.codes import CODES, SCALE_DTYPES, Code, check_block, code_for, scale_name, stored_shapes
from lowp.optim.slices import CodedState
from lowp.optim.spec import OptimizerSpec
from lowp.optim.storage import STATE_ROUNDINGS
from lowp.optim.writeback import BUFFER_NAMES, MODES, WriteBack, ensure_buffer

__all__ = ["STATE_DTYPES", "STORED_FLOATS", "REPLICATED_WARN_NUMEL", "default_state_dtype", "check_options",
           "asked_dtype", "codes_apply", "new_state_dtype", "state_dtypes", "coded_states", "coded_layout",
           "check_state", "init_state"]

#: What a state may be stored in (float64 states are refused: the fused kernels and the mixed
#: fp32/fp64 foreach pipeline cannot run them).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The floating-point dtypes of stored states (fp64 parameters keep fp64 ones); any other dtype
#: of a state (integers, fp8) is block-scaled codes.
STORED_FLOATS = (*STATE_DTYPES, torch.float64)
#: A sharded parameter of at least this many elements whose block-scaled states must be replicated
#: (its shards split blocks) gets a warning: it costs its whole state on every rank.
REPLICATED_WARN_NUMEL = 1 << 16


class LowpOptimizer(Protocol):
    """What the state layout reads of the optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    state: defaultdict[torch.Tensor, Any]

    @property
    def spec(self) -> OptimizerSpec | None:
        """The optimizer's spec (``None``: reference only)."""

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param``."""

    def state_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """Shape of state ``name`` of ``param``."""

    def state_dtypes(self, group: dict[str, Any], name: str, param: torch.Tensor) -> tuple[torch.dtype, ...]:
        """:func:`state_dtypes`, bound."""

    def coded_states(self, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
        """:func:`coded_states`, bound."""


def default_state_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the optimizer states of a ``weight_dtype`` parameter when ``state_dtype`` is
    ``None``: the weight's own, except bf16 for fp16 weights. fp16's range ends at 6.1e-5 (normal)
    and 6e-8 (subnormal), so Adam's second moment of typical gradients (``g**2`` around 1e-10)
    underflows to zero and the step ``m / (sqrt(v) + eps)`` blows up; bf16 has fp32's range at the
    same two bytes, and stochastic rounding keeps its 8-bit significand unbiased (measured on the
    demo model: fp16 weights with fp16 states end 56% above fp32's validation loss, with bf16
    states within 0.1% of it; docs/optimizers.md)."""
    return torch.bfloat16 if weight_dtype == torch.float16 else weight_dtype


def check_options(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first bad state option of ``group``: ``state_rounding``,
    ``state_dtype`` (a dtype of :data:`STATE_DTYPES`, a code, ``None`` or a dict of them keyed by
    state names), ``state_block`` and ``state_scale_dtype``."""
    if group["state_rounding"] not in STATE_ROUNDINGS:
        raise ValueError(f"state_rounding: expected one of {', '.join(STATE_ROUNDINGS)}, "
                         f"got {group['state_rounding']!r}")
    value = group["state_dtype"]
    if isinstance(value, Mapping) and not all(isinstance(k, str) for k in value):
        raise ValueError(f"state_dtype: expected a dict keyed by state names, got {value!r}")
    for d in (value.values() if isinstance(value, Mapping) else [value]):
        if d is not None and d not in STATE_DTYPES and code_for(d) is None:
            raise ValueError(f"state_dtype: expected None, torch.float32, torch.bfloat16, torch.float16, a "
                             f"block-scaled code ({', '.join(str(c) for c in CODES)}) or a dict of them, got {value!r}")
    check_block(group["state_block"], "state_block")
    least = group["coded_min_numel"]
    if type(least) is not int or least < 0:
        raise ValueError(f"coded_min_numel: expected an int >= 0 (a number of elements), got {least!r}")
    if group["state_scale_dtype"] not in SCALE_DTYPES:
        raise ValueError(f"state_scale_dtype: expected one of {', '.join(map(str, SCALE_DTYPES))}, "
                         f"got {group['state_scale_dtype']!r}")


def asked_dtype(group: Mapping[str, Any], name: str) -> torch.dtype | None:
    """The dtype or code ``group``'s ``state_dtype`` asks for state ``name`` (``None``: none)."""
    dtypes = group["state_dtype"]
    return dtypes.get(name) if isinstance(dtypes, Mapping) else dtypes


def codes_apply(group: Mapping[str, Any], param: torch.Tensor) -> bool:
    """Whether ``param`` may keep block-scaled states: at least ``coded_min_numel`` elements (of
    the whole parameter, so every sharding decides alike) and not fp64."""
    return param.dtype != torch.float64 and param.numel() >= group["coded_min_numel"]


def new_state_dtype(group: dict[str, Any], name: str, param: torch.Tensor) -> torch.dtype:
    """The dtype a new plain state ``name`` of ``param`` is created in: fp64 for fp64 parameters
    (their pipeline runs in fp64 and cannot mix in other dtypes, whatever ``state_dtype``
    says for the group), else ``state_dtype``'s (not a code: the parameter is below
    ``coded_min_numel``) or :func:`default_state_dtype`."""
    if param.dtype == torch.float64:
        return torch.float64
    asked = asked_dtype(group, name)
    return asked if asked is not None and code_for(asked) is None else default_state_dtype(param.dtype)


def state_dtypes(optimizer: LowpOptimizer, group: dict[str, Any], name: str,
                 param: torch.Tensor) -> tuple[torch.dtype, ...]:
    """The dtypes a stored state ``name`` of ``param`` may have: fp64 for fp64 parameters,
    else the one ``state_dtype`` asks for (a code's storage dtype for a block-scaled state,
    where :func:`codes_apply`), else any of fp32/bf16/fp16, since a loaded checkpoint keeps its
    states' dtypes."""
    if param.dtype == torch.float64:
        return (torch.float64,)
    dtype = asked_dtype(group, name)
    code = code_for(dtype)
    if dtype is None or (code is not None and not codes_apply(group, param)):
        return STATE_DTYPES
    return (code.storage,) if code is not None else (dtype,)


def coded_states(optimizer: LowpOptimizer, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
    """The states of ``param`` that ``state_dtype`` stores as block-scaled codes (none below
    ``coded_min_numel``, :func:`codes_apply`); a ``ValueError`` naming the state when its code
    cannot hold it (a non-elementwise state, an unsigned code for a state that may be negative),
    whatever the parameter's size."""
    if param.dtype == torch.float64:
        return []
    dtypes = group["state_dtype"]
    by_name = isinstance(dtypes, Mapping)   # asked_dtype, looked up once for all the states
    out = []
    for j, name in enumerate(optimizer.state_names(group, param)):
        code = code_for(dtypes.get(name) if by_name else dtypes)
        if code is None:
            continue
        where = f"state_dtype[{name!r}]" if by_name else "state_dtype"
        if optimizer.state_shape(name, param) != param.shape or optimizer.spec is None:
            raise ValueError(f"{where}: {type(optimizer).__name__}'s state {name!r} is not elementwise; block-scaled "
                             f"codes ({code.name}) hold states shaped like their parameter only")
        if not code.signed and name not in optimizer.spec.nonnegative:
            raise ValueError(f"{where}: {code.name} codes hold nonnegative states only (as square roots), and "
                             f"{type(optimizer).__name__}'s {name!r} may be negative; use torch.int8 or an fp8 dtype")
        out.append(CodedState(name, j, code))
    return out if codes_apply(group, param) else []


def coded_layout(group: dict[str, Any], p: torch.Tensor, code: Code
                 ) -> tuple[tuple[torch.Size, torch.Size], tuple | None]:
    """The global shapes of the codes and scales of a coded state of ``p``
    (:func:`~lowp.optim.codes.stored_shapes`) and, for a DTensor ``p``, their placements
    (:func:`~lowp.optim.sharding.coded_placements`; ``None`` for a plain ``p``)."""
    block = group["state_block"]
    placements = sharding.coded_placements(p, block) if sharding.is_dtensor(p) else None
    return stored_shapes(code, p.shape, block), placements


def check_state(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, state: Mapping[str, Any],
                where: str, coded_states: list[CodedState] | None = None) -> None:
    """Raise naming ``where[key]`` unless every entry the step reads is usable: ``step`` a
    count, each present state of the right shape, dtype and device, each present buffer of
    the weight's shape (``compensation``: the weight's dtype or fp32; ``remainder``: int16;
    ``remainder8``: int8).
    Missing states and buffers are fine: the step creates them. ``coded_states``: ``p``'s
    :func:`coded_states` in ``group`` when the caller has them (``None``: computed here)."""
    if not state:
        return
    step = state.get("step")
    if type(step) is not int or not 0 <= step < preflight.STEP_LIMIT - 1:
        raise ValueError(f"{where}['step']: expected a step count (an int in [0, 2**63 - 1): the next one is "
                         f"saved as an int64), got {step!r}")
    if coded_states is None:
        coded_states = optimizer.coded_states(group, p)
    coded = {c.name: c.code for c in coded_states}
    for name in optimizer.state_names(group, p):
        if name not in state:
            continue
        code = coded.get(name)
        value = state[name]
        if code is None:
            if scale_name(name) in state and isinstance(value, torch.Tensor) and value.dtype not in STORED_FLOATS:
                raise ValueError(f"{where}[{name!r}]: block-scaled codes where the group keeps a 16-bit state "
                                 f"(state_dtype or coded_min_numel changed since it was made, or the checkpoint "
                                 f"was saved with other ones); opt.load_state_dict(opt.state_dict()) decodes "
                                 f"them while state_dtype names their code (or their storage dtype and sizes "
                                 f"fit one code) and state_block their block")
            preflight.check_tensor(value, where, optimizer.state_shape(name, p),
                                   optimizer.state_dtypes(group, name, p), p.device, name)
            continue
        if scale_name(name) not in state:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                raise ValueError(f"{where}[{name!r}]: a {value.dtype} state where the group stores {code.name} "
                                 f"codes (state_dtype or coded_min_numel changed since it was made); "
                                 f"opt.load_state_dict(opt.state_dict()) encodes it")
            raise ValueError(f"{where}[{scale_name(name)!r}]: the block scales of the coded state {name!r} "
                             f"are missing")
        shapes, placements = coded_layout(group, p, code)
        for key, shape, dtypes in ((name, shapes[0], (code.storage,)),
                                   (scale_name(name), shapes[1], (group["state_scale_dtype"],))):
            preflight.check_tensor(state[key], where, shape, dtypes, p.device, key)
            placed = tuple(state[key].placements) if sharding.is_dtensor(state[key]) else None
            if placed != placements:
                raise ValueError(f"{where}[{key!r}]: placed as {placed}, expected {placements} (the layout of "
                                 f"{code.name} codes in blocks of {group['state_block']} for this parameter)")
    for mode in MODES.values():   # each mode's buffer in the dtypes the mode gives it
        if mode.buffer_name is not None and mode.buffer_name in state:
            preflight.check_tensor(state[mode.buffer_name], where, p.shape, mode.buffer_dtypes(p.dtype), p.device,
                                   mode.buffer_name)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn` called by this function's caller that names the
    first frame outside lowp and torch (the user's ``step()``, however deep the step's call chain)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("lowp", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def init_state(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, mode: WriteBack,
               coded_states: list[CodedState] | None = None) -> dict[str, Any]:
    """The state of ``p`` with everything a step in ``mode`` needs: ``step`` and the
    optimizer's states (zeros when missing) and the mode's buffer (:func:`ensure_buffer`).
    ``coded_states``: ``p``'s :func:`coded_states` in ``group`` when the caller has them
    (``None``: computed here)."""
    state = optimizer.state[p]
    if "step" not in state:
        state["step"] = 0
    if coded_states is None:
        coded_states = optimizer.coded_states(group, p)
    coded = {c.name: c.code for c in coded_states}
    if sharding.is_dtensor(p) and any(n not in state for n in coded) and p.numel() >= REPLICATED_WARN_NUMEL \
            and sharding.coded_placements(p, group["state_block"]) != tuple(p.placements):
        warnings.warn(f"lowp: the shards of a parameter of shape {tuple(p.shape)} ({tuple(p.placements)}) "
                      f"split blocks of {group['state_block']} elements, so its block-scaled states are "
                      f"replicated on every rank and it is stepped whole (an all-gather per step); a "
                      f"smaller state_block, coded_min_numel above its size (16-bit states) or a group "
                      f"with 16-bit states avoids it", stacklevel=_user_stacklevel())
    for name in optimizer.state_names(group, p):   # DTensor parameters: sharded like p
        if name in state:
            continue
        code = coded.get(name)
        if code is None:
            state[name] = sharding.new_state(p, optimizer.state_shape(name, p), new_state_dtype(group, name, p))
            continue
        (codes, scales), placements = coded_layout(group, p, code)
        for key, shape, dtype in ((name, codes, code.storage), (scale_name(name), scales,
                                                                  group["state_scale_dtype"])):
            state[key] = (torch.zeros(shape, dtype=dtype, device=p.device) if placements is None
                          else sharding.new_tensor(p, shape, dtype, placements))
    if mode.buffer_name is not None and not any(n in state for n in BUFFER_NAMES):
        state[mode.buffer_name] = sharding.new_buffer(p, mode.init_buffer)
    ensure_buffer(p, state, mode)   # a mode switch: folds or drops the other mode's buffer
    return state
