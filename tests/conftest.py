"""Shared fixtures: every test starts as a fresh process would."""
from __future__ import annotations

import pytest

from lowp.optim import randomness


@pytest.fixture(autouse=True)
def _fresh_default_seeds():
    """Optimizers built without a seed take distinct seeds while alive together
    (``randomness.default_seed``); each test starts with none held, so its bits do not depend on
    what the tests before it left alive."""
    randomness.reset_default_seeds()
    yield
