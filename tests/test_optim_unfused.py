"""The unfused (reference) step's building blocks against their definitions: the bf16 stochastic
store with and without NaNs, random bits of several streams at once, the zero count, the exact
mode's split, the scratch buffers, gradient factors on gradients the step must not touch, and the
finite check."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import lowp.optim as lo
from lowp.optim.randomness import ElementIndex, RandomStreams, random16, random16_range, random16_ranges, stream_key
from lowp.optim.scratch import Scratch
from lowp.optim.storage import _has_nan, store_stochastic_bf16
from lowp.optim.writeback import MODES
from lowp.optim.writeback.mode import unmoved


pytestmark = pytest.mark.usefixtures("one_thread")


def _every_bf16_with_low_halves() -> np.ndarray:
    """Every bf16 pattern (NaNs, infinities, subnormals included) as the top half of fp32 words,
    each with the low halves 0, 1, 0x7FFF, 0x8000 and 0xFFFF: uint32 bit patterns."""
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    return (top[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], dtype=np.uint32)).reshape(-1)


def _sr_reference(bits: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """storage.py's definition on uint32 patterns: ``(b + r) >> 16``, and ``(b | quiet) >> 16`` for NaNs."""
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    carried = ((bits.astype(np.uint64) + noise) >> 16) & 0xFFFF
    return np.where(nan, (bits | 0x00400000) >> 16, carried).astype(np.uint16)


def _store(bits: np.ndarray, noise: torch.Tensor) -> np.ndarray:
    src = torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    store_stochastic_bf16(dst, src, noise.clone())
    return dst.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("kind", ["positive", "negative", "NaN", "inf - inf"])
def test_bf16_stochastic_store_gives_the_defined_bits_on_either_path(kind):
    """Without a NaN (all signs alike, so the fp32 sum cannot be inf - inf) the store takes the
    integer fast path, with one (or with +inf and -inf, whose sum is NaN too) the fix-up path;
    both give the bits of the definition."""
    bits = _every_bf16_with_low_halves()
    nan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x007FFFFF) != 0)
    if kind in ("positive", "negative"):
        bits = bits[~nan & ((bits >> 31) == (kind == "negative"))]
    elif kind == "inf - inf":
        bits = np.array([0x7F800000, 0xFF800000, 0x3F80FFFF, 0xBF808000], dtype=np.uint32)
    noise = random16_range(0, bits.size, stream_key(3, 1, 0, 2))
    src = torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    assert _has_nan(src) == (kind not in ("positive", "negative"))
    assert np.array_equal(_store(bits, noise), _sr_reference(bits, noise.numpy().astype(np.uint64)))


def test_bf16_stochastic_store_keeps_bf16_values_whatever_the_noise():
    """A value with zero low bits is a bf16 already: every noise leaves it as it is, equal to
    torch's and ml_dtypes' casts (NaNs aside, whose payload the casts do not keep)."""
    bits = (np.arange(1 << 16, dtype=np.uint32) << 16)
    finite = (bits & 0x7F800000) != 0x7F800000
    values = bits[finite].view(np.float32)
    for noise in (torch.zeros(values.size, dtype=torch.int32), torch.full((values.size,), 0xFFFF, dtype=torch.int32),
                  random16_range(7, values.size, 12345)):
        got = _store(bits[finite], noise)
        assert np.array_equal(got, torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16))
        assert np.array_equal(got, values.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("scratch", [False, True])
def test_random16_ranges_draw_each_keys_bits(scratch):
    """Several keys at once equal random16 per key: aligned starts (the cached first xor-shift),
    unaligned ones (full mix) and ranges across 2**31 and 2**32."""
    keys = [stream_key(1, 2, 3, s) for s in range(3)]
    buffers = Scratch() if scratch else None
    for first, n in [(0, 1), (0, 4096), (1 << 17, 1 << 17), (1000, 3000), ((1 << 31) - 7, 300), ((1 << 32) - 100, 333),
                     ((5 << 32) + (1 << 20), 1 << 12), ((3 << 31) - 1, 2)]:
        got = random16_ranges(first, n, keys, scratch=buffers)
        for row, key in zip(got, keys):
            assert torch.equal(row, random16(torch.arange(first, first + n), key)), (first, n)
        assert torch.equal(random16_range(first, n, keys[1]), got[1])


def test_prefetched_bits_are_the_drawn_bits_handed_out_once():
    index = ElementIndex(offset=5000)
    streams = RandomStreams(9, 4, 2, index)
    streams.prefetch([2, 1, 3], 600, "cpu", Scratch())
    want = {s: random16(index.tensor(600), stream_key(9, 4, 2, s)) for s in (1, 2, 3)}
    first = streams.bits(1, (20, 30))
    assert first.shape == (20, 30) and torch.equal(first.reshape(-1), want[1])
    first.zero_()                                        # consumers overwrite the bits they get
    assert torch.equal(streams.bits(1, (600,)), want[1])  # drawn again, not the overwritten row
    assert torch.equal(streams.bits(3, (600,)), want[3]) and torch.equal(streams.bits(2, (600,)), want[2])


def test_zero_count_matches_count_nonzero_on_special_values():
    values = torch.tensor([0.0, -0.0, 1e-45, -1e-45, float("inf"), -float("inf"), float("nan"), 1.0, -2.0, 0.0])
    want = values.numel() - torch.count_nonzero(values)
    assert int(unmoved(values.clone())) == int(want) == 3
    assert int(unmoved(values.double())) == 3


def test_exact_split_keeps_the_low_half_and_rounds_the_high_half_ties_away():
    """``hi = (b + 2**15) >> 16`` and ``lo = b - hi * 2**16`` in int32 arithmetic (wrapping near
    0x7FFF8000), for random patterns and the edges."""
    gen = torch.Generator().manual_seed(0)
    b = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=gen, dtype=torch.int32)
    b[:6] = torch.tensor([0x7FFF8000, 0x7FFF7FFF, -1, -(1 << 31), 0x00008000, 0x3F808000], dtype=torch.int32)
    p, r = torch.empty(b.shape, dtype=torch.bfloat16), torch.empty(b.shape, dtype=torch.int16)
    MODES["exact"].apply(p, torch.full(b.shape, -0.0), b.view(torch.float32).clone(), r, None, False)
    n = torch.add(-0.0, b.view(torch.float32)).view(torch.int32).numpy().astype(np.int64)   # -0 + x quiets NaNs
    hi = (((n + (1 << 15)) & 0xFFFFFFFF) >> 16).astype(np.uint16)
    lo = ((n - (hi.astype(np.int64) << 16)) & 0xFFFF).astype(np.uint16)
    assert np.array_equal(p.view(torch.int16).numpy().view(np.uint16), hi)
    assert np.array_equal(r.numpy().view(np.uint16), lo)


def test_scratch_hands_out_disjoint_views_and_reuses_its_memory():
    scratch = Scratch()
    a, b = scratch.split("x", [(3, 4), (5,)], torch.float32, torch.device("cpu"))
    assert a.shape == (3, 4) and b.shape == (5,) and a.is_contiguous()
    assert b.data_ptr() == a.data_ptr() + 12 * 4
    again = scratch.take("x", (10,), torch.float32, torch.device("cpu"))
    assert again.data_ptr() == a.data_ptr()                               # same memory for the next chunk
    other = scratch.take("y", (10,), torch.float32, torch.device("cpu"))
    assert other.data_ptr() != a.data_ptr()
    bigger = scratch.take("x", (100,), torch.float32, torch.device("cpu"))  # grows
    assert bigger.numel() == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["eager", "foreach"])
def test_gradient_factors_leave_the_gradients_alone(backend, dtype):
    """maximize multiplies the working copy of the gradient: in place when it is a copy (bf16),
    out of place when it is the gradient itself (fp32). The step equals one on the negated
    gradients, and the gradients stay as they were."""
    shapes = [(300,), (17, 3)]
    gen = torch.Generator().manual_seed(0)
    steps = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]

    def run(maximize: bool) -> list[torch.Tensor]:
        params = [(torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype).requires_grad_()
                  for s in shapes]
        opt = lo.AdamW(params, maximize=maximize, backend=backend, chunk_size=128, seed=0)
        for grads in steps:
            for p, g in zip(params, grads):
                p.grad = g.clone() if maximize else -g
            opt.step()
            assert not maximize or all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        return params

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finite_flags_sum_first_and_check_what_the_sum_cannot_clear(dtype):
    """NaNs and infinities (alone, or +inf with -inf) are found; gradients whose sum leaves the
    dtype's range but whose elements are finite are cleared by the exact check."""
    from lowp.optim.backends import ForeachBackend
    big = torch.finfo(dtype).max
    grads = [torch.ones(1000, dtype=dtype), torch.tensor([1.0, float("nan")], dtype=dtype),
             torch.tensor([float("inf"), 2.0], dtype=dtype), torch.tensor([float("inf"), -float("inf")], dtype=dtype),
             torch.full((8,), big, dtype=dtype), torch.tensor([big, -big, big], dtype=dtype),
             torch.zeros(0, dtype=dtype)]
    assert ForeachBackend().finite_flags(grads) == [True, False, False, False, True, True, True]
