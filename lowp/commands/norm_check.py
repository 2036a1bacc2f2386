"""``lowp norm-check``: every L2-norm method x format x case family against the exact result."""
from __future__ import annotations

import argparse

from lowp.cli_args import (SEED_MAX, check_at_most, check_memory, int_at_least, int_in, output_file, usage_error,
                           writable_file)

HELP = ("measure the L2-norm methods (naive, max-scaled, two-segment, Blue's, robust) per format: ulp error, overflow, "
        "underflow")

DEFAULT_SPECS = "fp16,bf16,dlfloat16,e4m3:fp16,e5m2:fp16,e4m3:bf16"
MODULE_COLUMNS = ["module", "dtype", "rows", "lowp_max_ulp", "torch_max_ulp", "lowp_grad_rel_error",
                  "grad_rows_checked"]
#: the sequential methods take one Python-level step per column: longer rows would run for hours
MAX_N_LONG = 2**20
#: bytes per input element the methods' working tensors take at most (float64, double words)
BYTES_PER_ELEMENT = 512

COLUMNS = ["method", "input", "compute", "family", "rows", "max_ulp", "correctly_rounded_%", "faithful_%",
           "overflow", "underflow"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp norm-check`` to ``parser``."""
    parser.add_argument("--formats", default=DEFAULT_SPECS,
                        help="comma-separated INPUT[:COMPUTE] formats; COMPUTE is a format emulated exactly "
                             "(default: the input format) or 'native' for the fp32-opmath native path "
                             f"(default: {DEFAULT_SPECS})")
    parser.add_argument("--methods", default="naive,max_scaled,two_segment,blue,robust",
                        help="comma-separated methods")
    parser.add_argument("--rows", type=int_at_least(4), default=400, help="rows per random family (default 400)")
    parser.add_argument("--n-long", type=int_at_least(2), default=4096,
                        help=f"length of the long vectors (default 4096, at most {MAX_N_LONG:,})")
    parser.add_argument("--exhaustive", action="store_true", help="add the exhaustive n=1 family (all values)")
    parser.add_argument("--seed", type=int_in(0, SEED_MAX, " (a 64-bit seed)"), default=0,
                        help="seed of the random case families, in [0, 2**64) (default 0)")
    parser.add_argument("--modules", action="store_true",
                        help="also measure RMSNorm/LayerNorm forward and backward (lowp and torch) in fp16 and bf16")
    parser.add_argument("--markdown", metavar="PATH", type=output_file,
                        help="also write the table as markdown to PATH (a regular file; replaced)")
    parser.add_argument("--csv", metavar="PATH", type=output_file,
                        help="also write the table as CSV to PATH (a regular file; replaced)")


def _parse_specs(text: str) -> list[tuple[str, str]]:
    """``[(input format, compute format name or "native")]`` from ``"fp16,e4m3:bf16,bf16:native"``."""
    from lowp.formats import get_format
    from lowp.rounding import fits_in

    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, compute = item.partition(":")
        fmt = get_format(name)
        if compute == "native":
            specs.append((fmt.name, "native"))
            continue
        wide = get_format(compute or name)
        if not fits_in(fmt, wide):
            raise ValueError(f"compute format {wide.name} cannot hold every {fmt.name} value in {item!r}")
        specs.append((fmt.name, wide.name))
    if not specs:
        raise ValueError("--formats: expected at least one format")
    return specs


def run(args: argparse.Namespace) -> int:
    """Run ``lowp norm-check`` with the parsed ``args``; returns the exit status."""
    from lowp.norms.methods import METHODS
    from lowp.report import csv_text, markdown_table, text_table, write_atomic
    from lowp.threads import single_thread

    try:
        specs = _parse_specs(args.formats)
    except ValueError as exc:
        usage_error("norm-check", "--formats", str(exc).removeprefix("--formats: ").removeprefix("format: "))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        usage_error("norm-check", "--methods", f"unknown {', '.join(unknown) or '(none given)'}; expected some of "
                                               f"{', '.join(METHODS)}")
    if "robust" in methods:
        from lowp.formats import get_format
        from lowp.norms.methods import check_robust_format

        for _, compute in specs:
            try:
                check_robust_format(get_format("fp32" if compute == "native" else compute))
            except ValueError as exc:
                usage_error("norm-check", "--formats", str(exc).removeprefix("compute: "))
    check_at_most("norm-check", "--n-long", args.n_long, MAX_N_LONG, "the sequential methods step once per column")
    elements = 80 * args.rows + 9 * args.n_long
    check_memory("norm-check", "--rows" if 80 * args.rows > 9 * args.n_long else "--n-long",
                 elements * BYTES_PER_ELEMENT, f"{elements:,} input elements")
    for option, path in (("--markdown", args.markdown), ("--csv", args.csv)):
        if path:
            writable_file("norm-check", option, path)
    # thousands of tiny tensor ops: torch's thread pool only adds overhead here (5x on a busy 2-core box)
    with single_thread():
        table = _measure(specs, methods, args)
    print(text_table(COLUMNS, table))
    markdown = markdown_table(COLUMNS, table) + "\n"
    if args.modules:
        module_table = _measure_modules()
        print("\n" + text_table(MODULE_COLUMNS, module_table))
        markdown += "\n" + markdown_table(MODULE_COLUMNS, module_table) + "\n"
    if args.markdown:
        write_atomic(args.markdown, markdown)
    if args.csv:
        write_atomic(args.csv, csv_text(COLUMNS, table))
    return 0


def _measure_modules() -> list[list[object]]:
    import torch

    from lowp.norms.module_check import module_scores

    table: list[list[object]] = []
    for dtype in (torch.float16, torch.bfloat16):
        for center, name in ((False, "RMSNorm"), (True, "LayerNorm")):
            for s in module_scores(dtype, center):
                table.append([name, str(dtype).replace("torch.", ""), s.case, round(s.max_ulp, 3),
                              round(s.torch_max_ulp, 3), f"{s.grad_error:.2e}", s.grad_rows])
    return table


def _measure(specs: list[tuple[str, str]], methods: list[str], args: argparse.Namespace) -> list[list[object]]:
    from lowp.norms.cases import case_families
    from lowp.norms.check import score

    table: list[list[object]] = []
    for fmt, compute in specs:
        for case in case_families(fmt, rows=args.rows, n_long=args.n_long, seed=args.seed,
                                  exhaustive=args.exhaustive):
            for method in methods:
                s = score(case, method, fmt, None if compute == "native" else compute)
                table.append([method, fmt, compute, case.family, s.rows, round(s.max_ulp, 3),
                              round(100 * s.correctly_rounded, 2), round(100 * s.faithful, 2), s.overflow,
                              s.underflow])
    return table
