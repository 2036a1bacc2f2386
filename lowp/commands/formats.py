"""``lowp formats``: the table of every preset number format and its properties, then the block formats."""
from __future__ import annotations

import argparse

from lowp.cli_args import format_spec

HELP = "print every number format lowp knows, with eps, range and precision, and the block (MX, NVFP4) formats"

COLUMNS = ["name", "bits", "exponent_bits", "mantissa_bits", "bias", "subnormals", "special", "overflow",
           "eps", "unit_roundoff", "max", "min_normal", "min_subnormal", "decimal_digits", "torch_dtype"]
BLOCK_COLUMNS = ["preset", "element", "block", "scale_format", "scale_rounding", "overflow", "bits_per_element"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp formats`` to ``parser``."""
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--csv", action="store_true", help="print CSV")
    parser.add_argument("--custom", metavar="EXMY", type=format_spec, action="append", default=[],
                        help="also show a custom IEEE-style format, e.g. e3m4 (repeatable)")
    parser.add_argument("--blocks", action="store_true",
                        help="print only the block formats (elements plus a scale per block); with --csv, their CSV")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp formats`` with the parsed ``args``; returns the exit status."""
    from lowp.formats import PRESETS, get_format
    from lowp.report import csv_text, markdown_table, text_table

    from lowp.blocks import BLOCK_PRESETS

    formats = list(PRESETS.values()) + [get_format(c) for c in args.custom]
    rows = [[f.summary()[c] for c in COLUMNS] for f in formats]
    block_rows = [[b.summary()[c] for c in BLOCK_COLUMNS] for b in BLOCK_PRESETS.values()]
    tables = [] if args.blocks else [(COLUMNS, rows)]
    tables.append((BLOCK_COLUMNS, block_rows))
    if args.csv:  # one table per CSV: the element formats, or the block formats with --blocks
        print(csv_text(*tables[0]), end="")
    elif args.markdown:
        print("\n\n".join(markdown_table(columns, body) for columns, body in tables))
    else:
        if not args.blocks:
            print(text_table(COLUMNS, rows))
            print("\neps: gap between 1 and the next value; unit_roundoff u = eps/2 bounds the relative error of "
                  "round-to-nearest.\nfp16's largest value is 65504 (Paddle's low-precision operator guide, table "
                  "1-2, prints 655 by mistake).\n")
        print("Block formats (docs/blocks.md): elements of a narrow format, one scale per block")
        print(text_table(BLOCK_COLUMNS, block_rows))
        print("\nbits_per_element counts the block scale (8 bits over the block); nvfp4's one fp32 per-tensor scale "
              "is not counted.")
    return 0
