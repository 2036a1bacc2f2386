"""Bias of the Kahan-compensated bf16 weight under pure decoupled weight decay.

Zero gradients, ``lr * wd = 1e-5``, 1000 steps, weights N(0, s) rounded to bf16: the held value
``theta + k`` should decay like the fp64 recurrence ``w * (1 - lr*wd)**t``. Prints, per optimizer
and weight scale, the mean over elements of (held decay / fp64 decay - 1) for each seed, and the
mean over seeds: a positive number means the weights shrank too much.

    python benchmarks/kahan_decay.py [--steps 1000] [--numel 4096] [--seeds 3]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import lowp.optim as lo
from lowp.report import text_table

CASES = {"AdamW": (lo.AdamW, dict(lr=1e-3, weight_decay=1e-2)), "SGD": (lo.SGD, dict(lr=1e-2, weight_decay=1e-3))}


def decay_error(opt_class, kw: dict, scale: float, seed: int, steps: int, numel: int) -> float:
    """Mean relative error of the total decay of ``theta + k`` against fp64."""
    w0 = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
    ref = w0.double() * (1 - kw["lr"] * kw["weight_decay"]) ** steps
    p = w0.clone().requires_grad_()
    opt = opt_class([p], mode="kahan", seed=seed, fused=False, **kw)
    p.grad = torch.zeros_like(p)
    for _ in range(steps):
        opt.step()
    held = p.detach().double() + opt.state[p]["compensation"].double()
    return float(((w0.double() - held) / (w0.double() - ref)).mean()) - 1


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, (opt_class, kw) in CASES.items():
        for scale in (1e-3, 1.0, 1e3):
            errors = [decay_error(opt_class, kw, scale, seed, args.steps, args.numel) for seed in range(args.seeds)]
            rows.append([name, f"{scale:g}", ", ".join(f"{e:+.2%}" for e in errors),
                         f"{statistics.mean(errors):+.2%}"])
    print(f"held theta + k after {args.steps} zero-gradient steps at lr*wd = 1e-5, {args.numel} bf16 weights")
    print(text_table(["optimizer", "weight scale", "decay error per seed", "mean"], rows))


if __name__ == "__main__":
    main()
