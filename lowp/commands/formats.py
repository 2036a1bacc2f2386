"""``lowp formats``: the table of every preset number format and its properties."""
from __future__ import annotations

import argparse

from lowp.cli_args import format_spec

HELP = "print every number format lowp knows, with eps, range and precision"

COLUMNS = ["name", "bits", "exponent_bits", "mantissa_bits", "bias", "subnormals", "special", "overflow",
           "eps", "unit_roundoff", "max", "min_normal", "min_subnormal", "decimal_digits", "torch_dtype"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp formats`` to ``parser``."""
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--csv", action="store_true", help="print CSV")
    parser.add_argument("--custom", metavar="EXMY", type=format_spec, action="append", default=[],
                        help="also show a custom IEEE-style format, e.g. e3m4 (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp formats`` with the parsed ``args``; returns the exit status."""
    from lowp.formats import PRESETS, get_format
    from lowp.report import csv_text, markdown_table, text_table

    formats = list(PRESETS.values()) + [get_format(c) for c in args.custom]
    rows = [[f.summary()[c] for c in COLUMNS] for f in formats]
    if args.csv:
        print(csv_text(COLUMNS, rows), end="")
    elif args.markdown:
        print(markdown_table(COLUMNS, rows))
    else:
        print(text_table(COLUMNS, rows))
        print("\neps: gap between 1 and the next value; unit_roundoff u = eps/2 bounds the relative error of "
              "round-to-nearest.\nfp16's largest value is 65504 (Paddle's low-precision operator guide, table 1-2, "
              "prints 655 by mistake).")
    return 0
