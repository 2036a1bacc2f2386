"""Fused optimizer step speed: lowp's fused bf16 + Kahan AdamW against torch and optimi, at
several sizes (the measurement itself is :mod:`lowp.optim.speed`, also behind ``lowp optim-speed``).

    python benchmarks/optim_fused.py --sizes 8M,32M,64M --threads 2 [--with-compiled]
"""
from __future__ import annotations

import argparse

import torch

from lowp.optim.speed import measure, parse_size, report


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8M,32M", help="parameter counts, e.g. 8M,32M,64M")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per optimizer (best one counts)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--with-compiled", action="store_true",
                        help="add lowp's torch.compile backend on CPU (10-40 s to compile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, {args.threads} threads, torch {torch.__version__}")
    for total in (parse_size(s) for s in args.sizes.split(",")):
        print()
        print(report(measure(total, device, args.rounds, args.with_compiled)))


if __name__ == "__main__":
    main()
