"""Counter-based random bits: the tensor versions equal the pure-integer reference, the index map
of sharded and chunked tensors equals a direct enumeration, and the bits are uniform."""
from __future__ import annotations

import torch

from lowp.optim.randomness import (ElementIndex, RandomStreams, Stream, fold_key, hash32_int, random16,
                                    random16_int, random16_range, stream_key, stream_keys)


def test_random16_matches_the_integer_reference_across_the_64_bit_range():
    starts = [0, (1 << 31) - 5, (1 << 32) - 5, 3 << 32, (1 << 62) + 12345]
    index = torch.tensor([s + d for s in starts for d in range(10)], dtype=torch.int64)
    for key in (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, stream_key(7, 3, 2, Stream.WEIGHT)):
        got = random16(index, key).tolist()
        assert got == [random16_int(int(i), key) for i in index]


def test_elements_two_to_the_32_apart_draw_different_bits():
    i = torch.arange(4096, dtype=torch.int64)
    key = stream_key(0, 1, 0, Stream.WEIGHT)
    assert (random16(i, key) != random16(i + (1 << 32), key)).float().mean() > 0.99


def test_stream_keys_differ_by_every_input():
    base = (5, 10, 3, Stream.STATE)
    keys = {stream_key(*base)}
    for pos in range(4):
        for delta in (1, 2):
            args = list(base)
            args[pos] += delta
            keys.add(stream_key(*args))
    assert len(keys) == 9
    assert all(0 <= k < 1 << 32 for k in keys)


def test_bits_are_uniform():
    bits = random16(torch.arange(1 << 16, dtype=torch.int64), stream_key(0, 1, 0, 0))
    counts = torch.bincount(bits >> 12, minlength=16).double()   # 16 bins of 4096 expected
    chi2 = float(((counts - 4096) ** 2 / 4096).sum())
    assert chi2 < 40   # 15 degrees of freedom: p < 1e-3 above 37.7
    assert 0.45 < float((bits & 1).double().mean()) < 0.55


def test_element_index_of_a_shard_along_dim_1_enumerates_the_global_positions():
    full = torch.arange(6 * 10 * 4).reshape(6, 10, 4)
    local = full[:, 3:7, :]                    # a Shard(1) piece: columns 3..6 of 10
    index = ElementIndex(offset=3 * 4, block=4 * 4, stride=10 * 4)
    assert index.tensor(local.numel()).tolist() == local.reshape(-1).tolist()
    chunk = index.shifted(20)
    assert chunk.tensor(30).tolist() == local.reshape(-1)[20:50].tolist()
    assert [chunk.global_index(j) for j in range(30)] == local.reshape(-1)[20:50].tolist()
    assert ElementIndex(offset=100).shifted(5).tensor(3).tolist() == [105, 106, 107]
    assert ElementIndex(offset=100).contiguous and not index.contiguous


def test_random16_range_equals_random16_across_2_31_and_2_32_boundaries():
    """The int32 fast path (pieces cut at multiples of 2**32, high bits folded into the key, xor of
    counts for aligned pairs, add otherwise, odd and even starts) draws the bits of random16 on the
    int64 indices."""
    key = stream_key(1, 2, 3, Stream.COMPENSATION)
    for first in (0, 1000, 1 << 17, (1 << 31) - 7, (1 << 32) - 100, 1 << 32, (5 << 32) - 3, (3 << 31) - 1):
        for n in (1, 16, 300, (1 << 12) + 3):
            want = random16(torch.arange(first, first + n, dtype=torch.int64), key)
            assert torch.equal(random16_range(first, n, key), want), (first, n)


def test_stream_keys_and_random_streams_use_the_same_keys_and_indices():
    assert stream_keys(9, 4, 2, 5) == [stream_key(9, 4, 2, s) for s in range(5)]
    shard = ElementIndex(offset=3 * 4, block=4 * 4, stride=10 * 4).shifted(5)
    streams = RandomStreams(9, 4, 2, shard)
    key = stream_key(9, 4, 2, Stream.STATE)
    assert torch.equal(streams.bits(Stream.STATE, (3, 7)).reshape(-1), random16(shard.tensor(21), key))
    contiguous = RandomStreams(9, 4, 2, ElementIndex(offset=(1 << 32) - 10))
    assert torch.equal(contiguous.bits(Stream.WEIGHT, (20,)),
                       random16(torch.arange((1 << 32) - 10, (1 << 32) + 10), stream_key(9, 4, 2, Stream.WEIGHT)))


def test_the_two_elements_of_a_pair_take_the_halves_of_one_hash():
    """random16's definition: elements 2k and 2k + 1 read hash32(lo32(p) ^ key ^ hash32(hi32(p)))
    of their pair p = k, low half first; per 2**32 elements of one high half the backends xor
    lo32(i) // 2 with fold_key (the pair's top bit and high half folded into the key)."""
    key = stream_key(3, 1, 4, Stream.STATE)
    for first in (0, 1 << 20, (1 << 32) - 2, (7 << 32) + 10, (1 << 33) - 4, (5 << 61) + 6):
        for k in range(4):
            i = first + 2 * k
            pair = i >> 1
            h = hash32_int((pair & 0xFFFFFFFF) ^ key ^ hash32_int(pair >> 32))
            assert (random16_int(i, key), random16_int(i + 1, key)) == (h & 0xFFFF, h >> 16)
            assert h == hash32_int(((i & 0xFFFFFFFF) >> 1) ^ fold_key(key, i >> 32))


def _unhash32(x: int) -> int:
    """The inverse of hash32 (each of its steps is invertible: an xor-shift by s >= 16 is its own
    inverse, the multipliers are odd)."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 1 << 32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 1 << 32)) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_is_a_bijection_so_a_pairs_halves_are_uniform_and_independent_over_a_full_period():
    """hash32 has an inverse (checked on a sample of words): over the 2**32 pairs of one high half
    of the pair index, whose hash inputs are every 32-bit word once, the hashes are every word
    once, so the (low, high) halves take every combination of values exactly once."""
    gen = torch.Generator().manual_seed(0)
    words = [0, 1, 0xFFFFFFFF, 0x80000000] + torch.randint(0, 1 << 32, (2000,), generator=gen,
                                                           dtype=torch.int64).tolist()
    assert all(_unhash32(hash32_int(w)) == w for w in words)


def test_the_halves_of_a_pair_are_independent_and_unbiased_on_a_tensor():
    """On 2**20 pairs of one stream: the joint histogram of the top 4 bits of the two elements of a
    pair (256 cells) and each element's mean fit independent uniform 16-bit draws."""
    bits = random16(torch.arange(1 << 21, dtype=torch.int64) + 12345678, stream_key(0, 1, 0, Stream.STATE))
    even, odd = bits[0::2], bits[1::2]   # 12345678 is even: the pairs are (even, odd)
    cells = torch.bincount((even >> 12) * 16 + (odd >> 12), minlength=256).double()
    expected = (1 << 20) / 256
    chi2 = float(((cells - expected) ** 2 / expected).sum())
    assert chi2 < 330   # 255 degrees of freedom: p < 1e-3 above 330.5
    for half in (even, odd):
        assert abs(float(half.double().mean()) - 32767.5) < 4 * 18918 / 1024   # 4 sigma of 2**20 draws
    assert abs(float(torch.corrcoef(torch.stack([even.double(), odd.double()]))[0, 1])) < 4 / 1024


def test_a_big_endian_host_reads_the_same_halves(monkeypatch):
    """random16_ranges reads the hashes' 16-bit halves through the int32 words' bytes on a
    little-endian host and by shifts otherwise: both give random16's bits."""
    import sys
    key = stream_key(2, 7, 1, Stream.STATE)
    want = random16(torch.arange(999, 999 + 301, dtype=torch.int64), key)
    monkeypatch.setattr(sys, "byteorder", "big")
    assert torch.equal(random16_range(999, 301, key), want)
