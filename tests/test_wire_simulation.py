"""The simulator, the experiment table and the advisor learn the 8-bit wire formats
(lowp.distributed.simulator.wire_reduce, experiments.wire_table, advisor.advise_wire, and the
``wire`` section of ``lowp reduce-sim``)."""
from __future__ import annotations

import pytest
import torch

from lowp.cli import main
from lowp.distributed.advisor import BucketStats, advise_wire
from lowp.distributed.experiments import WIRE_METHODS, wire_table
from lowp.distributed.simulator import wire_reduce
from lowp.distributed.wire import WireFormat, decode, encode


@pytest.fixture(scope="module")
def table():
    headers, rows = wire_table((2, 64), elements=512, steps=(1, 4, 16))
    col = {h: i for i, h in enumerate(headers)}
    return {(r[0], r[1], r[2]): {h: r[i] for h, i in col.items()} for r in rows}


@pytest.mark.parametrize("fmt", [WireFormat(), WireFormat("int8", 64, "bf16"), WireFormat("fp8_e5m2", 32, "fp32")])
@pytest.mark.parametrize("elements", [256, 100])        # a multiple of the block (one encode call), and not
def test_wire_reduce_is_each_rank_encoded_then_summed_in_fp32(fmt, elements):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, elements, generator=g) * torch.exp2(torch.randint(-6, 7, (5, elements), generator=g).float())
    residual = torch.randn(5, elements, generator=g) * 1e-2
    got, new = wire_reduce(x, fmt, residual)
    v = x + residual
    sent = torch.stack([decode(encode(v[r], fmt), fmt, elements) for r in range(5)])
    total = sent[0]
    for r in range(1, 5):
        total = total + sent[r]
    assert torch.equal(got, (total / 5).double())
    assert torch.equal(new, v - sent)


def test_wire_reduce_checks_its_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(TypeError, match="fmt"):
        wire_reduce(x, "fp8_e4m3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="residual"):
        wire_reduce(x, WireFormat(), torch.zeros(2, 7))
    with pytest.raises(ValueError, match="random"):
        wire_reduce(x, WireFormat(rounding="stochastic"))


def test_table_has_every_method_case_and_world_size(table):
    assert {k[2] for k in table} == set(WIRE_METHODS)
    assert {k[0] for k in table} == {"gaussian", "heavy"} and {k[1] for k in table} == {2, 64}


def test_feedback_average_error_falls_as_one_over_t_while_nearest_stays_flat(table):
    for (case, R, method), row in table.items():
        if method.endswith("+EF"):
            assert row["avg1/noise"] == row["err/noise"] == table[(case, R, method[:-3])]["err/noise"]
            assert 2.5 < row["avg1/noise"] / row["avg4/noise"] < 6, (case, R, method, row)      # ~4
            assert 10 < row["avg1/noise"] / row["avg16/noise"] < 25, (case, R, method, row)    # ~16
        elif method.endswith("/SR"):      # independent rounding: 1/sqrt(T)
            assert 1.5 < row["avg1/noise"] / row["avg4/noise"] < 3, (case, R, method, row)
            assert 2.5 < row["avg1/noise"] / row["avg16/noise"] < 6, (case, R, method, row)
        else:
            assert row["avg1/noise"] == row["avg4/noise"] == row["avg16/noise"] == row["err/noise"]


def test_qualitative_facts_of_the_formats(table):
    for case in ("gaussian", "heavy"):
        for R in (2, 64):
            row = {m: table[(case, R, m)] for m in WIRE_METHODS}
            assert row["fp32"]["err/noise"] < 1e-5
            assert row["fp8_e5m2"]["err/noise"] > 1.5 * row["fp8_e4m3"]["err/noise"]    # one mantissa bit less
            assert row["fp8_e4m3/SR"]["err/noise"] > row["fp8_e4m3"]["err/noise"]       # SR: up to a whole step
            for m in ("fp8_e4m3", "fp8_e5m2", "int8"):
                assert row[m]["err/noise"] < 0.1                # fp32 accumulation: the compression error only
                assert abs(row[m]["bias/noise"]) < 0.1
    # the per-rank errors average like the noise: error / noise does not grow with R for the wire
    for m in ("fp8_e4m3", "fp8_e5m2", "int8"):
        ratio = table[("gaussian", 64, m)]["err/noise"] / table[("gaussian", 2, m)]["err/noise"]
        assert 0.7 < ratio < 1.4, (m, ratio)
    # the bf16 ring's per-hop rounding does: 64 ranks vs 2
    assert table[("gaussian", 64, "bf16_ring")]["err/noise"] > 2 * table[("gaussian", 2, "bf16_ring")]["err/noise"]


def test_table_is_deterministic_and_checks_its_arguments():
    a = wire_table((2,), elements=64, steps=(2,), cases=("heavy",), seed=5)
    b = wire_table((2,), elements=64, steps=(2,), cases=("heavy",), seed=5)
    assert a == b
    with pytest.raises(ValueError, match="steps"):
        wire_table((2,), elements=64, steps=(0,))
    with pytest.raises(ValueError, match="case"):
        wire_table((2,), elements=64, cases=("cauchy",))
    with pytest.raises(ValueError, match="block"):
        wire_table((2,), elements=64, block=24)
    with pytest.raises(ValueError, match="world_size"):
        wire_table((1 << 20,), elements=64)


@pytest.mark.parametrize("stats, element", [
    (BucketStats(4096, 8, 0.0, 1e-3, absmax=4e-3), "fp8_e4m3"),        # Gaussian: e4m3 far below the noise
    (BucketStats(4096, 64, 0.0, 1e-3, absmax=0.3), "fp8_e4m3"),        # an outlier 300 sigma out: int8 loses it
    (BucketStats(4096, 64, 16e-3, 1e-3, absmax=19e-3), "int8"),        # ranks agree to 1/16: e4m3's errors correlate
    (BucketStats(4096, 64, 0.0, 1e-3, absmax=1e3), "bf16"),            # 1e6 sigma: both flush the rest of the block
    (BucketStats(4096, 1024, 1.0, 1e-3, absmax=1.0), "bf16"),          # correlated errors at R = 1024
    (BucketStats(4096, 8, 1.0, 0.0, absmax=1.0), "bf16"),              # no sampling noise
])
def test_advisor_recommends_a_wire_format(stats, element):
    advice = advise_wire(stats)
    assert advice.wire.element == element, advice
    assert advice.error_feedback == (element != "bf16")
    if element != "bf16":
        assert advice.error_to_noise[element] <= 0.25 and element in advice.reason
    elif stats.spread_rms > 0:
        assert min(advice.error_to_noise.values()) > 0.25


def test_advisor_checks_its_arguments():
    with pytest.raises(TypeError, match="stats"):
        advise_wire({"numel": 4})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold"):
        advise_wire(BucketStats(16, 2, 0.0, 1.0), threshold=0)
    with pytest.raises(ValueError, match="stats.spread_rms"):
        advise_wire(BucketStats(16, 2, 0.0, -1.0))


def test_reduce_sim_wire_section(tmp_path, capsys):
    assert main(["reduce-sim", "--only", "wire", "--elements", "128", "--max-world-size", "8", "--wire-steps", "8",
                 "--no-plots", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "8-bit wire" in out and "fp8_e4m3+EF" in out and "avg4/noise" in out and "avg8/noise" in out
    lines = (tmp_path / "wire.csv").read_text().splitlines()
    assert lines[0].startswith("case,R,method,err/noise,bias/noise,avg4/noise,avg8/noise")
    assert len(lines) == 1 + 2 * 2 * len(WIRE_METHODS)        # 2 cases x R in (2, 8)
