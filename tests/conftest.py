"""Shared fixtures: every test starts as a fresh process would; ``one_thread`` runs a test with one
torch thread; ``mypy_run`` is the type check of ``lowp``, started in the background as soon as
the session's tests are collected, beside a warmer of the native kernels' build cache (the tests
of :data:`WARM_FIRST` run first in a background process)."""
from __future__ import annotations

import contextlib
import os
import signal
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


#: The tests that compile the most native kernel variants (about a second each; a fresh machine
#: has none in its build cache, :mod:`lowp.build_cache`): 160 of the default suite's 290 builds.
#: A session that runs them runs them first in a background process (:func:`_start_warmer`), at
#: a lower priority, on the core the session leaves idle, so that when its turn comes each finds
#: its variants built (the cache takes concurrent builds of one variant: one builds, the other
#: waits and loads it).
WARM_FIRST = ("tests/test_fused_native.py::", "tests/test_native_safety.py::test_fuzz_native",
              "tests/test_registry.py::test_native_")
_WARMER = pytest.StashKey["subprocess.Popen | None"]()
#: set in the warmer's environment: its own session starts no type check and no warmer
_WARMING = "LOWP_TESTS_WARMING"


#: the fewest of the session's tests of :data:`WARM_FIRST` worth a warmer (a few selected tests
#: would only run twice at once)
_WARM_MIN_TESTS = 20


def _start_warmer(session: pytest.Session) -> subprocess.Popen | None:
    """``python -m pytest`` of the session's tests of :data:`WARM_FIRST` in a process group of
    its own (its children end with it), output discarded (the session runs and reports them
    itself), without the session's ``PYTEST_ADDOPTS`` (a shared ``--basetemp`` or report file);
    ``None`` for fewer than :data:`_WARM_MIN_TESTS` of them or a session that only collects."""
    ids = [item.nodeid for item in session.items if item.nodeid.startswith(WARM_FIRST)]
    if len(ids) < _WARM_MIN_TESTS or session.config.option.collectonly:
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             "--timeout=600", *ids], cwd=ROOT, env={**env, _WARMING: "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_configure(config: pytest.Config) -> None:
    """The warmer's session runs at ``nice`` 10 (it takes the cores the session leaves idle) and,
    on Linux, ends with its process group when the session's process dies, however it dies
    (``PR_SET_PDEATHSIG``, prctl(2)): a CI job killed on a timeout leaves no warmer behind."""
    if not os.environ.get(_WARMING):
        return
    os.nice(10)
    if sys.platform.startswith("linux"):
        import ctypes
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        if os.getppid() == 1:   # the session died before the call
            os.killpg(0, signal.SIGKILL)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the type check when the session will run it (mypy over torch's stubs takes about a
    minute without a cache, a fresh clone, single-threaded, and most tests leave a core idle),
    and the warmer of the kernel cache (:data:`WARM_FIRST`), unless this session is the warmer."""
    if os.environ.get(_WARMING):
        return
    if any(item.nodeid.endswith(_MYPY_TEST) for item in session.items):
        session.config.stash[_MYPY] = _start_mypy()
    session.config.stash[_WARMER] = _start_warmer(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A type check the session did not wait for (stopped early, ``-x``) is ended with it, and
    so is a warmer still running, with every process it started."""
    proc = session.config.stash.get(_MYPY, None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()
    warmer = session.config.stash.get(_WARMER, None)
    if warmer is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(warmer.pid, signal.SIGKILL)   # its children too, even when it has ended
        warmer.communicate()


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
