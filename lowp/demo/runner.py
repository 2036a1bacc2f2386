"""Run several demo trainings, in parallel processes when asked, behind one progress bar.

On a small CPU one single-threaded process per run is much faster than one process using every
core for a model this small (thread hand-offs cost more than the matmuls save).

Workers never outlive the command: on SIGTERM or Ctrl-C the parent terminates the pool, and on
Linux each worker also asks the kernel for SIGTERM when its parent dies (``prctl(2)``,
``PR_SET_PDEATHSIG``), which covers a parent killed by SIGKILL. Workers ignore SIGINT, so
Ctrl-C in a terminal (sent to the whole process group) is handled once, by the parent.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm import tqdm

from lowp.demo.data import TextData
from lowp.demo.train import DemoConfig, RunResult, train_run
from lowp.threads import single_thread

__all__ = ["train_all"]

_counter = None


class _Ticker:
    """Minimal stand-in for a tqdm bar inside a worker: bumps a shared step counter."""

    def update(self, n: int = 1) -> None:
        assert _counter is not None, "set by the worker initializer"
        with _counter.get_lock():
            _counter.value += n


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when its parent exits; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _init_worker(counter, parent: int) -> None:
    global _counter
    _counter = counter
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    torch.set_num_threads(1)


class Terminated(Exception):
    """Raised in the parent by SIGTERM while workers run."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` for the block (so cleanup runs); only the main thread
    can install signal handlers, elsewhere the workers' PR_SET_PDEATHSIG is the only guard."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _worker(name: str, data: TextData, cfg: DemoConfig) -> RunResult:
    return train_run(name, data, cfg, _Ticker())


def train_all(runs: list[str], data: TextData, cfg: DemoConfig, jobs: int) -> list[RunResult]:
    """Train every run (``jobs`` at a time) and return the results in the order of ``runs``."""
    bar = tqdm(total=cfg.steps * len(runs), desc="training", unit="step")
    if jobs <= 1:
        results = []
        with single_thread():
            for name in runs:
                bar.set_postfix_str(name)
                results.append(train_run(name, data, cfg, bar))
        bar.close()
        return results
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    with _sigterm_raises():
        pool = ctx.Pool(jobs, initializer=_init_worker, initargs=(counter, os.getpid()))
        try:
            pending = [pool.apply_async(_worker, (name, data, cfg)) for name in runs]
            while not all(p.ready() for p in pending):
                bar.n = counter.value
                bar.refresh()
                time.sleep(0.5)
            bar.n = counter.value
            results = [p.get() for p in pending]
        except BaseException:
            pool.terminate()
            raise
        else:
            pool.close()
        finally:
            bar.close()
            pool.join()
    return results
