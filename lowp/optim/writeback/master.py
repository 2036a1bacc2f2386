"""``master``: an fp32 master weight kept beside a bf16 or fp16 weight (4 bytes per parameter).

The recipe of mixed-precision training (Micikevicius et al., "Mixed Precision Training", 2018,
sec. 3.1; Apex ``O2``, DeepSpeed's fp16 optimizer)::

    t' = rn_fp32(t + u);   theta' = rn(t')

The optimizer sees ``t`` (the master), never the rounded weight. For bf16 weights ``exact`` holds
the same fp32 value in half the bytes (the weight is the master's top half); ``master`` is the
exact mode for **fp16** weights, whose bits are not a prefix of fp32's, and the reference that
the cheaper modes are measured against in one optimizer. A master taken over from another mode
is the value that mode held (``theta + k``, the exact pair); a fresh one is the weight itself.
An element is stalled when its master did not change.
"""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.writeback.mode import LOW_PRECISION, WriteBack, no_streams, unmoved
from lowp.optim.writeback.traced import nearest

__all__ = ["MASTER"]


def _buffer(p: torch.Tensor) -> torch.Tensor:
    return p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def _load(p: torch.Tensor, t: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    assert t is not None, "master mode always keeps its master weight"
    return t   # read only by the optimizer's update


def _apply(p, w, u, t, streams, count, scratch=None):
    new = torch.add(w, u, out=u)      # t' = rn_fp32(t + u)
    stalled = unmoved(torch.sub(new, w)) if count else None
    t.copy_(new)
    p.copy_(new)                      # theta' = rn(t')
    return stalled


def _held(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t


def _keep(p: torch.Tensor, t: torch.Tensor, value: torch.Tensor) -> None:
    t.copy_(value)


def _compiled_load(p: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.float()


def _compiled_write(p: torch.Tensor, t: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert t is not None
    total = w + u
    t.copy_(total)
    new, _ = nearest(total, p.dtype)
    return new, ((total - w) == 0).sum(dtype=torch.int32) if count else None


MASTER = WriteBack(
    "master", LOW_PRECISION, "master", _buffer, _load, _apply, no_streams, held=_held, keep=_keep,
    buffer_dtypes=lambda weight: (torch.float32,), nan_guard=lambda buffer: True, stochastic_weight_dtype=False,
    compiled_load=_compiled_load, compiled_write=_compiled_write,
    triton_load="w = tl.load(b_ptr, mask=mask)",
    triton_write="total = w + u\n"
                 "tl.store(b_ptr, total, mask=mask)\n"
                 "new = round_to(total, P_T)\n"
                 "stalled = (((total - w) == 0) & mask).to(tl.int32)",
    native_header="master.h")
