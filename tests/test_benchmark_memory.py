"""``benchmarks/memory_accuracy.py --quick``: a smoke run in a subprocess whose tables hold every
configuration, with losses and memory figures that are consistent with each other."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "memory_accuracy.py"


def _names() -> tuple[list[str], list[str]]:
    """The configuration names, read from the script's own tables without importing it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_accuracy
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return [s.name for s in memory_accuracy.MAIN], [s.name for s in memory_accuracy.ABLATION]


@pytest.mark.slow   # 14 s, 31 s with a cold kernel cache; the memory rows' tests run by default (test_cli_memory)
def test_quick_run_reports_every_configuration(tmp_path: Path) -> None:
    out_json = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out_json)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    main, ablation = _names()
    results = json.loads(out_json.read_text())
    skipped = results["skipped"]
    assert set(skipped) <= {"torchao AdamW8bit"}, skipped
    lines = proc.stdout.splitlines()
    for name in main + ablation:
        if name in skipped:
            assert f"{name}: skipped, " in proc.stdout
            continue
        rows = [line for line in lines if line.startswith(name + "  ")]
        assert rows, f"no table row for {name!r}"
        # every loss in the row parses, and each one relative to fp32 is printed with it
        for row in rows:
            for loss, pct in re.findall(r"(\d+\.\d{4}) \(([+-]\d+\.\d{2})%\)", row):
                assert math.isfinite(float(loss)) and abs(float(pct)) < 100
    cells = {k.split("|")[2] for k in results["accuracy"]}
    assert cells == set(main) - set(skipped)
    assert set(results["ablation"]) == set(ablation)
    for key, run in {**results["accuracy"], **results["ablation"]}.items():
        assert math.isfinite(run["loss"]) and 0 < run["loss"] < math.log(256), key
    # the documented layouts (torch's AdamW adds a 4-byte step count per tensor); release never
    # raises the peak
    memory = results["memory"]
    assert 12.0 < memory["fp32 AdamW"]["bytes_per_param"] < 12.01
    assert memory["bf16 kahan"]["bytes_per_param"] == 8.0
    assert memory["recommended"]["bytes_per_param"] <= 5.1
    assert memory["aggressive"]["bytes_per_param"] <= 3.6
    for name, m in memory.items():
        assert m["peak"] >= m["resident"] > 0, name
        if m["peak_release"] is not None:
            assert m["resident"] < m["peak_release"] < m["peak"], name
