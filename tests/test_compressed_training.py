"""benchmarks/compressed_training.py's core for a handful of steps on 2 gloo ranks (issue 29's
training measurement, smoke-sized): the table's columns, the plot, the byte ratio of the 8-bit wire."""
from __future__ import annotations

import json

import pytest
import torch

from benchmark_helpers import benchmark
from lowp.distributed.training_runs import COLUMNS, RecallTask, RunResult, RunSpec, summarize, table


def test_script_core_runs_on_two_ranks_and_the_8bit_wire_sends_at_most_055_of_bf16(tmp_path, capsys):
    script = benchmark("compressed_training")
    out, raw = tmp_path / "curves.png", tmp_path / "runs.json"
    results = script.main(["--world-sizes", "2", "--models", "recall", "--reductions", "fp32,bf16-ring,fp8-ef,fp8",
                           "--recall-steps", "6", "--eval-every", "3", "--out", str(out), "--json", str(raw)])
    printed = capsys.readouterr().out
    assert "| " + " | ".join(COLUMNS) + " |" in printed
    assert out.stat().st_size > 1000
    assert [RunResult.from_dict(d).final_loss for d in json.loads(raw.read_text())] == \
        [r.final_loss for r in results]

    rows = {row["reduction"]: row for row in summarize(results)}
    assert set(rows) == {"fp32", "bf16-ring", "fp8-ef", "fp8"}
    for row in rows.values():
        assert tuple(row) == COLUMNS and row["R"] == 2 and row["model"] == "recall"
    assert rows["fp32"]["gap vs fp32 %"] == 0
    assert rows["bf16-ring"]["vs bf16 ring"] == pytest.approx(1.0)
    assert rows["fp32"]["vs bf16 ring"] == pytest.approx(2.0)
    for name in ("fp8-ef", "fp8"):        # 1 byte + 1/32 scale byte + padding + agreement: just above 0.5
        assert 0.5 < rows[name]["vs bf16 ring"] <= 0.55, rows[name]
    assert rows["fp8-ef"]["once (move) bytes"] > 0 and rows["fp8"]["once (move) bytes"] == 0
    # same start, same data: after 6 steps every reduction is still within 1% of fp32
    for row in rows.values():
        assert abs(row["gap vs fp32 %"]) < 1.0, row
    assert table(list(rows.values())).count("\n") == 5


def test_run_spec_and_recall_task_checks():
    with pytest.raises(ValueError, match="reduction"):
        RunSpec(reduction="fp4")
    with pytest.raises(ValueError, match="batch"):
        RunSpec(world_size=3)
    task = RecallTask(noise=0.0)
    x, y = task.sample(5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, task.length - 1)
    answers = y != -100
    assert int(answers.sum()) == 5 * task.queries
    # each answer is the value that followed its query key among the pairs
    for b in range(5):
        pairs = dict(zip(x[b, 0:2 * task.pairs:2].tolist(), x[b, 1:2 * task.pairs:2].tolist()))
        for t in answers[b].nonzero().flatten().tolist():
            assert y[b, t] == pairs[int(x[b, t])]
