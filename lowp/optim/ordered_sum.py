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

A tensor sharded in contiguous ranges (FSDP2's ``Shard(0)``) gets the same total without gathering
its terms: each rank cuts its range into :func:`pieces` (the sums of the units and blocks it holds
whole, the raw terms of the blocks it shares with a neighbour), the ranks exchange them, and
:func:`total_from_pieces` redoes steps 1-4 from them: the sum of the whole tensor, bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ordered_sum", "pieces", "total_from_pieces", "BLOCK", "UNIT", "TERM", "BLOCK_SUM", "UNIT_SUM"]

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
    blocks = _block_sums(flat)
    per_unit = UNIT // BLOCK
    blocks = F.pad(blocks.cpu(), (0, -blocks.numel() % per_unit)).view(-1, per_unit)  # zeros end a sum unchanged
    units = blocks.cumsum(1)[:, -1]
    return float(units.cumsum(0)[-1])


def _block_sums(flat: torch.Tensor) -> torch.Tensor:
    """Steps 1 and 2 over ``flat`` (fp32, a multiple of :data:`BLOCK` long): its block sums in float64."""
    lanes = (flat[0::2] + flat[1::2]).view(-1, BLOCK // 2).double()
    blocks = lanes[:, 0].clone()
    for lane in range(1, BLOCK // 2):
        blocks += lanes[:, lane]
    return blocks


#: the kinds of a piece (column 0 of :func:`pieces`' rows): a raw term (its element index), a block's
#: sum (its block index), a unit's sum (its unit index)
TERM, BLOCK_SUM, UNIT_SUM = 0, 1, 2


def pieces(terms: torch.Tensor, first: int, numel: int) -> torch.Tensor:
    """What a holder of the elements ``[first, first + n)`` of a tensor of ``numel`` elements (its
    fp32 ``terms``, ``n`` of them, in element order) contributes to the tensor's ordered sum: rows
    ``(kind, index, value)`` in float64, in element order: the sum of each unit it holds whole
    (:data:`UNIT_SUM`), the sum of each other block it holds whole (:data:`BLOCK_SUM`), each term
    of a block it holds only part of (:data:`TERM`, exact in float64). A block is held whole when
    every element of it below ``numel`` is in the range (the last block's padding is zeros)."""
    if not isinstance(terms, torch.Tensor) or terms.dtype != torch.float32:
        got = terms.dtype if isinstance(terms, torch.Tensor) else type(terms).__name__
        raise TypeError(f"terms: expected a float32 tensor, got {got}")
    flat = terms.detach().reshape(-1)
    n = flat.numel()
    if first < 0 or first + n > numel:
        raise ValueError(f"first: elements [{first}, {first + n}) are not inside a tensor of {numel} elements")
    end = first + n
    # whole blocks: from the first block boundary at or after ``first`` to the last one at or
    # before ``end`` (or to ``end`` itself when it is the tensor's end: the padded last block)
    lo = -(-first // BLOCK) * BLOCK
    hi = end if end == numel else end // BLOCK * BLOCK
    if hi <= lo:   # no whole block: every term raw
        return _rows(TERM, torch.arange(first, end, dtype=torch.float64), flat.double())
    head = _rows(TERM, torch.arange(first, lo, dtype=torch.float64), flat[:lo - first].double())
    tail = _rows(TERM, torch.arange(hi, end, dtype=torch.float64), flat[hi - first:].double())
    body = flat[lo - first:hi - first]
    blocks = _block_sums(F.pad(body, (0, -body.numel() % BLOCK))).cpu()
    b0, nblocks, per_unit = lo // BLOCK, -(-numel // BLOCK), UNIT // BLOCK
    b1 = b0 + blocks.numel()
    # units held whole: from the first unit boundary at or after b0, each ending (at the next
    # boundary or the tensor's last block) at or before b1
    whole = [u for u in range(-(-b0 // per_unit), b1 // per_unit + 1)
             if u * per_unit < b1 and min((u + 1) * per_unit, nblocks) <= b1]
    rows = [head]
    at = b0
    for u in whole:
        s, e = u * per_unit, min((u + 1) * per_unit, nblocks)
        rows.append(_rows(BLOCK_SUM, torch.arange(at, s, dtype=torch.float64), blocks[at - b0:s - b0]))
        unit = blocks[s - b0:e - b0].cumsum(0)[-1:]
        rows.append(_rows(UNIT_SUM, torch.tensor([float(u)], dtype=torch.float64), unit))
        at = e
    rows.append(_rows(BLOCK_SUM, torch.arange(at, b1, dtype=torch.float64), blocks[at - b0:]))
    rows.append(tail)
    return torch.cat(rows)


def _rows(kind: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Rows ``(kind, index, value)`` of :func:`pieces` (CPU float64)."""
    return torch.stack([torch.full_like(index, kind), index, values.cpu().to(torch.float64)], dim=1)


def total_from_pieces(rows: torch.Tensor, numel: int) -> float:
    """The ordered sum of a tensor of ``numel`` elements from the :func:`pieces` of ranges that
    cover it (rows of all holders, in any order; a range held twice, by replicas, gives the same
    rows): steps 1-4 of the module docstring redone from the largest pieces given, vectorized per
    unit without a unit sum. ``ValueError`` when a term the sum needs is missing."""
    rows = rows.detach().to("cpu", torch.float64)
    kind, index, value = rows[:, 0], rows[:, 1].long(), rows[:, 2]
    per_unit, nblocks = UNIT // BLOCK, -(-numel // BLOCK)
    units = torch.zeros(-(-nblocks // per_unit), dtype=torch.float64)
    whole = torch.zeros(units.numel(), dtype=torch.bool)
    at = kind == UNIT_SUM
    units[index[at]] = value[at]
    whole[index[at]] = True
    block_at, term_at = kind == BLOCK_SUM, kind == TERM
    for u in (~whole).nonzero().flatten().tolist():
        first, last = u * per_unit, min((u + 1) * per_unit, nblocks)
        blocks = torch.zeros(last - first, dtype=torch.float64)
        held = torch.zeros(last - first, dtype=torch.bool)
        mine = block_at & (index >= first) & (index < last)
        blocks[index[mine] - first] = value[mine]
        held[index[mine] - first] = True
        mine = term_at & (index >= first * BLOCK) & (index < last * BLOCK)
        if mine.any():   # blocks split between holders: steps 1 and 2 from their terms
            terms = torch.zeros((last - first) * BLOCK, dtype=torch.float32)
            present = torch.zeros(terms.numel(), dtype=torch.bool)
            terms[index[mine] - first * BLOCK] = value[mine].float()   # exact: each was an fp32 term
            present[index[mine] - first * BLOCK] = True
            present[max(0, numel - first * BLOCK):] = True   # the last block's padding: zeros
            split = present.view(-1, BLOCK).any(1) & ~held
            missing = (~present.view(-1, BLOCK) & split[:, None]).nonzero()
            if missing.numel():
                element = first * BLOCK + int(missing[0, 0]) * BLOCK + int(missing[0, 1])
                raise ValueError(f"pieces: element {element} of a tensor of {numel} elements is in no piece")
            blocks[split] = _block_sums(terms.view(-1, BLOCK)[split].reshape(-1))
            held |= split
        if not held.all():
            block = first + int((~held).nonzero()[0])
            raise ValueError(f"pieces: element {block * BLOCK} of a tensor of {numel} elements is in no piece")
        units[u] = float(blocks.cumsum(0)[-1])
    return float(torch.cat([torch.zeros(1, dtype=torch.float64), units]).cumsum(0)[-1])
