import json
import math

import numpy as np
import pytest
import torch

from lowp.audit import reference as ref
from lowp.audit.binary import audit_binary, grid
from lowp.audit.lowformat import LowFormatMath
from lowp.audit.metrics import error_stats, near_midpoint
from lowp.audit.ops import UNARY_OPS
from lowp.audit.reductions import LANES, audit_reductions, blocked_cumsum, lane_reduce
from lowp.audit.seed_tables import conversion_errors, family_table, math_vs_fp32
from lowp.audit.unary import audit_unary
from lowp.cli import main
from lowp.codec import all_values
from lowp.formats import get_format

FP16 = get_format("fp16")


#: the audit's tensors are small: two threads on a shared 2-core machine are ~10x slower
pytestmark = pytest.mark.usefixtures("one_thread")


def _row(rows, op, fmt, method):
    return next(r for r in rows if r["op"] == op and r["format"] == fmt and r["method"] == method)


def test_error_stats_counts_each_kind_of_error():
    exact = torch.tensor([1.0, 1.0 + 2**-12, 1e6, 1e-9, 2.0, 3.0], dtype=torch.float64)
    got = torch.tensor([1.0, 1.0 + 2**-10, math.inf, 0.0, math.nan, 3.0], dtype=torch.float64)
    s = error_stats(got, exact, FP16)
    assert s["n"] == 6
    # inf matches the correct overflow, 0 matches the correct underflow
    assert s["frac_correct"] == pytest.approx(4 / 6)
    assert s["overflow"] == 1  # NaN where a finite result was due
    assert s["nan_mismatch"] == 1 and s["inf_mismatch"] == 0
    assert s["underflow_to_zero"] == 0  # 1e-9 rounds to zero in fp16 too
    assert s["max_ulp"] == math.inf
    assert s["worst_index"] == 4
    one_ulp = error_stats(torch.tensor([1.0 + 2**-9]), torch.tensor([1.0 + 2**-10], dtype=torch.float64), FP16)
    assert one_ulp["max_ulp"] == 1.0 and one_ulp["frac_correct"] == 0.0
    under = error_stats(torch.tensor([0.0]), torch.tensor([1e-6], dtype=torch.float64), FP16)
    assert under["underflow_to_zero"] == 1


def test_near_midpoint_flags_only_values_close_to_a_tie():
    t = torch.tensor([1 + 2**-11 + 2**-50, 1 + 2**-11 + 2**-30, 1.0, 1.3], dtype=torch.float64)
    assert near_midpoint(t, FP16).tolist() == [True, False, False, False]


def test_references_are_accurate():
    x = np.linspace(-0.999, 0.999, 2001)
    back = ref.erf(ref.erfinv(x))
    assert np.max(np.abs(back - x)) < 4e-16
    tiny = np.array([1e-3, 1e-6, 2**-20])
    assert np.allclose(ref.tanh_shrink(tiny), tiny**3 / 3 - 2 * tiny**5 / 15, rtol=1e-12, atol=0)
    xs = np.array([-30.0, -1.0, 0.0, 2.0, 40.0])
    assert np.allclose(ref.sigmoid(xs), 1 / (1 + np.exp(-xs)), rtol=1e-15)
    mild = xs[1:]
    assert np.allclose(ref.gelu_erf(mild), [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in mild], rtol=1e-12)
    assert -1e-190 < ref.gelu_erf(np.array([-30.0]))[0] < 0  # 1 + erf(-30/sqrt 2) would cancel to 0


def test_unary_audit_is_exhaustive_and_opmath_is_correctly_rounded_for_exact_ops():
    rows = audit_unary(["exp", "sqrt", "square", "reciprocal", "expm1"], ["fp16"])
    n_all = all_values("fp16").numel()
    assert _row(rows, "exp", "fp16", "native")["n"] == n_all
    assert _row(rows, "sqrt", "fp16", "native")["n"] == int((all_values("fp16") >= 0).sum())
    for op in ("square", "reciprocal"):  # one fp32 op on fp16 inputs rounds once, correctly
        assert _row(rows, op, "fp16", "opmath")["frac_correct"] == 1.0
        assert _row(rows, op, "fp16", "lowformat")["max_ulp"] <= 0.5
    # a correctly rounded primitive is the low-format model of exp
    assert _row(rows, "exp", "fp16", "lowformat")["frac_correct"] == 1.0
    assert _row(rows, "exp", "fp16", "opmath")["max_ulp"] < 0.51
    # exp(x) - 1 in fp16 loses every small x to zero
    low = _row(rows, "expm1", "fp16", "lowformat")
    assert low["underflow_to_zero"] > 1000 and low["max_ulp"] > 1000


def test_emulated_formats_skip_missing_native_kernels():
    rows = audit_unary(["exp", "sigmoid"], ["fp8_e4m3fn", "dlfloat16"])
    methods = {(r["format"], r["method"]) for r in rows}
    assert ("dlfloat16", "native") not in methods
    assert ("dlfloat16", "lowformat") in methods and ("fp8_e4m3fn", "opmath") in methods
    assert _row(rows, "exp", "fp8_e4m3fn", "lowformat")["frac_correct"] == 1.0
    assert _row(rows, "exp", "fp8_e4m3fn", "opmath")["n"] == all_values("fp8_e4m3fn").numel()


def test_unary_audit_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ops"):
        audit_unary(["nope"])
    with pytest.raises(ValueError, match="methods"):
        audit_unary(["exp"], methods=["fast"])
    with pytest.raises(ValueError, match="stride"):
        audit_unary(["exp"], stride=0)


def test_lowformat_model_rounds_every_step():
    low = LowFormatMath("fp16")
    x = torch.tensor([1e-3, 0.5], dtype=torch.float32)
    # sigmoid = 1/(1+exp(-x)): three roundings, matches doing them by hand
    e = low.exp(-x)
    assert torch.equal(low.formula("sigmoid", x), low.div(torch.ones(2), low.add(torch.ones(2), e)))
    with pytest.raises(ValueError, match="op"):
        low.formula("nope", x)


def test_binary_audit_on_all_fp8_pairs():
    rows = audit_binary(["add", "mul", "hypot"], ["fp8_e4m3fn"], points=10_000)
    n = all_values("fp8_e4m3fn").numel()
    assert _row(rows, "add", "fp8_e4m3fn", "opmath")["n"] == n * n
    for op in ("add", "mul"):
        assert _row(rows, op, "fp8_e4m3fn", "opmath")["frac_correct"] == 1.0
        assert _row(rows, op, "fp8_e4m3fn", "lowformat")["frac_correct"] == 1.0
    assert _row(rows, "hypot", "fp8_e4m3fn", "lowformat")["max_ulp"] > 1  # squares lose range and precision
    assert grid(FP16, 100).numel() == 100
    with pytest.raises(ValueError, match="methods"):
        audit_binary(["add"], methods=["fast"])
    with pytest.raises(ValueError, match="points"):
        grid(FP16, 1)


def test_lane_model_sums_and_scans_exactly_on_integers():
    low = LowFormatMath("fp16")
    x = torch.arange(1, 601, dtype=torch.float32) % 7  # total 1797 < 2048: every partial sum is exact in fp16
    assert float(lane_reduce(low, x, low.add, 0.0)) == float(x.sum())
    assert torch.equal(blocked_cumsum(low, x[:500]), torch.cumsum(x[:500], 0))
    assert LANES >= 2


def test_reduction_audit_opmath_beats_lowformat_on_long_sums():
    rows = audit_reductions(["sum", "softmax"], ["bf16"], lengths=[1_000_000])
    assert _row(rows, "sum", "bf16", "opmath")["max_ulp"] <= 0.5
    assert _row(rows, "sum", "bf16", "lowformat")["max_ulp"] > 10
    assert _row(rows, "softmax", "bf16", "opmath")["n"] == 1_000_000
    with pytest.raises(ValueError, match="ops"):
        audit_reductions(["median"])
    with pytest.raises(ValueError, match="methods"):
        audit_reductions(["sum"], methods=["fast"])
    with pytest.raises(ValueError, match="lengths"):
        audit_reductions(["sum"], lengths=[1])


def test_seed_tables_reproduce_the_conversion_bounds():
    sub = conversion_errors(True, stride=4096)
    normal = conversion_errors(False, stride=4096)
    assert sub["max_abs"] == 16.0 and normal["max_abs"] == 16.0  # half an ulp (32) in [32768, 65504]
    assert 0.3 < sub["max_rel"] <= 1 / 3
    assert normal["max_rel"] <= 2**-11
    assert 0.35 < sub["mean_abs"] < 0.45 and 0.5 < normal["mean_abs"] < 0.56  # seed: 0.38871 and 0.51876
    with pytest.raises(ValueError, match="stride"):
        conversion_errors(stride=0)
    per_op = math_vs_fp32(["exp", "sin", "sqrt"])
    assert per_op["exp"]["max_abs"] <= 16 and per_op["sin"]["max_rel"] < 6e-4
    rows = family_table(per_op)
    assert len(rows) == 5 and rows[1][1] == "-"


def test_cli_writes_csv_json_markdown(tmp_path, capsys):
    code = main(["audit", "--ops", "exp,add,sum", "--lengths", "10,100", "--points", "16", "--out", str(tmp_path),
                 "--no-progress", "--no-exhaustive"])
    assert code == 0
    out = capsys.readouterr().out
    assert "exp" in out and "opmath" in out
    rows = json.loads((tmp_path / "audit.json").read_text())
    assert {r["kind"] for r in rows} == {"unary", "binary", "reduction"}
    assert (tmp_path / "audit.csv").read_text().startswith("kind,op,format,method")
    assert "## unary" in (tmp_path / "audit.md").read_text()
    with pytest.raises(SystemExit):
        main(["audit", "--ops", "nope"])
    with pytest.raises(SystemExit):
        main(["audit", "--kinds", "ternary"])


@pytest.mark.slow
def test_full_exhaustive_unary_audit():
    rows = audit_unary()
    assert len(rows) == 33 * 2 * 3
    for r in rows:
        if r["method"] == "opmath" and r["op"] in ("exp", "log", "sin", "cos", "atan", "tanh", "sqrt", "erfinv"):
            assert r["max_ulp"] < 0.51, r
        if r["method"] == "lowformat" and r["op"] in ("exp", "log2", "erf", "atan"):
            assert r["frac_correct"] == 1.0, r


def test_settle_ties_decides_near_midpoint_references_in_high_precision():
    from lowp.audit.ties import MP_UNARY, settle_ties

    # x - tanh(x) = x + 1 - tiny for x << 0: float64 says exactly x + 1, a midpoint of fp16 in [2048, 4096]
    x = torch.tensor([-4096.0, -4094.0, 4094.0], dtype=torch.float64)
    exact = x - torch.tanh(x)
    assert near_midpoint(exact, FP16).all()
    settled = settle_ties(MP_UNARY["tanh_shrink"], (x,), exact, FP16)
    assert settled.tolist() == [-4096.0, -4094.0, 4094.0]  # the tiny tail pushes past the tie toward x
    # exp2(-25) = 2**-25 is an exact tie between 0 and 2**-24: round to even (0)
    tie = torch.tensor([2.0**-25], dtype=torch.float64)
    assert settle_ties(MP_UNARY["exp2"], (torch.tensor([-25.0], dtype=torch.float64),), tie, FP16).item() == 0.0
    assert set(MP_UNARY) == set(UNARY_OPS)


def test_seed_table_rejects_unknown_op_names():
    with pytest.raises(ValueError, match="ops: unknown unary op"):
        math_vs_fp32(["exp", "no_such_op"])
