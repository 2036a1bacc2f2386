"""Speed of the reduction simulator.

1. Seed 003's full grid (10 world sizes x 5 sigmas x 4096 elements, ring + exact reference),
   target < 10 s on 2 cores, against the seed's own script (a Python ``sum`` over bf16 rows,
   sequential order, no NCCL chunking) run on the same grid in the same process.
2. One ring all-reduce simulation of R = 1024 ranks x 1M elements (bf16, pre-divide), in column
   chunks; sampling the gradients is timed separately from the reduction.

Run: ``PYTHONPATH=. python benchmarks/reduce_sim.py [--elements 1048576] [--threads 1]``.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from lowp.distributed.experiments import SEED_SIGMAS, SEED_WORLD_SIZES, seed_grid
from lowp.distributed.simulator import DEFAULT_CHUNK_BUDGET, GaussianGrads, ReduceConfig, exact_reduce, reduce


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``; on a shared machine CPU time is the steadier one."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def seed_script_grid() -> None:
    """The seed's loop: w in bf16, o = sum(v for v in w / R), o_ref = (w/R).sum(0), std of the difference."""
    for std in SEED_SIGMAS:
        for R in SEED_WORLD_SIZES:
            w = torch.normal(0.0, std, (R, 4096)).to(torch.bfloat16)
            o_bf16 = sum(v for v in w / R)
            o_ref = (w / R).sum(dim=0)
            float((o_bf16 - o_ref).float().std())


def big_ring(world_size: int, elements: int) -> tuple[float, float, float]:
    """(sampling seconds, ring seconds, error std / sigma) for one R x N ring simulation (CPU time)."""
    sigma, gen = 2**-6, torch.Generator().manual_seed(0)
    width = max(1, DEFAULT_CHUNK_BUDGET // world_size)
    t_sample = t_ring = 0.0
    sq = 0.0
    for offset in range(0, elements, width):
        count = min(width, elements - offset)
        t0 = time.process_time()
        x = GaussianGrads(sigma).sample(world_size, count, gen)
        t1 = time.process_time()
        got = reduce(x, ReduceConfig("ring", "bf16"), offset=offset, total=elements)
        t2 = time.process_time()
        sq += float(((got - exact_reduce(x)) ** 2).sum())
        t_sample += t1 - t0
        t_ring += t2 - t1
    return t_sample, t_ring, (sq / elements) ** 0.5 / sigma


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20, help="elements of the big ring run (default 1M)")
    parser.add_argument("--world-size", type=int, default=1024, help="ranks of the big ring run (default 1024)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; see docs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lowp_wall, lowp_cpu = timed(lambda: seed_grid(algorithms=("ring",)))
    all_wall, all_cpu = timed(seed_grid)
    seed_wall, seed_cpu = timed(seed_script_grid)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; times are wall / CPU seconds")
    print(f"seed 003 grid (10 R x 5 sigma x 4096, ring + exact + model): {lowp_wall:.2f} / {lowp_cpu:.2f} s  "
          "(target < 10 s)")
    print(f"  same grid, ring + tree + all-to-all + models:               {all_wall:.2f} / {all_cpu:.2f} s")
    print(f"  seed's own script (python sum over bf16 rows, no chunking): {seed_wall:.2f} / {seed_cpu:.2f} s  "
          f"-> lowp / seed (CPU) = {lowp_cpu / seed_cpu:.2f}")
    wall = time.perf_counter()
    t_sample, t_ring, err = big_ring(args.world_size, args.elements)
    wall = time.perf_counter() - wall
    hops = (args.world_size - 1) * args.elements
    print(f"ring R={args.world_size} x {args.elements} elements (CPU): sampling {t_sample:.2f} s, ring {t_ring:.2f} s "
          f"({1e9 * t_ring / hops:.2f} ns per element-hop; {wall:.1f} s wall in all), error std / sigma = {err:.3e}")


if __name__ == "__main__":
    main()
