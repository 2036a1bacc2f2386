"""Counter-based random bits for stochastic rounding, the same on every backend and every sharding.

Stochastic rounding needs 16 uniform random bits per element and stream. lowp draws them from a
pure function instead of a stateful generator (the approach of Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011)::

    key  = stream_key(seed, step, param_id, stream)          # 32 bits, once per tensor and step
    bits = random16(i, key)                                  # per element, i = global element index

``i`` is the element's index in the *whole* parameter (row-major), so a parameter sharded over
any number of ranks, cut into any chunks, or run by any backend (reference, native C++,
torch.compile, Triton) draws the same bits for the same element. Nothing needs checkpointing
beyond the seed and the step counters.

``random16`` hashes the pair index ``p = i // 2`` as the elements' own indices would be hashed
(its low 32 bits with the key, after folding its high 32 bits into the key, so pairs ``2**32``
apart draw different bits) and hands elements ``2k`` and ``2k + 1`` the low and the high 16 bits
of their pair's hash::

    random16(i, key) = (h >> 16 * (i & 1)) & 0xFFFF,   h = hash32(lo32(p) ^ key ^ hash32(hi32(p))),  p = i // 2

(``hash32(0) = 0``). One 32-bit hash thus serves two elements: the reference and the native
kernel hash 1.5 times per element for a step that rounds three streams (AdamW's two moments and
the Kahan compensation) instead of 3 times. ``hash32`` is a bijection of 32-bit words, so over the
``2**32`` pairs of one ``hi32(p)`` its input takes every word once, and so does its output: the
two halves take every one of the ``2**32`` combinations of values exactly once. Each element's
16 bits are uniform, and the two elements of a pair independent, over that period.

Backends work per ``2**32`` elements of one ``hi = hi32(i)``, where ``lo32(p) = lo32(i) // 2 +
(hi & 1) * 2**31``: they xor ``lo32(i) // 2`` with :func:`fold_key`, which folds ``hash32(hi //
2)`` and the top bit ``(hi & 1) * 2**31`` into the key.

The default seed is ``torch.initial_seed()``; in a process group of several ranks it is rank 0's
(:func:`default_seed`), so replicas of a parameter (DistributedDataParallel, replicated DTensor
placements) draw the same bits even when each rank seeds torch differently.

``hash32`` is an xor-shift-multiply integer mixer (constants from C. Wellons' "hash prospector",
2018, a low-bias 32-bit mixer); ``stream_key`` mixes its inputs with SplitMix64's finalizer
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014).
"""
from __future__ import annotations

import array
import functools
import itertools
import math
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from lowp.optim.scratch import Scratch

__all__ = ["as_int32", "default_seed", "reset_default_seeds", "Stream", "stream_key", "stream_keys", "hash32_int",
           "random16_int", "hash32", "random16", "random16_range", "random16_ranges", "fold_key", "ElementIndex",
           "RandomStreams"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


class Stream:
    """Stream numbers of one parameter: the weight's rounding, the Kahan compensation's, then
    one per optimizer state (``STATE + i`` for the ``i``-th state name)."""

    WEIGHT = 0
    COMPENSATION = 1
    STATE = 2


def default_seed(owner: object | None = None) -> int:
    """The seed of an optimizer built without one: ``torch.initial_seed()``, but rank 0's when
    torch.distributed's default process group has more than one rank (one broadcast of a Python
    int over that group, so every rank must build its lowp optimizers in the same order, as
    every rank builds its DistributedDataParallel wrapper; give ``seed=`` to avoid it), then,
    for an ``owner``, made its own among the live optimizers that drew the same one
    (:func:`_own_seed`).

    Replicated parameters stay replicas only if every rank rounds them with the same bits: with
    each rank's own ``torch.initial_seed()`` (scripts often seed torch with ``base + rank`` for
    dropout or augmentation) the replicas of a DDP model would drift apart, an ulp at a time,
    without an error."""
    seed = torch.initial_seed()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[object] = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = int(box[0])  # type: ignore[call-overload]
    return seed if owner is None else _own_seed(seed, owner)


#: per base seed: slot -> the live optimizer holding it
_SLOTS: dict[int, weakref.WeakValueDictionary[int, object]] = {}


def reset_default_seeds() -> None:
    """Forget which optimizers hold which default seeds, as in a fresh process."""
    _SLOTS.clear()


def _own_seed(seed: int, owner: object) -> int:
    """The default seed of ``owner``: the lowest slot ``n`` that no live optimizer built without a
    seed from the same ``seed`` holds; ``seed`` itself for slot 0, ``splitmix64(seed ^
    splitmix64(n))`` for the others. Optimizers built one per parameter (optimizer-in-backward,
    each numbering its parameters from 0) are alive together and so draw independent bits; a run
    repeated in one process after the previous run's optimizers are gone gets the seeds a fresh
    process gets. The slots depend only on the order of construction and on lifetimes, the same in
    every run and, with the same program, on every rank."""
    slots = _SLOTS.setdefault(seed, weakref.WeakValueDictionary())
    n = next(i for i in itertools.count() if i not in slots)
    slots[n] = owner
    return seed if n == 0 else _splitmix64((seed ^ _splitmix64(n)) & _MASK64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _parameter_mix(seed: int, step: int, param_id: int) -> int:
    """The inputs every stream of one parameter at one step shares, mixed."""
    x = _splitmix64(seed & _MASK64)
    for v in (step, param_id):
        x = _splitmix64(x ^ (v & _MASK64))
    return x


def stream_key(seed: int, step: int, param_id: int, stream: int) -> int:
    """The 32-bit key (``0 <= key < 2**32``) of one random stream of one parameter at one step."""
    return _splitmix64(_parameter_mix(seed, step, param_id) ^ (stream & _MASK64)) & _MASK32


def stream_keys(seed: int, step: int, param_id: int, streams: int) -> list[int]:
    """``[stream_key(seed, step, param_id, s) for s in range(streams)]``, mixing the shared
    inputs once."""
    x = _parameter_mix(seed, step, param_id)
    return [_splitmix64(x ^ s) & _MASK32 for s in range(streams)]


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` elementwise on ``uint64`` values (numpy arrays wrap modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_key_table(seed: int, step: int, param_ids: np.ndarray, streams: int) -> np.ndarray:
    """``table[j, s] = stream_key(seed, step, param_ids[j], s)`` as ``uint64`` (each below
    2**32): the keys of many parameters at one step in a few vectorized passes, for kernels whose
    host prepares the keys (``param_ids``: ``uint64``)."""
    base = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    x = _splitmix64_array(param_ids ^ np.uint64(base))
    table = x[:, None] ^ np.arange(streams, dtype=np.uint64)[None, :]
    return _splitmix64_array(table) & np.uint64(_MASK32)


def fold_key(key: int, hi: int) -> int:
    """``key ^ hash32(hi // 2) ^ (hi & 1) * 2**31``: the key that :func:`random16` xors with
    ``lo32(i) // 2`` for every index ``i`` whose high 32 bits are ``hi`` (so a range of indices
    with one ``hi`` needs only 32-bit math)."""
    return (key ^ hash32_int(hi >> 1) ^ ((hi & 1) << 31)) & _MASK32


def hash32_int(x: int) -> int:
    """``hash32`` on one Python int in ``[0, 2**32)``: the reference the tensor versions match."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def random16_int(index: int, key: int) -> int:
    """16 random bits of global element ``index`` (``0 <= index < 2**63``) in the stream ``key``."""
    pair = index >> 1
    h = hash32_int((pair & _MASK32) ^ key ^ hash32_int(pair >> 32))
    return (h >> 16 * (index & 1)) & 0xFFFF


def as_int32(value: int) -> int:
    """A 32-bit pattern as the signed value torch's int32 holds."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def hash32(x: torch.Tensor) -> torch.Tensor:
    """:func:`hash32_int` elementwise on an int32 tensor (wrap-around products; the masks make the
    arithmetic shifts logical, so the bits equal the uint32 version in C++ and Triton)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * as_int32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * as_int32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def random16(index: torch.Tensor, key: int) -> torch.Tensor:
    """:func:`random16_int` elementwise on an int64 tensor of global indices; int32 result in
    ``[0, 2**16)``."""
    pair = index >> 1
    lo = (pair & _MASK32).to(torch.int32)   # int64 -> int32 keeps the low 32 bits (two's complement)
    hi = hash32((pair >> 32).to(torch.int32))
    half = ((index & 1) << 4).to(torch.int32)
    return (hash32(lo ^ hi ^ as_int32(key)) >> half) & 0xFFFF


#: hash32's constants as 0-dim int32 tensors: a Python int argument costs each op a conversion
#: of the scalar to a tensor (a CPU scalar tensor also serves tensors on other devices)
_MUL1, _MUL2, _SHIFT15, _SHIFT16, _LOW17, _LOW16 = (torch.tensor(as_int32(v), dtype=torch.int32)
                                                    for v in (0x7FEB352D, 0x846CA68B, 15, 16, 0x1FFFF, 0xFFFF))
_COUNTS: dict[torch.device, torch.Tensor] = {}
_MIXED_COUNTS: dict[torch.device, torch.Tensor] = {}


def _cached_arange(cache: dict[torch.device, torch.Tensor], n: int, device: torch.device, mixed: bool) -> torch.Tensor:
    """``arange(n)`` as int32 (``mixed``: with ``hash32``'s first xor-shift applied, ``k ^ (k >> 16)``)
    from a per-device cache that grows to the largest ``n`` asked for."""
    cached = cache.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
        if mixed:
            cached.bitwise_xor_(cached >> 16)   # counts stay below 2**31: the shift is logical
        cache[device] = cached
    return cached[:n]


def _xorshift16(v: int) -> int:
    """``hash32``'s first step ``v ^ (v >> 16)`` on a 32-bit pattern."""
    v &= _MASK32
    return v ^ (v >> 16)


def random16_range(first: int, n: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``random16(arange(first, first + n), key)`` (int32) with 32-bit arithmetic only; see
    :func:`random16_ranges`."""
    return random16_ranges(first, n, [key], device)[0]


def random16_ranges(first: int, n: int, keys: list[int], device: torch.device | str = "cpu",
                    scratch: Scratch | None = None) -> torch.Tensor:
    """``random16(arange(first, first + n), key)`` for each key, as one ``(len(keys), n)`` int32
    tensor (one pass per operation for all streams) with 32-bit arithmetic only.

    The range is cut where the index crosses a multiple of ``2**32``: within a piece the high bits
    are constant, so their hash is folded into the key once (:func:`fold_key`), and the pairs
    ``lo32(i) // 2`` stay below ``2**31``. Each piece hashes its pairs (:func:`_pair_hashes`) and
    reads the 32-bit hashes as 16-bit halves, low half first (the element order of
    :func:`random16`). With a ``scratch`` the result and the
    temporaries live in its buffers ``"random"``, ``"random pairs"`` and ``"random temporary"``.
    """
    device = torch.device(device)
    x = (torch.empty((len(keys), n), dtype=torch.int32, device=device) if scratch is None
         else scratch.take("random", (len(keys), n), torch.int32, device))
    j = 0
    while j < n:
        index = first + j
        lo = index & _MASK32
        end = min(n, j + (1 << 32) - lo)
        size, odd = end - j, lo & 1
        pairs = (odd + size + 1) >> 1   # pairs lo // 2 .. (lo + size - 1) // 2
        hashes = _pair_hashes(lo >> 1, pairs, [fold_key(key, index >> 32) for key in keys], device, scratch)
        x[:, j:end].copy_(_halves(hashes)[:, odd:odd + size])
        j = end
    return x.bitwise_and_(_LOW16)


def _halves(hashes: torch.Tensor) -> torch.Tensor:
    """The 16-bit halves of int32 ``hashes`` (rows of ``m``), low half first: ``(rows, 2 m)``
    int16 values (sign-extended when widened; :func:`random16_ranges` masks them)."""
    if sys.byteorder == "little":   # the int32 words' own bytes: no pass over them
        return hashes.view(torch.int16)
    return torch.stack([hashes, hashes >> 16], dim=-1).to(torch.int16).flatten(-2)


def _pair_hashes(pair: int, m: int, folds: list[int], device: torch.device, scratch: Scratch | None) -> torch.Tensor:
    """``hash32(pair + k ^ fold)`` for ``k < m`` and each fold, as a ``(len(folds), m)`` int32
    tensor (``pair + m <= 2**31``).

    ``hash32``'s first step ``x ^ (x >> 16)`` is linear over xor, and when ``pair`` is a multiple
    of a power of two at least ``m`` (chunks of whole tensors) ``pair + k == pair ^ k``, so there
    the step is one xor of the cached ``k ^ (k >> 16)`` with ``c ^ (c >> 16)`` for ``c = pair ^
    fold``; otherwise the counts are added and mixed in full.
    """
    if scratch is None:
        x, t = (torch.empty((len(folds), m), dtype=torch.int32, device=device),
                torch.empty(m, dtype=torch.int32, device=device))
    else:
        x, t = (scratch.take("random pairs", (len(folds), m), torch.int32, device),
                scratch.take("random temporary", (m,), torch.int32, device))
    if pair & ((1 << (m - 1).bit_length()) - 1) == 0:
        mixed = _cached_arange(_MIXED_COUNTS, m, device, mixed=True)
        torch.bitwise_xor(mixed.unsqueeze(0), _column([_xorshift16(pair ^ f) for f in folds], device), out=x)
    else:
        counts = torch.add(_cached_arange(_COUNTS, m, device, mixed=False), pair)
        torch.bitwise_xor(counts.unsqueeze(0), _column(folds, device), out=x)
        _xorshift_rows(x, _SHIFT16, _LOW16, t)
    x.mul_(_MUL1)
    _xorshift_rows(x, _SHIFT15, _LOW17, t)
    x.mul_(_MUL2)
    _xorshift_rows(x, _SHIFT16, _LOW16, t)
    return x


def _xorshift_rows(x: torch.Tensor, shift: torch.Tensor, low: torch.Tensor, t: torch.Tensor) -> None:
    """``x ^= (x >> shift) & low`` (a logical shift of the int32 words), one row at a time: the
    temporary ``t`` stays one row long."""
    for row in x.unbind():
        row.bitwise_xor_(torch.bitwise_right_shift(row, shift, out=t).bitwise_and_(low))


def _column(values: list[int], device: torch.device) -> torch.Tensor | int:
    """32-bit patterns as an int32 column that broadcasts over a ``(len(values), n)`` tensor
    (a plain int for one value)."""
    if len(values) == 1:
        return as_int32(values[0])
    column = torch.frombuffer(array.array("i", [as_int32(v) for v in values]), dtype=torch.int32).unsqueeze(1)
    return column if device.type == "cpu" else column.to(device)


@dataclass(frozen=True)
class ElementIndex:
    """Where the elements of a local tensor sit in the whole parameter, for the random streams.

    Local flat element ``j`` has the global index::

        offset + ((start + j) // block) * stride + (start + j) % block      (block > 0)
        offset + start + j                                                  (block == 0)

    ``block == 0`` is a contiguous range (a whole tensor, a chunk of one, a ``Shard(0)`` shard).
    A shard along dimension ``d > 0`` of a row-major tensor is a run of ``block`` local elements
    (the product of the local sizes from ``d`` on) every ``stride`` global elements (the product
    of the global sizes from ``d`` on), starting at ``offset``. ``start`` moves along the local
    tensor when it is cut into chunks.

    The fields are not checked: they are computed by lowp from the tensor's placement.

    Args:
        offset: global index of the local tensor's first element (default 0), >= 0.
        start: local flat position where this piece starts (default 0), >= 0.
        block: contiguous local elements per run, or 0 (default) for one contiguous range.
        stride: global elements between the starts of two runs (unused when ``block == 0``;
            default 0), at least ``block``.
    """

    offset: int = 0
    start: int = 0
    block: int = 0
    stride: int = 0

    @property
    def contiguous(self) -> bool:
        """True when the global indices of the local elements are one contiguous range."""
        return self.block == 0

    def first(self) -> int:
        """Global index of local element 0 (for a contiguous range: of every element, plus ``j``)."""
        return self.global_index(0)

    def global_index(self, j: int) -> int:
        """Global index of local flat element ``j``."""
        k = self.start + j
        return self.offset + k if self.block == 0 else self.offset + (k // self.block) * self.stride + k % self.block

    def shifted(self, n: int) -> "ElementIndex":
        """The index of the local tensor that starts ``n`` elements further on (a chunk)."""
        return ElementIndex(self.offset, self.start + n, self.block, self.stride)

    def tensor(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global indices of local elements ``0 .. n-1`` as an int64 tensor."""
        k = torch.arange(self.start, self.start + n, dtype=torch.int64, device=device)
        if self.block == 0:
            return k + self.offset
        return (k // self.block) * self.stride + k % self.block + self.offset

    def random16(self, n: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The random bits of local elements ``0 .. n-1`` in the stream ``key`` (int32, 16 bits each)."""
        if self.contiguous:
            return random16_range(self.first(), n, key, device)
        return random16(self.tensor(n, device), key)


@dataclass(frozen=True)
class RandomStreams:
    """The random streams of one (local piece of a) parameter at one step: what a write-back or
    a state store needs to round stochastically.

    Args:
        seed: the optimizer's seed, any int (only its low 64 bits count).
        step: the parameter's step counter, any int (low 64 bits).
        param_id: the parameter's position in the optimizer, any int (low 64 bits); with
            ``seed`` and ``step`` it selects independent streams per parameter.
        index: where the local elements sit in the whole parameter (default: the whole tensor,
            from global index 0).
    """

    seed: int
    step: int
    param_id: int
    index: ElementIndex = ElementIndex()
    _ahead: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @functools.cached_property
    def _mix(self) -> int:
        return _parameter_mix(self.seed, self.step, self.param_id)

    def key(self, stream: int) -> int:
        """:func:`stream_key` of ``stream`` (the shared inputs mixed once per instance)."""
        return _splitmix64(self._mix ^ (stream & _MASK64)) & _MASK32

    def prefetch(self, streams: list[int], n: int, device: torch.device | str = "cpu",
                 scratch: Scratch | None = None) -> None:
        """Draw the bits of ``n`` elements of several streams together (:func:`random16_ranges`:
        one pass per hash operation for all of them), into ``scratch``'s buffers when one is
        given; the next :meth:`bits` call of each of these streams for ``n`` elements hands
        them out (once: the caller may overwrite them)."""
        streams = list(dict.fromkeys(streams))
        if len(streams) < (1 if scratch is not None else 2) or not self.index.contiguous:
            return
        rows = random16_ranges(self.index.first(), n, [self.key(s) for s in streams], device, scratch)
        self._ahead.update(zip(streams, rows.unbind()))

    def bits(self, stream: int, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu"
             ) -> torch.Tensor:
        """16 random bits (int32) per element of a tensor of ``shape`` (row-major order)."""
        n = math.prod(shape)
        drawn = self._ahead.pop(stream, None)
        if drawn is None or drawn.numel() != n or drawn.device != torch.device(device):
            drawn = self.index.random16(n, self.key(stream), device)
        return drawn if drawn.shape == shape else drawn.view(shape)
