"""The ways an fp32 update ``u`` is written back into a (low-precision) weight.

Every optimizer hands over ``u``, the intended change of the weight for this step (decoupled
weight decay included, so that it is compensated too), and the parameter's mode applies it. One
module per mode holds its definition, its reference implementation and its fragments for the
compiled, Triton and native kernels (:class:`~lowp.optim.writeback.mode.WriteBack`):

=============================  =============================================  ================
mode (module)                  write-back                                     extra bytes/param
=============================  =============================================  ================
``nearest`` (:mod:`.nearest`)  ``theta' = rn(theta + u)``; fp32 weights       0
``stochastic``                 ``theta' = SR(theta + u)``                      0
``kahan``                      compensation ``k``: ``theta + k`` tracks        2 (bf16 ``k``)
                               ``theta + sum u``
``exact``                      bf16 + int16 remainder = the fp32 weight       2
``exact8``                     bf16 + int8 remainder, low bits rounded        1
                               stochastically
``master``                     an fp32 master ``t``: ``theta' = rn(t + u)``   4
                               (bf16 or fp16 weights)
=============================  =============================================  ================

:func:`ensure_buffer` creates the buffer a parameter's mode needs when it is missing (first step,
a group switched mode, a state dict from another optimizer) and folds the other mode's buffer
into it through the fp32 value the old pair holds (``held``) and the new mode's ``keep``:
kahan -> exact stores ``rn_fp32(theta + k)`` as the exact pair (``theta + k`` needs more than
fp32's 24 bits only when ``|k| < 2**-16 |theta|``); exact -> kahan keeps the fp32 master weight
``t`` as ``theta = hi`` and ``k = t - hi`` rounded to the buffer's dtype (about 16 of t's 24 bits
survive in bf16); kahan or exact -> exact8 rounds the held value to the nearest pair; exact8 ->
exact is exact; exact8 -> kahan keeps ``theta = hi`` and ``k = held - theta``; a switch to
nearest or stochastic drops the buffer (its sub-ulp part is lost, the visible weight is kept).

A new mode is one module defining a :class:`~lowp.optim.writeback.mode.WriteBack` (and its C++
header beside it) plus one entry in :data:`MODES`.
"""
from __future__ import annotations

import torch

from lowp.optim.writeback.exact import EXACT
from lowp.optim.writeback.exact8 import EXACT8, store_nearest_pair8
from lowp.optim.writeback.kahan import KAHAN
from lowp.optim.writeback.master import MASTER
from lowp.optim.writeback.mode import LOW_PRECISION, WriteBack
from lowp.optim.writeback.nearest import NEAREST
from lowp.optim.writeback.stochastic import STOCHASTIC

__all__ = ["WriteBack", "MODES", "get_mode", "resolve_mode", "ensure_buffer", "BUFFER_NAMES", "LOW_PRECISION",
           "store_nearest_pair8"]

#: Every mode by name: the one registration of a mode.
MODES: dict[str, WriteBack] = {m.name: m for m in (NEAREST, STOCHASTIC, KAHAN, EXACT, EXACT8, MASTER)}

#: Every mode's buffer name.
BUFFER_NAMES: tuple[str, ...] = tuple(m.buffer_name for m in MODES.values() if m.buffer_name is not None)


def get_mode(name: str) -> WriteBack:
    """The :class:`WriteBack` called ``name``; a clear error otherwise."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"mode: unknown update mode {name!r}; expected 'auto' or one of "
                         f"{', '.join(MODES)}") from None


def resolve_mode(mode: str, param: torch.Tensor) -> WriteBack:
    """The mode used for ``param``: fp32/fp64 weights are always updated plainly; ``auto`` is
    ``kahan`` for bf16/fp16 weights."""
    if param.dtype not in LOW_PRECISION:
        return MODES["nearest"]
    chosen = get_mode("kahan" if mode == "auto" else mode)
    if param.dtype not in chosen.dtypes:
        raise TypeError(f"mode: {chosen.name!r} does not support {param.dtype} parameters "
                        f"(it needs one of {', '.join(str(d) for d in chosen.dtypes)})")
    return chosen


def _by_buffer(name: str) -> WriteBack:
    return next(m for m in MODES.values() if m.buffer_name == name)


def ensure_buffer(param: torch.Tensor, state: dict, mode: WriteBack) -> None:
    """Give ``state`` the buffer of ``mode`` (zeros when nothing can be folded into it) and remove
    the buffers of other modes, folding them as the module docstring says. Shapes and dtypes
    of existing buffers must have been checked (``compensation``: the weight's shape;
    ``remainder``: int16, ``remainder8``: int8, of the weight's shape)."""
    wanted = mode.buffer_name
    if (wanted is None or wanted in state) and not any(n in state for n in BUFFER_NAMES if n != wanted):
        return      # the common case, every step: nothing to do
    with torch.no_grad():
        others = {name: state.pop(name) for name in BUFFER_NAMES if name != wanted and name in state}
        if wanted is None or wanted in state:
            return
        buffer = mode.init_buffer(param.detach())
        assert buffer is not None and mode.keep is not None, "a mode with a buffer name makes and fills its buffer"
        if param.dtype == torch.bfloat16 and others:
            # an exact pair first, should a state hold several
            name = min(others, key=lambda n: not _by_buffer(n).integer_buffer)
            old, held = others[name], _by_buffer(name).held
            if held is not None:
                mode.keep(param, buffer, held(param, old))
        state[wanted] = buffer
