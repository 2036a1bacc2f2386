"""``lowp audit --blocks`` (:mod:`lowp.audit.blocks`): the test tensors are what they claim, the
SQNR is the formula, and the table orders the formats as their bits do."""
import math

import pytest
import torch

from lowp.audit.blocks import (BLOCK_PRESETS, SCALE_ROUNDINGS, TENSORS, block_format_table, outlier_channels,
                               sqnr_db, sample_tensor)
from lowp.cli import main


def test_tensors():
    g, t, o = (sample_tensor(kind, 64, 512) for kind in TENSORS)
    assert g.shape == t.shape == o.shape == (64, 512)
    kurtosis = [float((x - x.mean()).pow(4).mean() / (x - x.mean()).pow(2).mean() ** 2) for x in (g, t)]
    assert 2.5 < kurtosis[0] < 3.5 and kurtosis[1] > 6      # Student t(3) has heavy tails
    channels = outlier_channels(512)
    assert channels.numel() == 5
    others = torch.ones(512, dtype=torch.bool)
    others[channels] = False
    assert o[:, channels].abs().mean() > 50 * o[:, others].abs().mean()
    with pytest.raises(ValueError, match="^kind: "):
        sample_tensor("uniform")


def test_sqnr_is_the_formula():
    assert sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0])) == pytest.approx(10 * math.log10(25.0))
    assert sqnr_db(torch.ones(4), torch.ones(4)) == math.inf


def test_table_orders_formats_by_bits():
    heads, rows = block_format_table(rows=32, cols=256)
    assert len(heads) == 3 + len(TENSORS) + 1
    assert len(rows) == len(BLOCK_PRESETS) * len(SCALE_ROUNDINGS) * 2
    db = {(r[0], r[1], r[2]): [float(v) for v in r[3:]] for r in rows}
    e4m3, fp4 = db[("mxfp8_e4m3", "floor", "-")], db[("mxfp4", "floor", "-")]
    assert 28 < e4m3[0] < 34              # 3 mantissa bits: about 6.02 x 4 + 7 dB on N(0, 1)
    assert all(a > b + 8 for a, b in zip(e4m3, fp4))
    # an outlier channel sets its blocks' scales: fp4's other channels lose most of their precision,
    # while fp8 e4m3's range keeps them (without the Hadamard transform, which spreads the outlier)
    assert db[("mxfp4", "floor", "-")][-1] < 10 < db[("mxfp8_e4m3", "floor", "-")][-1]
    assert db[("mxfp8_e4m3", "floor", 32)][-1] < db[("mxfp8_e4m3", "floor", "-")][-1] - 10


def test_cli_prints_the_table(capsys):
    assert main(["audit", "--blocks"]) == 0
    out = capsys.readouterr().out
    assert "SQNR" in out and "nvfp4" in out and out.count("mxfp8_e4m3") == 8
