"""benchmarks/compressed_training.py's core for a handful of steps on 2 gloo ranks (issue 29's
training measurement, smoke-sized): the table's columns, the plot, the byte ratio of the 8-bit wire."""
from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from benchmark_helpers import benchmark
from lowp.distributed.training_runs import (COLUMNS, SEED_COLUMNS, RecallTask, RunResult, RunSpec, seed_table,
                                            summarize, summarize_seeds, table)


@pytest.mark.slow   # 23 s on 2 cores; test_compressed_fsdp and test_compressed_hooks run the wire by default
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


def _fake(reduction: str, seed: int, loss: float, model: str = "demo", R: int = 2) -> RunResult:
    spec = asdict(RunSpec(model=model, reduction=reduction, world_size=R, seed=seed, steps=4))
    ratio = {"fp32": 2.0, "bf16-ring": 1.0}.get(reduction, 0.52)
    return RunResult(spec=spec, curve=[(1, 9.0), (2, loss), (3, loss), (4, loss)], params=10, hook_calls=4,
                     elements=40, wire_bytes=0, control_bytes=0, move_bytes=0, ring_bytes=400.0 * ratio,
                     bf16_ring_bytes=400.0, seconds=1.0)


def test_gaps_are_paired_by_seed_and_the_verdict_uses_their_mean(tmp_path, capsys):
    """Three seeds whose fp32 losses differ more than the gaps: the summary pairs each run with the
    fp32 run of its own seed (mean gap and standard error over seeds), the verdict judges the mean,
    and several --from-json files of one seed each give the tables and both plots."""
    fp32 = {0: 2.0, 1: 2.2, 2: 1.9}
    gaps = {0: 0.004, 1: -0.002, 2: 0.007}     # fractions of fp32's loss
    results = [_fake("fp32", s, fp32[s]) for s in fp32]
    results += [_fake("fp8-ef", s, fp32[s] * (1 + gaps[s])) for s in fp32]
    results += [_fake("fp8-ef", 3, 1.0)]        # a seed without an fp32 run is left out
    rows = summarize_seeds(results)
    row = next(r for r in rows if r["reduction"] == "fp8-ef")
    assert tuple(row) == SEED_COLUMNS and row["seeds"] == 3
    per_seed = [100 * gaps[s] for s in (0, 1, 2)]
    assert row["gaps per seed %"] == pytest.approx(per_seed)
    mean = sum(per_seed) / 3
    assert row["mean gap vs fp32 %"] == pytest.approx(mean)
    assert row["s.e. %"] == pytest.approx(math.sqrt(sum((g - mean) ** 2 for g in per_seed) / 2 / 3))
    assert "+0.30" in seed_table(rows)

    script = benchmark("compressed_training")
    files = []
    for s in (0, 1, 2):
        path = tmp_path / f"seed{s}.json"
        path.write_text(json.dumps([asdict(r) for r in results if r.spec["seed"] == s]))
        files.append(str(path))
    out = tmp_path / "curves.png"
    script.main(["--from-json", ",".join(files), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| " + " | ".join(SEED_COLUMNS) + " |" in printed
    assert "demo R=2 fp8-ef (mean of 3 seeds, s.e. 0.26%): gap +0.300% (met" in printed
    assert out.stat().st_size > 1000 and (tmp_path / "curves_seeds.png").stat().st_size > 1000


def test_bad_seeds_are_refused_with_the_option_named():
    script = benchmark("compressed_training")
    for bad in ("1,x", ","):
        with pytest.raises(SystemExit, match="--seeds: expected"):
            script.main(["--seeds", bad])
