"""``benchmarks/sharded_plan.py``: a small run on 2 gloo ranks prints every row against torch's,
and the cached plan row took its steps from the plan while leaving the parameters whose shards
split blocks to a full step (the remainder), the full-step row none; with coded_min_numel=4096
the vectors keep bf16 states and leave the remainder (at GPT-2 / 8 some matrices' shards still
split blocks)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_helpers import benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sharded_plan.py"


@pytest.mark.slow   # 17 s, 31 s with a cold kernel cache; the plan with a remainder runs by default (test_meshes)
def test_a_small_run_takes_the_plan_with_a_remainder():
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--scale", "8"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    kept, left = map(int, re.search(r"the plan keeps (\d+) parameters and leaves (\d+)", done.stdout).groups())
    assert kept > 0 and left > 0 and kept + left == 148, done.stdout
    found = re.search(r"with the default coded_min_numel=4096 it keeps (\d+) and leaves (\d+)", done.stdout)
    kept_small, left_small = map(int, found.groups())
    assert kept_small + left_small == 148 and left_small < left, done.stdout
    # 3 steps per row: the full-step row none from a plan, the plans' rows all but the first
    assert "steps from the plan per row: [0, 2, 2]" in done.stdout, done.stdout
    rows = benchmark("sharded_plan").ROWS
    for row in rows:
        line = next(line for line in done.stdout.splitlines() if line.startswith(row))
        assert re.search(r"\d+\.\d+ ms +\d+\.\d+x", line), line
    assert re.search(r"1\.00x", next(line for line in done.stdout.splitlines() if line.startswith(rows[0])))
