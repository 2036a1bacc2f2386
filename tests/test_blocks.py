"""Block formats (lowp.blocks): bit-exact against torchao's mx_formats reference and against an
independent exact (Fraction) reference written here; stochastic rounding, the random Hadamard
transform, the documented disagreements with torchao, and bad inputs."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lowp.blocks import (BLOCK_PRESETS, BlockFormat, dequantize_blocks, e8m0_decode, e8m0_encode, fake_quantize,
                         get_block_format, get_scale_format, hadamard_matrix, inverse_random_hadamard,
                         quantize_blocks, random_hadamard, register_block_format)
from lowp.blocks import core
from lowp.codec import all_values
from lowp.rounding import quantize
from lowp.formats import custom_format, get_format

MX = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4"]
ROUNDINGS = ["floor", "ceil", "rceil", "even"]


# ---- torchao reference -----------------------------------------------------------------------
def _torchao():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats import kernels
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    dtypes = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": DTYPE_FP6_E2M3,
              "mxfp6_e3m2": DTYPE_FP6_E3M2, "mxfp4": torch.float4_e2m1fn_x2}
    # lowp's scale rounding -> torchao's ScaleCalculationMode (same formula, see docs/blocks.md)
    modes = {"floor": ScaleCalculationMode.FLOOR, "ceil": ScaleCalculationMode.CEIL,
             "rceil": ScaleCalculationMode.RCEIL, "even": ScaleCalculationMode.EVEN}
    return mx, kernels, dtypes, modes


def torchao_mx(x: torch.Tensor, preset: str, rounding: str):
    """(e8m0 codes, element values, dequantized values) from torchao's to_mx / to_dtype."""
    mx, kernels, dtypes, modes = _torchao()
    dt = dtypes[preset]
    scale, data = mx.to_mx(x.clone(), dt, 32, modes[rounding])
    deq = mx.to_dtype(data, scale, dt, 32, torch.float32)
    if preset.startswith("mxfp8"):
        elems = data.float()
    elif preset == "mxfp4":
        elems = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data)).reshape(x.shape)
    else:
        unpack = kernels.f6_e2m3_unpacked_to_f32 if preset == "mxfp6_e2m3" else kernels.f6_e3m2_unpacked_to_f32
        elems = unpack(data).reshape(x.shape)
    return scale.view(torch.uint8), elems, deq


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality that counts NaN == NaN and tells -0 from +0 apart."""
    return (a == b) & (torch.signbit(a) == torch.signbit(b)) | (torch.isnan(a) & torch.isnan(b))


def probe_blocks(preset: str) -> torch.Tensor:
    """Every element value, every midpoint and one fp32 ulp either side of it, times every scale
    exponent s in [-127, 127 - emax]; each block starts with max * 2**s so the floor and rceil scales are 2**s."""
    elem = get_block_format(preset).element
    v = all_values(elem).float()
    v = v[v >= 0]
    mid = (v[1:] + v[:-1]) / 2
    probes = torch.cat([v, mid, torch.nextafter(mid, torch.zeros(())), torch.nextafter(mid, mid * 4)])
    probes = torch.cat([probes, -probes])
    pad = (-probes.numel()) % 31
    probes = torch.cat([probes, probes[:pad]]).reshape(-1, 31)
    head = torch.full((probes.shape[0], 1), elem.max)
    unit = torch.cat([head, probes], 1)                               # (blocks, 32), scale exponent 0
    exps = torch.arange(-127, 128 - elem.emax, dtype=torch.float32)
    return (unit.unsqueeze(0) * torch.exp2(exps).reshape(-1, 1, 1)).reshape(-1, 32)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("preset", MX)
def test_mx_bit_exact_against_torchao_exhaustive(preset, rounding):
    """Equal scale codes, element values and dequantized values on every block but those whose
    scale is 2**-127 (code 0), where torchao is wrong (test_torchao_scale_code_zero_*)."""
    x = probe_blocks(preset)
    codes, elems, deq = torchao_mx(x, preset, rounding)
    q = quantize_blocks(x, get_block_format(preset).replace(scale_rounding=rounding))
    mine_codes = e8m0_encode(q.scales)
    code_zero_blocks = (codes == 0).squeeze(-1) | (mine_codes == 0).squeeze(-1)
    ok = ~code_zero_blocks
    assert ok.sum() > 0.95 * ok.numel()
    assert torch.equal(mine_codes[ok], codes[ok])
    assert bool(same(q.elements[ok], elems[ok]).all())
    assert bool(same(q.dequantize()[ok], deq[ok]).all())


# ---- independent exact reference -------------------------------------------------------------
def floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    return e if Fraction(2) ** e <= v else e - 1


def round_fraction(v: Fraction, mantissa_bits: int, emin: int, mode: str = "nearest") -> Fraction:
    """|v| rounded to a float grid with the given precision and subnormal floor (no upper limit)."""
    if v == 0:
        return Fraction(0)
    sign, v = (-1 if v < 0 else 1), abs(v)
    quantum = Fraction(2) ** (max(floor_log2(v), emin) - mantissa_bits)
    n = v / quantum
    whole = n.numerator // n.denominator
    frac = n - whole
    if mode == "nearest":
        up = frac > Fraction(1, 2) or (frac == Fraction(1, 2) and whole % 2 == 1)
    elif mode == "up":
        up = frac > 0
    else:
        up = False
    return sign * (whole + up) * quantum


def reference_scale(amax: Fraction, preset: BlockFormat, t: Fraction = Fraction(1)) -> Fraction:
    elem, r = preset.element, preset.scale_rounding
    if preset.scale_format.name == "e8m0":
        if amax == 0:
            return Fraction(2) ** -127
        fl = floor_log2(amax)
        ce = fl if Fraction(2) ** fl == amax else fl + 1
        if r == "floor":
            k = fl - elem.emax
        elif r == "ceil":
            k = ce - elem.emax
        elif r == "even":
            k = floor_log2(round_fraction(amax, elem.mantissa_bits, -10**6)) - elem.emax
        else:
            k = next(k for k in range(fl - elem.emax - 2, 200) if amax <= Fraction(elem.max) * Fraction(2) ** k)
        return Fraction(2) ** max(k, -127)
    sf = preset.scale_format.float_format
    mode = {"floor": "down", "ceil": "up", "rceil": "up", "even": "nearest"}[r]
    s = round_fraction(amax / (Fraction(elem.max) * t), sf.mantissa_bits, sf.emin, mode)
    return max(s, Fraction(sf.min_subnormal))


def reference_block(block: list[float], preset: BlockFormat, t: Fraction = Fraction(1)):
    elem = preset.element
    amax = max(abs(Fraction(v)) for v in block)
    s = reference_scale(amax, preset, t)
    out = []
    for v in block:
        e = round_fraction(Fraction(v) / (s * t), elem.mantissa_bits, elem.emin)
        out.append(max(min(e, Fraction(elem.max)), -Fraction(elem.max)))   # elements saturate
    return s, out


def reference_inputs(block_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, block_size, generator=g) * torch.exp2(torch.randint(-140, 120, (48, 1), generator=g).float())
    x[0] = 0.0                                            # zero block
    x[1, :] = 3.0 * 2.0**-140                              # fp32-subnormal block
    x[2] = torch.tensor([6.0, 5.0, 3.5, 2.5, 0.75, 0.25] * 6)[:block_size]   # e2m1 ties
    x[3, 0] = 7.75                                         # rounds into the next binade
    return x


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("preset", MX + ["nvfp4"])
def test_against_exact_fraction_reference(preset, rounding):
    fmt = get_block_format(preset).replace(scale_rounding=rounding)
    x = reference_inputs(fmt.block_size, seed=len(preset) + len(rounding))
    q = quantize_blocks(x, fmt)
    t = Fraction(q.tensor_scale) if fmt.tensor_scale else Fraction(1)
    if fmt.tensor_scale:   # t = amax / (6 * 448) rounded up to fp32
        amax = max(abs(Fraction(v)) for v in x.flatten().tolist())
        assert t == round_fraction(amax / (Fraction(fmt.element.max) * 448), 23, -126, "up")
    for i, block in enumerate(x.tolist()):
        s, elems = reference_block(block, fmt, t)
        assert Fraction(float(q.scales[i, 0])) == s, (i, block)
        assert [Fraction(v) for v in q.elements[i].tolist()] == elems, i


@pytest.mark.parametrize("t", [0.75, 1.0 + 2.0**-20, 3.0 * 2.0**-30],
                         ids=["m d in fp32", "m d between fp32s", "small t"])
def test_nvfp4_rounds_midpoints_exactly_by_counting(t, monkeypatch):
    """NVFP4's elements come from counting midpoints (no division): at every e2m1 midpoint m times
    the block's divisor d = S t, and one fp32 step either side, the result is the exact quotient's
    nearest-even value (Fraction reference) and the fp64-division path's; the counting path ran."""
    fmt = get_block_format("nvfp4")
    calls = []
    real = core._round_by_midpoints
    monkeypatch.setattr(core, "_round_by_midpoints", lambda *a: calls.append(1) or real(*a))
    blocks = []
    for scale in (1.0, 0.0390625, 448.0):                   # e4m3 scales: S = amax / (6 t) exactly
        amax = 6.0 * scale * t
        d = scale * t
        near = []
        for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            v = torch.tensor(m * d, dtype=torch.float64).float()
            near += [v, torch.nextafter(v, torch.tensor(math.inf)), torch.nextafter(v, torch.tensor(-math.inf))]
        values = torch.stack(near)
        for part in values.split(15):
            block = torch.zeros(16)
            block[0] = amax
            block[1:1 + len(part)] = part * torch.tensor([1.0, -1.0]).repeat(8)[:len(part)]
            blocks.append(block)
    x = torch.stack(blocks)
    assert torch.equal(x.abs().amax(-1), x[:, 0])
    q = quantize_blocks(x, fmt, tensor_scale=t)
    assert calls == [1]
    for i, block in enumerate(x.tolist()):
        s, elems = reference_block(block, fmt, Fraction(t))
        assert Fraction(float(q.scales[i, 0])) == s
        assert [Fraction(v) for v in q.elements[i].tolist()] == elems, i
    divided = quantize(x.double() / (q.scales.double() * t), fmt.element_format, "nearest_even").float()
    assert torch.equal(divided, q.elements)


# ---- NVFP4 against torchao -------------------------------------------------------------------
def torchao_nvfp4(x: torch.Tensor, tensor_scale: "float | None"):
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats import kernels
    t = None if tensor_scale is None else torch.tensor(tensor_scale, dtype=torch.float32)
    scales, packed = nv.nvfp4_quantize(x, 16, t)
    elems = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(packed)).reshape(x.shape)
    return scales.float(), elems


def test_nvfp4_against_torchao_differs_only_where_torchao_is_not_nearest():
    """Same per-tensor scale passed to both: equal block scales; equal elements except where torchao's
    fp32 product x * ((1/t)/s) lands on an e2m1 midpoint that the exact quotient x / (s t) is not on."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_blocks(x, "nvfp4")
    scales, elems = torchao_nvfp4(x, q.tensor_scale)
    assert torch.equal(scales, q.scales)
    diff = (elems != q.elements).nonzero().tolist()
    assert 1 <= len(diff) <= 4
    for i, j in diff:
        s = Fraction(float(q.scales[i, j // 16])) * Fraction(q.tensor_scale)
        exact = Fraction(float(x[i, j])) / s
        assert abs(exact - Fraction(float(q.elements[i, j]))) < abs(exact - Fraction(float(elems[i, j])))
    # the documented example (docs/blocks.md)
    i, j = diff[0]
    assert float(x[i, j]) == 0.6178650259971619 and float(elems[i, j]) == 2.0 and float(q.elements[i, j]) == 1.5


def test_nvfp4_torchao_clamps_block_scales_at_e4m3_min_normal():
    """torchao clamps a block scale to >= 2**-6 (e4m3's smallest normal) before rounding it; lowp applies
    the nearest-even rule down to e4m3's subnormals (2**-9). A convention difference, not an error on
    either side: each set of elements is the nearest e2m1 rounding of x / S for its own S."""
    x = torch.zeros(1, 32)
    x[0, :16] = 2688.0                                   # t = 1
    x[0, 16:] = torch.linspace(-0.03, 0.03, 16)
    q = quantize_blocks(x, "nvfp4")
    assert q.tensor_scale == 1.0
    scales, elems = torchao_nvfp4(x, 1.0)
    assert float(scales[0, 1]) == 2.0**-6 and float(q.scales[0, 1]) == 3 * 2.0**-9
    e2m1 = get_format("fp4_e2m1")
    for s, e in ((float(scales[0, 1]), elems), (float(q.scales[0, 1]), q.elements)):
        for v, got in zip(x[0, 16:].tolist(), e[0, 16:].tolist()):
            assert Fraction(got) == round_fraction(Fraction(v) / Fraction(s), e2m1.mantissa_bits, e2m1.emin)


# ---- documented disagreements with torchao's MX reference ------------------------------------
def test_torchao_scale_code_zero_floor_dequantizes_to_half():
    """FLOOR/CEIL/EVEN: torchao stores code 0 (2**-127) but divides by 2**-126 (it clamps the fp32
    scale at the smallest normal), so the block decodes to half its value; lowp is exact."""
    x = torch.full((1, 32), 2.0**-120)
    codes, _, deq = torchao_mx(x, "mxfp8_e4m3", "floor")
    q = quantize_blocks(x, "mxfp8_e4m3")
    assert int(codes) == 0 and int(e8m0_encode(q.scales)) == 0
    assert float(deq[0, 0]) == 2.0**-121
    assert float(q.dequantize()[0, 0]) == 2.0**-120


def test_torchao_scale_code_zero_rceil_flushes_block():
    """RCEIL: for code 0 torchao multiplies by 1.0 instead of 2**127, so the block becomes zero."""
    x = torch.full((1, 32), 2.0**-120)
    codes, _, deq = torchao_mx(x, "mxfp8_e4m3", "rceil")
    q = quantize_blocks(x, get_block_format("mxfp8_e4m3").replace(scale_rounding="rceil"))
    assert int(codes) == 0 and float(deq.abs().max()) == 0.0
    assert float(q.dequantize()[0, 0]) == 2.0**-120


def test_torchao_rceil_rounds_the_descale_in_fp32_subnormals():
    """torchao computes amax / 448 in fp32; below 2**-126 that quotient is rounded to the subnormal grid,
    and 448 * 2**-127 (1 + 2**-23) / 448 rounds down to exactly 2**-127: code 0 instead of 1."""
    x = torch.zeros(1, 32)
    x[0, 0] = torch.nextafter(torch.tensor(448 * 2.0**-127), torch.tensor(1.0))
    codes, _, _ = torchao_mx(x, "mxfp8_e4m3", "rceil")
    q = quantize_blocks(x, get_block_format("mxfp8_e4m3").replace(scale_rounding="rceil"))
    assert int(codes) == 0 and int(e8m0_encode(q.scales)) == 1
    assert float(q.elements[0, 0]) == 224.0                 # x / 2**-126 = 224.0000..., in range


def test_torchao_inf_block_is_not_nan():
    """An inf in a block: lowp gives the block a NaN scale (every element decodes to NaN, the OCP rule
    for a NaN scale); torchao gives a finite scale (2**120 for e4m3), the inf element saturates and
    decodes to inf by fp32 overflow, and the block's other elements are flushed to zero."""
    x = torch.ones(1, 32)
    x[0, 3] = math.inf
    codes, _, deq = torchao_mx(x, "mxfp8_e4m3", "floor")
    assert int(codes) == 127 + 120 and float(deq[0, 0]) == 0.0 and deq[0, 3] == math.inf
    q = quantize_blocks(x, "mxfp8_e4m3")
    assert int(e8m0_encode(q.scales)) == 0xFF and bool(torch.isnan(q.dequantize()).all())


def test_nan_block_matches_torchao():
    x = torch.ones(2, 32)
    x[0, 5] = math.nan
    codes, _, deq = torchao_mx(x, "mxfp8_e4m3", "floor")
    q = quantize_blocks(x, "mxfp8_e4m3")
    assert torch.equal(e8m0_encode(q.scales), codes)
    assert bool(same(q.dequantize(), deq).all())
    assert bool(torch.isnan(q.dequantize()[0]).all()) and bool((q.dequantize()[1] == 1).all())
    assert float(q.elements[0].abs().max()) == 0.0


# ---- formats, presets, scales ----------------------------------------------------------------
def test_presets_and_bits_per_element():
    assert set(MX + ["nvfp4", "nvfp4_2d"]) <= set(BLOCK_PRESETS)
    expect = {"mxfp8_e4m3": ("fp8_e4m3fn", 32, 8.25), "mxfp8_e5m2": ("fp8_e5m2", 32, 8.25),
              "mxfp6_e2m3": ("fp6_e2m3", 32, 6.25), "mxfp6_e3m2": ("fp6_e3m2", 32, 6.25),
              "mxfp4": ("fp4_e2m1", 32, 4.25), "nvfp4": ("fp4_e2m1", 16, 4.5)}
    for name, (elem, block, bits) in expect.items():
        f = get_block_format(name)
        assert (f.element.name, f.block_size, f.bits_per_element) == (elem, block, bits)
        assert f.overflow == "saturate"
    assert get_block_format("nvfp4").scale_format.name == "e4m3" and get_block_format("nvfp4").tensor_scale
    assert get_block_format("MXFP8") is get_block_format("mxfp8_e4m3")
    assert get_block_format("nvfp4_2d").bits_per_element == 4 + 8 / 256


def test_e8m0_codes_round_trip():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e8m0_decode(codes)
    assert float(values[0]) == 2.0**-127 and float(values[127]) == 1.0 and float(values[254]) == 2.0**127
    assert math.isnan(float(values[255]))
    assert torch.equal(e8m0_encode(values), codes)
    with pytest.raises(ValueError, match="scales"):
        e8m0_encode(torch.tensor([3.0]))
    with pytest.raises(TypeError, match="codes"):
        e8m0_decode(torch.tensor([1.0]))
    assert get_scale_format("e8m0").min == 2.0**-127 and get_scale_format("e4m3").max == 448.0


def test_two_dimensional_tiles_equal_one_block_per_tile():
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(3))
    q = quantize_blocks(x, "nvfp4_2d")
    assert q.scales.shape == (2, 3)
    tiles = x.reshape(2, 16, 3, 16).transpose(1, 2).reshape(2, 3, 256)
    flat = quantize_blocks(tiles, get_block_format("nvfp4_2d").replace(block_rows=1, block_size=256),
                           tensor_scale=q.tensor_scale)
    assert torch.equal(flat.scales.squeeze(-1), q.scales)
    assert torch.equal(flat.elements.reshape(2, 3, 16, 16).transpose(1, 2).reshape(32, 48), q.elements)


def test_fake_quantize_keeps_dtype_and_matches_quantize():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    for name in BLOCK_PRESETS:
        if name == "nvfp4_2d":
            continue
        y = fake_quantize(x, name)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, quantize_blocks(x, name).dequantize(torch.bfloat16))


def test_ceil_and_rceil_never_saturate_floor_can():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)) * 3
    for name in MX:
        elem = get_block_format(name).element
        for r in ("ceil", "rceil"):
            q = quantize_blocks(x, get_block_format(name).replace(scale_rounding=r))
            amax = (x.abs().amax(-1) / q.scales.squeeze(-1))
            assert bool((amax <= elem.max).all())
    q = quantize_blocks(torch.tensor([[500.0] + [1.0] * 31]), "mxfp8_e4m3")  # 500 / 2**0 > 448
    assert float(q.elements[0, 0]) == 448.0


def test_overflow_nan_policy():
    fmt = get_block_format("mxfp8_e4m3").replace(overflow="nan")
    q = quantize_blocks(torch.tensor([[500.0] + [1.0] * 31]), fmt)
    assert math.isnan(float(q.elements[0, 0])) and float(q.elements[0, 1]) == 1.0
    with pytest.raises(ValueError, match="overflow"):
        get_block_format("mxfp4").replace(overflow="nan")


# ---- stochastic rounding ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp4", "nvfp4"])
def test_stochastic_rounding_is_unbiased(preset):
    """Each of 32 (16) values is rounded N = 4000 times; the mean decoded value must be within
    6 standard errors of x: |mean - x| <= 6 * (quantum / 2) / sqrt(N) (a Bernoulli std is <= quantum / 2)."""
    fmt = get_block_format(preset).replace(scale_rounding="rceil")   # no saturation: SR alone
    g = torch.Generator().manual_seed(5)
    base = torch.rand(1, fmt.block_size, generator=g) * 2 - 1
    base[0, 0] = 1.0
    n = 4000
    x = base.repeat(n, 1)
    ts = 1.0 if fmt.tensor_scale else None
    q = quantize_blocks(x, fmt, "stochastic", generator=g, tensor_scale=ts)
    mean = q.dequantize().double().mean(0)
    scale = float(q.scales[0, 0]) * (ts or 1.0)
    elem = fmt.element
    quantum = torch.tensor([scale * 2.0 ** (max(math.floor(math.log2(abs(v) / scale)), elem.emin) - elem.mantissa_bits)
                            if v else 0.0 for v in base[0].tolist()], dtype=torch.float64)
    assert bool(((mean - base[0].double()).abs() <= 6 * quantum / 2 / math.sqrt(n) + 1e-12).all())
    nearest = quantize_blocks(x[:1], fmt, tensor_scale=ts).dequantize()
    assert bool(((mean - base[0].double()).abs() < (nearest[0].double() - base[0].double()).abs() + 1e-12).any())


def test_random_bits_give_multiples_of_two_to_the_minus_r():
    """e2m1 between 4 and 6 (quantum 2): x = 4 + 2j/64, j = 0..63; with r = 3 random bits rounding up has
    probability floor(8 j / 64) / 8: exactly 0 for j < 8 (checked exactly), and within 0.02 (> 5 sd
    at N = 20000) of the multiple of 1/8 otherwise."""
    j = torch.arange(64, dtype=torch.float32)
    vals = 4 + 2 * j / 64
    n = 20000
    x = torch.cat([torch.full((n, 1), 6.0), vals.repeat(n, 1)[:, :31]], 1)        # scale 1 (block max 6)
    x2 = torch.cat([torch.full((n, 1), 6.0), vals.repeat(n, 1)[:, 31:62]], 1)
    x3 = torch.cat([torch.full((n, 1), 6.0), vals.repeat(n, 1)[:, 62:], torch.full((n, 29), 4.0)], 1)
    fmt = get_block_format("mxfp4").replace(scale_rounding="rceil")
    g = torch.Generator().manual_seed(11)
    ups = []
    for part in (x, x2, x3):
        q = quantize_blocks(part, fmt, "stochastic", random_bits=3, generator=g)
        assert bool((q.scales == 1).all())
        ups.append((q.elements[:, 1:] == 6).double().mean(0))
    p = torch.cat(ups)[:64]
    want = torch.floor(8 * j / 64).double() / 8
    assert bool((p[:8] == 0).all())
    assert bool(((p - want).abs() <= 0.02).all())


# ---- Hadamard ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 16, 32, 128])
def test_hadamard_is_orthonormal(n):
    q = hadamard_matrix(n, seed=7)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=4 * n * 2.0**-53, rtol=0)
    assert bool((q.abs() == 1 / math.sqrt(n)).all())


def test_hadamard_seeded_and_inverse():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    y = random_hadamard(x, 16, seed=3)
    assert torch.equal(y, random_hadamard(x, 16, seed=3))
    assert not torch.equal(y, random_hadamard(x, 16, seed=4))
    back = inverse_random_hadamard(y, 16, seed=3)
    norms = x.reshape(8, 4, 16).norm(dim=-1, keepdim=True).expand(8, 4, 16).reshape(8, 64)
    gamma = 16 * 2.0**-24 / (1 - 16 * 2.0**-24)
    assert bool(((back - x).abs() <= 2.1 * gamma * norms).all())           # stated bound, fp32
    x64 = x.double()
    assert torch.allclose(inverse_random_hadamard(random_hadamard(x64, 32, 1), 32, 1), x64, atol=1e-14, rtol=0)


def test_hadamard_pre_transform_round_trip_and_spreads_outliers():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 64, generator=g)
    x[:, 5] *= 50                                         # an outlier channel
    plain = get_block_format("mxfp4")
    rht = plain.replace(hadamard=32)
    q = quantize_blocks(x, rht, hadamard_seed=9)
    assert q.hadamard_seed == 9
    assert torch.equal(q.dequantize(), fake_quantize(x, rht, hadamard_seed=9))
    err_rht = (q.dequantize() - x).norm()
    err_plain = (fake_quantize(x, plain) - x).norm()
    assert err_rht < err_plain
    exact = dequantize_blocks(q.elements, q.scales, plain)   # without the inverse: the rotated tensor
    assert torch.allclose(inverse_random_hadamard(exact, 32, 9), q.dequantize(), atol=1e-5, rtol=0)


# ---- bad inputs --------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="block_size"):
        quantize_blocks(torch.randn(2, 48), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="block_rows"):
        quantize_blocks(torch.randn(8, 16), "nvfp4_2d")
    with pytest.raises(ValueError, match="^x: block"):
        quantize_blocks(torch.tensor([[math.nan] * 32]), "mxfp8_e4m3", nonfinite="raise")
    with pytest.raises(ValueError, match="^x: block"):
        quantize_blocks(torch.tensor([[math.inf] + [0.0] * 31]), "mxfp4", nonfinite="raise")
    with pytest.raises(ValueError, match="^fmt: unknown block format"):
        quantize_blocks(x, "mxfp5")
    with pytest.raises(TypeError, match="^fmt"):
        quantize_blocks(x, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^x: expected float32"):
        quantize_blocks(x.double(), "mxfp4")
    with pytest.raises(TypeError, match="^x"):
        quantize_blocks(torch.ones(2, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(TypeError, match="^x"):
        quantize_blocks([1.0] * 32, "mxfp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^rounding"):
        quantize_blocks(x, "mxfp4", "up")
    with pytest.raises(ValueError, match="^random_bits"):
        quantize_blocks(x, "mxfp4", random_bits=4)
    with pytest.raises(ValueError, match="^random_bits"):
        quantize_blocks(x, "mxfp4", "stochastic", random_bits=0)
    with pytest.raises(ValueError, match="^tensor_scale"):
        quantize_blocks(x, "mxfp4", tensor_scale=2.0)
    with pytest.raises(ValueError, match="^tensor_scale"):
        quantize_blocks(x, "nvfp4", tensor_scale=-1.0)
    with pytest.raises(ValueError, match="^nonfinite"):
        quantize_blocks(x, "mxfp4", nonfinite="ignore")
    # a scale format that cannot hold the block's scale
    one_level = get_block_format("nvfp4").replace(tensor_scale=False)
    with pytest.raises(ValueError, match="^x: a block max needs a scale beyond e4m3"):
        quantize_blocks(torch.full((1, 16), 1e6), one_level)
    tiny_elem = BlockFormat("tiny", custom_format(2, 1, bias=3, special="none"), scale_rounding="ceil")  # emax 0
    with pytest.raises(ValueError, match="^x: a block needs the scale 2\\*\\*128"):
        quantize_blocks(torch.full((1, 32), 3e38), tiny_elem)
    q = quantize_blocks(x, "nvfp4")
    with pytest.raises(ValueError, match="^tensor_scale"):
        dequantize_blocks(q.elements, q.scales, "nvfp4")
    with pytest.raises(ValueError, match="^scales"):
        dequantize_blocks(q.elements, q.scales[:, :1], "nvfp4", tensor_scale=q.tensor_scale)


@pytest.mark.parametrize("field, value", [("block_size", 0), ("block_rows", -1), ("block_size", 2.0),
                                          ("scale_rounding", "nearest"), ("scale_format", "e5m2"),
                                          ("tensor_scale", "yes"), ("overflow", "wrap"), ("hadamard", 12),
                                          ("element", "fp64"), ("element", "nosuch")])
def test_block_format_validation_names_the_field(field, value):
    kwargs = {"name": "t", "element": get_format("fp8_e4m3fn"), field: value}
    with pytest.raises(ValueError, match=f"^{field}"):
        BlockFormat(**kwargs)
    with pytest.raises(ValueError, match="^tensor_scale"):
        BlockFormat("t", get_format("fp4_e2m1"), tensor_scale=True)
    with pytest.raises(ValueError, match="^scale_format: fp32 scales with a per-tensor scale"):
        BlockFormat("t", get_format("fp8_e4m3fn"), scale_format="fp32", tensor_scale=True)
    assert BlockFormat("t", get_format("fp8_e4m3fn"), scale_format="bf16", tensor_scale=True).tensor_scale


def test_register_block_format():
    fmt = register_block_format(BlockFormat("test_mxfp8_rceil", "fp8_e4m3fn", scale_rounding="rceil"))
    assert get_block_format("TEST_MXFP8_RCEIL") is fmt
    with pytest.raises(TypeError, match="fmt"):
        register_block_format("mxfp4")  # type: ignore[arg-type]


def test_zero_and_negative_zero_blocks():
    x = torch.zeros(2, 32)
    x[1] = -0.0
    q = quantize_blocks(x, "mxfp8_e4m3")
    assert bool((e8m0_encode(q.scales) == 0).all())
    assert torch.equal(torch.signbit(q.elements), torch.signbit(x))
    assert float(quantize_blocks(torch.zeros(1, 16), "nvfp4").scales[0, 0]) == 2.0**-9
