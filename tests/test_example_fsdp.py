"""The FSDP2 example stays runnable: ``torchrun --nproc_per_node 2 examples/fsdp_train.py`` trains,
saves a DCP checkpoint half way, and ``--resume`` prints the same losses after it, bit for bit; the
advisor's verdict it prints matches the reduce-scatter it installs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path: Path, *args: str) -> tuple[dict[int, str], list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--standalone", str(ROOT / "examples" / "fsdp_train.py"), "--steps", "8",
                             "--checkpoint", str(tmp_path / "ckpt"), *args],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    losses = {int(m[1]): m[2] for m in re.finditer(r"step\s+(\d+)\s+loss (\S+)", result.stdout)}
    return losses, re.findall(r"^advisor: (.*)$", result.stdout, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("--states", "8bit", "--mode", "exact8"), ("--reduce", "bf16")],
                         ids=["bf16", "8bit", "bf16-reduce"])
def test_fsdp_example_trains_and_resumes_bit_identically(tmp_path, options):
    first, advice = _torchrun(tmp_path, *options)
    if "--reduce" in options:      # FSDP's own reduce-scatter of bf16 parameters: bf16 sums, flagged
        assert advice and all("reduce_dtype is None, so gradients are reduced in torch.bfloat16" in a for a in advice)
    else:
        assert advice == ["nothing to change"]
    assert sorted(first) == list(range(1, 9))
    resumed, _ = _torchrun(tmp_path, "--resume", *options)
    assert sorted(resumed) == list(range(5, 9))
    assert all(resumed[s] == first[s] for s in resumed)   # printed to 6 decimals: the same run
    assert float(first[8]) < float(first[1])
