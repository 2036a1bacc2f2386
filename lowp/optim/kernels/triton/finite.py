"""The Triton kernel of the non-finite check: which of many gradients hold a NaN or an infinity,
in one launch and one device-to-host read for all of them (the generic check sums each tensor
apart, two kernels per gradient).

Each program reads ``BLOCK`` elements of one tensor through the same tables as a step launch
(:func:`~lowp.optim.kernels.triton.kernel.launch_tables`); a block holding a value whose fp32
exponent field is all ones (a NaN or an infinity: widening bf16 and fp16 keeps both) sets its
tensor's flag ``FLAGS[1 + t]`` and the launch's flag ``FLAGS[0]``. Every writer writes 1, so
programs need no atomics. A step kernel given ``CHECK`` reads these flags before writing
(:mod:`~lowp.optim.kernels.triton.source`).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finite_kernel"]


@triton.jit
def finite_kernel(G, SIZES, BLOCK_TENSOR, BLOCK_START, FLAGS, G_T: tl.constexpr, BLOCK: tl.constexpr):
    """Set ``FLAGS[1 + t]`` and ``FLAGS[0]`` to 1 when block ``program_id`` of tensor ``t``
    holds a NaN or an infinity (``G``: a data pointer per tensor, of type ``G_T``)."""
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(SIZES + t)
    g = tl.load(tl.load(G + t).to(tl.pointer_type(G_T)) + offs, mask=mask, other=0.0).to(tl.float32)
    bits = g.to(tl.int32, bitcast=True)
    bad = tl.max(((bits & 0x7F800000) == 0x7F800000).to(tl.int32), axis=0)
    tl.store(FLAGS + 1 + t, 1, mask=bad != 0)
    tl.store(FLAGS, 1, mask=bad != 0)
