"""``lowp doctor``: run the precision monitor on the built-in demo model and print its report."""
from __future__ import annotations

import argparse

HELP = "run the overflow/underflow monitor on a demo model and print per-module advice for a low format"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", default="fp16", help="target format to check against (default fp16)")
    parser.add_argument("--scale", type=float, default=300.0, help="input scale (large values overflow fp16)")
    parser.add_argument("--loss-factor", type=float, default=1e-6, help="loss multiplier (small values underflow grads)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights and inputs")


def run(args: argparse.Namespace) -> int:
    import torch

    from lowp.audit.demo import DemoModel, demo_batch, run_demo
    from lowp.audit.monitor import PrecisionMonitor

    torch.manual_seed(args.seed)
    model = DemoModel()
    x, y = demo_batch(scale=args.scale, seed=args.seed)
    try:
        monitor = PrecisionMonitor(model, args.format)
    except ValueError as exc:
        raise SystemExit(f"lowp doctor: --format: {exc}") from exc
    with monitor:
        loss = run_demo(model, x, y, args.loss_factor)
    print(f"demo model: {sum(p.numel() for p in model.parameters())} parameters, input scale {args.scale:g}, "
          f"loss {float(loss):.3g} (x{args.loss_factor:g}); computed in fp32, checked against {monitor.format.name}\n")
    print(monitor.report())
    return 0
