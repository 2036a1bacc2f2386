"""Thread-count control for code made of many small tensor ops.

For loops of small vector ops (emulated arithmetic, simulated reduction hops, a tiny demo model)
torch's intra-op thread pool only adds synchronisation; on a busy 2-core machine it was measured
to make such loops 5-20x slower. Those paths run inside :func:`single_thread`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["single_thread"]


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch single-threaded inside the block, restoring the thread count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
