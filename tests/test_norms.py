"""vector_norm: every method against exact (math.fsum / Fraction) truth, the issue's goal for
``robust``, the documented failures of the other methods, and argument errors."""
import math

import pytest
import torch

from lowp.arith import Arith
from lowp.codec import all_values
from lowp.norms import METHODS, vector_norm
from lowp.norms.cases import case_families
from lowp.norms.check import as_input, score
from lowp.norms.compute import Native, two_square, two_sum
from lowp.norms.methods import blue_constants, seed_thresholds
from lowp.formats import get_format
from lowp.norms.reference import exact_norm
from lowp.ulp import ulp


def _norm(values, fmt="fp16", **kw):
    x = torch.tensor(values, dtype=torch.float64)
    inp, container = as_input(x, get_format(fmt))
    return vector_norm(inp, format=container, **kw).double()


# ---- building blocks -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "bf16", "dlfloat16"])
def test_two_square_is_exact_on_every_significand(fmt):
    ar = Arith(fmt)
    v = all_values(fmt)
    y = ar.cast(v[(v >= 1) & (v < 2)])
    hi, lo = two_square(ar, y)
    assert torch.equal(hi.double() + lo.double(), y.double() ** 2)


def test_two_sum_is_exact():
    ar = Arith("fp16")
    g = torch.Generator().manual_seed(0)
    a = ar.cast(torch.randn(5000, generator=g, dtype=torch.float64) * 100)
    b = ar.cast(torch.randn(5000, generator=g, dtype=torch.float64))
    s, e = two_sum(ar, a, b)
    assert torch.equal(s.double() + e.double(), a.double() + b.double())


def test_seed_thresholds_and_blue_constants_are_derived_per_format():
    bh, bl = seed_thresholds(Arith("fp16"))
    # seed 002: beta_H = sqrt(65504) ~ 256 (fp16's sqrt rounds it to 255.875), beta_L = 2**-12 ~ 2.4e-4
    assert float(bh) == 255.875 and float(bl) == 2.0**-12
    assert blue_constants(get_format("fp16")) == {
        "tsml": 2.0**-7, "tbig": 8.0, "ssml": 2.0**12, "sbig": 2.0**-13}
    # fp64 gives LAPACK's own constants (la_constants.f90)
    c64 = blue_constants(get_format("fp64"))
    assert c64["tsml"] == 2.0**-511 and c64["tbig"] == 2.0**486 and c64["ssml"] == 2.0**537 and c64["sbig"] == 2.0**-538


# ---- exhaustive n = 1 ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_robust_exhaustive_single_values_are_exact(fmt):
    v = all_values(fmt).unsqueeze(-1)
    x, _ = as_input(v, get_format(fmt))
    got = vector_norm(x, compute=fmt).double()
    assert torch.equal(got, v.abs().squeeze(-1))


def test_robust_exhaustive_fp16_with_eps_is_correctly_rounded():
    v = all_values("fp16").unsqueeze(-1)
    eps = 2.0**-10
    got = vector_norm(v.half(), eps=eps, compute="fp16").double()
    value, rounded = exact_norm(v, eps, "fp16")
    assert torch.equal(got, rounded)


# ---- the goal for robust ---------------------------------------------------------------

@pytest.mark.parametrize("fmt,compute", [("fp16", "fp16"), ("bf16", "bf16"), ("e4m3", "fp16"), ("e5m2", "fp16"),
                                         ("e4m3", "bf16"), ("e5m2", "bf16"), ("dlfloat16", "dlfloat16"),
                                         ("fp16", None), ("bf16", None), ("e4m3", None), ("e5m2", None)])
def test_robust_is_faithful_never_spuriously_overflows_or_underflows(fmt, compute):
    total = cr = 0.0
    for case in case_families(fmt, rows=300, n_long=2048, seed=7, exhaustive=False):
        s = score(case, "robust", fmt, compute)
        assert s.max_ulp < 1, (case.family, s)
        assert s.overflow == 0 and s.underflow == 0, (case.family, s)
        total += s.rows
        cr += s.correctly_rounded * s.rows
    assert cr / total >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_robust_goal_with_65536_long_vectors(fmt):
    for case in case_families(fmt, rows=1000, n_long=65536, seed=11, exhaustive=False):
        s = score(case, "robust", fmt, fmt)
        assert s.max_ulp < 1 and s.overflow == 0 and s.underflow == 0 and s.correctly_rounded >= 0.99, case.family


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_robust_lengths_that_are_not_powers_of_two(fmt):
    from lowp.norms.cases import log_uniform

    f = get_format(fmt)
    g = torch.Generator().manual_seed(5)
    for n in (3, 5, 7, 100, 1000):
        rows = log_uniform((50, n), f.min_subnormal, f.max / n, f, g)
        x, _ = as_input(rows, f)
        got = vector_norm(x, compute=fmt, eps=2.0**-12).double()
        _, rounded = exact_norm(rows, 2.0**-12, fmt)
        assert (got == rounded).double().mean() >= 0.98, n
        assert (torch.isfinite(got) == torch.isfinite(rounded)).all(), n


def test_robust_long_vectors_up_to_65536():
    g = torch.Generator().manual_seed(3)
    rows = torch.stack([torch.ones(65536, dtype=torch.float64),
                        torch.rand(65536, generator=g, dtype=torch.float64) * 255,
                        torch.rand(65536, generator=g, dtype=torch.float64) * 1e-4]).half().double()
    for compute in ("fp16", torch.float16):
        got = vector_norm(rows.half(), compute=compute).double()
        value, rounded = exact_norm(rows, 0.0, "fp16")
        assert torch.equal(got, rounded), compute
    assert float(got[0]) == 256.0


def test_native_fp16_compute_matches_emulated_fp16_bit_for_bit():
    case = case_families("fp16", rows=200, n_long=512, seed=1, exhaustive=False)
    for c in case:
        x = c.rows.half()
        for method in METHODS:
            a = vector_norm(x, eps=c.eps, method=method, compute="fp16")
            b = vector_norm(x, eps=c.eps, method=method, compute=torch.float16)
            assert torch.equal(a.isnan(), b.isnan()), (method, c.family)
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), (method, c.family)


# ---- where the other methods break (documented in docs/norms.md) ------------------------------

def test_seed_normal_branch_overflows_on_255_255():
    assert math.isinf(_norm([[255.0, 255.0]], method="two_segment", compute="fp16")[0])
    assert math.isinf(_norm([[255.0, 255.0]], method="naive", compute="fp16")[0])
    assert _norm([[255.0, 255.0]], method="robust", compute="fp16")[0] == 360.5  # fp16(360.62)


def test_long_fp16_sum_of_ones_stagnates_except_robust():
    ones = [[1.0] * 4096]
    for method in ("naive", "max_scaled", "two_segment"):
        assert _norm(ones, method=method, compute="fp16")[0] == 45.25  # fp16(sqrt(2048)): the sum sticks at 2048
    assert _norm(ones, method="robust", compute="fp16")[0] == 64.0


def test_blue_medium_accumulator_overflows_in_fp16():
    # 2048 values of 8 (= tbig): amed = 64 * 2048 = 131072 > 65504 although the norm is 362
    assert math.isinf(_norm([[8.0] * 2048], method="blue", compute="fp16")[0])
    assert _norm([[8.0] * 2048], method="robust", compute="fp16")[0] == 362.0


def test_seed_underflow_segment_gives_nan_without_normal_components():
    # every component below beta_L and eps = 0: Q = 0, gamma = inf, Q*sqrt(1+gamma^2) = 0*inf
    assert math.isnan(_norm([[1e-5, 1e-5]], method="two_segment", compute="fp16")[0])
    got = _norm([[1e-5, 1e-5]], method="robust", compute="fp16")[0]
    assert got == float(torch.tensor(math.sqrt(2) * float(torch.tensor(1e-5).half())).half())


def test_max_scaled_loses_small_components_to_underflow():
    # 1000 and 4096 components of 0.01: (0.01/1000)**2 underflows in fp16; the true norm is 1000.2
    row = [[1000.0] + [0.01] * 4096]
    assert _norm(row, method="max_scaled", compute="fp16")[0] == 1000.0
    assert _norm(row, method="robust", compute="fp16")[0] == 1000.0  # fp16 spacing at 1000 is 0.5
    row = [[1.0] + [2.0**-13] * 4096]  # true: sqrt(1 + 4096 * 2**-26) = 1.0000305 -> rounds to 1
    naive = _norm(row, method="naive", compute="fp16")[0]
    assert naive == 1.0


# ---- eps -------------------------------------------------------------------------------------

def test_negative_eps_gives_nan_when_it_exceeds_the_sum_and_zero_when_equal():
    got = _norm([[3.0, 4.0], [1.0, 0.0], [0.5, 0.5]], eps=-1.0, compute="fp16")
    assert got[0] == math.sqrt(24) or abs(got[0] - math.sqrt(24)) < 0.005
    assert got[1] == 0.0
    assert math.isnan(got[2])


def test_eps_only_and_huge_eps():
    assert _norm([[0.0, 0.0]], eps=4.0, compute="fp16")[0] == 2.0
    assert _norm([[1e-7, 0.0]], eps=60000.0, compute="bf16", fmt="bf16")[0] == float(
        torch.tensor(math.sqrt(float(torch.tensor(60000.0).bfloat16()))).bfloat16())


def test_special_values_propagate():
    got = _norm([[float("inf"), 1.0], [float("nan"), 1.0], [0.0, 0.0]], compute="fp16")
    assert math.isinf(got[0]) and math.isnan(got[1]) and got[2] == 0.0


def test_dim_argument_and_output_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=g).half()
    got = vector_norm(x, dim=1)
    assert got.dtype == torch.float16 and got.shape == (3, 4)
    want = vector_norm(x.transpose(1, 2).contiguous(), dim=-1)
    assert torch.equal(got, want)
    e4 = vector_norm(torch.tensor([[3.0, 4.0]]).to(torch.float8_e4m3fn), compute="fp16")
    assert e4.dtype == torch.float8_e4m3fn and float(e4[0]) == 5.0


# ---- 1-D, 0-D and empty inputs: every method x compute format ---------------------------------

SHAPE_SPECS = [("fp16", "fp16"), ("fp16", torch.float16), ("fp16", None), ("bf16", "bf16"),
               ("bf16", torch.bfloat16), ("bf16", None), ("e4m3", "fp16"), ("e5m2", "bf16"),
               ("dlfloat16", "dlfloat16"), ("fp32", None)]


def _vectors(fmt):
    """1-D vectors that stress range: at the maximum (overflows to inf: the true norm is larger),
    half the maximum, the smallest subnormal, mixed magnitudes, and 3-4-5."""
    f = get_format(fmt)
    tiny = f.min_subnormal if f.subnormals else f.min_normal
    return [[3.0, 4.0], [f.max, f.max], [f.max / 2, -f.max / 2], [tiny, tiny, tiny],
            [f.max / 4, 1.0, -tiny], [-1.5, 0.0, 2.0, 0.25, 3.0]]


def _exact(values, fmt, eps=0.0):
    """fsum-based fp64 value and its correct rounding to ``fmt`` (lowp.norms.reference)."""
    v, r = exact_norm(torch.tensor([values], dtype=torch.float64), eps, fmt)
    return float(v[0]), float(r[0])


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("fmt,compute", SHAPE_SPECS)
def test_one_dimensional_inputs_match_rows_and_the_exact_norm(method, fmt, compute):
    """1-D input takes the 2-D path (bf16 [3e38, 3e38] raised IndexError): same bits as the row of
    a 2-D tensor, and robust is faithful to the fsum reference (inf where the norm overflows)."""
    f = get_format(fmt)
    for values in _vectors(fmt):
        x, container = as_input(torch.tensor(values, dtype=torch.float64), f)
        got = vector_norm(x, method=method, compute=compute, format=container)
        assert got.shape == () and got.dtype == x.dtype
        row = vector_norm(x.unsqueeze(0), method=method, compute=compute, format=container)[0]
        assert torch.equal(got, row) or (got.isnan() and row.isnan())
        value, rounded = _exact(values, f)
        if method == "robust":
            if math.isinf(rounded) or rounded == f.max:
                assert float(got) == rounded, (values, float(got), rounded)
            else:
                assert abs(float(got) - value) < float(ulp(torch.tensor(value), f)), (values, float(got), value)
        elif values == [3.0, 4.0]:
            assert float(got) == 5.0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("fmt,compute", SHAPE_SPECS)
def test_zero_dimensional_and_empty_inputs(method, fmt, compute):
    """0-D x is one element: ``sqrt(x**2 + eps)``; an empty dimension is an empty sum: ``sqrt(eps)``
    (NaN for eps < 0), with torch.linalg.vector_norm's shapes; zero rows give an empty result."""
    f = get_format(fmt)
    x, container = as_input(torch.tensor(-3.0, dtype=torch.float64), f)
    got = vector_norm(x, method=method, compute=compute, format=container)
    assert got.shape == () and float(got) == _exact([3.0], f)[1] == 3.0
    with_eps = float(vector_norm(x, 0, eps=0.25, method=method, compute=compute, format=container))
    value, rounded = _exact([3.0], f, 0.25)
    if method == "robust":
        assert with_eps == rounded
    else:
        assert abs(with_eps - value) <= 2 * float(ulp(torch.tensor(value), f))
    empty, container = as_input(torch.empty(2, 0, dtype=torch.float64), f)
    for eps, want in ((0.0, 0.0), (0.25, 0.5), (-0.25, math.nan)):
        got = vector_norm(empty, eps=eps, method=method, compute=compute, format=container)
        assert got.shape == (2,) and got.dtype == empty.dtype
        assert _exact([], f, eps)[1] == want or math.isnan(want)
        assert torch.equal(got.double(), torch.full((2,), want, dtype=torch.float64)) or \
            (math.isnan(want) and got.isnan().all())
    flat, container = as_input(torch.empty(0, dtype=torch.float64), f)
    assert float(vector_norm(flat, eps=0.25, method=method, compute=compute, format=container)) == 0.5
    no_rows, container = as_input(torch.empty(0, 5, dtype=torch.float64), f)
    assert vector_norm(no_rows, method=method, compute=compute, format=container).shape == (0,)


# ---- errors ------------------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
    x = torch.ones(2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="method"):
        vector_norm(x, method="fast")
    with pytest.raises(ValueError, match="eps"):
        vector_norm(x, eps=float("nan"))
    with pytest.raises(TypeError, match="x"):
        vector_norm([1.0, 2.0])
    with pytest.raises(TypeError, match="x"):
        vector_norm(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="compute"):
        vector_norm(x.bfloat16(), compute="fp16")  # bf16 values do not fit in fp16
    with pytest.raises(TypeError, match="compute"):
        vector_norm(x, compute=3)
    with pytest.raises(ValueError, match="compute"):
        Native(torch.int8)
    with pytest.raises(ValueError, match="dim"):
        vector_norm(x, dim=2)
    with pytest.raises(ValueError, match="dim"):
        vector_norm(torch.tensor(1.0), dim=1)
    with pytest.raises(ValueError, match="dim"):
        vector_norm(x, dim=1.0)
    with pytest.raises(ValueError, match="too narrow"):
        vector_norm(torch.tensor([[1.0, 2.0]]), compute="fp4_e2m1", format="fp4_e2m1")


# ---- lowp norm-check ------------------------------------------------------------------------

def test_norm_check_command_writes_markdown_and_csv(tmp_path, capsys):
    from lowp.cli import main

    md, csv = tmp_path / "n.md", tmp_path / "n.csv"
    assert main(["norm-check", "--formats", "fp16,e4m3:bf16,bf16:native", "--methods", "naive,robust", "--rows", "8",
                 "--n-long", "64", "--markdown", str(md), "--csv", str(csv), "--modules"]) == 0
    out = capsys.readouterr().out
    assert "robust" in out and "fp8_e4m3fn" in out
    assert "LayerNorm" in out and "| module |" in md.read_text()
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("method,input,compute,family")
    robust_rows = [line.split(",") for line in lines[1:] if line.startswith("robust")]
    assert robust_rows and all(float(r[5]) < 1 for r in robust_rows)  # max_ulp column
    assert md.read_text().startswith("| method |")


@pytest.mark.parametrize("argv,option", [(["--methods", "nope"], "--methods"),
                                         (["--formats", "notaformat"], "--formats")])
def test_norm_check_rejects_bad_arguments(argv, option, capsys):
    from lowp.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["norm-check", *argv])
    assert exc.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_float32_inputs_use_float64_opmath_without_overflow():
    x = torch.tensor([[1e30, 1e30], [1e-40, 1e-40], [3.0, 4.0]], dtype=torch.float32)
    got = vector_norm(x)
    assert got.dtype == torch.float32
    want = torch.linalg.vector_norm(x.double(), dim=-1).float()  # fp64 is exact enough here
    assert torch.equal(got, want)
