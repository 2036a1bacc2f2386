"""Speed of lowp's safe norms against torch's own, measured in the same run.

Native path: (4096, 4096) fp16 and bf16 rows; lowp ``vector_norm`` (robust, default compute =
fp32 opmath with exact row scaling where needed) and ``lowp.norms.RMSNorm`` against
``torch.linalg.vector_norm``, ``torch.nn.functional.rms_norm`` and the naive fp32 formula.
Target: lowp within 1.5x of ``rms_norm``. Emulated path: ``robust`` with every operation
rounded to fp16/bf16 (``compute="fp16"``) and run natively in fp16 (``compute=torch.float16``)
on smaller inputs, reported as ns per element.

Usage: ``python benchmarks/norms.py [--size 4096] [--repeat 5]``
"""
from __future__ import annotations

import argparse
import time

import torch

from lowp.norms import RMSNorm, vector_norm


def best_time(fn, repeat: int) -> float:
    """Best wall time of ``repeat`` calls after one warm-up (CUDA work is synchronized)."""
    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--emulated-rows", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="device for the native path (e.g. cuda)")
    args = parser.parse_args()
    n = args.size
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, shape ({n}, {n})")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype).to(args.device)
        ours_rms = RMSNorm(n, eps=1e-6).to(dtype).to(args.device)
        with torch.no_grad():
            timings = {
                "torch rms_norm": best_time(lambda: torch.nn.functional.rms_norm(x, (n,), ours_rms.weight, 1e-6),
                                            args.repeat),
                "torch vector_norm": best_time(lambda: torch.linalg.vector_norm(x, dim=-1), args.repeat),
                "naive fp32 formula": best_time(lambda: x.float().square().sum(-1).sqrt().to(dtype), args.repeat),
                "lowp vector_norm robust": best_time(lambda: vector_norm(x), args.repeat),
                "lowp RMSNorm": best_time(lambda: ours_rms(x), args.repeat),
            }
        base = timings["torch rms_norm"]
        print(f"\n{str(dtype).replace('torch.', '')} native path")
        for name, t in timings.items():
            print(f"  {name:26s} {t * 1e3:8.2f} ms   {t / base:5.2f}x torch rms_norm")
        small = x[: args.emulated_rows].cpu()
        fmt = "fp16" if dtype == torch.float16 else "bf16"
        for label, compute in ((f"emulated {fmt}", fmt), (f"native {fmt}-only", dtype)):
            t = best_time(lambda: vector_norm(small, compute=compute), 1)
            print(f"  robust, every op in {label:16s} {t * 1e9 / small.numel():8.1f} ns/element "
                  f"({tuple(small.shape)})")
        t = best_time(lambda: vector_norm(small, method="naive", compute=fmt), 1)
        print(f"  naive (sequential), emulated {fmt} {t * 1e9 / small.numel():8.1f} ns/element")


if __name__ == "__main__":
    main()
