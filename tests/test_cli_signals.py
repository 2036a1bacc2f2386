"""``lowp demo --jobs 2``: its worker processes die with the command (SIGTERM handled by the
parent; SIGKILL of the parent covered by the workers' PR_SET_PDEATHSIG on Linux)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, uses prctl")


def _workers(parent: int) -> list[int]:
    """Live multiprocessing workers (``spawn_main`` in the command line) whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # 15-25 s on a loaded 2-core machine: two spawned workers import torch
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_demo_workers_die_with_the_parent(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lowp", "demo", "--jobs", "2", "--modes", "fp32,bf16-kahan", "--steps", "100000",
           "--batch-size", "2", "--max-bytes", "20000", "--out", str(tmp_path / "out")]
    log = tmp_path / "stderr.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    workers: list[int] = []
    try:
        # wait until both workers train (the progress bar counts steps): a worker still starting
        # up exits on its own when the parent goes, so that would prove nothing
        deadline = time.monotonic() + 120
        training = re.compile(rb"\| *[1-9]\d*/\d+ \[")
        while time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid)
            if len(workers) == 2 and training.search(log.read_bytes()):
                break
            time.sleep(0.2)
        assert len(workers) == 2 and proc.poll() is None, f"workers never started: {log.read_text()[-2000:]}"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [w for w in workers if _alive(w)]
        assert not survivors, f"workers {survivors} outlived the parent"
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM
            assert b"Traceback" not in log.read_bytes()
            assert not (tmp_path / "out" / "demo.csv").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:  # only if the test failed: do not leave them running
            if _alive(w):
                os.kill(w, signal.SIGKILL)
