"""``lowp doctor``: run the precision monitor on the built-in demo model and print its report."""
from __future__ import annotations

import argparse

from lowp.cli_args import SEED_MAX, float_in, format_spec, int_in

HELP = "run the overflow/underflow monitor on a demo model and print per-module advice for a low format"


def _checkable_format(text: str) -> str:
    """A format narrower than fp32: the demo computes in fp32, so only those can be checked against."""
    from lowp.formats import get_format
    from lowp.rounding import fits_in

    name = format_spec(text)
    fmt, fp32 = get_format(name), get_format("fp32")
    if fmt == fp32 or not fits_in(fmt, fp32):
        raise argparse.ArgumentTypeError(f"expected a format narrower than fp32 (the demo computes in fp32), "
                                         f"such as fp16, bf16 or fp8_e4m3fn; got {text!r}")
    return name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp doctor`` to ``parser``."""
    parser.add_argument("--format", type=_checkable_format, default="fp16",
                        help="target format to check against, narrower than fp32 (default fp16)")
    parser.add_argument("--scale", type=float_in(0, 1e30, low_open=True), default=300.0,
                        help="input scale in (0, 1e30] (large values overflow fp16)")
    parser.add_argument("--loss-factor", type=float_in(0, 1e30, low_open=True), default=1e-6,
                        help="loss multiplier in (0, 1e30] (small values underflow grads)")
    parser.add_argument("--seed", type=int_in(0, SEED_MAX, " (a 64-bit seed)"), default=0,
                        help="random seed for weights and inputs, in [0, 2**64) (default 0)")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp doctor`` with the parsed ``args``; returns the exit status."""
    import torch

    from lowp.audit.demo import DemoModel, demo_batch, run_demo
    from lowp.audit.monitor import PrecisionMonitor

    torch.manual_seed(args.seed)
    model = DemoModel()
    x, y = demo_batch(scale=args.scale, seed=args.seed)
    monitor = PrecisionMonitor(model, args.format)
    with monitor:
        loss = run_demo(model, x, y, args.loss_factor)
    print(f"demo model: {sum(p.numel() for p in model.parameters())} parameters, input scale {args.scale:g}, "
          f"loss {float(loss):.3g} (x{args.loss_factor:g}); computed in fp32, checked against {monitor.format.name}\n")
    print(monitor.report())
    return 0
