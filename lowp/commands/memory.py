"""``lowp memory``: bytes per parameter and totals of weights, optimizer states (and gradients)
for every lowp configuration of one optimizer, measured on a real model now, next to named
baselines from other libraries with their sources (:mod:`lowp.footprint`)."""
from __future__ import annotations

import argparse

HELP = "print optimizer memory per parameter and in total for lowp's configurations and other libraries"

#: when neither --params nor --model is given
DEFAULT_PARAMS = "7e9"


def _count(text: str) -> int:
    from lowp.footprint.models import parse_count

    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("params: ")) from None


def _optimizer(text: str) -> str:
    from lowp.footprint.measure import lowp_optimizer

    try:
        return lowp_optimizer(text.strip()).__name__
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("optimizer: ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp memory`` to ``parser``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--params", type=_count, default=None, metavar="N",
                      help=f"parameter count, e.g. 7e9, 125M, 1.3B (K, M, B/G, T are powers of 1000; "
                           f"default {DEFAULT_PARAMS})")
    size.add_argument("--model", default=None, metavar="NAME",
                      help="'demo' (lowp's demo model) or a Hugging Face transformers model type such as gpt2 or "
                           "llama, built from its config class's defaults on the meta device (needs transformers; "
                           "nothing is downloaded)")
    parser.add_argument("--optimizer", type=_optimizer, default="AdamW",
                        help="the lowp optimizer, any case (default adamw)")
    parser.add_argument("--grads", action="store_true", help="count the gradients too")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp memory`` with the parsed ``args``; returns the exit status."""
    import json

    from lowp.cli_args import usage_error
    from lowp.footprint.models import meta_model
    from lowp.footprint.report import build_report, format_report

    if args.model is not None:
        try:
            target, description = meta_model(args.model)
        except ValueError as exc:
            usage_error("memory", "--model", str(exc).removeprefix("model: "))
        report = build_report(args.optimizer, None, args.grads, args.model.strip().lower(), target, description)
    else:
        count = args.params if args.params is not None else _count(DEFAULT_PARAMS)
        report = build_report(args.optimizer, count, args.grads)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
