"""``stochastic``: ``theta' = SR(theta + u)`` (stream ``Stream.WEIGHT``): unbiased,
``E[theta'] = theta + u``, no extra memory (Gupta et al., "Deep Learning with Limited Numerical
Precision", 2015)."""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.randomness import Stream
from lowp.optim.storage import store
from lowp.optim.writeback.mode import (LOW_PRECISION, TRITON_PLAIN_LOAD, WriteBack, compiled_plain_load, no_buffer,
                                       plain_load, unmoved)
from lowp.optim.writeback.traced import stochastic_bf16

__all__ = ["STOCHASTIC"]


def _apply(p, w, u, buf, streams, count, scratch=None):
    store(p, torch.add(w, u, out=u), "stochastic", streams, Stream.WEIGHT)
    return unmoved(u.copy_(p).sub_(w)) if count else None


def _compiled_write(p: torch.Tensor, buf: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    new = stochastic_bf16(w + u, bits(Stream.WEIGHT))
    return new, (new.float() == w).sum(dtype=torch.int32) if count else None


STOCHASTIC = WriteBack(
    "stochastic", LOW_PRECISION, None, no_buffer, plain_load, _apply, lambda buffer: (Stream.WEIGHT,), held=None,
    keep=None, buffer_dtypes=lambda weight: (), nan_guard=lambda buffer: False, stochastic_weight_dtype=True,
    compiled_load=compiled_plain_load, compiled_write=_compiled_write, triton_load=TRITON_PLAIN_LOAD,
    triton_write="new = stochastic_bf16(w + u, random16(index, keys, 0))\n"
                 "stalled = ((widen(new, P_T) == w) & mask).to(tl.int32)",
    native_header="stochastic.h")
