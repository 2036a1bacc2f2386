"""Reading and writing low-precision tensors through fp32 working copies.

Every optimizer computes in fp32. A tensor stored in bf16/fp16 is read into an fp32 working
copy and written back with one rounding, either to nearest (``copy_``) or stochastically.

Stochastic rounding of an fp32 value ``x`` to bf16 needs no float arithmetic: bf16 is the top
half of fp32's bit pattern, so adding a uniform random integer ``r`` in ``[0, 2**16)`` to the
bits of ``x`` and clearing the low 16 bits rounds the magnitude up with probability
``(low 16 bits of x) / 2**16``, which is exactly ``(|x| - trunc(|x|)) / ulp``. fp16 goes through
:func:`lowp.rounding.quantize` with ``mode="stochastic"``.
"""
from __future__ import annotations

import torch

from lowp.rounding import quantize

__all__ = ["STATE_ROUNDINGS", "working_copy", "store", "stochastic_round_bf16_"]

STATE_ROUNDINGS = ("nearest", "stochastic")
_LOW_16_BITS_CLEARED = -65536  # 0xFFFF0000 as a signed int32


def working_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32 (fp64 stays fp64): the tensor itself when no cast is needed, so in-place math
    on the working copy writes through."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def stochastic_round_bf16_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None) -> None:
    """``dst = SR_bf16(src)`` for an fp32 ``src``: round up with probability (distance to trunc) / ulp."""
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    noise.add_(src.contiguous().view(torch.int32)).bitwise_and_(_LOW_16_BITS_CLEARED)
    dst.copy_(noise.view(torch.float32))


def store(dst: torch.Tensor, src: torch.Tensor, rounding: str, generator: torch.Generator | None) -> None:
    """Write the fp32 working copy ``src`` into ``dst`` (any float dtype) with ``rounding``."""
    if rounding not in STATE_ROUNDINGS:
        raise ValueError(f"rounding: expected one of {', '.join(STATE_ROUNDINGS)}, got {rounding!r}")
    if dst is src:
        return
    if rounding == "stochastic" and dst.dtype == torch.bfloat16:
        stochastic_round_bf16_(dst, src, generator)
    elif rounding == "stochastic" and dst.dtype == torch.float16:
        dst.copy_(quantize(src, "fp16", mode="stochastic", generator=generator))
    else:
        dst.copy_(src)
