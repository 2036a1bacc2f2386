"""Shared fixtures: every test starts as a fresh process would; ``one_thread`` runs a test with one
torch thread."""
from __future__ import annotations

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
