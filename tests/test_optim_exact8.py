"""Write-back mode ``exact8`` (lowp.optim.writeback): a bf16 weight plus an int8 remainder that
hold an fp32 value whose low 8 bits are zero, the low bits of each new value rounded
stochastically. The split, its unbiasedness, special values, folds between modes and the
checks; bit-identity of every backend is in test_registry.py and test_fused_*.py."""
from __future__ import annotations

import pytest
import torch

import lowp.optim as lo
from lowp.optim.randomness import RandomStreams, Stream
from lowp.optim.writeback import MODES, ensure_buffer, store_nearest_pair8

EXACT8 = MODES["exact8"]


def patterns(values: list[int]) -> torch.Tensor:
    """fp32 tensor of the given 32-bit patterns (unsigned ints)."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32).view(torch.float32)


def bits(x: torch.Tensor) -> list[int]:
    """The unsigned 32-bit patterns of an fp32 tensor."""
    return [v & 0xFFFFFFFF for v in x.contiguous().view(torch.int32).tolist()]


def write(u: torch.Tensor, seed: int = 0, start: float = -0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One exact8 write-back of ``start + u`` (from the pair of ``start``): (weight, remainder,
    stalled count)."""
    p = torch.full(u.shape, start, dtype=torch.bfloat16)
    r8 = EXACT8.init_buffer(p)
    stalled = EXACT8.apply(p, EXACT8.load(p, r8), u.clone(), r8, RandomStreams(seed, 1, 0), True)
    return p, r8, int(stalled)


def random_patterns(n: int, seed: int) -> torch.Tensor:
    """Finite fp32 values of every sign and binade (subnormals included), low 8 bits zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1 << 31, (n,), generator=g, dtype=torch.int64)
    x = x % (0x7F800000) | (torch.randint(0, 2, (n,), generator=g) << 31)
    return patterns([v & ~0xFF for v in x.tolist()])


def test_values_with_eight_zero_low_bits_split_exactly():
    x = torch.cat([random_patterns(1 << 14, 0), torch.tensor([0.0, -0.0, 1.0, -3.0, 2.0 ** -149 * 256])])
    folded = (torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int8))
    store_nearest_pair8(*folded, x)                # the fold of a mode switch: also exact here
    for p, r8 in (write(x)[:2], folded):
        assert bits(EXACT8.load(p, r8)) == bits(x)
        assert int(r8.min()) >= -128 and int(r8.max()) <= 127
        # the visible weight is the value rounded to the nearest bf16 (ties away from zero)
        finite = x.bfloat16().isfinite()
        err = (x.double() - p.double()).abs()[finite]
        assert (err <= (x.double() - x.bfloat16().double()).abs()[finite]).all()


def test_only_the_low_eight_bits_are_rounded_with_the_top_of_the_weight_stream():
    """``b2 = (b + (random16 >> 8)) & ~0xFF``: a value half-way between two pairs goes up half the time."""
    n = 1 << 14
    u = patterns([0x3F801080] * n)          # 1.0000..., low 8 bits 0x80
    p, r8, stalled = write(u, seed=4)
    noise = RandomStreams(4, 1, 0).bits(Stream.WEIGHT, (n,)) >> 8
    want = [(0x3F801080 + k) & ~0xFF for k in noise.tolist()]
    assert bits(EXACT8.load(p, r8)) == want
    up = sum(v == 0x3F801100 for v in want) / n
    assert abs(up - 0.5) < 4 * (0.25 / n) ** 0.5
    assert stalled == 0


def test_decoupled_decay_below_the_remainder_unit_is_unbiased():
    """lr * wd = 1e-5 with zero gradients: each step changes a weight by 1e-5 of itself, below half
    the pair's unit (2**-16 to 2**-17 of the weight) for most weights. The pair's mean relative
    drift matches an fp32 AdamW within a few standard errors; bf16 nearest stalls completely, and
    the same pair rounded to nearest (instead of stochastically) is far off."""
    n, steps, lr, wd = 4096, 100, 1e-3, 1e-2
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()

    def run(mode, dtype):
        p = w0.to(dtype, copy=True).requires_grad_()
        opt = lo.AdamW([p], lr=lr, weight_decay=wd, mode=mode, seed=2)
        p.grad = torch.zeros_like(p)
        for _ in range(steps):
            opt.step()
        buf = opt.state[p].get("remainder8")
        return (EXACT8.load(p.detach(), buf) if buf is not None else p.detach().float()).double()

    fp32 = run("nearest", torch.float32)
    drift32 = fp32 / w0.double() - 1
    assert float(drift32.mean()) == pytest.approx(-(1 - (1 - lr * wd) ** steps), rel=1e-3)
    diff = run("exact8", torch.bfloat16) / w0.double() - 1 - drift32
    se = float(diff.std()) / n ** 0.5
    assert 0 < se < 1e-5 and abs(float(diff.mean())) < 4 * se
    assert torch.equal(run("nearest", torch.bfloat16), w0.double())   # every update rounded away

    held = w0.float()                                  # the pair rounded to nearest at every step
    p, r8 = w0.clone(), EXACT8.init_buffer(w0)
    for _ in range(steps):
        store_nearest_pair8(p, r8, held - (lr * wd) * held)
        held = EXACT8.load(p, r8)
    assert abs(float((held.double() / w0.double() - 1 - drift32).mean())) > 50 * se


def test_infinities_nans_and_the_largest_float():
    n = 1 << 14
    for value, pair in ((float("inf"), 0x7F800000), (float("-inf"), 0xFF800000)):
        p, r8, stalled = write(torch.full((n,), value))
        assert set(bits(EXACT8.load(p, r8))) == {pair} and (r8 == 0).all() and stalled == 0
        assert write(torch.zeros(n), start=value)[2] == n      # inf + 0: the pair did not change

    # NaNs take the quiet bit instead of the carry (which could reach the exponent), then drop
    # their low 8 bits; the payload above them survives
    for payload in (0x7FC000FF, 0xFFC012FF, 0x7F8000FF):
        u = patterns([payload] * n)
        total = torch.full((n,), -0.0) + u
        want = [(b | 0x00400000) & ~0xFF for b in bits(total)]
        p, r8, _ = write(u)
        assert bits(EXACT8.load(p, r8)) == want and p.isnan().all()

    # the largest fp32: up to infinity with probability 255/256, else the largest pair, whose
    # bf16 half rounds to infinity (ties away, as exact mode) with the remainder -1
    p, r8, _ = write(torch.full((n,), torch.finfo(torch.float32).max))
    got = bits(EXACT8.load(p, r8))
    assert set(got) <= {0x7F800000, 0x7F7FFF00}
    down = got.count(0x7F7FFF00)
    assert abs(down - n / 256) < 5 * (n / 256) ** 0.5
    assert p.isinf().all() and set(r8[torch.tensor([v == 0x7F7FFF00 for v in got])].tolist()) == {-1}


def _nearest_pair(x: torch.Tensor) -> list[int]:
    return [((b + 0x80) & ~0xFF) & 0xFFFFFFFF for b in bits(x)]


def test_mode_switches_fold_the_held_value():
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(4000, generator=g).bfloat16()
    ulp = (theta.float().abs() * 2.0 ** -8)

    k = (torch.rand(4000, generator=g) - 0.5).mul(ulp).bfloat16()        # kahan -> exact8: the nearest pair
    state = {"compensation": k}
    p = theta.clone()
    ensure_buffer(p, state, EXACT8)
    assert list(state) == ["remainder8"]
    assert bits(EXACT8.load(p, state["remainder8"])) == _nearest_pair(theta.float() + k.float())

    r16 = torch.randint(-1 << 15, 1 << 15, (4000,), generator=g, dtype=torch.int16)   # exact -> exact8
    state, p = {"remainder": r16}, theta.clone()
    held = MODES["exact"].load(p, r16)
    ensure_buffer(p, state, EXACT8)
    assert bits(EXACT8.load(p, state["remainder8"])) == _nearest_pair(held)

    r8 = torch.randint(-128, 128, (4000,), generator=g, dtype=torch.int8)           # exact8 -> exact: exact
    held = EXACT8.load(theta, r8)
    state, p = {"remainder8": r8.clone()}, theta.clone()
    ensure_buffer(p, state, MODES["exact"])
    assert list(state) == ["remainder"] and bits(MODES["exact"].load(p, state["remainder"])) == bits(held)

    state, p = {"remainder8": r8.clone()}, theta.clone()                               # exact8 -> kahan
    ensure_buffer(p, state, MODES["kahan"])
    assert torch.equal(p, theta) and torch.equal(state["compensation"], (held - theta.float()).bfloat16())

    for mode in ("nearest", "stochastic"):                                              # dropped
        state, p = {"remainder8": r8.clone()}, theta.clone()
        ensure_buffer(p, state, MODES[mode])
        assert state == {} and torch.equal(p, theta)


def test_a_group_switched_to_exact8_keeps_training():
    p = torch.randn(300).bfloat16().requires_grad_()
    opt = lo.AdamW([p], lr=1e-2, mode="exact")
    for mode in ("exact", "exact8", "kahan", "exact8"):
        opt.param_groups[0]["mode"] = mode
        p.grad = torch.randn(300).bfloat16()
        opt.step()
        assert [n for n in opt.state[p] if n in ("remainder", "remainder8", "compensation")] == \
            [MODES[mode].buffer_name]
    assert opt.state[p]["remainder8"].dtype == torch.int8


def test_bad_remainders_and_fp16_weights_are_refused():
    with pytest.raises(TypeError, match="exact8"):
        lo.AdamW([torch.zeros(4, dtype=torch.float16, requires_grad=True)], mode="exact8").step()
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = lo.AdamW([p], lr=1e-2, mode="exact8")
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    before = (p.detach().clone(), opt.state[p]["remainder8"].clone())
    for bad in (torch.zeros(4, dtype=torch.int16), torch.zeros(5, dtype=torch.int8), torch.zeros(4)):
        sd["state"][0]["remainder8"] = bad
        with pytest.raises((TypeError, ValueError), match="remainder8"):
            opt.load_state_dict(sd)
    assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["remainder8"], before[1])
