"""``lowp optim-speed``: how fast lowp's fused bf16 + Kahan AdamW steps on this machine, against
torch's fused fp32 AdamW and optimi, measured now (:mod:`lowp.optim.speed`)."""
from __future__ import annotations

import argparse

from lowp.cli_args import check_at_most, check_memory, usage_error

HELP = "time lowp's fused optimizer step here against torch's fused AdamW and optimi"


#: every contender's parameters, gradients and states are alive together (fp32 AdamW 16 bytes,
#: each bf16 variant about 10, the bandwidth probes 20, optimi 10): an upper estimate per parameter
BYTES_PER_PARAM = 128
MAX_ROUNDS = 10_000
MAX_THREADS = 1024


def _size(text: str) -> int:
    from lowp.optim.speed import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        message = str(e) if str(e).startswith("size:") else f"expected a parameter count such as 8M, got {text!r}"
        raise argparse.ArgumentTypeError(message.removeprefix("size: ")) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp optim-speed`` to ``parser``."""
    parser.add_argument("--size", type=_size, default="8M", help="parameter count, e.g. 8M (default) or 64M")
    parser.add_argument("--rounds", type=_positive, default=5, help="timed steps per optimizer; the best counts")
    parser.add_argument("--threads", type=_positive, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--with-compiled", action="store_true",
                        help="add lowp's torch.compile backend (CPU; 10-40 s to compile)")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp optim-speed`` with the parsed ``args``; returns the exit status."""
    import torch

    from lowp.optim.backends import backend_for
    from lowp.optim.speed import measure, report

    if args.device == "cuda" and not torch.cuda.is_available():
        usage_error("optim-speed", "--device", "cuda: no CUDA device here")
    check_at_most("optim-speed", "--rounds", args.rounds, MAX_ROUNDS, "timed steps per optimizer")
    if args.threads:
        check_at_most("optim-speed", "--threads", args.threads, MAX_THREADS, "torch's thread pool")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    need = args.size * BYTES_PER_PARAM
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            usage_error("optim-speed", "--size", f"{args.size:,} parameters need about {need / 2**30:.3g} GiB of "
                                                 f"GPU memory, {free / 2**30:.3g} GiB is free")
    else:
        check_memory("optim-speed", "--size", need, f"{args.size:,} parameters")
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
