"""``benchmarks/sharded_sums.py``: a small run on 2 gloo ranks, on the native kernel and on the
reference, prints every row, the two StableAdamW rows (gathered copies, sums exchanged) give the
same bits, and the exchange receives fewer bytes."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_helpers import benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sharded_sums.py"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "foreach"])
def test_a_small_run_gives_the_gathered_bits_for_fewer_bytes(backend):
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--scale", "8", "--backend", backend],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the two StableAdamW rows give the same bits: True" in done.stdout, done.stdout
    assert f"lowp on {backend}," in done.stdout, done.stdout
    received = {}
    for row in benchmark("sharded_sums").ROWS:
        line = next(line for line in done.stdout.splitlines() if line.startswith(row))
        found = re.search(r"\d+\.\d+ ms +\d+\.\d+x +(\d+\.\d+) MiB", line)
        assert found, line
        received[row] = float(found.group(1))
    torch_row, gathered, exchanged = benchmark("sharded_sums").ROWS
    assert received[torch_row] == 0.0 and 0.0 < received[exchanged] < received[gathered], received
