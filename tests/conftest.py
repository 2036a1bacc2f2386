"""Shared fixtures: every test starts as a fresh process would; ``one_thread`` runs a test with one
torch thread; ``mypy_run`` is the type check of ``lowp``, started in the background as soon as
the session's tests are collected."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowp.optim import randomness
from lowp.threads import single_thread


@pytest.fixture(autouse=True)
def _fresh_default_seeds():
    """Optimizers built without a seed take distinct seeds while alive together
    (``randomness.default_seed``); each test starts with none held, so its bits do not depend on
    what the tests before it left alive."""
    randomness.reset_default_seeds()
    yield


@pytest.fixture
def one_thread():
    """Torch single-threaded for the test (``pytestmark = pytest.mark.usefixtures("one_thread")``
    in a module whose tensors are small): a second thread only adds wake-up latency, milliseconds
    per op on a busy 2-core machine."""
    with single_thread():
        yield


ROOT = Path(__file__).resolve().parents[1]
_MYPY_TEST = "tests/test_lint.py::test_mypy_finds_nothing"
_MYPY = pytest.StashKey["subprocess.Popen | None"]()


def _start_mypy() -> subprocess.Popen:
    """``python -m mypy`` on the repository (its configuration in pyproject.toml), output captured."""
    return subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the type check when the session will run it: mypy over torch's stubs takes about a
    minute without a cache (a fresh clone), single-threaded, and most tests leave a core idle."""
    if any(item.nodeid.endswith(_MYPY_TEST) for item in session.items):
        session.config.stash[_MYPY] = _start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A type check the session did not wait for (stopped early, ``-x``) is ended with it."""
    proc = session.config.stash.get(_MYPY, None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture
def mypy_run(request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    """The finished type check: the one started at collection, else one run now."""
    proc = request.config.stash.get(_MYPY, None) or _start_mypy()
    request.config.stash[_MYPY] = None   # used up: a second run of the test starts its own
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
