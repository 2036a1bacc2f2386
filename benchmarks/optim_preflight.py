"""What the checks before every step cost: ``LowpOptimizer._prepare`` (hyper-parameters, layouts,
gradients, states and buffers of every parameter) against the whole ``step()``, for many small
parameters, where the per-parameter Python work weighs most. CPU time of this process
(``time.process_time``), so other jobs on a shared machine disturb it less; the two are
interleaved and the median of the rounds is printed.

    python benchmarks/optim_preflight.py [--params 200] [--numel 64] [--backend native] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import lowp.optim as lo


def _cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat * 1e3


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=200)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--backend", default="native")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = [torch.zeros(args.numel, dtype=torch.bfloat16, requires_grad=True) for _ in range(args.params)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = lo.AdamW(params, lr=1e-3, backend=args.backend)
    opt.step()
    steps, checks = [], []
    for _ in range(args.rounds):
        steps.append(_cpu_ms(opt.step, args.repeat))
        checks.append(_cpu_ms(opt._prepare, args.repeat))
    step, check = statistics.median(steps), statistics.median(checks)
    print(f"{args.params} bf16 parameters of {args.numel} elements, AdamW kahan, backend {args.backend}")
    print(f"step {step:.2f} ms, of which checks {check:.2f} ms ({check / step:.0%}); "
          f"{check / args.params * 1e3:.1f} us per parameter")


if __name__ == "__main__":
    main()
