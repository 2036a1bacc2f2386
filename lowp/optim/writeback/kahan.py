"""``kahan``: a compensated update with a buffer ``k`` of the weight's dtype.

After Kahan (1965) and Zamirai et al., "Revisiting BFloat16 Training" (2020)::

    v = k + u;   theta' = rn(theta + v);   k' = SR(v - (theta' - theta))

``theta' - theta`` is exact (Sterbenz), so ``v - (theta' - theta)`` is exactly what rounding
dropped, up to its own rounding to the buffer dtype. That rounding is stochastic (stream
``Stream.COMPENSATION``): ``E[k'] = v - (theta' - theta)``, so ``theta + k`` follows the intended
trajectory without bias. Rounded to nearest it is biased whenever the update is a fixed fraction
of the weight (decoupled weight decay): the dropped part then repeats step after step and its
rounding error with it (docs/optimizers.md measures both). ``theta + k`` carries about twice the
weight's precision (16 significant bits for bf16). A value taken over from another mode keeps
the weight and puts the rest in ``k`` (``k = held - theta``, rounded to the buffer's dtype).
"""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.randomness import Stream
from lowp.optim.storage import store
from lowp.optim.writeback.mode import (LOW_PRECISION, TRITON_PLAIN_LOAD, WriteBack, compiled_plain_load, plain_load,
                                       unmoved)
from lowp.optim.writeback.traced import nearest, stochastic_bf16

__all__ = ["KAHAN"]


def _buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.contiguous_format)


def _apply(p, w, u, k, streams, count, scratch=None):
    u.add_(k)                      # v = k + u
    change = torch.add(w, u) if scratch is None else torch.add(w, u, out=scratch.take("change", u.shape, u.dtype,
                                                                                      u.device))
    p.copy_(change)                # theta' = rn(theta + v)
    change.copy_(p).sub_(w)        # theta' - theta, exact
    store(k, u.sub_(change), "stochastic", streams, Stream.COMPENSATION)   # k' = SR(v - (theta' - theta))
    return unmoved(change) if count else None


def _streams(buffer: torch.dtype | None) -> tuple[int, ...]:
    return (Stream.COMPENSATION,) if buffer in LOW_PRECISION else ()


def _held(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return p.float() + k.float()


def _keep(p: torch.Tensor, k: torch.Tensor, value: torch.Tensor) -> None:
    k.copy_(value - p.float())


def _compiled_write(p: torch.Tensor, k: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert k is not None
    v = k.float() + u
    new, new_value = nearest(w + v, p.dtype)
    change = new_value - w
    k.copy_(stochastic_bf16(v - change, bits(Stream.COMPENSATION)))
    return new, (change == 0).sum(dtype=torch.int32) if count else None


KAHAN = WriteBack(
    "kahan", LOW_PRECISION, "compensation", _buffer, plain_load, _apply, _streams, held=_held, keep=_keep,
    buffer_dtypes=lambda weight: (weight, torch.float32), nan_guard=lambda buffer: buffer != torch.bfloat16,
    stochastic_weight_dtype=True, compiled_load=compiled_plain_load, compiled_write=_compiled_write,
    triton_load=TRITON_PLAIN_LOAD,
    triton_write="c = widen(tl.load(b_ptr, mask=mask), B_T) + u\n"
                 "new = round_to(w + c, P_T)\n"
                 "change = widen(new, P_T) - w\n"
                 "tl.store(b_ptr, stochastic_bf16(c - change, random16(index, keys, 1)), mask=mask)\n"
                 "stalled = ((change == 0) & mask).to(tl.int32)",
    native_header="kahan.h")
