"""The five ways an fp32 update ``u`` is written back into a (low-precision) weight.

Every optimizer hands over ``u``, the intended change of the weight for this step (decoupled
weight decay included, so that it is compensated too), and one of these modes applies it:

``nearest``
    ``theta' = rn(theta + u)``. Plain low-precision training; an update below half an ulp of
    the weight is lost. Used for fp32 parameters whatever the group's mode.
``kahan``
    Compensated update with a buffer ``k`` of the weight's dtype (Kahan 1965; Zamirai et al.,
    "Revisiting BFloat16 Training", 2020)::

        v = k + u;   theta' = rn(theta + v);   k' = SR(v - (theta' - theta))

    ``theta' - theta`` is exact (Sterbenz), so ``v - (theta' - theta)`` is exactly what rounding
    dropped, up to its own rounding to the buffer dtype. That rounding is stochastic (stream
    ``Stream.COMPENSATION``): ``E[k'] = v - (theta' - theta)``, so ``theta + k`` follows the
    intended trajectory without bias. Rounded to nearest it is biased whenever the update is a
    fixed fraction of the weight (decoupled weight decay): the dropped part then repeats step after
    step and its rounding error with it (docs/optimizers.md measures both). ``theta + k`` carries
    about twice the weight's precision (16 significant bits for bf16).
``stochastic``
    ``theta' = SR(theta + u)`` (stream ``Stream.WEIGHT``): unbiased, ``E[theta'] = theta + u``, no
    extra memory.
``exact``
    bf16 weight plus an int16 remainder that hold an fp32 master weight exactly. With ``b``
    the int32 bit pattern of the fp32 value, ``hi = (b + 2**15) >> 16`` (the weight, rounded to
    nearest with ties away) and ``lo = b - hi * 2**16`` in ``[-2**15, 2**15)`` (the remainder), so
    ``b = hi * 2**16 + lo`` exactly and the update is plain fp32 arithmetic.
``exact8``
    bf16 weight plus an int8 remainder (3 bytes per parameter): together an fp32 value whose low
    8 bits are zero, 16 significant bits (the size of FlashOptim's int8 error term). With ``hi``
    the bf16 bit pattern and ``r8`` the remainder, both sign-extended::

        load:   w = float32 from bits (hi << 16) + (r8 << 8)
        apply:  b  = int32 bits of rn_fp32(w + u)
                b2 = (b + (random16 >> 8)) & ~0xFF            (NaN: b2 = (b | 0x00400000) & ~0xFF)
                hi = (b2 + 2**15) >> 16,   r8 = (b2 - (hi << 16)) >> 8   in [-128, 128)

    ``random16`` are the 16 bits of stream ``Stream.WEIGHT``; their top 8 bits round the low 8
    bits of ``b`` stochastically, up with probability ``(b & 0xFF) / 256``, so
    ``E[pair'] = rn_fp32(w + u)``: an update below the remainder's unit (about ``2**-16`` of
    the weight, e.g. decoupled weight decay ``lr * wd = 1e-5``) moves the pair on average
    instead of stalling (rounded to nearest it would be lost every step, or biased by the same
    rounding error step after step). The quiet bit keeps a NaN a NaN (the carry could turn it
    into an infinity). ``hi`` is ``b2`` rounded to nearest bf16 (ties away, as in exact mode), and
    ``(hi, r8)`` holds ``b2`` exactly. An element is stalled when its pair did not change.

Each mode is a :class:`WriteBack` with three small functions over lists of tensors (a batch):
``init_buffer`` (the mode's extra per-parameter tensor or ``None``), ``load`` (the fp32 weight
the optimizer sees) and ``apply`` (write ``w + u`` back with the random streams of the parameter,
:class:`~lowp.optim.randomness.RandomStreams`; returns the number of elements whose stored weight
did not change, when asked).

:func:`ensure_buffer` creates the buffer a parameter's mode needs when it is missing (first step,
a group switched mode, a state dict from another optimizer) and folds the other mode's buffer
into it: kahan -> exact stores ``rn_fp32(theta + k)`` as the exact pair (``theta + k`` needs
more than fp32's 24 bits only when ``|k| < 2**-16 |theta|``); exact -> kahan keeps the fp32
master weight ``t`` as ``theta = hi`` and ``k = t - hi`` rounded to the buffer's dtype (about 16
of t's 24 bits survive in bf16); kahan or exact -> exact8 rounds the held fp32 value
(``rn_fp32(theta + k)`` or the exact pair) to the nearest pair, ties away from zero
(``b2 = (b + 0x80) & ~0xFF``, no random bits: a fold is not a step); exact8 -> exact is exact
(the pair is an fp32 value, its low 8 bits become the int16 remainder's); exact8 -> kahan keeps
``theta = hi`` and ``k = held - theta`` rounded to the buffer's dtype; a switch to nearest or
stochastic drops the buffer (its sub-ulp part is lost, the visible weight is kept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lowp.optim.randomness import Stream
from lowp.optim.storage import store, working_copy

__all__ = ["WriteBack", "MODES", "get_mode", "resolve_mode", "ensure_buffer", "BUFFER_NAMES", "LOW_PRECISION",
           "store_nearest_pair8"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
_ALL = (torch.float64, torch.float32, *LOW_PRECISION)
# 0-dim int32 constants: a Python int argument costs each op a conversion of the scalar to a tensor
_HALF, _SHIFT16, _NOT_SIGN = (torch.tensor(v, dtype=torch.int32) for v in (1 << 15, 16, 0x7FFFFFFF))
_SHIFT8, _LOW8_CLEAR, _QUIET = (torch.tensor(v, dtype=torch.int32) for v in (8, ~0xFF, 0x00400000))


def _unmoved(change: torch.Tensor) -> torch.Tensor:
    """Elements whose stored weight did not change (update rounded away, or exactly zero), from
    the differences ``change`` (overwritten).

    For fp32 the zeros are counted on the bit patterns without the sign bit (``+-0.0`` are the
    only fp32 values whose other 31 bits are zero): an int32 ``count_nonzero`` costs about a
    third of the floating-point one."""
    if change.dtype == torch.float32:
        return change.numel() - torch.count_nonzero(change.view(torch.int32).bitwise_and_(_NOT_SIGN))
    return change.numel() - torch.count_nonzero(change)


def _no_buffer(p: torch.Tensor) -> None:
    return None


def _no_draws(p: torch.Tensor, buf: torch.Tensor | None) -> tuple[int, ...]:
    return ()


def _weight_draws(p: torch.Tensor, buf: torch.Tensor | None) -> tuple[int, ...]:
    return (Stream.WEIGHT,)


def _compensation_draws(p: torch.Tensor, k: torch.Tensor | None) -> tuple[int, ...]:
    return (Stream.COMPENSATION,) if k is not None and k.dtype in LOW_PRECISION else ()


def _plain_load(p: torch.Tensor, buf: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    return working_copy(p, out)


def _apply_nearest(p, w, u, buf, streams, count, scratch=None):
    new = torch.add(w, u, out=u)
    if new.dtype == p.dtype:       # fp32/fp64 weights: w is p itself, so count before writing
        stalled = _unmoved(torch.sub(new, w)) if count else None
        p.copy_(new)
        return stalled
    p.copy_(new)                   # theta' = rn(theta + u)
    return _unmoved(new.copy_(p).sub_(w)) if count else None


def _apply_stochastic(p, w, u, buf, streams, count, scratch=None):
    store(p, torch.add(w, u, out=u), "stochastic", streams, Stream.WEIGHT)
    return _unmoved(u.copy_(p).sub_(w)) if count else None


def _kahan_buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.contiguous_format)


def _apply_kahan(p, w, u, k, streams, count, scratch=None):
    u.add_(k)                      # v = k + u
    change = torch.add(w, u) if scratch is None else torch.add(w, u, out=scratch.take("change", u.shape, u.dtype,
                                                                                      u.device))
    p.copy_(change)                # theta' = rn(theta + v)
    change.copy_(p).sub_(w)        # theta' - theta, exact
    store(k, u.sub_(change), "stochastic", streams, Stream.COMPENSATION)   # k' = SR(v - (theta' - theta))
    return _unmoved(change) if count else None


def _remainder_buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=torch.int16, device=p.device)


def _pair_load(p: torch.Tensor, r: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 value of a bf16 weight and its remainder: ``(hi << 16) + r`` for exact mode's
    int16 remainder, ``(hi << 16) + (r8 << 8)`` for exact8's int8 one."""
    assert r is not None, "the exact modes always keep a remainder"
    hi = p.view(torch.int16)
    bits = hi.to(torch.int32) if out is None else out.view(torch.int32).copy_(hi)
    low = r if r.dtype == torch.int16 else r.to(torch.int32).bitwise_left_shift_(_SHIFT8)
    return bits.bitwise_left_shift_(_SHIFT16).add_(low).view(torch.float32)


def _apply_exact(p, w, u, r, streams, count, scratch=None):
    bits = torch.add(w, u, out=u).view(torch.int32)
    hi = torch.add(bits, _HALF).bitwise_right_shift_(_SHIFT16)
    p.view(torch.int16).copy_(hi)  # int32 -> int16 keeps the low 16 bits
    r.copy_(bits)                  # lo = b - hi * 2**16 is b's low 16 bits as a signed int16
    return torch.zeros((), dtype=torch.int64, device=p.device) if count else None


def _remainder8_buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=torch.int8, device=p.device)


def _store_pair8(p: torch.Tensor, r8: torch.Tensor, b2: torch.Tensor) -> None:
    """Write the int32 patterns ``b2`` (low 8 bits zero; overwritten) as the pair ``(hi, r8)``:
    ``hi = (b2 + 2**15) >> 16`` and ``r8 = (b2 - (hi << 16)) >> 8``."""
    hi = torch.add(b2, _HALF).bitwise_right_shift_(_SHIFT16)
    p.view(torch.int16).copy_(hi)           # int32 -> int16 keeps the low 16 bits
    r8.copy_(b2.sub_(hi.bitwise_left_shift_(_SHIFT16)).bitwise_right_shift_(_SHIFT8))   # in [-128, 128)


def _nan_quiet(b2: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``b2`` with the NaNs of ``x`` (fp32, bit patterns ``bits``) replaced by ``bits | 0x00400000``
    (both cleared of their low 8 bits afterwards)."""
    if x.is_cpu and not bool(x.isnan().any()):   # the common case on the CPU: no select pass
        return b2
    return torch.where(x.isnan(), bits.bitwise_or(_QUIET), b2)


def _apply_exact8(p, w, u, r8, streams, count, scratch=None):
    new = torch.add(w, u, out=u)                       # rn_fp32(w + u)
    bits = new.view(torch.int32)
    noise = streams.bits(Stream.WEIGHT, bits.shape, bits.device)
    b2 = _nan_quiet(noise.bitwise_right_shift_(_SHIFT8).add_(bits), new, bits).bitwise_and_(_LOW8_CLEAR)
    stalled = torch.eq(b2, w.view(torch.int32)).sum(dtype=torch.int64) if count else None
    _store_pair8(p, r8, b2)
    return stalled


def store_nearest_pair8(p: torch.Tensor, r8: torch.Tensor, held: torch.Tensor) -> None:
    """Store the fp32 value ``held`` in exact8 mode's pair (bf16 ``p``, int8 ``r8``), rounded to
    the nearest pair, ties away from zero (``b2 = (b + 0x80) & ~0xFF``; NaNs made quiet)."""
    bits = held.view(torch.int32)
    b2 = _nan_quiet(torch.add(bits, 0x80), held, bits).bitwise_and_(_LOW8_CLEAR)
    _store_pair8(p, r8, b2)


ApplyFn = Callable[..., "torch.Tensor | None"]   # (p, w, u, buf, streams, count, scratch=None)


@dataclass(frozen=True)
class WriteBack:
    """One update mode: the weight dtypes it supports, its buffer, how the fp32 weight is read
    and how ``w + u`` is written back.

    ``load(p, buf, out=None)`` returns the fp32 weight (``p`` itself for fp32/fp64 weights),
    in ``out`` (fp32, ``p``'s shape) when one is given and a copy is needed.
    ``apply(p, w, u, buf, streams, count, scratch=None)`` may overwrite ``u``; it
    returns the number of stalled elements (a 0-dim tensor) when ``count`` is true, else
    ``None``, and takes its temporaries from the :class:`~lowp.optim.scratch.Scratch` when one is
    given. ``draws(p, buf)`` names the random streams ``apply`` rounds with (so that they can be
    drawn together with the states', :meth:`~lowp.optim.randomness.RandomStreams.prefetch`).

    The modes are the entries of :data:`MODES`; user code selects one by name (:func:`get_mode`).

    Args:
        name: the mode's name (``"nearest"``, ``"stochastic"``, ``"kahan"``, ``"exact"``,
            ``"exact8"``).
        dtypes: weight dtypes the mode supports (:func:`resolve_mode` refuses others).
        buffer_name: key of the mode's per-parameter state buffer (``"compensation"``,
            ``"remainder"``, ``"remainder8"``), or ``None`` when it keeps none.
        init_buffer: ``init_buffer(p)`` makes the buffer for parameter ``p`` (``None`` without one).
        load: ``load(p, buf, out=None)``, described above.
        apply: the write-back ``apply(p, w, u, buf, streams, count, scratch=None)`` described above.
        draws: ``draws(p, buf)``, described above (default: no streams).
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    buffer_name: str | None
    init_buffer: Callable[[torch.Tensor], "torch.Tensor | None"]
    load: Callable[..., torch.Tensor]   # (p, buf, out=None)
    apply: ApplyFn
    draws: Callable[[torch.Tensor, "torch.Tensor | None"], tuple[int, ...]] = _no_draws


MODES: dict[str, WriteBack] = {
    "nearest": WriteBack("nearest", _ALL, None, _no_buffer, _plain_load, _apply_nearest),
    "stochastic": WriteBack("stochastic", LOW_PRECISION, None, _no_buffer, _plain_load, _apply_stochastic,
                            _weight_draws),
    "kahan": WriteBack("kahan", LOW_PRECISION, "compensation", _kahan_buffer, _plain_load, _apply_kahan,
                       _compensation_draws),
    "exact": WriteBack("exact", (torch.bfloat16,), "remainder", _remainder_buffer, _pair_load, _apply_exact),
    "exact8": WriteBack("exact8", (torch.bfloat16,), "remainder8", _remainder8_buffer, _pair_load, _apply_exact8,
                        _weight_draws),
}


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


#: Every mode's buffer name.
BUFFER_NAMES: tuple[str, ...] = tuple(m.buffer_name for m in MODES.values() if m.buffer_name is not None)


def _held(param: torch.Tensor, others: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The fp32 value a bf16 ``param`` holds with the dropped buffers ``others`` (``None`` when
    they hold nothing beyond the weight)."""
    if "remainder" in others:
        return _pair_load(param, others["remainder"])
    if "remainder8" in others:
        return _pair_load(param, others["remainder8"])
    if "compensation" in others:
        return param.float() + others["compensation"].float()
    return None


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
        assert buffer is not None, "a mode with a buffer name makes its buffer"
        held = _held(param, others) if param.dtype == torch.bfloat16 else None
        if held is not None:
            if mode.name == "exact":        # kahan -> exact (rn_fp32(theta + k)), exact8 -> exact (exact)
                _apply_exact(param, torch.full_like(held, -0.0), held, buffer, None, False)
            elif mode.name == "exact8":     # kahan or exact -> exact8: the nearest pair
                store_nearest_pair8(param, buffer, held)
            elif mode.name == "kahan":      # exact or exact8 -> kahan: k = held - theta
                buffer.copy_(held - param.float())
        state[wanted] = buffer
