import math

import pytest
import torch
from torch import nn

from lowp.audit.demo import DemoModel, demo_batch, run_demo
from lowp.audit.monitor import PrecisionMonitor
from lowp.cli import main


class Emit(nn.Module):
    """Returns a fixed tensor, so the monitor's counts can be checked exactly."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.values = values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.values + 0 * x.sum()


def _record(mon, module, phase="forward", tensor="output"):
    return mon.records[(module, phase, tensor)]


def test_counts_match_torch_cast_to_fp16():
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(torch.empty(20000).uniform_(-30, 20, generator=g))
    values = torch.cat([mags * torch.sign(torch.randn(20000, generator=g)),
                        torch.tensor([0.0, 65519.0, 65520.0, 2.0**-25, 2.0**-25 * 1.0001])])
    model = nn.Sequential(Emit(values))
    with PrecisionMonitor(model, "fp16", backward=False) as mon:
        model(torch.zeros(1))
    rec = _record(mon, "0")
    cast = values.half().float()
    assert rec.overflow == int(torch.isinf(cast).sum())
    assert rec.underflow == int(((cast == 0) & (values != 0)).sum())
    assert rec.subnormal == int(((cast != 0) & (cast.abs() < 2.0**-14)).sum())
    assert rec.amax == float(values.abs().max())
    assert rec.min_nonzero == float(values.abs()[values != 0].min())
    assert rec.range_log2 == pytest.approx(math.log2(rec.amax / rec.min_nonzero))


@pytest.mark.parametrize("name", ["bf16", "dlfloat16", "fp8_e4m3fn", "fp8_e5m2"])
def test_counts_match_lowp_rounding(name):
    from lowp.formats import get_format
    from lowp.rounding import quantize

    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    lo = math.log2(fmt.min_subnormal if fmt.subnormals else fmt.min_normal) - 3
    hi = min(math.log2(fmt.max) + 2, 127.99)  # stay finite in fp32
    mags = torch.exp2(torch.empty(20000, dtype=torch.float64).uniform_(lo, hi, generator=g))
    low_ulp = 2.0 ** (fmt.emin - fmt.mantissa_bits)
    top_ulp = 2.0 ** (fmt.emax - fmt.mantissa_bits)
    ties = torch.tensor([fmt.max + top_ulp / 2, low_ulp / 2, fmt.min_normal - low_ulp / 2], dtype=torch.float64)
    values = torch.cat([mags, ties]).float()
    model = nn.Sequential(Emit(values))
    with PrecisionMonitor(model, fmt, backward=False) as mon:
        model(torch.zeros(1))
    rec = _record(mon, "0")
    unbounded = fmt.with_overflow("nan") if fmt.overflow == "saturate" else fmt  # make overflow visible
    q = quantize(values.double(), unbounded, native=False)
    assert rec.overflow == int((~torch.isfinite(q)).sum())
    assert rec.underflow == int(((q == 0) & (values != 0)).sum())
    assert rec.subnormal == int(((q != 0) & (q.abs() < fmt.min_normal)).sum())


def test_nan_inf_counts_and_advice():
    values = torch.tensor([70000.0, 1.0, math.nan, math.inf, 1e-9])
    model = nn.Sequential(Emit(values))
    with PrecisionMonitor(model, "fp16", backward=False) as mon:
        model(torch.zeros(1))
    rec = _record(mon, "0")
    assert (rec.nan, rec.inf, rec.overflow, rec.underflow) == (1, 1, 1, 1)
    text = "\n".join(mon.recommendations())
    assert "non-finite" in text and "keep in fp32: dynamic range 2^46" in text  # 70000 / 1e-9 > fp16's 2^40
    narrow = nn.Sequential(Emit(torch.tensor([70000.0, 1.0])))
    with PrecisionMonitor(narrow, "fp16", backward=False) as mon_narrow:
        narrow(torch.zeros(1))
    assert "rescale by 2^-2 or keep in fp32" in "\n".join(mon_narrow.recommendations())
    with PrecisionMonitor(model, "bf16", backward=False) as mon16:  # bf16 has fp32's range
        model(torch.zeros(1))
    assert _record(mon16, "0").overflow == 0 and _record(mon16, "0").underflow == 0


def test_hooks_exist_only_inside_the_context():
    model = DemoModel()
    x, y = demo_batch()
    mon = PrecisionMonitor(model, "fp16")
    with mon:
        assert all(len(m._forward_hooks) == 1 for m in model.modules())
        run_demo(model, x, y)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    seen = len(mon.records)
    model(x)
    assert len(mon.records) == seen and not mon.attached


def test_demo_model_shows_attention_overflow_and_gradient_underflow():
    torch.manual_seed(0)
    model = DemoModel()
    x, y = demo_batch()
    with PrecisionMonitor(model, "fp16") as mon:
        run_demo(model, x, y, loss_factor=1e-6)
    assert _record(mon, "block.scores").overflow > 0
    assert _record(mon, "block.mlp.0.weight", "backward", "param_grad").underflow > 0
    k = mon.loss_scale_log2()
    assert k is not None and k > 10
    amax = max(r.amax for r in mon.records.values() if r.phase == "backward")
    assert amax * 2.0**k <= 65504 < amax * 2.0 ** (k + 2)
    report = mon.report()
    assert "block.scores [forward output]: overflows fp16" in report and "loss scale of 2^" in report


def test_monitor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        PrecisionMonitor(object())
    with pytest.raises(ValueError, match="underflow_threshold"):
        PrecisionMonitor(nn.Linear(2, 2), underflow_threshold=2)
    with pytest.raises(TypeError, match="underflow_threshold"):
        PrecisionMonitor(nn.Linear(2, 2), underflow_threshold="0.1")
    with pytest.raises(TypeError, match="underflow_threshold"):
        PrecisionMonitor(nn.Linear(2, 2), underflow_threshold=True)
    with pytest.raises(TypeError, match="include"):
        PrecisionMonitor(nn.Linear(2, 2), include="fc")
    with pytest.raises(TypeError, match="backward"):
        PrecisionMonitor(nn.Linear(2, 2), backward="yes")


@pytest.mark.parametrize("args, error, arg", [
    ((None, "forward", "output", torch.ones(2)), TypeError, "module"),
    (("fc", "forward", "", torch.ones(2)), TypeError, "tensor"),
    (("fc", "sideways", "output", torch.ones(2)), ValueError, "phase"),
    (("fc", "forward", "output", [1.0, 2.0]), TypeError, "t"),
    (("fc", "forward", "output", None), TypeError, "t"),
])
def test_observe_rejects_bad_arguments_and_records_nothing(args, error, arg):
    mon = PrecisionMonitor(nn.Linear(2, 2))
    with pytest.raises(error, match=f"^{arg}:"):
        mon.observe(*args)
    assert mon.records == {}
    with pytest.raises(TypeError, match="rec"):
        mon.advise("fc")


def test_observe_ignores_integer_and_empty_tensors_and_records_floats():
    mon = PrecisionMonitor(nn.Linear(2, 2), "fp16")
    mon.observe("fc", "forward", "output", torch.arange(3))
    mon.observe("fc", "forward", "output", torch.empty(0))
    assert mon.records == {}
    mon.observe("fc", "backward", "param_grad", torch.tensor([1e5, 1e-9, 1.0]))
    rec = _record(mon, "fc", "backward", "param_grad")
    assert (rec.numel, rec.overflow, rec.underflow) == (3, 1, 1)


@pytest.mark.parametrize("value, bad", [("10,abc", "abc"), ("0", "0"), ("1", "1"), ("10,2.5", "2.5"), (",", ","),
                                        ("nan", "nan")])
def test_audit_rejects_bad_lengths_with_a_usage_error(value, bad, capsys):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--kinds", "reductions", "--lengths", value, "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "lowp audit: error: argument --lengths: expected" in err and repr(bad) in err
    assert "Traceback" not in err


def test_audit_lengths_accept_exponent_notation():
    import argparse

    from lowp.commands.audit import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--lengths", "10, 1e3"]).lengths == [10, 1000]
    assert parser.parse_args([]).lengths == [10, 1000, 100000, 1000000]


def test_doctor_prints_report(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "block.scores" in out and "Recommendations (target fp16)" in out
    assert main(["doctor", "--format", "bf16"]) == 0
    with pytest.raises(SystemExit):
        main(["doctor", "--format", "nope"])


def test_include_filter_and_forward_only():
    model = DemoModel()
    x, y = demo_batch()
    with PrecisionMonitor(model, "fp16", backward=False, include=lambda name: name.startswith("block.mlp")) as mon:
        run_demo(model, x, y)
    assert mon.records and all(k[0].startswith("block.mlp") and k[1] == "forward" for k in mon.records)
    assert mon.loss_scale_log2() is None


def test_demo_labels_follow_the_class_count():
    from lowp.audit.demo import CLASSES

    assert DemoModel().head.out_features == CLASSES
    _, y = demo_batch(batch=64)
    assert set(y.unique().tolist()) == set(range(CLASSES))
    model = DemoModel(classes=3)
    x, y = demo_batch(classes=3)
    assert int(y.max()) == 2
    assert torch.isfinite(run_demo(model, x, y))
    with pytest.raises(ValueError, match=r"y: expected labels in \[0, 3\)"):
        run_demo(model, *demo_batch())
    with pytest.raises(ValueError, match="y: expected labels of shape"):
        run_demo(model, x, y[:1])
