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
threads, devices or chunking. A total that is NaN is the one quiet NaN (``float("nan")``): which
NaN an addition of two NaNs keeps depends on the order of its operands in the machine code, so
NaN payloads are no part of the order. Steps 1 and 2 are elementwise (exact IEEE operations on any device);
steps 3 and 4 are sequential scans, taken with :func:`torch.cumsum` on the CPU (a left-to-right
loop in float64 there).

A tensor sharded in contiguous ranges (FSDP2's ``Shard(0)``) gets the same total without gathering
its terms: each rank cuts its range into :func:`pieces` (the sums of the units and blocks it holds
whole, the raw terms of the blocks it shares with a neighbour; at most five :class:`Runs` of
consecutive pieces of one kind), the ranks exchange them, and :func:`total_from_pieces` redoes
steps 1-4 from them: the sum of the whole tensor, bit for bit.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

__all__ = ["ordered_sum", "layout", "layouts", "pieces", "Pieces", "Runs", "total_from_pieces", "totals_from_pieces",
           "rebuild_for", "Rebuild", "inexact_term", "BLOCK", "UNIT", "TERM", "BLOCK_SUM", "UNIT_SUM", "PIECE_SIZE"]

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
    total = float(_unit_sums(_block_sums(flat).cpu()).cumsum(0)[-1])
    return math.nan if math.isnan(total) else total


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


class _Segments:
    """Step 3 over blocks cut into consecutive units of ``sizes`` blocks (each at most a unit's;
    :meth:`sums`: each unit's sum, its blocks added in order from its first), its indices made
    once: the units whose sizes share a power of two ``w`` at or above them are summed together,
    as rows of ``w`` padded with zeros (which leave a sum unchanged), so at most 12 passes however
    many sizes there are.

    Args:
        sizes: int64, each unit's block count (at most a unit's).
    """

    def __init__(self, sizes: torch.Tensor) -> None:
        self.units = sizes.numel()
        first = torch.cumsum(sizes, 0) - sizes
        width = torch.where(sizes > 1, torch.exp2(torch.ceil(torch.log2(sizes.clamp(min=1).double()))), 1).long()
        self.passes = []   # per width: its units, and per row the blocks it reads (inside: a block of the unit)
        for w in torch.unique(width[sizes > 0]).tolist():
            of_width = ((width == w) & (sizes > 0)).nonzero().flatten()
            at = torch.arange(w)
            inside = at < sizes[of_width][:, None]
            self.passes.append((of_width, torch.where(inside, first[of_width][:, None] + at, 0), inside))

    def sums(self, blocks: torch.Tensor) -> torch.Tensor:
        """Each unit's sum of ``blocks`` (float64, the units' blocks end to end)."""
        sums = torch.zeros(self.units, dtype=torch.float64)
        for of_width, index, inside in self.passes:
            sums[of_width] = torch.where(inside, blocks[index], 0.0).cumsum(1)[:, -1]
        return sums


def _block_sums(flat: torch.Tensor) -> torch.Tensor:
    """Steps 1 and 2 over ``flat`` (fp32, a multiple of :data:`BLOCK` long): its block sums in float64."""
    lanes = (flat[0::2] + flat[1::2]).view(-1, BLOCK // 2).double()
    blocks = lanes[:, 0].clone()
    for lane in range(1, BLOCK // 2):
        blocks += lanes[:, lane]
    return blocks


#: the kinds of a piece (column 0 of a run's head, :class:`Runs`): a raw term (indexed by its
#: element), a block's sum (by its block), a unit's sum (by its unit)
TERM, BLOCK_SUM, UNIT_SUM = 0, 1, 2
#: the elements a piece of each kind sums (the last block and unit of a tensor may hold fewer)
PIECE_SIZE = (1, BLOCK, UNIT)


class Runs(NamedTuple):
    """Pieces of a tensor as runs of consecutive pieces of one kind: ``head`` (int64, ``[r, 3]``)
    holds each run's ``(kind, first index, count)``, and ``values`` (float64) the ``count`` pieces
    of each run in turn: piece ``first + k`` of run ``j`` is ``values[offset_j + k]``. A range of a
    tensor is at most five runs (:func:`layouts`), whatever its length: the wire format of
    :mod:`lowp.optim.sharded_sums` (8 bytes per piece plus 32 per run).

    Args:
        head: int64 ``[r, 3]``, each run's kind, first piece's index and piece count.
        values: float64, the pieces of every run in turn.
    """

    head: torch.Tensor
    values: torch.Tensor

    @staticmethod
    def empty() -> Runs:
        """No pieces: an empty range's."""
        return Runs(torch.zeros((0, 3), dtype=torch.int64), torch.zeros(0, dtype=torch.float64))


def layout(first: int, n: int, numel: int) -> tuple[torch.Tensor, ...]:
    """The runs of pieces (:func:`pieces`) of the elements ``[first, first + n)`` of a tensor of
    ``numel`` elements: :func:`layouts` of one range, without the run count."""
    return layouts([first], [n], [numel])[:5]


def layouts(firsts: Sequence[int], ns: Sequence[int], numels: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The runs of pieces of many ranges (range ``r``: elements ``[firsts[r], firsts[r] + ns[r])`` of
    a tensor of ``numels[r]``), as int64 tensors ``(kind, first, count, start, length, runs)``: per
    run its kind, its first piece's index (element, block or unit), its piece count, and the local
    elements it sums, ``[start, start + length)`` of its range; then the number of runs of each
    range. A range is, in element order, at most five runs: the raw terms before its first whole
    block, whole blocks up to its first whole unit, its whole units, whole blocks after them, the
    raw terms after its last whole block (empty ones left out). A block is held whole when every
    element of it below ``numel`` is in the range (the last block's padding is zeros); a unit
    likewise."""
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
    # per range, its five runs: (kind, first index, count)
    kind = torch.tensor([TERM, BLOCK_SUM, UNIT_SUM, BLOCK_SUM, TERM]).repeat(first.numel())
    index = torch.stack([first, b0, u0, after, hi], 1).reshape(-1)
    count = torch.stack([lo - first, torch.where(units, u0 * per_unit, b1) - b0, u1 - u0,
                         torch.where(units, b1 - after, 0), end - hi], 1).reshape(-1)
    size = torch.tensor(PIECE_SIZE)[kind]
    element = index * size   # each run's first element in its tensor
    length = torch.minimum(numel.repeat_interleave(5) - element, count * size)
    start = element - first.repeat_interleave(5)
    kept = count > 0
    return kind[kept], index[kept], count[kept], start[kept], length[kept], kept.view(-1, 5).sum(1)


def pieces(terms: torch.Tensor, first: int, numel: int) -> Runs:
    """What a holder of the elements ``[first, first + n)`` of a tensor of ``numel`` elements (its
    fp32 ``terms``, ``n`` of them, in element order) contributes to the tensor's ordered sum, as
    :class:`Runs` in element order (:func:`layout`): the sum of each unit it holds whole
    (:data:`UNIT_SUM`), the sum of each other block it holds whole (:data:`BLOCK_SUM`), each term
    of a block it holds only part of (:data:`TERM`, exact in float64). :class:`Pieces` of one
    range."""
    _check_terms(terms)
    made = Pieces([first], [terms.numel()], [numel])
    made.add(terms)
    return made.runs()[0]


class Pieces:
    """The :func:`pieces` of many ranges (range ``r``: elements ``[firsts[r], firsts[r] + ns[r])``
    of a tensor of ``numels[r]``), made from one range's terms at a time (:meth:`add`), so only
    one range's fp32 terms need exist at once.

    :meth:`add` keeps, on the terms' device, what the runs need of them: the raw terms outside
    the range's whole blocks (at most 15 on each side) and the whole blocks' sums (steps 1 and 2
    of the module docstring, elementwise; float64, 1 / 8 of the terms' bytes). :meth:`runs` copies
    all of it to the host at once (one transfer and one synchronisation for every range, where a
    range at a time cost one each and the whole terms' bytes) and makes every unit's sum (step 3,
    a left-to-right ``cumsum`` on the CPU).

    Args:
        firsts: each range's first element in its tensor.
        ns: each range's element count.
        numels: the element count of each range's tensor.
    """

    def __init__(self, firsts: Sequence[int], ns: Sequence[int], numels: Sequence[int]) -> None:
        kind, index, count, start, length, runs = layouts(firsts, ns, numels)
        self.ns = [int(n) for n in ns]
        self.heads = list(torch.stack([kind, index, count], 1).split(runs.tolist()))
        self.lengths = [t.tolist() for t in length.split(runs.tolist())]   # each run's elements
        # each range's whole blocks are its local elements [lo, hi) (its block and unit runs); its raw terms the rest
        held = kind != TERM
        range_of = torch.repeat_interleave(torch.arange(len(self.ns)), runs)
        n = torch.tensor(self.ns, dtype=torch.int64)
        lo = n.clone().scatter_reduce_(0, range_of[held], start[held], "amin")
        hi = torch.zeros_like(n).scatter_reduce_(0, range_of[held], (start + length)[held], "amax")
        hi = torch.where(torch.bincount(range_of[held], minlength=len(self.ns)) > 0, hi, n)
        self.lo, self.hi = lo.tolist(), hi.tolist()
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

    def runs(self) -> list[Runs]:
        """Each range's :class:`Runs`, float64 values on the CPU, in element order."""
        if len(self._raw) != len(self.ns):
            raise ValueError(f"terms: {len(self._raw)} of {len(self.ns)} ranges have their terms")
        raw_sizes, block_sizes = [t.numel() for t in self._raw], [t.numel() for t in self._blocks]
        host = _to_host(self._raw + self._blocks).split(raw_sizes + block_sizes)
        made = []
        for head, lengths, raw, blocks in zip(self.heads, self.lengths, host[:len(raw_sizes)], host[len(raw_sizes):]):
            values, at_raw, at_block = [], 0, 0
            for (kind, _, count), length in zip(head.tolist(), lengths):
                if kind == TERM:   # before the whole blocks, then after them
                    values.append(raw[at_raw:at_raw + count])
                    at_raw += count
                elif kind == BLOCK_SUM:
                    values.append(blocks[at_block:at_block + count])
                    at_block += count
                else:   # the units' blocks (the tensor's last unit may be shorter)
                    end = at_block - (-length // BLOCK)
                    values.append(_unit_sums(blocks[at_block:end]))
                    at_block = end
            made.append(Runs(head, torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)))
        return made


def _to_host(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (float64) end to end on the CPU: one copy from a device they share."""
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    if len({t.device for t in parts}) == 1:
        return torch.cat(parts).cpu()
    return torch.cat([t.cpu() for t in parts])


def _ragged(first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``first[j], first[j] + 1, ..., first[j] + count[j] - 1`` for every ``j``, end to end."""
    return torch.repeat_interleave(first - (torch.cumsum(count, 0) - count), count) + torch.arange(int(count.sum()))


def _which(t: int, count: int) -> str:
    """`` (tensor t)`` in an error of :func:`totals_from_pieces` over several tensors."""
    return f" (tensor {t})" if count > 1 else ""


def _check_runs(tensor: torch.Tensor, kind: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                numel: torch.Tensor) -> torch.Tensor | None:
    """``ValueError`` unless every run holds pieces of its tensor (a known kind, its pieces'
    indices below the tensor's elements, blocks or units). When runs of one kind overlap (a
    replica's repeated, or worse), the pairs of pieces that must agree (:func:`_repeats`); else
    ``None``."""
    tensors = numel.numel()
    if ((tensor < 0) | (tensor >= tensors)).any():
        raise ValueError(f"pieces: a run of tensor {int(tensor[(tensor < 0) | (tensor >= tensors)][0])}, "
                         f"expected one of {tensors}")
    known = (kind >= TERM) & (kind <= UNIT_SUM)
    if not known.all():
        raise ValueError(f"pieces: a run of kind {int(kind[~known][0])}, expected {TERM} (term), {BLOCK_SUM} "
                         f"(block sum) or {UNIT_SUM} (unit sum)")
    nblocks = -(-numel // BLOCK)
    bound = torch.stack([numel, nblocks, -(-nblocks // (UNIT // BLOCK))], 1)[tensor, kind]
    outside = (first < 0) | (count < 0) | (first > bound) | (count > bound - first)
    if outside.any():
        t, k, i, c = (int(v[outside][0]) for v in (tensor, kind, first, count))
        raise ValueError(f"pieces: a run of kind {k} of {c} pieces from index {i} is outside a tensor of "
                         f"{int(numel[t])} elements{_which(t, tensors)}")
    size = torch.tensor(PIECE_SIZE)[kind]
    padded = -(-nblocks // (UNIT // BLOCK)) * UNIT   # each tensor's units' elements: past its runs' padded ends
    element = torch.cumsum(padded, 0) - padded   # each tensor's first element among all tensors'
    space = int(padded.sum()) + UNIT
    start = kind * space + element[tensor] + first * size
    start, order = torch.sort(start)
    end = (start + count[order] * size[order]).cummax(0).values
    if start.numel() > 1 and bool((start[1:] < end[:-1]).any()):
        return _repeats(tensor, kind, first, count, element)
    return None


def _repeats(tensor: torch.Tensor, kind: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
             element: torch.Tensor) -> torch.Tensor:
    """Per pair of pieces of the same tensor, kind and index (``element``: each tensor's first
    element among all tensors', at unit-padded offsets), a row ``(a, b, tensor, kind, index)``:
    their positions in the runs' values, then what they are."""
    kinds = torch.repeat_interleave(kind, count)
    tensor_of = torch.repeat_interleave(tensor, count)
    index = _ragged(first, count)
    key, order = torch.sort((element[tensor_of] + index * torch.tensor(PIECE_SIZE)[kinds]) * 3 + kinds)
    same = key[1:] == key[:-1]
    a, b = order[:-1][same], order[1:][same]
    return torch.stack([a, b, tensor_of[a], kinds[a], index[a]])


def total_from_pieces(pieces: Sequence[Runs], numel: int) -> float:
    """The ordered sum of a tensor of ``numel`` elements from the :class:`Runs` of ranges that
    cover it (every holder's, in any order; a range held twice, by replicas, gives the same
    runs): :func:`totals_from_pieces` of one tensor."""
    for r in pieces:
        if not isinstance(r.head, torch.Tensor) or r.head.dtype != torch.int64 or r.head.dim() != 2 \
                or r.head.shape[1] != 3:
            got = f"{r.head.dtype} of shape {tuple(r.head.shape)}" if isinstance(r.head, torch.Tensor) \
                else type(r.head).__name__
            raise ValueError(f"pieces: expected runs whose head is an int64 tensor of shape [runs, 3], got {got}")
    head = torch.cat([torch.zeros((0, 4), dtype=torch.int64)]
                     + [torch.cat([torch.zeros((r.head.shape[0], 1), dtype=torch.int64), r.head], 1) for r in pieces])
    values = torch.cat([torch.zeros(0, dtype=torch.float64)] + [r.values.to("cpu", torch.float64) for r in pieces])
    return float(totals_from_pieces(head, values, [numel])[0])


def totals_from_pieces(head: torch.Tensor, values: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    """The ordered sums (float64) of tensors of ``numels`` elements from the runs of pieces of
    ranges that cover each: ``head`` (int64 ``[r, 4]``) holds each run's ``(tensor, kind, first
    index, count)`` (``tensor`` its position in ``numels``), ``values`` (float64) the runs' pieces in
    turn (:class:`Runs`); the runs of all holders in any order, a range held twice (by replicas)
    giving the same runs. Steps 1-4 of the module docstring are redone from the largest pieces
    given, for all tensors at once (:class:`Rebuild`; the indices of the last few ``head`` and
    ``numels`` are kept, as a sharded step gives the same runs every step). ``ValueError`` when a
    term a sum needs is missing or is no fp32 value, or a run is not one of pieces of its tensor
    (outside it, of an unknown kind, repeating a piece with another value, holding more or fewer
    pieces than ``values``)."""
    _check_values_type(values)
    return rebuild_for(head, numels).totals(values.detach().cpu())


def _check_values_type(values: object) -> None:
    """``ValueError`` unless ``values`` is a float64 tensor of one dimension."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float64 or values.dim() != 1:
        got = f"{values.dtype} of shape {tuple(values.shape)}" if isinstance(values, torch.Tensor) \
            else type(values).__name__
        raise ValueError(f"values: expected a float64 tensor of one dimension, got {got}")


def rebuild_for(head: torch.Tensor, numels: Sequence[int]) -> Rebuild:
    """The :class:`Rebuild` of the runs ``head`` (int64 ``[r, 4]``, :func:`totals_from_pieces`)
    of tensors of ``numels`` elements: made, or the one kept from an earlier call with the same
    ``head`` and ``numels`` (the last :data:`_KEPT_REBUILDS` are kept). ``ValueError`` for runs
    that are no pieces of their tensors (:func:`totals_from_pieces`)."""
    if not isinstance(head, torch.Tensor) or head.dtype != torch.int64 or head.dim() != 2 or head.shape[1] != 4:
        got = f"{head.dtype} of shape {tuple(head.shape)}" if isinstance(head, torch.Tensor) else type(head).__name__
        raise ValueError(f"head: expected an int64 tensor of shape [runs, 4], got {got}")
    head = head.detach().cpu().contiguous()
    key = (tuple(int(n) for n in numels), head.numpy().tobytes())
    rebuild = _REBUILDS.pop(key, None) or Rebuild(head, key[0])
    _REBUILDS[key] = rebuild   # the most recent last
    while len(_REBUILDS) > _KEPT_REBUILDS:
        _REBUILDS.popitem(last=False)
    return rebuild


#: how many :class:`Rebuild` :func:`rebuild_for` keeps (least recently used dropped)
_KEPT_REBUILDS = 4
_REBUILDS: OrderedDict[tuple[tuple[int, ...], bytes], Rebuild] = OrderedDict()


class Rebuild:
    """:func:`totals_from_pieces` for one ``head`` and ``numels``: the runs checked and every index
    made once (where each piece lands: a unit's sum, a block of a unit no holder gave whole, a term
    of a block split between holders), so that :meth:`totals` only moves values and adds (and
    ``lowp.optim.kernels.native.rebuild`` does the same in C++). The tensors' units are laid end
    to end (tensor ``t``'s unit ``u`` is unit ``base[t] + u``), the blocks of the units without a
    unit sum likewise (a run of blocks placed by its first one).

    Args:
        head: int64 ``[r, 4]`` on the CPU, contiguous: each run's tensor, kind, first index, count.
        numels: each tensor's element count.
    """

    def __init__(self, head: torch.Tensor, numels: tuple[int, ...]) -> None:
        tensor, kind, first, count = head.t().contiguous()
        numel = torch.tensor(numels, dtype=torch.int64)
        self.tensors, per_unit = numel.numel(), UNIT // BLOCK
        self.repeats = _check_runs(tensor, kind, first, count, numel)
        self.pieces = int(count.sum())
        offset = torch.cumsum(count, 0) - count   # each run's first value
        kept = count > 0
        tensor, kind, first, count, offset = tensor[kept], kind[kept], first[kept], count[kept], offset[kept]
        nblocks = -(-numel // BLOCK)
        nunits = -(-nblocks // per_unit)
        base = torch.cumsum(nunits, 0) - nunits   # each tensor's first unit
        self.base, self.nunits, self.units = base, nunits, int(nunits.sum())
        owner = torch.repeat_interleave(torch.arange(self.tensors), nunits)   # each unit's tensor
        whole = torch.zeros(self.units, dtype=torch.bool)
        at = kind == UNIT_SUM
        self.unit_to, self.unit_from = _ragged(base[tensor[at]] + first[at], count[at]), _ragged(offset[at], count[at])
        whole[self.unit_to] = True
        self.partial = (~whole).nonzero().flatten()
        empty = torch.zeros(0, dtype=torch.int64)
        self.block_to, self.block_from, self.term_to, self.term_from, self.split = empty, empty, empty, empty, empty
        self.blocks, self.sizes, self.segments = 0, empty, _Segments(empty)
        if self.partial.numel():
            self._partial_units(tensor, kind, first, count, offset, numel, nblocks, base, owner, whole)
        # step 4: the tensors of n units together, each row a tensor's units
        self.step4 = [(of_n, base[of_n][:, None] + torch.arange(n))
                      for n in torch.unique(nunits[nunits > 0]).tolist()
                      for of_n in [(nunits == n).nonzero().flatten()]]

    def _partial_units(self, tensor: torch.Tensor, kind: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                       offset: torch.Tensor, numel: torch.Tensor, nblocks: torch.Tensor, base: torch.Tensor,
                       owner: torch.Tensor, whole: torch.Tensor) -> None:
        """Where the blocks and terms of the units without a unit sum land; ``ValueError`` when
        an element of one is in no piece."""
        per_unit, partial = UNIT // BLOCK, self.partial
        # the blocks of the partial units end to end (a unit's up to its tensor's last block)
        sizes = torch.clamp(nblocks[owner[partial]] - (partial - base[owner[partial]]) * per_unit, max=per_unit)
        row = torch.full((self.units,), -(1 << 62), dtype=torch.int64)   # each unit's first slot; whole: none
        row[partial] = torch.cumsum(sizes, 0) - sizes
        self.blocks, self.sizes, self.segments = int(sizes.sum()), sizes, _Segments(sizes)
        held = torch.zeros(self.blocks, dtype=torch.bool)

        def slot(block: torch.Tensor) -> torch.Tensor:   # a block (among all tensors') in the blocks; < 0: none
            return row[block // per_unit] + block % per_unit
        at = kind == BLOCK_SUM
        first_block = base[tensor[at]] * per_unit + first[at]   # among all tensors' blocks
        start = slot(first_block)
        # a run of blocks of partial units lands on consecutive slots; the blocks of a run that
        # crosses a unit some holder gave whole are placed one at a time, those of that unit left out
        along = (start >= 0) & (slot(first_block + count[at] - 1) - start == count[at] - 1)
        to, source = [_ragged(start[along], count[at][along])], [_ragged(offset[at][along], count[at][along])]
        if not bool(along.all()):
            across = _ragged(first_block[~along], count[at][~along])
            needed = ~whole[across // per_unit]
            to.append(slot(across[needed]))
            source.append(_ragged(offset[at][~along], count[at][~along])[needed])
        self.block_to, self.block_from = torch.cat(to), torch.cat(source)
        held[self.block_to] = True
        at = kind == TERM
        element = _ragged(base[tensor[at]] * UNIT + first[at], count[at])   # among all tensors' elements
        source_term = _ragged(offset[at], count[at])
        needed = ~whole[element // UNIT]
        element, source_term = element[needed], source_term[needed]
        block = element // BLOCK
        split = torch.unique(block)
        split = split[~held[slot(split)]]
        if split.numel():   # blocks split between holders: steps 1 and 2 from their terms
            where = torch.searchsorted(split, block).clamp(max=split.numel() - 1)   # split is sorted
            mine = split[where] == block
            self.term_to = where[mine] * BLOCK + element[mine] % BLOCK
            self.term_from = source_term[mine]
            present = torch.zeros(split.numel() * BLOCK, dtype=torch.bool)
            present[self.term_to] = True
            t_of = owner[split // per_unit]
            start = (split - base[t_of] * per_unit) * BLOCK   # each one's first element in its tensor
            present |= (start[:, None] + torch.arange(BLOCK) >= numel[t_of][:, None]).reshape(-1)
            missing = (~present).nonzero()
            if missing.numel():
                at_missing = int(missing[0]) // BLOCK
                t = int(t_of[at_missing])
                raise ValueError(f"pieces: element {int(start[at_missing]) + int(missing[0]) % BLOCK} of a tensor of "
                                 f"{int(numel[t])} elements is in no piece{_which(t, self.tensors)}")
            self.split = slot(split)
            held[self.split] = True
        if not held.all():
            at_missing = int((~held).nonzero()[0])
            j = int(torch.searchsorted(row[partial], at_missing, right=True)) - 1   # its partial unit
            u = int(partial[j])
            t = int(owner[u])
            element_missing = ((u - int(base[t])) * per_unit + at_missing - int(row[u])) * BLOCK
            raise ValueError(f"pieces: element {element_missing} of a tensor of {int(numel[t])} elements is in no "
                             f"piece{_which(t, self.tensors)}")

    def totals(self, values: torch.Tensor) -> torch.Tensor:
        """Each tensor's ordered sum (float64) from ``values`` (float64 on the CPU, the runs' pieces
        in turn)."""
        self.check_values(values)
        units = torch.zeros(self.units, dtype=torch.float64)
        units[self.unit_to] = values[self.unit_from]
        if self.partial.numel():
            blocks = torch.zeros(self.blocks, dtype=torch.float64)
            blocks[self.block_to] = values[self.block_from]
            if self.split.numel():
                terms = torch.zeros(self.split.numel() * BLOCK, dtype=torch.float32)
                value = values[self.term_from]
                terms[self.term_to] = value.float()
                inexact = (terms[self.term_to].double() != value) & ~value.isnan()
                if bool(inexact.any()):   # each was an fp32 term: exact in float64
                    raise inexact_term(float(value[inexact][0]))
                blocks[self.split] = _block_sums(terms)
            units[self.partial] = self.segments.sums(blocks)
        totals = torch.zeros(self.tensors, dtype=torch.float64)
        for of_n, at_units in self.step4:
            totals[of_n] = torch.cat([torch.zeros((of_n.numel(), 1), dtype=torch.float64), units[at_units]],
                                     1).cumsum(1)[:, -1]
        return torch.where(totals.isnan(), math.nan, totals)   # the one NaN (module docstring)

    def check_values(self, values: torch.Tensor) -> None:
        """``ValueError`` unless ``values`` holds one value per piece and pieces given twice (a
        replica's) agree bit for bit (else the order of the runs would decide the sum)."""
        _check_values_type(values)
        if values.numel() != self.pieces:
            raise ValueError(f"pieces: the runs hold {self.pieces} pieces, got {values.numel()} values")
        if self.repeats is not None:
            bits = values.view(torch.int64)
            differ = bits[self.repeats[0]] != bits[self.repeats[1]]
            if bool(differ.any()):
                _, _, t, k, i = self.repeats[:, differ][:, 0].tolist()
                raise ValueError(f"pieces: pieces of kind {k} and index {i} disagree{_which(t, self.tensors)}")


def inexact_term(value: float) -> ValueError:
    """The error of a raw term that is no fp32 value (a holder sends each term exactly)."""
    return ValueError(f"pieces: a term of {value!r}, which is no fp32 value")
