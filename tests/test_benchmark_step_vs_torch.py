"""``benchmarks/step_vs_torch.py``: its parameter lists are the models they name, and a small run
in a subprocess prints every row with the baseline at 1.00x, the host time per tensor and the steps
lowp took from its cached plan."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_helpers import benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "step_vs_torch.py"


def test_gpt2_lists_are_gpt2_small():
    """148 tensors; 124,439,808 parameters (GPT-2 small with tied output embedding), and the list
    with every dimension divided by 8."""
    bench = benchmark("step_vs_torch")
    full, small = bench.gpt2_shapes(1), bench.gpt2_shapes(8)
    assert len(full) == len(small) == 148
    assert sum(torch.Size(s).numel() for s in full) == 124_439_808
    assert sum(torch.Size(s).numel() for s in small) == 1_957_632
    assert full[0] == (50257, 768) and full[2 + 2] == (768, 2304)


#: sgd and lion run the same script's rows (about 7 s each with a cold kernel cache): the slow suite
@pytest.mark.parametrize("optimizer,dtensor", [("adamw", False), pytest.param("sgd", False, marks=pytest.mark.slow),
                                               pytest.param("lion", False, marks=pytest.mark.slow),
                                               pytest.param("adamw", True, marks=pytest.mark.slow)],   # 19 s
                         ids=["adamw", "sgd", "lion", "adamw, DTensor parameters"])
def test_a_small_run_prints_every_row(optimizer, dtensor):
    """With ``--dtensor`` the lowp rows' steps come from their cached plans too (DTensor
    parameters on a mesh of one rank; the 8-bit states of 1,000-element shards keep the
    parameter's placements, as nothing is split)."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--optimizer", optimizer, "--lists", "500x1000", "--steps",
                           "1", "--threads", "1", *(["--dtensor"] if dtensor else [])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    baseline, rows = benchmark("step_vs_torch").configs(optimizer, dtensor=dtensor)
    assert ("DTensor parameters (one rank)" in done.stdout) == dtensor
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[")]   # DeepSpeed logs "[date] ..."
    header = next(line for line in lines if line.startswith("parameter list"))
    assert all(name in header for name in rows)
    data = next(line for line in lines if line.startswith("500x1000"))
    assert len(re.findall(r"\d+\.\d+ ms \(\d+\.\d+x\)", data)) == len(rows)
    assert re.search(r"\(1\.00x\)", data)   # the baseline against itself
    host = next(line for line in lines if line.startswith("host time per tensor (500x1000)"))
    assert all(name in host for name in rows)
    memory = next(line for line in lines if line.startswith("memory copy bandwidth in this process"))
    assert float(re.search(r": (\d+) GB/s", memory).group(1)) > 0
    cached = next(line for line in lines if line.startswith("steps taken from the cached plan"))
    lowp_rows = [name for name in rows if name.startswith("lowp")]
    # every step of a lowp row after its first took the cached plan (the fast path ran)
    assert all(f"{name} 2 of 3" in cached for name in lowp_rows) and lowp_rows
