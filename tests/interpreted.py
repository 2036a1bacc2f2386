"""Run a test file under Triton's interpreter in a subprocess: ``TRITON_INTERPRET=1`` must be set
before triton is imported, so the cases that step Triton kernels on CPU tensors run as
``python <file> <args>`` with the repository and ``tests/`` on the path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def run_interpreted(script: str | Path, *args: str, timeout: float = 540) -> str:
    """Run ``script`` with ``args`` under the interpreter; its stdout, after asserting it exited
    with 0 (the assertion shows the end of its output)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
