"""Run several demo trainings, in parallel processes when asked, behind one progress bar.

On a small CPU one single-threaded process per run is much faster than one process using every
core for a model this small (thread hand-offs cost more than the matmuls save).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

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
        with _counter.get_lock():
            _counter.value += n


def _init_worker(counter) -> None:
    global _counter
    _counter = counter
    torch.set_num_threads(1)


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
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(counter,)) as pool:
        futures = [pool.submit(_worker, name, data, cfg) for name in runs]
        while not all(f.done() for f in futures):
            bar.n = counter.value
            bar.refresh()
            time.sleep(0.5)
        bar.n = counter.value
        bar.close()
        return [f.result() for f in futures]
