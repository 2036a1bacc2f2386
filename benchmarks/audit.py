"""Benchmark: the exhaustive unary audit (every listed op, every finite fp16 and bf16 input, three
methods) against the 60 s target on 2 cores, with 1 and 2 torch threads (the tensors are small,
<= 65,536 elements, and two OpenMP threads slow down badly when the cores are shared), and against
the floor of computing the float64 references alone (numpy/math; no torch kernels, no rounding, no statistics).

Run: PYTHONPATH=$PWD python benchmarks/audit.py
"""
from __future__ import annotations

import time

import torch

from lowp.audit.ops import get_unary
from lowp.audit.unary import audit_unary, reference, unary_inputs
from lowp.formats import get_format

TARGET_S = 60.0


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    formats = ("fp16", "bf16")
    audit_unary(["exp"], formats)  # warm up imports and kernels
    times = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        rows = audit_unary(None, formats)
        times[threads] = time.perf_counter() - t0
    audit_s = min(times.values())
    torch.set_num_threads(min(times, key=times.get))
    t0 = time.perf_counter()
    inputs = 0
    for fmt in formats:
        for op in get_unary():
            x = unary_inputs(op, get_format(fmt))
            reference(op, x)
            inputs += x.numel()
    ref_s = time.perf_counter() - t0
    ops = len(get_unary())
    print(f"exhaustive unary audit: {ops} ops x {len(formats)} formats, {inputs:,} (op, input) pairs, {len(rows)} rows")
    for threads, sec in times.items():
        print(f"  audit, {threads} torch thread(s)     {sec:8.2f} s   "
              f"({sec / TARGET_S:.3f} x the {TARGET_S:.0f} s target)")
    print(f"  float64 references only     {ref_s:8.2f} s   (audit / references = {audit_s / ref_s:.2f})")
    print(f"  per (op, input): {1e9 * audit_s / inputs:.0f} ns")


if __name__ == "__main__":
    main()
