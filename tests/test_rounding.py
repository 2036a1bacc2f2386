"""quantize: bit-exact against torch's casts, ml_dtypes and a from-the-definition reference, for
every value, every midpoint and one container ulp either side of each midpoint."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowp.codec import all_values
from lowp.formats import PRESETS, FloatFormat, custom_format, get_format
from lowp.rounding import (ROUNDING_MODES, _native_cast_matches, _round, canonical_mode, container_for, fits_in,
                           quantize, quantize_ste)
from rounding_reference import bits_equal, neighbours, probe_points, reference_round, stochastic_up_probability

DETERMINISTIC = [m for m in ROUNDING_MODES if m != "stochastic"]
# every preset but fp64, fp32; tf32 (2**19 codes, 2M probe points) has its own, slow-marked test
ENUMERABLE = [name for name, f in PRESETS.items() if f.bits <= 16]
TORCH_DTYPES = ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"]
# lowp format -> ml_dtypes type (with the overflow policy ml_dtypes uses)
ML_DTYPES = {
    "fp16": (np.float16, None),
    "bf16": (ml_dtypes.bfloat16, None),
    "fp8_e4m3fn": (ml_dtypes.float8_e4m3fn, "nan"),   # ml_dtypes: overflow -> NaN; torch saturates
    "fp8_e5m2": (ml_dtypes.float8_e5m2, None),
    "fp8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, None),
    "fp8_e5m2fnuz": (ml_dtypes.float8_e5m2fnuz, None),
    "fp6_e2m3": (ml_dtypes.float6_e2m3fn, None),
    "fp6_e3m2": (ml_dtypes.float6_e3m2fn, None),
    "fp4_e2m1": (ml_dtypes.float4_e2m1fn, None),
    "ieee_e4m3": (ml_dtypes.float8_e4m3, None),        # IEEE-style custom formats
    "ieee_e3m4": (ml_dtypes.float8_e3m4, None),
}


def _fmt(name: str):
    """Preset by name; ``ieee_eXmY`` is the IEEE-style custom format (``e4m3`` alone is fp8_e4m3fn)."""
    if name.startswith("ieee_e"):
        e, m = name[len("ieee_e"):].split("m")
        return custom_format(int(e), int(m))
    return get_format(name)


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    ok = bits_equal(got, want)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()[:5]
        rows = [(float(x[i]), float(got[i]), float(want[i])) for i in bad]
        raise AssertionError(f"{what}: {int((~ok).sum())} mismatches, first (x, got, want): {rows}")


# ---- against the reference, every mode ------------------------------------------------------
@pytest.mark.parametrize("name", ENUMERABLE)
@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_every_mode_matches_reference_on_every_value_and_midpoint(name, mode):
    fmt = get_format(name)
    x = probe_points(fmt, torch.float32)
    got = quantize(x, fmt, mode, native=False)
    assert got.dtype == torch.float32
    _assert_bits_equal(got, reference_round(x, fmt, mode), x, f"{name} {mode}")


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3fn", "dlfloat16"])
def test_many_chunks_mixing_zeros_tiny_normal_and_special_values(name):
    """Over 2**18 elements the bit path works chunk by chunk and sends magnitudes below min_normal
    to the value-space method; shuffled probe points (zeros, subnormals, specials everywhere) over
    two chunks check the bookkeeping."""
    fmt = get_format(name)
    points = probe_points(fmt, torch.float32)
    gen = torch.Generator().manual_seed(0)
    shuffled = points[torch.randperm(len(points), generator=gen)]
    x = torch.cat([shuffled[:200_000], torch.zeros(70_000), shuffled[-100_000:]])  # chunk 2 starts at 262,144
    for mode in ("nearest_even", "up", "odd"):
        _assert_bits_equal(quantize(x, fmt, mode, native=False), reference_round(x, fmt, mode), x, f"{name} {mode}")
    draws = quantize(x, fmt, "stochastic", generator=gen)
    _, lo, hi, _, _ = neighbours(x, fmt)
    finite = torch.isfinite(x) & (x.abs() <= fmt.max)
    assert bool(((draws.double() == lo) | (draws.double() == hi))[finite].all())


@pytest.mark.parametrize("mode", ["nearest_even", pytest.param("nearest_away", marks=pytest.mark.slow),
                                  pytest.param("toward_zero", marks=pytest.mark.slow), "up",
                                  pytest.param("down", marks=pytest.mark.slow),
                                  pytest.param("odd", marks=pytest.mark.slow)])
def test_tf32_every_value_and_midpoint(mode):
    fmt = get_format("tf32")
    x = probe_points(fmt, torch.float32)
    _assert_bits_equal(quantize(x, fmt, mode), reference_round(x, fmt, mode), x, f"tf32 {mode}")


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp16"])
@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_value_space_method_matches_reference(name, mode):
    """The value-space method (used by quantize for magnitudes below the format's min_normal)
    checked on its own over every probe point."""
    fmt = get_format(name)
    x = probe_points(fmt, torch.float32)
    _assert_bits_equal(_round(x, fmt, mode, None, None), reference_round(x, fmt, mode), x, f"{name} {mode}")


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn", "fp6_e3m2"])
@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_float64_container_matches_reference(name, mode):
    fmt = get_format(name)
    x = probe_points(fmt, torch.float64)
    _assert_bits_equal(quantize(x, fmt, mode), reference_round(x, fmt, mode), x, f"{name} {mode} fp64")


@pytest.mark.parametrize("e,m", [(2, 1), (3, 3), (4, 2), (5, 5), (6, 4), (8, 3), (3, 8)])
@pytest.mark.parametrize("policy", ["inf", "saturate"])
def test_custom_formats_match_reference(e, m, policy):
    fmt = custom_format(e, m, overflow=policy)
    x = probe_points(fmt, torch.float32)
    for mode in DETERMINISTIC:
        _assert_bits_equal(quantize(x, fmt, mode), reference_round(x, fmt, mode), x, f"{fmt} {policy} {mode}")


def test_no_subnormal_format_rounds_between_zero_and_min_normal():
    fmt = get_format("dlfloat16")
    tiny = torch.tensor([0.3, 0.5, 0.7, -0.7], dtype=torch.float32) * fmt.min_normal
    assert quantize(tiny, fmt).tolist() == [0.0, 0.0, fmt.min_normal, -fmt.min_normal]
    assert quantize(tiny, fmt, "up").tolist() == [fmt.min_normal] * 3 + [-0.0]
    assert quantize(tiny, fmt, "toward_zero").abs().max() == 0


# ---- against torch's own casts ------------------------------------------------------------
def _torch_overflow_policy(fmt):
    """Probe what torch does with a value far beyond the max (it changed between releases)."""
    got = torch.tensor([fmt.max * 4], dtype=torch.float32).to(fmt.torch_dtype).float()
    if torch.isnan(got).all():
        return "nan"
    return "inf" if torch.isinf(got).all() else "saturate"


@pytest.mark.parametrize("name", TORCH_DTYPES)
@pytest.mark.parametrize("native", [False, True])
def test_bit_exact_against_torch_cast(name, native):
    fmt = get_format(name)
    fmt = fmt.with_overflow(_torch_overflow_policy(fmt))
    x = probe_points(fmt, torch.float32)
    if not fmt.has_inf:  # torch maps inf like an overflow for these: probe rather than assume
        x = x[torch.isfinite(x)]
    want = x.to(fmt.torch_dtype).float()
    _assert_bits_equal(quantize(x, fmt, native=native), want, x, f"{name} native={native}")


def test_torch_e4m3fn_overflow_policy_is_probed():
    """torch 2.13 saturates float8_e4m3fn overflow, other releases gave NaN: whatever this torch
    does, lowp's emulation with that policy matches it, and quantize uses the native cast only when
    the preset's policy is the same."""
    fmt = get_format("fp8_e4m3fn")
    policy = _torch_overflow_policy(fmt)
    x = torch.tensor([500.0, 1e9, -1e9, 464.0, 464.00003, -470.0])
    _assert_bits_equal(quantize(x, fmt.with_overflow(policy), native=False), x.to(torch.float8_e4m3fn).float(), x,
                       f"e4m3fn policy {policy}")
    assert _native_cast_matches(fmt) == (policy == fmt.overflow)
    _assert_bits_equal(quantize(x, fmt), quantize(x, fmt, native=False), x, "preset")


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2"])
def test_torch_double_rounds_float64_inputs_and_lowp_does_not(name):
    """torch casts float64 -> fp16/bf16/fp8 through float32: a float64 just above a midpoint first
    rounds *onto* the midpoint, then ties to even. lowp rounds once (it matches the reference in
    test_float64_container_matches_reference); torch equals lowp applied to the float32 value."""
    fmt = get_format(name)
    x = probe_points(fmt, torch.float64)
    torch_cast = x.to(fmt.torch_dtype).double()
    _assert_bits_equal(torch_cast, quantize(x.float(), fmt).double(), x, f"{name} torch = via fp32")
    once = quantize(x, fmt)
    differs = ~bits_equal(once, torch_cast)
    assert int(differs.sum()) > 0
    _assert_bits_equal(once, reference_round(x, fmt, "nearest_even"), x, name)


def test_half_and_bfloat16_inputs_keep_their_dtype():
    x = torch.linspace(-3, 3, 101, dtype=torch.bfloat16)
    y = quantize(x, "fp8_e5m2")
    assert y.dtype == torch.bfloat16
    assert y.float().equal(quantize(x.float(), "fp8_e5m2"))
    h = torch.linspace(-3, 3, 101, dtype=torch.float16)
    assert quantize(h, "fp16").equal(h)
    with pytest.raises(ValueError, match="representable in x's dtype"):
        quantize(h, "bf16")  # bf16 values (e.g. 1e-6, 1e30) do not all exist in fp16
    with pytest.raises(ValueError, match="representable in x's dtype"):
        quantize(x, "fp16")


# ---- against ml_dtypes ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ML_DTYPES))
def test_bit_exact_against_ml_dtypes(name):
    np_type, policy = ML_DTYPES[name]
    fmt = _fmt(name)
    if policy:
        fmt = fmt.with_overflow(policy)
    x = probe_points(fmt, torch.float32)
    if not fmt.has_nan:  # lowp keeps NaN in the container; ml_dtypes has no NaN code and writes -0
        x = x[~torch.isnan(x)]
    with np.errstate(over="ignore"):
        want = torch.from_numpy(x.numpy().astype(np_type).astype(np.float64))
    _assert_bits_equal(quantize(x, fmt, native=False), want, x, name)


def test_ml_dtypes_double_rounds_float64_inputs():
    fmt = get_format("fp4_e2m1")
    x = torch.tensor([0.7499999999999999, 2.5000000000000004], dtype=torch.float64)
    assert quantize(x, fmt).tolist() == [0.5, 3.0]
    assert x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float64).tolist() == [1.0, 2.0]


def test_fp32_in_float64_container_matches_numpy():
    gen = torch.Generator().manual_seed(0)
    f32 = (torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-140, 120, (20000,), generator=gen).float()))
    f32 = f32[torch.isfinite(f32)]
    nxt = torch.nextafter(f32, torch.tensor(float("inf")))
    mids = (f32.double() + nxt.double()) / 2
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    x = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), f32.double(),
                   torch.tensor([3.5e38, 3.4028235677973366e+38, 1e-46, 7e-46, -1e-300])])
    with np.errstate(over="ignore"):
        want = torch.from_numpy(x.numpy().astype(np.float32).astype(np.float64))
    _assert_bits_equal(quantize(x, "fp32"), want, x, "fp32 in fp64")


# ---- stochastic rounding -------------------------------------------------------------------
def _stochastic_inputs(fmt):
    """Points strictly between neighbours at several fractions, and exact values."""
    vals = all_values(fmt)
    index = torch.arange(2, len(vals) - 3, max(1, len(vals) // 150))  # ~150 gaps across the range
    lo, hi = vals[index], vals[index + 1]
    fractions = torch.tensor([0.5, 0.1, 0.9, 0.3], dtype=torch.float64)
    inner = (lo[:, None] + (hi - lo)[:, None] * fractions[None, :]).flatten()
    return torch.cat([inner, vals[index[:10]]])


@pytest.mark.parametrize("name,container", [("fp16", torch.float32), ("bf16", torch.float32),
                                            ("fp8_e4m3fn", torch.float32), ("fp16", torch.float64),
                                            ("fp8_e5m2", torch.float64)])
def test_stochastic_rounding_is_unbiased(name, container):
    """Mean over N=4000 draws per point lies within 5 standard errors of x itself. |z| > 5 has
    probability 5.7e-7 per point under the null, so with <= 650 points per case the chance of a
    false alarm is below 4e-4 (and the seed is fixed, so the outcome is reproducible)."""
    fmt = get_format(name)
    x = _stochastic_inputs(fmt).to(container)
    n = 4000
    gen = torch.Generator().manual_seed(1234)
    draws = quantize(x.expand(n, -1).contiguous(), fmt, "stochastic", generator=gen).double()
    _, lo, hi, _, _ = neighbours(x, fmt)
    assert bool(((draws == lo) | (draws == hi)).all()), "stochastic rounding must return a neighbour"
    p = stochastic_up_probability(x, fmt)
    sigma = (hi - lo).abs() * torch.sqrt(p * (1 - p) / n)
    err = (draws.mean(0) - x.double()).abs()
    assert bool((err <= 5 * sigma + 1e-300).all()), f"max z = {float((err / sigma).nan_to_num().max())}"
    exact = lo == hi
    assert bool((draws[:, exact] == x.double()[exact]).all())


@pytest.mark.parametrize("rand_bits", [1, 2, 4])
def test_rand_bits_sets_the_probability_resolution(rand_bits):
    """With k random bits the chance of rounding up is floor(frac * 2**k) / 2**k (as hardware does):
    biased toward zero by less than 2**-k of a gap."""
    fmt = get_format("fp16")
    x = torch.tensor([1 + 0.3 * 2**-10, 1 + 0.7 * 2**-10, -(1 + 0.55 * 2**-10), 1 + 0.2 * 2**-10])
    n = 20000
    gen = torch.Generator().manual_seed(7)
    draws = quantize(x.expand(n, -1).contiguous(), fmt, "sr", generator=gen, rand_bits=rand_bits)
    frac_up = (draws.abs() > x.abs()).double().mean(0)
    p = stochastic_up_probability(x, fmt, rand_bits)
    assert torch.allclose(frac_up, p, atol=5 * 0.5 / math.sqrt(n))
    if rand_bits == 1:
        assert p.tolist() == [0.0, 0.5, 0.5, 0.0]


def test_stochastic_is_reproducible_with_a_seed_and_varies_without():
    x = torch.rand(10000) * 10
    a = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(5))
    b = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(5))
    c = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(6))
    assert a.equal(b)
    assert not a.equal(c)


def test_stochastic_specials_follow_policy():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e9, 0.0, -0.0])
    got = quantize(x, "fp16", "stochastic", generator=torch.Generator().manual_seed(0))
    _assert_bits_equal(got, torch.tensor([float("nan"), float("inf"), -float("inf"), float("inf"), 0.0, -0.0]), x, "sr")
    sat = quantize(x, "fp8_e4m3fn", "stochastic", generator=torch.Generator().manual_seed(0))
    _assert_bits_equal(sat, torch.tensor([float("nan"), 448.0, -448.0, 448.0, 0.0, -0.0]), x, "sr e4m3fn")


# ---- overflow and NaN behaviour (documented IEEE behaviour) -------------------------------
def test_overflow_policies():
    x = torch.tensor([70000.0, -70000.0, 65519.0, 65520.0, float("inf")])
    assert quantize(x, "fp16").tolist() == [math.inf, -math.inf, 65504.0, math.inf, math.inf]
    sat = get_format("fp16").with_overflow("saturate")
    assert quantize(x, sat).tolist() == [65504.0, -65504.0, 65504.0, 65504.0, math.inf]
    assert quantize(x, "fp16", "toward_zero").tolist() == [65504.0, -65504.0, 65504.0, 65504.0, math.inf]
    assert quantize(x, "fp16", "down").tolist() == [65504.0, -math.inf, 65504.0, 65504.0, math.inf]
    assert torch.isnan(quantize(x[:2], "fp8_e4m3fnuz")).all()


def test_nan_and_negative_zero():
    x = torch.tensor([float("nan"), -0.0, -1e-30])
    y = quantize(x, "fp16", native=False)
    assert torch.isnan(y[0]) and torch.signbit(y[1]) and torch.signbit(y[2]) and y[2] == 0
    z = quantize(x, "fp8_e4m3fnuz", native=False)
    assert torch.isnan(z[0]) and not torch.signbit(z[1:]).any()
    assert torch.isnan(quantize(x, "fp4_e2m1")[0])  # the container keeps NaN even where the format has none


# ---- straight-through -----------------------------------------------------------------------
def test_quantize_ste_forward_is_quantize_and_gradient_is_identity():
    x = (torch.randn(257) * 3).requires_grad_()
    y = quantize_ste(x, "fp8_e4m3fn")
    assert y.detach().equal(quantize(x.detach(), "fp8_e4m3fn"))
    w = torch.randn(257)
    (y * w).sum().backward()
    assert x.grad.equal(w)


def test_quantize_ste_stochastic_with_generator():
    x = torch.rand(100, requires_grad=True)
    y1 = quantize_ste(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(3))
    y2 = quantize(x.detach(), "bf16", "stochastic", generator=torch.Generator().manual_seed(3))
    assert y1.detach().equal(y2)
    y1.sum().backward()
    assert x.grad.equal(torch.ones(100))


# ---- containers and double rounding ----------------------------------------------------------
def test_container_rules():
    assert container_for("bf16") == torch.float32
    assert container_for("fp8_e4m3fn") == torch.float32
    assert container_for("tf32") == torch.float32
    assert container_for("fp32") == torch.float32
    assert container_for("e8m24") == torch.float64
    assert container_for("e9m5") == torch.float64    # exponent range wider than fp32's
    assert container_for("e8m23") == torch.float32
    assert not fits_in(get_format("fp32"), get_format("bf16"))


@pytest.mark.parametrize("name", ["e8m24", "e9m5", "fp64"])
def test_format_too_wide_for_the_container_raises(name):
    with pytest.raises(ValueError, match="double rounding"):
        quantize(torch.ones(3), name)


def test_wide_format_in_float64_container_works():
    x = torch.tensor([1 + 2.0**-30, 1 + 3 * 2.0**-25], dtype=torch.float64)
    assert quantize(x, "e8m24").tolist() == [1.0, 1 + 2 * 2.0**-24]
    with pytest.raises(ValueError, match="representable in x's dtype"):
        quantize(torch.ones(2, dtype=torch.bfloat16), "e8m24")


# ---- bad input ------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown format name"):
        quantize(torch.ones(2), "fp7")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, dtype=torch.int32), "fp16")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, dtype=torch.complex64), "fp16")
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize([1.0, 2.0], "fp16")
    with pytest.raises(ValueError, match="mode"):
        quantize(torch.ones(2), "fp16", "banker")
    with pytest.raises(ValueError, match="rand_bits"):
        quantize(torch.ones(2), "fp16", "nearest_even", rand_bits=8)
    for bad in (0, 25, -1):
        with pytest.raises(ValueError, match="rand_bits"):
            quantize(torch.ones(2), "fp16", "stochastic", rand_bits=bad)
    with pytest.raises(TypeError, match="rand_bits"):
        quantize(torch.ones(2), "fp16", "stochastic", rand_bits=2.5)
    with pytest.raises(TypeError, match="container"):
        quantize(torch.ones(2).to(torch.float8_e5m2), "fp16")
    assert quantize(torch.ones(2, dtype=torch.float64), "fp16", "stochastic", rand_bits=53).tolist() == [1.0, 1.0]


def test_mode_aliases():
    assert canonical_mode("rne") == "nearest_even"
    assert canonical_mode("sr") == "stochastic"
    x = torch.tensor([1 + 2.0**-11])
    assert quantize(x, "fp16", "rtz").item() == 1.0
    assert quantize(x, "fp16", "rna").item() == 1 + 2.0**-10


def test_empty_and_shaped_inputs():
    assert quantize(torch.empty(0), "fp16", native=False).shape == (0,)
    scalar = quantize(torch.tensor(1 + 2.0**-9), "bf16", "up", native=False)
    assert scalar.shape == () and scalar.item() == 1 + 2.0**-7
    x = torch.randn(3, 4, 5)
    assert quantize(x, "bf16", "up").shape == (3, 4, 5)
    assert quantize(x.transpose(0, 2), "bf16", native=False).equal(  # non-contiguous input
        quantize(x, "bf16", native=False).transpose(0, 2))


# ---- CUDA (run with -m gpu on a machine with a GPU) ----------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TORCH_DTYPES + ["fp6_e3m2", "dlfloat16"])
def test_cuda_matches_reference_and_torch_cuda_cast(name):
    fmt = get_format(name)
    x = probe_points(fmt, torch.float32)
    xc = x.cuda()
    for mode in DETERMINISTIC:
        _assert_bits_equal(quantize(xc, fmt, mode, native=False).cpu(), reference_round(x, fmt, mode), x,
                           f"cuda {name} {mode}")
    if fmt.torch_dtype is not None:
        policy = _torch_overflow_policy(fmt)
        finite = xc if fmt.has_inf else xc[torch.isfinite(xc)]
        want = finite.to(fmt.torch_dtype).float().cpu()
        _assert_bits_equal(quantize(finite, fmt.with_overflow(policy), native=False).cpu(), want, finite.cpu(),
                           f"cuda cast {name}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    draws = quantize(xc, fmt, "stochastic", generator=gen).cpu().double()
    _, lo, hi, _, _ = neighbours(x, fmt)
    inside = torch.isfinite(x) & (x.abs() <= fmt.max)
    assert bool(((draws == lo) | (draws == hi))[inside].all())


@pytest.mark.parametrize("bias", [130, 140, 145])
def test_custom_bias_normal_range_reaching_below_float32_normals(bias):
    """With a bias above 127 the format's normals start inside float32's subnormals, where the
    container's bit layout no longer matches the format's quantum."""
    fmt = FloatFormat(f"e8m3b{bias}", 8, 3, bias=bias)
    x = probe_points(fmt, torch.float32)
    for mode in DETERMINISTIC:
        _assert_bits_equal(quantize(x, fmt, mode), reference_round(x, fmt, mode), x, f"{fmt} {mode}")
