"""Timing shared by the benchmark scripts (``benchmarks/`` is on ``sys.path`` when they run)."""
from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The best of ``repeats`` timings of ``fn`` by ``clock``, in seconds, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best
