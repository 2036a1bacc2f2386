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

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ordered_sum", "layout", "layouts", "pieces", "Pieces", "total_from_pieces", "totals_from_pieces",
           "BLOCK", "UNIT", "TERM", "BLOCK_SUM", "UNIT_SUM"]

#: elements per block: 8 fp32 lanes of two elements each
BLOCK = 16
#: elements per work unit (``UNIT`` of ``native/step.h``; a multiple of :data:`BLOCK`)
UNIT = 1 << 15


def ordered_sum(terms: torch.Tensor) -> float:
    """The sum of the fp32 tensor ``terms`` (any shape, any device, read in row-major order) in
    the order of the module docstring, as a Python float (float64); ``0.0`` when empty."""
    _check_terms(terms)
    flat = terms.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    if flat.numel() % BLOCK:
        flat = F.pad(flat, (0, -flat.numel() % BLOCK))
    return float(_unit_sums(_block_sums(flat).cpu()).cumsum(0)[-1])


def _check_terms(terms: object) -> None:
    """``TypeError`` unless ``terms`` is a float32 tensor."""
    if not isinstance(terms, torch.Tensor) or terms.dtype != torch.float32:
        got = terms.dtype if isinstance(terms, torch.Tensor) else type(terms).__name__
        raise TypeError(f"terms: expected a float32 tensor, got {got}")


def _unit_sums(blocks: torch.Tensor) -> torch.Tensor:
    """Step 3 over consecutive block sums (float64, on the CPU) from a unit's first block: each
    unit's sum, its blocks added in order (the last unit's missing blocks as zeros, which end a
    sum unchanged)."""
    per_unit = UNIT // BLOCK
    return F.pad(blocks, (0, -blocks.numel() % per_unit)).view(-1, per_unit).cumsum(1)[:, -1]


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
    the range (the last block's padding is zeros); a unit likewise (:func:`layouts` of one range)."""
    kind, index, start, length, _ = layouts([first], [n], [numel])
    return kind, index, start, length


def layouts(firsts: Sequence[int], ns: Sequence[int], numels: Sequence[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`layout` of many ranges at once (range ``r``: elements ``[firsts[r], firsts[r] +
    ns[r])`` of a tensor of ``numels[r]``), their entries one after the other, and the number of
    entries of each range. A range is, in element order: the raw terms before its first whole
    block, whole blocks up to its first whole unit, its whole units, whole blocks after them, the
    raw terms after its last whole block (each part maybe empty); every part of every range is
    made at once (a ragged ``arange``)."""
    if not len(firsts) == len(ns) == len(numels):
        raise ValueError(f"firsts, ns, numels: expected one entry per range in each, got {len(firsts)}, "
                         f"{len(ns)} and {len(numels)} entries")
    first, n, numel = (torch.tensor(list(v), dtype=torch.int64) for v in (firsts, ns, numels))
    end = first + n
    bad = (first < 0) | (n < 0) | (end > numel)
    if bad.any():
        r = int(bad.nonzero()[0])
        raise ValueError(f"first: elements [{int(first[r])}, {int(end[r])}) are not inside a tensor of "
                         f"{int(numel[r])} elements")
    per_unit, nblocks = UNIT // BLOCK, -(-numel // BLOCK)
    # whole blocks: from the first block boundary at or after ``first`` to the last one at or
    # before ``end`` (or to ``end`` itself when it is the tensor's end: the padded last block)
    lo = -(-first // BLOCK) * BLOCK
    hi = torch.where(end == numel, end, end // BLOCK * BLOCK)
    none = hi <= lo   # no whole block: every term raw
    lo, hi = torch.where(none, end, lo), torch.where(none, end, hi)
    b0, b1 = lo // BLOCK, torch.where(none, lo // BLOCK, -(-hi // BLOCK))
    # units held whole, [u0, u1): starting at or after b0, ending (at the next boundary or the
    # tensor's last block) at or before b1
    u0 = -(-b0 // per_unit)
    u1 = torch.maximum(u0, torch.where(b1 == nblocks, -(-nblocks // per_unit), b1 // per_unit))
    units = u1 > u0
    after = torch.minimum(u1 * per_unit, nblocks)
    # per range, its five parts: (kind, first index, count)
    kinds = torch.tensor([TERM, BLOCK_SUM, UNIT_SUM, BLOCK_SUM, TERM]).repeat(first.numel())
    starts = torch.stack([first, b0, u0, after, hi], 1).reshape(-1)
    counts = torch.stack([lo - first, torch.where(units, u0 * per_unit, b1) - b0, u1 - u0,
                          torch.where(units, b1 - after, 0), end - hi], 1).reshape(-1)
    index = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts) \
        + torch.arange(int(counts.sum()))
    kind = torch.repeat_interleave(kinds, counts)
    size = torch.tensor([1, BLOCK, UNIT])[kind]   # elements of a term, block, unit
    whole = torch.repeat_interleave(numel.repeat_interleave(5), counts)
    element = index * size   # each piece's first element
    length = torch.minimum(whole - element, size)
    start = element - torch.repeat_interleave(first.repeat_interleave(5), counts)
    return kind, index, start, length, counts.view(-1, 5).sum(1)


def pieces(terms: torch.Tensor, first: int, numel: int) -> torch.Tensor:
    """What a holder of the elements ``[first, first + n)`` of a tensor of ``numel`` elements (its
    fp32 ``terms``, ``n`` of them, in element order) contributes to the tensor's ordered sum: rows
    ``(kind, index, value)`` in float64, in element order (:func:`layout`): the sum of each unit it
    holds whole (:data:`UNIT_SUM`), the sum of each other block it holds whole (:data:`BLOCK_SUM`),
    each term of a block it holds only part of (:data:`TERM`, exact in float64). :class:`Pieces`
    of one range."""
    _check_terms(terms)
    made = Pieces([first], [terms.numel()], [numel])
    made.add(terms)
    return made.rows()[0]


class Pieces:
    """The :func:`pieces` of many ranges (range ``r``: elements ``[firsts[r], firsts[r] + ns[r])``
    of a tensor of ``numels[r]``), made from one range's terms at a time (:meth:`add`), so only
    one range's fp32 terms need exist at once.

    :meth:`add` keeps, on the terms' device, what the rows need of them: the raw terms outside
    the range's whole blocks (at most 15 on each side) and the whole blocks' sums (steps 1 and 2
    of the module docstring, elementwise; float64, 1 / 8 of the terms' bytes). :meth:`rows` copies
    all of it to the host at once (one transfer and one synchronisation for every range, where a
    range at a time cost one each and the whole terms' bytes) and makes every unit's sum (step 3,
    a left-to-right ``cumsum`` on the CPU) and every row together.

    Args:
        firsts: each range's first element in its tensor.
        ns: each range's element count.
        numels: the element count of each range's tensor.
    """

    def __init__(self, firsts: Sequence[int], ns: Sequence[int], numels: Sequence[int]) -> None:
        self.kind, self.index, start, length, self.counts = layouts(firsts, ns, numels)
        self.ns = [int(n) for n in ns]
        ranges = len(self.ns)
        self.range_of = torch.repeat_interleave(torch.arange(ranges), self.counts)   # each row's range
        # each range's whole blocks are its local elements [lo, hi); its raw terms the rest
        held = self.kind != TERM
        n = torch.tensor(self.ns, dtype=torch.int64)
        lo = n.clone().scatter_reduce_(0, self.range_of[held], start[held], "amin")
        hi = torch.zeros_like(n).scatter_reduce_(0, self.range_of[held], (start + length)[held], "amax")
        hi = torch.where(torch.bincount(self.range_of[held], minlength=ranges) > 0, hi, n)
        self.lo, self.hi = lo.tolist(), hi.tolist()
        self.first_block = (torch.tensor(list(firsts), dtype=torch.int64) + lo) // BLOCK
        self._raw: list[torch.Tensor] = []
        self._blocks: list[torch.Tensor] = []

    def add(self, terms: torch.Tensor) -> None:
        """The next range's fp32 ``terms`` (``ns[r]`` of them, in element order, on any device):
        its raw terms and block sums kept on that device."""
        _check_terms(terms)
        r = len(self._raw)
        if r == len(self.ns):
            raise ValueError(f"terms: every one of the {r} ranges has its terms already")
        flat = terms.detach().reshape(-1)
        if flat.numel() != self.ns[r]:
            raise ValueError(f"terms: range {r} holds {self.ns[r]} elements, got {flat.numel()} terms")
        lo, hi = self.lo[r], self.hi[r]
        body = flat[lo:hi]
        if body.numel() % BLOCK:   # the tensor's last block: padded with zeros
            body = F.pad(body, (0, -body.numel() % BLOCK))
        self._raw.append(torch.cat([flat[:lo], flat[hi:]]).double())
        self._blocks.append(_block_sums(body))

    def rows(self) -> list[torch.Tensor]:
        """Each range's rows ``(kind, index, value)``, float64 on the CPU, in element order."""
        if len(self._raw) != len(self.ns):
            raise ValueError(f"terms: {len(self._raw)} of {len(self.ns)} ranges have their terms")
        raw_count = sum(t.numel() for t in self._raw)
        host = _to_host(self._raw + self._blocks)
        raw, blocks = host[:raw_count], host[raw_count:]
        nblocks = torch.tensor([t.numel() for t in self._blocks], dtype=torch.int64)
        offset = torch.cumsum(nblocks, 0) - nblocks   # each range's first block sum in ``blocks``
        kind, index, range_of = self.kind, self.index, self.range_of
        values = torch.zeros(kind.numel(), dtype=torch.float64)
        values[kind == TERM] = raw   # the raw terms, before and after each range's whole blocks, in order
        at = kind == BLOCK_SUM
        values[at] = blocks[offset[range_of[at]] + index[at] - self.first_block[range_of[at]]]
        at = kind == UNIT_SUM
        if at.any():   # a range's whole units are consecutive, and so are their blocks' sums
            per_unit = UNIT // BLOCK
            unit_range = range_of[at]
            begins = offset[unit_range] + index[at] * per_unit - self.first_block[unit_range]   # in ``blocks``
            with_units, units = torch.unique_consecutive(unit_range, return_counts=True)
            begin = begins[torch.cumsum(units, 0) - units].tolist()
            end = (offset + nblocks)[with_units].tolist()   # the tensor's last unit may be shorter
            values[at] = torch.cat([_unit_sums(blocks[b:min(b + u * per_unit, e)])
                                    for b, e, u in zip(begin, end, units.tolist())])
        return list(torch.stack([kind.double(), index.double(), values], dim=1).split(self.counts.tolist()))


def _to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (float64) end to end on the CPU: one copy from a device they share."""
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    if len({t.device for t in parts}) == 1:
        return torch.cat(parts).cpu()
    return torch.cat([t.cpu() for t in parts])


def _check_rows(tensor: torch.Tensor, kind: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
                bounds: torch.Tensor, key: torch.Tensor) -> None:
    """``ValueError`` unless every row is a piece of its tensor (a known kind, its index below
    ``bounds[tensor, kind]``: the tensor's elements, blocks or units) and rows of the same ``key``
    (tensor, kind and index) carry the same value bit for bit (replicas' rows repeat; different
    ones would make the sum depend on the rows' order)."""
    known = (kind >= TERM) & (kind <= UNIT_SUM)
    if not known.all():
        bad = int(kind[~known][0])
        raise ValueError(f"pieces: a row of kind {bad}, expected {TERM} (term), {BLOCK_SUM} (block sum) "
                         f"or {UNIT_SUM} (unit sum)")
    outside = (index < 0) | (index >= bounds[tensor, kind])
    if outside.any():
        t, k, i = int(tensor[outside][0]), int(kind[outside][0]), int(index[outside][0])
        raise ValueError(f"pieces: a row of kind {k} and index {i} is outside a tensor of {int(bounds[t, 0])} "
                         f"elements{_which(t, bounds.shape[0])}")
    key, order = torch.sort(key * 3 + kind)
    same = key[1:] == key[:-1]
    if same.any():
        bits = value.view(torch.int64)[order]
        differ = same & (bits[1:] != bits[:-1])
        if differ.any():
            at = int(order[1:][differ][0])
            raise ValueError(f"pieces: rows of kind {int(kind[at])} and index {int(index[at])} disagree"
                             f"{_which(int(tensor[at]), bounds.shape[0])}")


def _which(t: int, count: int) -> str:
    """`` (tensor t)`` in an error of :func:`totals_from_pieces` over several tensors."""
    return f" (tensor {t})" if count > 1 else ""


def total_from_pieces(rows: torch.Tensor, numel: int) -> float:
    """The ordered sum of a tensor of ``numel`` elements from the :func:`pieces` of ranges that
    cover it (rows of all holders, in any order; a range held twice, by replicas, gives the same
    rows): :func:`totals_from_pieces` of one tensor."""
    rows = rows.detach().to("cpu", torch.float64)
    return float(totals_from_pieces(torch.cat([torch.zeros((rows.shape[0], 1), dtype=torch.float64), rows], 1),
                                    [numel])[0])


def totals_from_pieces(rows: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    """The ordered sums (float64) of tensors of ``numels`` elements from the :func:`pieces` of
    ranges that cover each, as rows ``(tensor, kind, index, value)`` (``tensor`` its position in
    ``numels``; rows of all holders, in any order; a range held twice, by replicas, gives the same
    rows): steps 1-4 of the module docstring redone from the largest pieces given, for all
    tensors at once. The tensors' units are laid end to end (tensor ``t``'s unit ``u`` is unit
    ``base[t] + u``), every unit without a unit sum rebuilt from its blocks at once (a row of
    2,048 block sums each), then each tensor's units added in order from ``+0.0``. ``ValueError``
    when a term a sum needs is missing, or a row is not a piece of its tensor (outside it, of an
    unknown kind, repeating a piece with another value)."""
    rows = rows.detach().to("cpu", torch.float64)
    ints = rows[:, :3].long()
    if not torch.equal(ints.double(), rows[:, :3]):   # a fraction, a NaN or an infinity does not come back
        raise ValueError("pieces: a row whose tensor, kind or index is not an integer")
    (tensor, kind, index), value = ints.t().contiguous(), rows[:, 3]
    numel = torch.tensor(list(numels), dtype=torch.int64)
    count, per_unit = numel.numel(), UNIT // BLOCK
    if ((tensor < 0) | (tensor >= count)).any():
        raise ValueError(f"pieces: a row of tensor {int(tensor[(tensor < 0) | (tensor >= count)][0])}, "
                         f"expected one of {count}")
    nblocks = -(-numel // BLOCK)
    nunits = -(-nblocks // per_unit)
    base = torch.cumsum(nunits, 0) - nunits   # each tensor's first unit
    unit_of = torch.where(kind == TERM, index // UNIT, torch.where(kind == BLOCK_SUM, index // per_unit, index))
    _check_rows(tensor, kind, index, value, torch.stack([numel, nblocks, nunits], 1),
                torch.where(kind == TERM, index, torch.where(kind == BLOCK_SUM, index * BLOCK, index * UNIT))
                + base[tensor] * UNIT)
    units = torch.zeros(int(nunits.sum()), dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(count), nunits)   # each unit's tensor
    unit = base[tensor] + unit_of   # each row's unit
    whole = torch.zeros(units.numel(), dtype=torch.bool)
    at = kind == UNIT_SUM
    units[unit[at]], whole[unit[at]] = value[at], True
    partial = (~whole).nonzero().flatten()
    if partial.numel():
        needed = ~whole[unit]
        row_of = torch.full((units.numel(),), -1, dtype=torch.int64)
        row_of[partial] = torch.arange(partial.numel())
        # [unit row, block in unit]; the blocks past a tensor's last block are held (zeros)
        ends = nblocks[owner[partial]] - (partial - base[owner[partial]]) * per_unit
        held = (torch.arange(per_unit) >= ends[:, None]).reshape(-1)
        blocks = torch.zeros(held.numel(), dtype=torch.float64)

        def slot(u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:   # unit ``u``'s block ``b`` (of its unit)
            return row_of[u] * per_unit + b
        at = (kind == BLOCK_SUM) & needed
        blocks[slot(unit[at], index[at] % per_unit)], held[slot(unit[at], index[at] % per_unit)] = value[at], True
        at = (kind == TERM) & needed
        block = unit[at] * per_unit + index[at] % UNIT // BLOCK   # its block among all units' blocks
        split = torch.unique(block)
        split = split[~held[slot(split // per_unit, split % per_unit)]]
        if split.numel():   # blocks split between holders: steps 1 and 2 from their terms
            terms = torch.zeros(split.numel() * BLOCK, dtype=torch.float32)
            present = torch.zeros(terms.numel(), dtype=torch.bool)
            where = torch.searchsorted(split, block).clamp(max=split.numel() - 1)   # split is sorted
            mine = split[where] == block
            spot = where[mine] * BLOCK + index[at][mine] % BLOCK
            terms[spot] = value[at][mine].float()   # exact: each was an fp32 term
            present[spot] = True
            first = (split - base[owner[split // per_unit]] * per_unit) * BLOCK   # each one's first element
            present |= (first[:, None] + torch.arange(BLOCK) >= numel[owner[split // per_unit]][:, None]).reshape(-1)
            missing = (~present).nonzero()
            if missing.numel():
                at_missing = int(missing[0]) // BLOCK
                t = int(owner[split[at_missing] // per_unit])
                raise ValueError(f"pieces: element {int(first[at_missing]) + int(missing[0]) % BLOCK} of a tensor of "
                                 f"{int(numel[t])} elements is in no piece{_which(t, count)}")
            blocks[slot(split // per_unit, split % per_unit)] = _block_sums(terms)
            held[slot(split // per_unit, split % per_unit)] = True
        if not held.all():
            at_missing = int((~held).nonzero()[0])
            u = int(partial[at_missing // per_unit])
            t = int(owner[u])
            element = ((u - int(base[t])) * per_unit + at_missing % per_unit) * BLOCK
            raise ValueError(f"pieces: element {element} of a tensor of {int(numel[t])} elements is in no piece"
                             f"{_which(t, count)}")
        units[partial] = _unit_sums(blocks)   # a row of per_unit blocks per partial unit
    totals = torch.zeros(count, dtype=torch.float64)
    for n in torch.unique(nunits[nunits > 0]).tolist():   # step 4, the tensors of n units together
        of_n = (nunits == n).nonzero().flatten()
        at_units = units[base[of_n][:, None] + torch.arange(n)]
        totals[of_n] = torch.cat([torch.zeros((of_n.numel(), 1), dtype=torch.float64), at_units], 1).cumsum(1)[:, -1]
    return totals
