"""The one order in which lowp sums a per-tensor reduction term (StableAdamW's RMS).

A spec with a ``tensor_sum`` (:mod:`lowp.optim.spec`) needs, per tensor, the sum of an fp32 term
before its step. Floating-point addition is not associative, so every backend must add the same
terms in the same order to step bit for bit alike. The order is the native kernel's
(``lowp/optim/kernels/native/step.h``, ``lowp_sums``), vectorised there, written down here:

1. lanes: the tensor is cut into blocks of :data:`BLOCK` = 16 elements (the last one padded with
   zeros); lane ``l = 0..7`` of block ``b`` is ``t[16b + 2l] + t[16b + 2l + 1]``, added in fp32;
2. blocks: the 8 lanes of a block added in float64, in lane order:
   ``B_b = (((L_0 + L_1) + L_2) + ...) + L_7``;
3. units: the blocks of a work unit of :data:`UNIT` = 2**15 elements (the last one shorter)
   added in float64, in block order from 0;
4. the tensor: its units' sums added in float64, in unit order from 0.

Every float64 sum starts from ``+0.0`` and adds left to right, so the total does not depend on
threads, devices or chunking. Steps 1 and 2 are elementwise (exact IEEE operations on any device);
steps 3 and 4 are sequential scans, taken with :func:`torch.cumsum` on the CPU (a left-to-right
loop in float64 there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ordered_sum", "BLOCK", "UNIT"]

#: elements per block: 8 fp32 lanes of two elements each
BLOCK = 16
#: elements per work unit (``UNIT`` of ``native/step.h``; a multiple of :data:`BLOCK`)
UNIT = 1 << 15


def ordered_sum(terms: torch.Tensor) -> float:
    """The sum of the fp32 tensor ``terms`` (any shape, any device, read in row-major order) in
    the order of the module docstring, as a Python float (float64); ``0.0`` when empty."""
    if not isinstance(terms, torch.Tensor) or terms.dtype != torch.float32:
        got = terms.dtype if isinstance(terms, torch.Tensor) else type(terms).__name__
        raise TypeError(f"terms: expected a float32 tensor, got {got}")
    flat = terms.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    if flat.numel() % BLOCK:
        flat = F.pad(flat, (0, -flat.numel() % BLOCK))
    lanes = (flat[0::2] + flat[1::2]).view(-1, BLOCK // 2).double()
    blocks = lanes[:, 0].clone()
    for lane in range(1, BLOCK // 2):
        blocks += lanes[:, lane]
    per_unit = UNIT // BLOCK
    blocks = F.pad(blocks.cpu(), (0, -blocks.numel() % per_unit)).view(-1, per_unit)  # zeros end a sum unchanged
    units = blocks.cumsum(1)[:, -1]
    return float(units.cumsum(0)[-1])
