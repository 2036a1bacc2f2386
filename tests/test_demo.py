"""``lowp demo``: the data, the model, and the command end to end (tiny in the default suite,
the full accuracy claim under ``-m slow``)."""
from __future__ import annotations

import csv

import pytest
import torch

from lowp.cli import main
from lowp.demo.data import load_data, stdlib_text
from lowp.demo.train import RUNS, DemoConfig, train_run


pytestmark = pytest.mark.usefixtures("one_thread")


def test_stdlib_text_is_deterministic_python_source():
    text, files = stdlib_text(50_000)
    again, files_again = stdlib_text(50_000)
    assert text == again and files == files_again and len(text) == 50_000
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert b"def " in text and b"import " in text
    data = load_data(50_000, val_fraction=0.1)
    assert data.val.numel() == 5_000 and int(data.train.max()) < 256
    x, y = data.batch(4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="val_fraction"):
        load_data(1000, val_fraction=1.5)


def test_every_run_starts_from_the_same_weights_and_bf16_runs_store_bf16():
    data = load_data(20_000)
    cfg = DemoConfig(steps=3, batch_size=2, seq_len=16, dim=16, heads=2, eval_every=1, eval_batches=1)
    results = {name: train_run(name, data, cfg) for name in RUNS}
    assert results["fp32"].bytes_per_param == pytest.approx(16.0)        # 4 + 4 + 2 * 4
    assert results["bf16-kahan"].bytes_per_param == pytest.approx(10.0)  # 2 + 2 + 2 * 2 + 2
    assert results["bf16-nearest"].bytes_per_param == pytest.approx(8.0)
    assert results["bf16-exact"].bytes_per_param == pytest.approx(10.0)
    assert results["fp16-kahan"].bytes_per_param == pytest.approx(10.0)  # fp16 weights, bf16 moments by default
    first = {name: r.curve[0][1] for name, r in results.items()}
    assert max(first.values()) - min(first.values()) < 0.05              # same start, bf16 rounding only


def test_demo_command_writes_table_csv_and_png(tmp_path, capsys):
    rc = main(["demo", "--steps", "4", "--modes", "fp32,bf16-kahan", "--jobs", "1", "--batch-size", "2",
               "--max-bytes", "20000", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bf16-kahan" in out and "val loss" in out and "bytes/param" in out
    rows = list(csv.reader((tmp_path / "demo.csv").open()))
    assert rows[0][:2] == ["run", "val loss"] and [r[0] for r in rows[1:]] == ["fp32", "bf16-kahan"]
    png = (tmp_path / "demo_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_command_rejects_unknown_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--modes", "fp32,bf16-kahn", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--modes" in capsys.readouterr().err


@pytest.mark.slow
def test_full_demo_bf16_kahan_matches_fp32_and_nearest_is_worse(tmp_path):
    """Default settings (seed 0): bf16 + kahan no more than 0.5% above fp32's validation loss,
    bf16 + nearest more than 1% above bf16 + kahan. docs/optimizers.md has the numbers of other
    seeds and step counts: the seed-to-seed spread at this scale is about 0.5%."""
    assert main(["demo", "--out", str(tmp_path)]) == 0
    rows = {r[0]: float(r[1]) for r in list(csv.reader((tmp_path / "demo.csv").open()))[1:]}
    assert rows["bf16-kahan"] / rows["fp32"] - 1 < 0.005, rows
    assert rows["bf16-nearest"] / rows["bf16-kahan"] - 1 > 0.01, rows


@pytest.mark.slow
def test_full_demo_fp16_weights_with_default_states_match_fp32(tmp_path):
    """fp16 weights + kahan with the default (bf16) moments: within 0.5% of fp32 (measured +0.05%;
    with fp16 moments +56%, docs/optimizers.md)."""
    assert main(["demo", "--modes", "fp32,fp16-kahan", "--out", str(tmp_path)]) == 0
    rows = {r[0]: float(r[1]) for r in list(csv.reader((tmp_path / "demo.csv").open()))[1:]}
    assert abs(rows["fp16-kahan"] / rows["fp32"] - 1) < 0.005, rows
