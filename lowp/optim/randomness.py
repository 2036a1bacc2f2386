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

``random16`` hashes the low 32 bits of ``i`` with the key, after folding the high 32 bits into the
key, so elements ``i`` and ``i + 2**32`` draw different bits::

    random16(i, key) = hash32(lo32(i) ^ key ^ hash32(hi32(i))) >> 16      (hash32(0) = 0)

``hash32`` is an xor-shift-multiply integer mixer (constants from C. Wellons' "hash prospector",
2018, a low-bias 32-bit mixer); ``stream_key`` mixes its inputs with SplitMix64's finalizer
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["Stream", "stream_key", "stream_keys", "hash32_int", "random16_int", "hash32", "random16",
           "random16_range", "fold_key", "ElementIndex", "RandomStreams"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


class Stream:
    """Stream numbers of one parameter: the weight's rounding, the Kahan compensation's, then
    one per optimizer state (``STATE + i`` for the ``i``-th state name)."""

    WEIGHT = 0
    COMPENSATION = 1
    STATE = 2


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


def fold_key(key: int, hi: int) -> int:
    """``key ^ hash32(hi)``: the key that :func:`random16` applies to the low 32 bits of every index
    whose high 32 bits are ``hi`` (so a range of indices with one ``hi`` needs only 32-bit math)."""
    return (key ^ hash32_int(hi)) & _MASK32


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
    return hash32_int((index & _MASK32) ^ key ^ hash32_int(index >> 32)) >> 16


def _as_int32(value: int) -> int:
    """A 32-bit pattern as the signed value torch's int32 holds."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def hash32(x: torch.Tensor) -> torch.Tensor:
    """:func:`hash32_int` elementwise on an int32 tensor (wrap-around products; the masks make the
    arithmetic shifts logical, so the bits equal the uint32 version in C++ and Triton)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _as_int32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _as_int32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def random16(index: torch.Tensor, key: int) -> torch.Tensor:
    """:func:`random16_int` elementwise on an int64 tensor of global indices; int32 result in
    ``[0, 2**16)``."""
    lo = (index & _MASK32).to(torch.int32)   # int64 -> int32 keeps the low 32 bits (two's complement)
    hi = hash32((index >> 32).to(torch.int32))
    return (hash32(lo ^ hi ^ _as_int32(key)) >> 16) & 0xFFFF


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counts(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` as int32, from a per-device cache that grows to the largest ``n`` asked for
    (an add from a cached tensor is about twice as fast as a fresh ``arange`` on CPU)."""
    cached = _COUNTS.get(device)
    if cached is None or cached.numel() < n:
        cached = _COUNTS[device] = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
    return cached[:n]


def random16_range(first: int, n: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``random16(arange(first, first + n), key)`` (int32) with 32-bit arithmetic only.

    The range is cut where the low 32 bits of the index cross a multiple of ``2**31``: within a
    piece the int32 counts do not wrap and the high bits are constant, so their hash is folded
    into the key once (:func:`fold_key`); a piece that starts at a multiple of a power of two at
    least its length (chunks of whole tensors) xors its counts in instead of adding them. The
    last xor-shift of ``hash32`` leaves the top 16 bits unchanged, so it is skipped:
    ``random16 = (x >> 16) & 0xFFFF`` with ``x`` the value after the second multiply.
    """
    x = torch.empty(n, dtype=torch.int32, device=device)
    j = 0
    while j < n:
        index = first + j
        lo = index & _MASK32
        end = min(n, j + (1 << 31) - (lo & 0x7FFFFFFF))
        piece, fold = x[j:end], _as_int32(fold_key(key, index >> 32))
        if lo & ((1 << (end - j - 1).bit_length()) - 1) == 0:
            # lo + k == lo ^ k for every k < end - j (lo has no bits below that power of two): one pass
            torch.bitwise_xor(_counts(end - j, x.device), _as_int32(lo) ^ fold, out=piece)
        else:
            torch.add(_counts(end - j, x.device), _as_int32(lo), out=piece).bitwise_xor_(fold)
        j = end
    t = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF))
    x.mul_(_as_int32(0x7FEB352D))
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=t).bitwise_and_(0x1FFFF))
    x.mul_(_as_int32(0x846CA68B))
    return x.bitwise_right_shift_(16).bitwise_and_(0xFFFF)


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

    @functools.cached_property
    def _mix(self) -> int:
        return _parameter_mix(self.seed, self.step, self.param_id)

    def key(self, stream: int) -> int:
        """:func:`stream_key` of ``stream`` (the shared inputs mixed once per instance)."""
        return _splitmix64(self._mix ^ (stream & _MASK64)) & _MASK32

    def bits(self, stream: int, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu"
             ) -> torch.Tensor:
        """16 random bits (int32) per element of a tensor of ``shape`` (row-major order)."""
        return self.index.random16(math.prod(shape), self.key(stream), device).view(shape)
