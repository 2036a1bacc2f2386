"""``lowp memory``: bytes per parameter and totals of weights, optimizer states (and gradients)
for every lowp configuration of one optimizer, measured on a real model now, next to named
baselines from other libraries with their sources (:mod:`lowp.footprint`), for a parameter count
or for the model ``--model`` names (:mod:`lowp.model_spec`), built on the meta device. What it is
measuring is printed on stderr as it goes (``--quiet``: nothing)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lowp.progress import Progress

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
    size.add_argument("--model", default=None, metavar="MODEL",
                      help="'demo' (lowp's demo model); module:factory (a function called with no arguments that "
                           "returns an nn.Module); a transformers model type such as gpt2 or llama (its config "
                           "class's defaults); a path to a config.json or a folder holding one; or a Hugging Face "
                           "hub id whose config.json is in the local cache. Built on the meta device; nothing is "
                           "downloaded")
    parser.add_argument("--optimizer", type=_optimizer, default="AdamW",
                        help="the lowp optimizer, any case (default adamw)")
    parser.add_argument("--grads", action="store_true", help="count the gradients too")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="print no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp memory`` with the parsed ``args``; returns the exit status."""
    import json

    from lowp.progress import Progress
    from lowp.footprint.report import build_report, format_report

    with Progress("lowp memory", enabled=not args.quiet) as progress:
        if args.model is not None:
            target, description, label = _meta_model(args.model, progress)
            progress.stage(f"{description}: {sum(p.numel() for p in target.parameters()):,} parameters; measuring "
                           f"every configuration of lowp {args.optimizer} and the baselines")
            report = build_report(args.optimizer, None, args.grads, label, target, description, progress.step)
        else:
            count = args.params if args.params is not None else _count(DEFAULT_PARAMS)
            progress.stage(f"measuring every configuration of lowp {args.optimizer} and the baselines")
            report = build_report(args.optimizer, count, args.grads, progress=progress.step)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _meta_model(text: str, progress: Progress) -> tuple[torch.nn.Module, str, str]:
    """(model on the meta device, description, name for the report) of ``--model``; a usage error
    naming the option when it names no model that can be built."""
    from lowp.cli_args import usage_error
    from lowp.footprint.models import build_meta
    from lowp.model_spec import ModelSpecError, resolve

    try:
        progress.stage(f"looking up --model {text.strip()!r}")
        source = resolve(text)
        progress.stage(f"building {source.label} on the meta device")
        model, description = build_meta(source)
    except ModelSpecError as exc:
        usage_error("memory", exc.option, str(exc))
    return model, description, source.label
