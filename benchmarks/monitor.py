"""Benchmark: overhead of the precision monitor on a forward+backward step.

Baselines measured in the same run: the model with no monitor, with the monitor attached
(forward and backward hooks, statistics on every tensor), and after the monitor is detached
(hooks removed: should be ~1.00x).

Run: PYTHONPATH=$PWD python benchmarks/monitor.py
"""
from __future__ import annotations

import time

import torch

from lowp.audit.demo import DemoModel, demo_batch, run_demo
from lowp.audit.monitor import PrecisionMonitor


def _step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        run_demo(model, x, y)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    torch.set_num_threads(1)  # stable timings on a shared 2-core machine
    torch.manual_seed(0)
    for width, tokens in ((32, 8), (256, 128)):
        model = DemoModel(width=width)
        x, y = demo_batch(batch=8, tokens=tokens)
        plain = _step_time(model, x, y, 20)
        monitor = PrecisionMonitor(model, "fp16")
        with monitor:
            watched = _step_time(model, x, y, 20)
        after = _step_time(model, x, y, 20)
        print(f"DemoModel width {width}, {tokens} tokens, batch 8 ({len(monitor.records)} tensors recorded):")
        print(f"  no monitor        {plain * 1e3:8.2f} ms  1.00x")
        print(f"  monitor attached  {watched * 1e3:8.2f} ms  {watched / plain:.2f}x")
        print(f"  after detach      {after * 1e3:8.2f} ms  {after / plain:.2f}x")


if __name__ == "__main__":
    main()
