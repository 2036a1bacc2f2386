"""Bias of the compensated bf16 weights under pure decoupled weight decay.

Zero gradients, ``lr * wd = 1e-5``, weights N(0, s) rounded to bf16: the held value should decay
like the fp64 recurrence ``w * (1 - lr*wd)**t``.

First table (Kahan), 1000 steps: per optimizer and weight scale, the mean over elements of (held
decay / fp64 decay - 1) for each seed, and the mean over seeds: a positive number means the
weights shrank too much.

Second table (modes), AdamW, 10,000 steps on 65,536 weights N(0, 1): for every write-back mode
(and, emulated here only, exact8 with its remainder rounded to nearest instead of
stochastically), the relative L2 error of the held value (``theta`` for nearest/stochastic,
``theta + k`` for kahan, the weight/remainder pair for exact and exact8) against the fp64
trajectory, and its decay error as above.

    python benchmarks/kahan_decay.py [--steps 1000] [--numel 4096] [--seeds 3]
                                     [--mode-steps 10000] [--mode-numel 65536] [--tables kahan,modes]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import lowp.optim as lo
from lowp.optim.writeback import MODES, store_nearest_pair8
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


def held_value(p: torch.Tensor, state: dict) -> torch.Tensor:
    """The fp64 value the optimizer holds for ``p`` (weight plus its mode's buffer)."""
    p = p.detach()
    if "compensation" in state:
        return p.double() + state["compensation"].double()
    for mode in ("exact", "exact8"):
        name = MODES[mode].buffer_name
        if name in state:
            return MODES[mode].load(p, state[name]).double()
    return p.double()


def nearest_pair_run(w0: torch.Tensor, rate: float, steps: int) -> torch.Tensor:
    """exact8 with the remainder rounded to nearest (not a library mode): the decoupled decay
    ``w - rn_fp32(rate) * w`` in fp32, stored as the nearest pair at every step."""
    p, r8 = w0.clone(), MODES["exact8"].init_buffer(w0)
    held = w0.float()
    factor = torch.tensor(rate, dtype=torch.float32)
    for _ in range(steps):
        store_nearest_pair8(p, r8, held - factor * held)
        held = MODES["exact8"].load(p, r8)
    return held.double()


def mode_errors(mode: str, steps: int, numel: int, seed: int = 0) -> tuple[float, float]:
    """(relative L2 error, decay error) of the held AdamW weights after ``steps`` zero-gradient
    steps at ``lr * wd = 1e-5`` in ``mode`` (``"exact8-nearest"``: :func:`nearest_pair_run`)."""
    kw = CASES["AdamW"][1]
    rate = kw["lr"] * kw["weight_decay"]
    w0 = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).bfloat16()
    ref = w0.double() * (1 - rate) ** steps
    if mode == "exact8-nearest":
        held = nearest_pair_run(w0, rate, steps)
    else:
        p = w0.clone().requires_grad_()
        opt = lo.AdamW([p], mode=mode, seed=seed, **kw)
        p.grad = torch.zeros_like(p)
        for _ in range(steps):
            opt.step()
        held = held_value(p, opt.state[p])
    relative = float((held - ref).norm() / ref.norm())
    return relative, float(((w0.double() - held) / (w0.double() - ref)).mean()) - 1


#: (mode, bytes per parameter of weight + buffer, significant bits held)
MODE_ROWS = [("nearest", 2, 8), ("stochastic", 2, 8), ("kahan", 4, 16), ("exact", 4, 24), ("exact8", 3, 16),
             ("exact8-nearest", 3, 16)]


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--mode-steps", type=int, default=10_000)
    ap.add_argument("--mode-numel", type=int, default=65_536)
    ap.add_argument("--tables", default="kahan,modes", help="comma-separated: kahan, modes")
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    if "kahan" in tables:
        rows = []
        for name, (opt_class, kw) in CASES.items():
            for scale in (1e-3, 1.0, 1e3):
                errors = [decay_error(opt_class, kw, scale, seed, args.steps, args.numel)
                          for seed in range(args.seeds)]
                rows.append([name, f"{scale:g}", ", ".join(f"{e:+.2%}" for e in errors),
                             f"{statistics.mean(errors):+.2%}"])
        print(f"held theta + k after {args.steps} zero-gradient steps at lr*wd = 1e-5, {args.numel} bf16 weights")
        print(text_table(["optimizer", "weight scale", "decay error per seed", "mean"], rows))
    if "modes" in tables:
        rows = []
        for mode, nbytes, significant in MODE_ROWS:
            relative, decay = mode_errors(mode, args.mode_steps, args.mode_numel)
            rows.append([mode, str(nbytes), str(significant), f"{relative:.2e}", f"{decay:+.2%}"])
        print(f"AdamW, {args.mode_steps} zero-gradient steps at lr*wd = 1e-5, {args.mode_numel} bf16 weights "
              f"N(0, 1); expected decay {1 - (1 - 1e-5) ** args.mode_steps:.2%}")
        print(text_table(["mode", "weight + buffer B/param", "significant bits", "rel. error vs fp64",
                          "decay error"], rows))


if __name__ == "__main__":
    main()
