"""``benchmarks/codes_step.py``: the bytes a step moves (its memory floor) against the tensors'
own sizes, and a small run in a subprocess whose table holds every configuration."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowp.optim as lo
from lowp.optim.kernels.native import codec as native_codec
from benchmark_helpers import benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "codes_step.py"


@pytest.mark.parametrize("state_dtype, expected", [
    (None, 2 * (2 + 2 + 2 + 2) + 2),                              # weight, Kahan, two bf16 moments; gradient
    ({"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, 2 * (2 + 2 + 1 + 1 + 2 * 2 / 64) + 2),
    ({"exp_avg": torch.int8, "exp_avg_sq": torch.uint4}, 2 * (2 + 2 + 1 + 0.5 + 2 * 2 / 64) + 2),
])
def test_moved_bytes_counts_every_state_read_and_written(state_dtype, expected):
    numel = 64 * 40
    p = torch.nn.Parameter(torch.randn(numel).bfloat16())
    p.grad = torch.randn(numel).bfloat16()
    coded = {} if state_dtype is None else {"state_dtype": state_dtype, "coded_min_numel": 0}
    opt = lo.AdamW([p], lr=1e-3, backend="foreach", **coded)
    opt.step()
    assert benchmark("codes_step").moved_bytes(p, opt.state[p]) == expected * numel


@pytest.mark.slow   # 6 s, 21 s with a cold kernel cache
@pytest.mark.skipif(not native_codec.available(), reason="the CPU table times the native backend (x86-64, AVX2)")
def test_small_run_prints_every_configuration_against_its_floor():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "64K", "--threads", "1", "--rounds", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 64K | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 3 + len(benchmark("codes_step").CONFIGS) + 1
    assert float(re.match(r"([\d.]+) GB/s", cells[2]).group(1)) > 0
    per_param = [float(re.search(r"([\d.]+) B/param", c).group(1)) for c in cells[3:-1]]
    assert per_param == [18.0, 14.12, 14.12, 13.12]               # printed to two decimals
    assert all(float(re.search(r"([\d.]+)x floor", c).group(1)) > 0 for c in cells[3:-1])
    assert float(re.match(r"([\d.]+) GB/s", cells[-1]).group(1)) > 0
