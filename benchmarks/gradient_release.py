"""Peak memory of one training step with and without gradient release (``release_gradients``).

The model is a stack of ``--layers`` bf16 ``Linear(width, width)`` + GELU blocks (the MLP half
of a transformer), trained by lowp AdamW (kahan, bf16 moments) on small batches, so that the
gradients, not the activations, are what a step adds to memory. One training step is forward,
backward, ``opt.step()`` and ``opt.zero_grad()``, after a first step that created the optimizer
states. Its peak extra memory is measured from torch.profiler's CPU memory events (the running
sum of allocations minus frees over the step, in time order, as in ``optim_step.py``); the
time per step is the median over ``--steps`` steps, the two configurations interleaved. The
ratio is the step with release over the one without, measured in the same run.

    python benchmarks/gradient_release.py [--width 1024] [--layers 8] [--batch 16] [--steps 5] [--threads N]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import lowp.optim as lo
from lowp.optim.speed import profiled_peak_bytes
from lowp.report import text_table


def _setup(width: int, layers: int, release: bool) -> tuple[torch.nn.Module, lo.AdamW, lo.GradientRelease | None]:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    model = torch.nn.Sequential(*blocks).bfloat16()
    opt = lo.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2, mode="kahan")
    return model, opt, lo.release_gradients(opt) if release else None


def _train_step(model: torch.nn.Module, opt: lo.AdamW, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1)).bfloat16()
    runs = {}
    for release in (False, True):
        model, opt, _ = _setup(args.width, args.layers, release)
        step = functools.partial(_train_step, model, opt, x)
        step()                                             # creates the states
        peak = profiled_peak_bytes(step)
        runs["with release" if release else "without release"] = (model, step, peak)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (_, step, _) in runs.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    grad_bytes = sum(p.numel() * p.element_size() for p in runs["without release"][0].parameters())
    layer_bytes = max(p.numel() * p.element_size() for p in runs["without release"][0].parameters())
    base_peak, base_time = runs["without release"][2], statistics.median(times["without release"])
    rows = [[name, f"{peak / 2**20:.2f}", f"{peak / base_peak:.3f}", f"{statistics.median(times[name]) * 1e3:.1f}",
             f"{statistics.median(times[name]) / base_time:.2f}x"] for name, (_, _, peak) in runs.items()]
    print(f"one training step of {args.layers} x Linear({args.width}, {args.width}) + GELU in bf16, batch "
          f"{args.batch}, lowp AdamW kahan, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"all gradients {grad_bytes / 2**20:.2f} MiB, the largest one {layer_bytes / 2**20:.2f} MiB")
    print(text_table(["configuration", "peak extra MiB", "peak vs without", "ms/step", "time vs without"], rows))


if __name__ == "__main__":
    main()
