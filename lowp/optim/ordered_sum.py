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

__all__ = ["ordered_sum", "layout", "pieces", "total_from_pieces", "BLOCK", "UNIT", "TERM", "BLOCK_SUM", "UNIT_SUM"]

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


def layout(first: int, n: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces (:func:`pieces`) of the elements ``[first, first + n)`` of a tensor of ``numel``
    elements, as int64 tensors ``(kind, index, start, length)`` in element order: each piece's
    kind, its index (element, block or unit), and the local elements it sums, ``[start, start +
    length)`` of the range. A block is held whole when every element of it below ``numel`` is in
    the range (the last block's padding is zeros); a unit likewise."""
    if first < 0 or n < 0 or first + n > numel:
        raise ValueError(f"first: elements [{first}, {first + n}) are not inside a tensor of {numel} elements")
    end = first + n
    # whole blocks: from the first block boundary at or after ``first`` to the last one at or
    # before ``end`` (or to ``end`` itself when it is the tensor's end: the padded last block)
    lo = -(-first // BLOCK) * BLOCK
    hi = end if end == numel else end // BLOCK * BLOCK
    if hi <= lo:   # no whole block: every term raw
        lo = hi = end
    b0, b1 = lo // BLOCK, (-(-hi // BLOCK) if hi > lo else lo // BLOCK)
    per_unit, nblocks = UNIT // BLOCK, -(-numel // BLOCK)
    # units held whole, [u0, u1): starting at or after b0, ending (at the next boundary or the
    # tensor's last block) at or before b1
    u0 = -(-b0 // per_unit)
    u1 = max(u0, -(-nblocks // per_unit) if b1 == nblocks else b1 // per_unit)
    head = _entries(TERM, torch.arange(first, lo), torch.ones(lo - first, dtype=torch.int64))
    tail = _entries(TERM, torch.arange(hi, end), torch.ones(end - hi, dtype=torch.int64))
    if u1 > u0:
        units = torch.arange(u0, u1)
        parts = [head, _block_entries(b0, u0 * per_unit, numel),
                 _entries(UNIT_SUM, units, torch.clamp(numel - units * UNIT, max=UNIT), units * UNIT),
                 _block_entries(min(u1 * per_unit, nblocks), b1, numel), tail]
    else:
        parts = [head, _block_entries(b0, b1, numel), tail]
    kind, index, start, length = (torch.cat(c) for c in zip(*parts))
    return kind, index, start - first, length


def _entries(kind: int, index: torch.Tensor, length: torch.Tensor, element: torch.Tensor | int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries of :func:`layout` (``element``: each one's first global element; default ``index``)."""
    first = index if element is None else torch.as_tensor(element).expand(index.shape)
    return torch.full_like(index, kind), index, first.clone(), length


def _block_entries(b: int, e: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`layout`'s entries of the whole blocks ``[b, e)``."""
    index = torch.arange(b, e)
    return _entries(BLOCK_SUM, index, torch.clamp(numel - index * BLOCK, max=BLOCK), index * BLOCK)


def pieces(terms: torch.Tensor, first: int, numel: int) -> torch.Tensor:
    """What a holder of the elements ``[first, first + n)`` of a tensor of ``numel`` elements (its
    fp32 ``terms``, ``n`` of them, in element order) contributes to the tensor's ordered sum: rows
    ``(kind, index, value)`` in float64, in element order (:func:`layout`): the sum of each unit it
    holds whole (:data:`UNIT_SUM`), the sum of each other block it holds whole (:data:`BLOCK_SUM`),
    each term of a block it holds only part of (:data:`TERM`, exact in float64)."""
    if not isinstance(terms, torch.Tensor) or terms.dtype != torch.float32:
        got = terms.dtype if isinstance(terms, torch.Tensor) else type(terms).__name__
        raise TypeError(f"terms: expected a float32 tensor, got {got}")
    flat = terms.detach().reshape(-1).cpu()
    kind, index, start, length = layout(first, flat.numel(), numel)
    values = torch.zeros(kind.numel(), dtype=torch.float64)
    raw = kind == TERM
    values[raw] = flat[start[raw]].double()
    held = ~raw
    if held.any():   # the whole blocks, steps 1 and 2 at once, then each unit's blocks in order
        lo, hi = int(start[held][0]), int(start[held][-1] + length[held][-1])
        body = flat[lo:hi]
        blocks = _block_sums(F.pad(body, (0, -body.numel() % BLOCK)) if body.numel() % BLOCK else body)
        b0 = (first + lo) // BLOCK
        block = kind == BLOCK_SUM
        values[block] = blocks[index[block] - b0]
        unit = kind == UNIT_SUM
        if unit.any():   # the units held whole are consecutive: their blocks, a row each (the
            # last one's zeros past its end add nothing), summed in block order
            b = (first + int(start[unit][0])) // BLOCK - b0
            per_unit, count = UNIT // BLOCK, int(unit.sum())
            rows = F.pad(blocks[b:b + count * per_unit], (0, max(0, b + count * per_unit - blocks.numel())))
            values[unit] = rows.view(count, per_unit).cumsum(1)[:, -1]
    return torch.stack([kind.double(), index.double(), values], dim=1)


def _check_rows(kind: torch.Tensor, index: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
                numel: int) -> None:
    """``ValueError`` unless every row is a piece of a tensor of ``numel`` elements (a known kind,
    its index below ``bounds[kind]``: the elements, blocks or units) and rows of the same kind
    and index carry the same value bit for bit (replicas' rows repeat; different ones would make
    the sum depend on the rows' order)."""
    known = (kind >= TERM) & (kind <= UNIT_SUM)
    if not known.all():
        bad = int(kind[~known][0])
        raise ValueError(f"pieces: a row of kind {bad}, expected {TERM} (term), {BLOCK_SUM} (block sum) "
                         f"or {UNIT_SUM} (unit sum)")
    outside = (index < 0) | (index >= bounds[kind])
    if outside.any():
        k, i = int(kind[outside][0]), int(index[outside][0])
        raise ValueError(f"pieces: a row of kind {k} and index {i} is outside a tensor of {numel} elements")
    key, order = torch.sort(index * 3 + kind)
    same = key[1:] == key[:-1]
    if same.any():
        bits = value.view(torch.int64)[order]
        differ = same & (bits[1:] != bits[:-1])
        if differ.any():
            at = int(order[1:][differ][0])
            raise ValueError(f"pieces: rows of kind {int(kind[at])} and index {int(index[at])} disagree")


def total_from_pieces(rows: torch.Tensor, numel: int) -> float:
    """The ordered sum of a tensor of ``numel`` elements from the :func:`pieces` of ranges that
    cover it (rows of all holders, in any order; a range held twice, by replicas, gives the same
    rows): steps 1-4 of the module docstring redone from the largest pieces given, every unit
    without a unit sum at once (a row of 2,048 block sums each). ``ValueError`` when a term the
    sum needs is missing, or a row is not a piece of the tensor (:func:`_check_rows`)."""
    rows = rows.detach().to("cpu", torch.float64)
    if not torch.equal(rows[:, :2], rows[:, :2].trunc()):
        raise ValueError("pieces: a row whose kind or index is not an integer")
    kind, index, value = rows[:, 0].long(), rows[:, 1].long(), rows[:, 2]
    per_unit, nblocks = UNIT // BLOCK, -(-numel // BLOCK)
    units = torch.zeros(-(-nblocks // per_unit), dtype=torch.float64)
    _check_rows(kind, index, value, torch.tensor([numel, nblocks, units.numel()]), numel)
    whole = torch.zeros(units.numel(), dtype=torch.bool)
    at = kind == UNIT_SUM
    units[index[at]], whole[index[at]] = value[at], True
    unit_of = torch.where(kind == TERM, index // UNIT, torch.where(kind == BLOCK_SUM, index // per_unit, index))
    partial = (~whole).nonzero().flatten()
    if partial.numel():
        needed = ~whole[unit_of]
        row_of = torch.full((units.numel(),), -1, dtype=torch.int64)
        row_of[partial] = torch.arange(partial.numel())
        blocks = torch.zeros((partial.numel() * per_unit,), dtype=torch.float64)   # [unit row, block in unit]
        held = torch.zeros(blocks.numel(), dtype=torch.bool)
        # the padding past the tensor's last block is held (zeros)
        last = nblocks - int(partial[-1]) * per_unit
        held[(partial.numel() - 1) * per_unit + last:] = True

        def slot(b: torch.Tensor) -> torch.Tensor:
            return row_of[b // per_unit] * per_unit + b % per_unit
        at = (kind == BLOCK_SUM) & needed
        blocks[slot(index[at])], held[slot(index[at])] = value[at], True
        at = (kind == TERM) & needed
        split = torch.unique(index[at] // BLOCK)
        split = split[~held[slot(split)]]
        if split.numel():   # blocks split between holders: steps 1 and 2 from their terms
            terms = torch.zeros(split.numel() * BLOCK, dtype=torch.float32)
            present = torch.zeros(terms.numel(), dtype=torch.bool)
            b = index[at] // BLOCK
            where = torch.searchsorted(split, b).clamp(max=split.numel() - 1)   # split is sorted
            mine = split[where] == b
            spot = where[mine] * BLOCK + index[at][mine] % BLOCK
            terms[spot] = value[at][mine].float()   # exact: each was an fp32 term
            present[spot] = True
            padding = (split * BLOCK)[:, None] + torch.arange(BLOCK) >= numel
            present |= padding.reshape(-1)
            missing = (~present).nonzero()
            if missing.numel():
                element = int(split[int(missing[0]) // BLOCK]) * BLOCK + int(missing[0]) % BLOCK
                raise ValueError(f"pieces: element {element} of a tensor of {numel} elements is in no piece")
            blocks[slot(split)], held[slot(split)] = _block_sums(terms), True
        if not held.all():
            first = int((~held).nonzero()[0])
            element = (int(partial[first // per_unit]) * per_unit + first % per_unit) * BLOCK
            raise ValueError(f"pieces: element {element} of a tensor of {numel} elements is in no piece")
        units[partial] = blocks.view(-1, per_unit).cumsum(1)[:, -1]   # zeros after a short unit add nothing
    return float(torch.cat([torch.zeros(1, dtype=torch.float64), units]).cumsum(0)[-1])
