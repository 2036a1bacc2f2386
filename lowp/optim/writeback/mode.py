"""What a write-back mode is: :class:`WriteBack`, one frozen description that every backend reads.

A mode writes an fp32 update ``u`` back into a (low-precision) weight, possibly with a buffer of
its own. One module of this package holds each mode, side by side in three forms that give the
same bits:

- the **reference** (``init_buffer``, ``load``, ``apply``): ``torch`` ops on lists of tensors, the
  definition the ``eager`` and ``foreach`` backends run;
- the **compiled** fragment (``compiled_load``, ``compiled_write``): elementwise tensor
  expressions that :func:`lowp.optim.kernels.compiled.step.fused_step` composes with an optimizer's rule
  and :func:`torch.compile` fuses into one loop;
- the **Triton** fragment (``triton_load``, ``triton_write``): source lines that
  :mod:`lowp.optim.kernels.triton.source` puts into the generated kernel;
- the **native** fragment: a C++ header beside the module (``native_header``), which the
  generated translation unit includes (:mod:`lowp.optim.kernels.native.source`): ``load_weight``
  and ``write_back_lanes`` over 16 elements as (even, odd) fp32 vectors.

What the backends must know besides the code (the random streams it draws, whether its buffer is
an integer remainder, whether a NaN guard is needed) are fields here, so no backend keeps a table
of modes. Adding a mode is one module (and its header) plus one line in
:data:`lowp.optim.writeback.MODES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lowp.optim.storage import working_copy

__all__ = ["WriteBack", "LOW_PRECISION", "ALL_FLOATS", "HEADERS", "unmoved", "plain_load", "no_buffer",
           "no_streams", "compiled_plain_load", "TRITON_PLAIN_LOAD"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
ALL_FLOATS = (torch.float64, torch.float32, *LOW_PRECISION)
#: The folder of the modes' C++ headers (the native build adds it to the include path).
HEADERS = Path(__file__).parent
_NOT_SIGN = torch.tensor(0x7FFFFFFF, dtype=torch.int32)

ApplyFn = Callable[..., "torch.Tensor | None"]   # (p, w, u, buf, streams, count, scratch=None)
#: ``compiled_write(p, buf, w, u, bits, count) -> (new weight, stalled or None)``; ``bits(stream)``
#: gives the 16 random bits of each element in that stream.
CompiledWrite = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]


def unmoved(change: torch.Tensor) -> torch.Tensor:
    """Elements whose stored weight did not change (update rounded away, or exactly zero), from
    the differences ``change`` (overwritten).

    For fp32 the zeros are counted on the bit patterns without the sign bit (``+-0.0`` are the
    only fp32 values whose other 31 bits are zero): an int32 ``count_nonzero`` costs about a
    third of the floating-point one."""
    if change.dtype == torch.float32:
        return change.numel() - torch.count_nonzero(change.view(torch.int32).bitwise_and_(_NOT_SIGN))
    return change.numel() - torch.count_nonzero(change)


def no_buffer(p: torch.Tensor) -> None:
    """``init_buffer`` of a mode without a buffer."""
    return None


def no_streams(buffer: torch.dtype | None) -> tuple[int, ...]:
    """``streams`` of a mode that rounds to nearest only."""
    return ()


def plain_load(p: torch.Tensor, buf: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight itself as fp32 (:func:`~lowp.optim.storage.working_copy`)."""
    return working_copy(p, out)


def compiled_plain_load(p: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """The compiled fragment's weight of a mode without a remainder: ``p`` widened to fp32."""
    return p.float()


#: The Triton fragment's weight of a mode without a remainder.
TRITON_PLAIN_LOAD = "w = widen(tl.load(p_ptr, mask=mask), P_T)"


@dataclass(frozen=True)
class WriteBack:
    """One write-back mode (module docstring).

    Args:
        name: the mode's name, by which users select it.
        dtypes: weight dtypes the mode supports (:func:`lowp.optim.writeback.resolve_mode`
            refuses others).
        buffer_name: key of the mode's per-parameter state buffer, or ``None`` when it keeps none.
        init_buffer: ``init_buffer(p)`` makes the buffer for parameter ``p`` (``None`` without one).
        load: ``load(p, buf, out=None)``: the fp32 weight the optimizer sees (``p`` itself for
            fp32/fp64 weights; in ``out``, fp32 of ``p``'s shape, when given and a copy is needed).
        apply: ``apply(p, w, u, buf, streams, count, scratch=None)``: write ``w + u`` back (may
            overwrite ``u``, takes temporaries from the :class:`~lowp.optim.scratch.Scratch`);
            returns the number of elements whose stored weight did not change (a 0-dim tensor)
            when ``count`` is true, else ``None``.
        streams: ``streams(buffer dtype or None)``: the random streams ``apply`` draws
            (:class:`~lowp.optim.randomness.Stream`), so they can be drawn with the states'.
        held: ``held(p, buf)``: the fp32 value the weight and the buffer hold together (``None``:
            a mode without a buffer); another mode's ``keep`` takes it over on a mode switch.
        keep: ``keep(p, buf, value)``: store the fp32 ``value`` in the weight and buffer as well
            as they can hold it (``None``: the mode has no buffer and keeps the weight as it is).
        buffer_dtypes: ``buffer_dtypes(weight dtype)``: the dtypes its buffer may have (empty
            without a buffer; an integer dtype for a remainder).
        nan_guard: ``nan_guard(buffer dtype)``: whether the native kernel must keep NaNs apart in
            its roundings for this mode (a remainder passes a NaN weight's bits on).
        stochastic_weight_dtype: the mode rounds stochastically to the weight's dtype (the
            weight, or a compensation of that dtype); the kernels round bf16 so, fp16 on some.
        compiled_load: ``compiled_load(p, buf)``: the fp32 weight, as a tensor expression.
        compiled_write: see :data:`CompiledWrite`.
        triton_load: Triton source that sets ``w`` (fp32) from ``p_ptr``/``b_ptr``.
        triton_write: Triton source that writes ``w + u`` back from ``w`` and ``u``: stores the
            buffer and sets ``new`` (the weight to store) and ``stalled`` (int32 per element).
        native_header: the file name of the mode's C++ header in :data:`HEADERS`.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    buffer_name: str | None
    init_buffer: Callable[[torch.Tensor], "torch.Tensor | None"]
    load: Callable[..., torch.Tensor]
    apply: ApplyFn
    streams: Callable[["torch.dtype | None"], tuple[int, ...]]
    held: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    keep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None
    buffer_dtypes: Callable[[torch.dtype], tuple[torch.dtype, ...]]
    nan_guard: Callable[["torch.dtype | None"], bool]
    stochastic_weight_dtype: bool
    compiled_load: Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
    compiled_write: CompiledWrite
    triton_load: str
    triton_write: str
    native_header: str

    @property
    def integer_buffer(self) -> bool:
        """Whether the buffer is an integer remainder (the exact modes), not a float."""
        return any(not d.is_floating_point for d in self.buffer_dtypes(torch.bfloat16))

    def draws(self, p: torch.Tensor, buf: torch.Tensor | None) -> tuple[int, ...]:
        """The streams ``apply`` draws for parameter ``p`` with buffer ``buf``."""
        return self.streams(None if buf is None else buf.dtype)

