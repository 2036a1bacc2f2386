"""``exact``: a bf16 weight plus an int16 remainder that hold an fp32 master weight exactly. With
``b`` the int32 bit pattern of the fp32 value, ``hi = (b + 2**15) >> 16`` (the weight, rounded to
nearest with ties away) and ``lo = b - hi * 2**16`` in ``[-2**15, 2**15)`` (the remainder), so
``b = hi * 2**16 + lo`` exactly and the update is plain fp32 arithmetic (the split of
Zamirai et al., "Revisiting BFloat16 Training", 2020, sec. 4; Ozkara et al., "Stochastic Rounding
for LLM Training", 2025)."""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.writeback.mode import WriteBack, no_streams
from lowp.optim.writeback.pairs import compiled_pair_load, pair_load, store_pair, triton_pair_load
from lowp.optim.writeback.traced import HALF, bf16_of

__all__ = ["EXACT"]


def _buffer(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros(p.shape, dtype=torch.int16, device=p.device)


def _apply(p, w, u, r, streams, count, scratch=None):
    store_pair(p, r, torch.add(w, u, out=u).view(torch.int32))
    return torch.zeros((), dtype=torch.int64, device=p.device) if count else None


def _keep(p: torch.Tensor, r: torch.Tensor, value: torch.Tensor) -> None:
    store_pair(p, r, torch.add(value.float(), -0.0).view(torch.int32))   # a new tensor: store_pair overwrites it


def _compiled_write(p: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, u: torch.Tensor,
                    bits: Callable[[int], torch.Tensor], count: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert r is not None
    total = (w + u).view(torch.int32)
    hi = (total + HALF) >> 16
    r.copy_((total - (hi << 16)).to(torch.int16))
    return bf16_of(hi), torch.zeros((), dtype=torch.int32, device=p.device) if count else None


EXACT = WriteBack(
    "exact", (torch.bfloat16,), "remainder", _buffer, pair_load, _apply, no_streams, held=pair_load, keep=_keep,
    buffer_dtypes=lambda weight: (torch.int16,), nan_guard=lambda buffer: True, stochastic_weight_dtype=False,
    compiled_load=compiled_pair_load, compiled_write=_compiled_write, triton_load=triton_pair_load(0),
    triton_write="bits = (w + u).to(tl.int32, bitcast=True)\n"
                 "top = (bits + 32768) >> 16\n"
                 "tl.store(b_ptr, (bits - (top << 16)).to(tl.int16), mask=mask)\n"
                 "new = top.to(tl.int16).to(tl.bfloat16, bitcast=True)",
    native_header="exact.h")
