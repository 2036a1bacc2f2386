"""``lowp optim-speed``: how fast lowp's fused bf16 + Kahan AdamW steps on this machine, against
torch's fused fp32 AdamW and optimi, measured now (:mod:`lowp.optim.speed`)."""
from __future__ import annotations

import argparse

HELP = "time lowp's fused optimizer step here against torch's fused AdamW and optimi"


def _size(text: str) -> int:
    from lowp.optim.speed import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=_size, default="8M", help="parameter count, e.g. 8M (default) or 64M")
    parser.add_argument("--rounds", type=_positive, default=5, help="timed steps per optimizer; the best counts")
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--with-compiled", action="store_true",
                        help="add lowp's torch.compile backend (CPU; 10-40 s to compile)")


def run(args: argparse.Namespace) -> int:
    import torch

    from lowp.optim.kernels import backend_for
    from lowp.optim.speed import measure, report

    if args.device == "cuda" and not torch.cuda.is_available():
        print("lowp optim-speed: error: --device cuda: no CUDA device here")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = backend_for([torch.zeros(args.size, dtype=torch.bfloat16, device=device)], None, None)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"fused=None picks backend {chosen!r} for this size")
    print(report(measure(args.size, device, args.rounds, args.with_compiled)))
    print("\nMparams/s: parameters updated per second (best step). GB/s counts the bytes an ideal step moves "
          "(28/param fp32 AdamW, 18/param bf16 + Kahan + bf16 states); the in-place update bandwidth is the "
          "ceiling for a memory-bound step. Rows after the fused lowp row switch off one more option each.")
    return 0
