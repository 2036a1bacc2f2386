"""``nearest``: ``theta' = rn(theta + u)``. Plain low-precision training: an update below half an
ulp of the weight is lost. Used for fp32 parameters whatever the group's mode."""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.writeback.mode import (ALL_FLOATS, TRITON_PLAIN_LOAD, WriteBack, compiled_plain_load, no_buffer,
                                       no_streams, plain_load, unmoved)
from lowp.optim.writeback.traced import nearest

__all__ = ["NEAREST"]


def _apply(p, w, u, buf, streams, count, scratch=None):
    new = torch.add(w, u, out=u)
    if new.dtype == p.dtype:       # fp32/fp64 weights: w is p itself, so count before writing
        stalled = unmoved(torch.sub(new, w)) if count else None
        p.copy_(new)
        return stalled
    p.copy_(new)                   # theta' = rn(theta + u)
    return unmoved(new.copy_(p).sub_(w)) if count else None


def _compiled_write(p: torch.Tensor, buf: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    new, new_value = nearest(w + u, p.dtype)
    return new, (new_value == w).sum(dtype=torch.int32) if count else None


NEAREST = WriteBack(
    "nearest", ALL_FLOATS, None, no_buffer, plain_load, _apply, no_streams, held=None, keep=None,
    buffer_dtypes=lambda weight: (), nan_guard=lambda buffer: False, stochastic_weight_dtype=False,
    compiled_load=compiled_plain_load, compiled_write=_compiled_write, triton_load=TRITON_PLAIN_LOAD,
    triton_write="new = round_to(w + u, P_T)\n"
                 "stalled = ((widen(new, P_T) == w) & mask).to(tl.int32)",
    native_header="nearest.h")
