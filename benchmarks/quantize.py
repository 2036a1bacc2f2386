"""ns/element of lowp.quantize against torch's native casts and ml_dtypes, measured in one run.

    python benchmarks/quantize.py [--elements 16777216] [--repeats 5] [--threads N] [--clock cpu] [--markdown]

Input: N(0,1) float32 values (scaled by 64 for fp8 so the subnormal and overflow ranges are both
exercised). For every format it times
  torch  : x.to(dtype)                 (the native cast; the lower bound)
  torch2 : x.to(dtype).float()         (native fake-quantization, what quantize returns)
  ml_dtypes: x.numpy().astype(t)       (and back to float32)
  lowp   : quantize(x, fmt, mode, native=False) (the emulation: any format, any mode)
and prints the best-of-N time per element and the ratio to each baseline. ``--clock cpu`` measures
process CPU time (all threads summed) instead of wall time: steadier on a shared, busy machine.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch

from lowp.formats import get_format
from lowp.report import markdown_table, text_table
from lowp.rounding import quantize
from timing import best_seconds

CASES = [("bf16", ml_dtypes.bfloat16, 1.0), ("fp16", np.float16, 1.0), ("fp8_e4m3fn", ml_dtypes.float8_e4m3fn, 64.0)]


def best_ns_per_element(fn: Callable[[], object], n: int, repeats: int,
                        clock: Callable[[], float] = time.perf_counter) -> float:
    """Best of ``repeats`` timings of ``fn`` (after one warm-up call), in nanoseconds per element of ``n``."""
    return best_seconds(fn, repeats, clock) / n * 1e9


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.elements, generator=gen)
    rows = []
    for name, np_type, scale in CASES:
        fmt = get_format(name)
        x = base * scale
        x_np = x.numpy()
        t_torch = best_ns_per_element(lambda: x.to(fmt.torch_dtype), args.elements, args.repeats, clock)
        t_torch2 = best_ns_per_element(lambda: x.to(fmt.torch_dtype).float(), args.elements, args.repeats, clock)
        t_ml = best_ns_per_element(lambda: x_np.astype(np_type).astype(np.float32), args.elements, args.repeats, clock)
        for mode in ("nearest_even", "stochastic"):
            g = torch.Generator().manual_seed(1)
            t_lowp = best_ns_per_element(lambda: quantize(x, fmt, mode, generator=g, native=False),
                                         args.elements, args.repeats, clock)
            rows.append([name, mode, t_lowp, t_torch, t_torch2, t_ml, t_lowp / t_torch, t_lowp / t_torch2,
                         t_lowp / t_ml])
    headers = ["format", "mode", "lowp ns/elt", "torch .to ns/elt", "torch .to().float() ns/elt",
               "ml_dtypes ns/elt", "lowp/torch", "lowp/torch roundtrip", "lowp/ml_dtypes"]
    rows = [[r[0], r[1], *(round(v, 3) for v in r[2:])] for r in rows]
    print(f"{args.elements} float32 elements, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"best of {args.repeats}, {args.clock} clock")
    print(markdown_table(headers, rows) if args.markdown else text_table(headers, rows))


if __name__ == "__main__":
    main()
