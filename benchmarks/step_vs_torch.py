"""lowp's optimizer step against the fp32 step users run today, on real models' parameter lists.

Every configuration steps its own copy of the same parameter list (the same values, gradients
fixed), all built in one process; the timed steps are interleaved configuration by configuration
(so a change in machine load hits every row alike) and the median counts. The ratio is the
baseline's time over the row's: above 1.0 the row is faster than torch's fused fp32 step.

Parameter lists:

* ``16x8M``, ``16x32M``: 16 equal tensors of 8M and 32M elements in all;
* ``gpt2``: the 148 tensors of GPT-2 small (124M parameters: token and position embeddings,
  12 blocks of two layer norms, the attention and MLP matrices and biases, the final norm);
* ``gpt2/8``: the same 148 tensors with every dimension divided by 8 (1.95M parameters);
* ``500x1000``: 500 tensors of 1,000 elements, where host time per tensor is the step.

Rows (``--optimizer adamw``): torch's AdamW on fp32 weights, ``fused=True`` (the baseline) and
foreach; DeepSpeed's ``DeepSpeedCPUAdam`` on fp32 weights when ``deepspeed`` is importable; lowp's
AdamW on bf16 weights with its defaults (``kahan``, bf16 states) and in the 5 bytes/param
configuration (``exact8``, int8/uint8 states); optimi's AdamW on bf16 weights with Kahan
summation when ``optimi`` is importable. ``--optimizer sgd`` (momentum 0.9) and ``lion`` give the
same table for SGD (torch's fused SGD the baseline) and Lion (optimi's the baseline: torch has
none). Host time per tensor is the ``500x1000`` row's time divided by its 500 tensors.

    python benchmarks/step_vs_torch.py [--optimizer adamw|sgd|lion] [--lists 16x8M gpt2 ...]
        [--steps 9] [--threads N] [--markdown]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch

import lowp.optim as lo
from lowp.report import markdown_table, text_table

LR, WD = 1e-3, 1e-2
EIGHT_BIT = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def gpt2_shapes(scale: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (Radford et al., 2019: 12 blocks, width 768, 1024
    positions, 50257 tokens; 148 tensors), every dimension divided by ``scale``."""
    d, vocab, ctx = 768 // scale, 50257 // scale, 1024 // scale
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *block * 12, (d,), (d,)]


LISTS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "16x8M": lambda: [(500_000,)] * 16,
    "16x32M": lambda: [(2_000_000,)] * 16,
    "gpt2": lambda: gpt2_shapes(1),
    "gpt2/8": lambda: gpt2_shapes(8),
    "500x1000": lambda: [(1000,)] * 500,
}

Maker = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _deepspeed_adam() -> Callable | None:
    """DeepSpeed's CPUAdam when it imports and its extension builds here (a first use builds it)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], lr=LR).step()
    except Exception:   # not installed, or its extension does not build here
        return None
    return DeepSpeedCPUAdam


def _optimi(name: str) -> Callable | None:
    try:
        import optimi
    except ImportError:
        return None
    return getattr(optimi, name)


def configs(optimizer: str) -> tuple[str, dict[str, tuple[torch.dtype, Maker]]]:
    """(the baseline's name, every row: weight dtype and how to build it) for ``optimizer``."""
    rows: dict[str, tuple[torch.dtype, Maker]] = {}
    if optimizer == "adamw":
        rows["torch AdamW fp32 fused"] = (torch.float32, lambda ps: torch.optim.AdamW(ps, LR, weight_decay=WD,
                                                                                       fused=True))
        rows["torch AdamW fp32 foreach"] = (torch.float32, lambda ps: torch.optim.AdamW(ps, LR, weight_decay=WD,
                                                                                         foreach=True))
        cpu_adam = _deepspeed_adam()
        if cpu_adam is not None:
            rows["DeepSpeed CPUAdam fp32"] = (torch.float32, lambda ps: cpu_adam(ps, lr=LR, weight_decay=WD))
        rows["lowp bf16 defaults"] = (torch.bfloat16, lambda ps: lo.AdamW(ps, LR, weight_decay=WD, seed=0))
        rows["lowp 5 B/param"] = (torch.bfloat16, lambda ps: lo.AdamW(ps, LR, weight_decay=WD, mode="exact8",
                                                                       state_dtype=EIGHT_BIT, seed=0))
        optimi_adamw = _optimi("AdamW")
        if optimi_adamw is not None:
            rows["optimi AdamW bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_adamw(ps, lr=LR, weight_decay=WD,
                                                                                       kahan_sum=True, foreach=True))
        return "torch AdamW fp32 fused", rows
    if optimizer == "sgd":
        rows["torch SGD fp32 fused"] = (torch.float32, lambda ps: torch.optim.SGD(ps, LR, momentum=0.9, fused=True))
        rows["torch SGD fp32 foreach"] = (torch.float32, lambda ps: torch.optim.SGD(ps, LR, momentum=0.9,
                                                                                     foreach=True))
        rows["lowp bf16 defaults"] = (torch.bfloat16, lambda ps: lo.SGD(ps, LR, momentum=0.9, seed=0))
        rows["lowp bf16 exact8, int8 momentum"] = (torch.bfloat16, lambda ps: lo.SGD(
            ps, LR, momentum=0.9, mode="exact8", state_dtype=torch.int8, seed=0))
        optimi_sgd = _optimi("SGD")
        if optimi_sgd is not None:
            rows["optimi SGD bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_sgd(ps, lr=LR, momentum=0.9,
                                                                                   kahan_sum=True, foreach=True))
        return "torch SGD fp32 fused", rows
    optimi_lion = _optimi("Lion")
    if optimi_lion is not None:
        rows["optimi Lion fp32"] = (torch.float32, lambda ps: optimi_lion(ps, lr=LR, foreach=True))
        rows["optimi Lion bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_lion(ps, lr=LR, kahan_sum=True,
                                                                                 foreach=True))
    rows["lowp Lion bf16 defaults"] = (torch.bfloat16, lambda ps: lo.Lion(ps, LR, seed=0))
    rows["lowp Lion bf16 exact8, int8 momentum"] = (torch.bfloat16, lambda ps: lo.Lion(
        ps, LR, mode="exact8", state_dtype=torch.int8, seed=0))
    return next(iter(rows)), rows


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
        out.append(p)
    return out


def measure(shapes: list[tuple[int, ...]], rows: dict[str, tuple[torch.dtype, Maker]], steps: int,
            cached: dict[str, int] | None = None) -> dict[str, float]:
    """Median seconds per step of every row on ``shapes``, the rows' steps interleaved; ``cached``
    collects, per lowp row, how many of its steps took the cached plan (lowp.optim.cached_step)."""
    built = {}
    for name, (dtype, make) in rows.items():
        params = _params(shapes, dtype)
        opt = make(params)
        for _ in range(2):   # states created, kernels built
            opt.step()
        built[name] = opt
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(steps):
        for name, opt in built.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    if cached is not None:
        for name, opt in built.items():
            if isinstance(opt, lo.LowpOptimizer):
                cached[name] = cached.get(name, 0) + opt._plans.cached_steps
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark described in the module docstring and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=("adamw", "sgd", "lion"), default="adamw")
    ap.add_argument("--lists", nargs="+", choices=list(LISTS), default=list(LISTS))
    ap.add_argument("--steps", type=int, default=9, help="timed steps per row and list (the median counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline, rows = configs(args.optimizer)
    header = ["parameter list", *rows]
    table = []
    per_tensor = {}
    cached: dict[str, int] = {}
    for name in args.lists:
        shapes = LISTS[name]()
        medians = measure(shapes, rows, args.steps, cached)
        base = medians[baseline]
        table.append([f"{name} ({len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.2f}M)",
                      *(f"{medians[r] * 1e3:.2f} ms ({base / medians[r]:.2f}x)" for r in rows)])
        if name == "500x1000":
            per_tensor = {r: medians[r] / len(shapes) * 1e6 for r in rows}
    print(f"{args.optimizer} step, median ms (baseline {baseline} / row); {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, lowp's native kernel: "
          f"{native_isa()} build")
    print((markdown_table if args.markdown else text_table)(header, table))
    if per_tensor:
        print("host time per tensor (500x1000): " + ", ".join(f"{r} {us:.1f} us" for r, us in per_tensor.items()))
    steps = len(args.lists) * (args.steps + 2)
    print("steps taken from the cached plan: " + ", ".join(f"{r} {n} of {steps}" for r, n in cached.items()))


def native_isa() -> str:
    """The instruction set of lowp's native kernel builds here (``none`` without the kernel)."""
    from lowp.optim.kernels.native.build import isa, native_available
    return isa() if native_available() else "none"


if __name__ == "__main__":
    main()
