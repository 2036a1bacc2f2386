"""``lowp audit``: ulp audit of unary, binary and reduction ops in low precision, three ways."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lowp.cli_args import (check_at_most, check_memory, format_list, int_at_least, int_list, output_dir, usage_error,
                           writable_folder)

HELP = "audit op precision (ulp error vs correctly rounded fp64) for fp16/bf16/fp8: native, opmath and low-format"

TABLE_COLUMNS = ["kind", "op", "format", "method", "length", "n", "max_ulp", "mean_ulp", "p99_ulp", "frac_correct",
                 "max_rel", "overflow", "underflow_to_zero", "nan_mismatch", "inf_mismatch", "near_midpoint"]
KINDS = ("unary", "binary", "reductions")
#: working bytes per grid pair (binary: inputs, exact and rounded results in float64) and per
#: reduction element (the input, its exact partial results and every method's output)
BYTES_PER_PAIR = 96
BYTES_PER_REDUCTION_ELEMENT = 256
MAX_THREADS = 1024
#: the largest K of ``--gemm`` (the emulation loops over K; 2**20 takes minutes)
MAX_GEMM_K = 2 ** 20
#: the files written into --out
OUTPUT_FILES = ("audit.csv", "audit.json", "audit.md")


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _audit_formats(text: str) -> list[str]:
    """Comma-separated formats of at most 16 bits (the unary audit enumerates every value)."""
    from lowp.formats import get_format

    names = format_list(text)
    wide = [n for n in names if get_format(n).bits > 16]
    if wide:
        raise argparse.ArgumentTypeError(f"expected formats of at most 16 bits (every value is enumerated), "
                                         f"got {', '.join(wide)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp audit`` to ``parser``."""
    parser.add_argument("--formats", type=_audit_formats, default="fp16,bf16",
                        help="comma-separated formats (fp16, bf16 natively; fp8_e4m3fn, fp8_e5m2, dlfloat16 emulated)")
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: every op of the chosen kinds)")
    parser.add_argument("--kinds", default="unary,binary,reductions",
                        help="comma-separated subset of " + ",".join(KINDS))
    parser.add_argument("--methods", default="native,opmath,lowformat", help="comma-separated methods")
    parser.add_argument("--no-exhaustive", dest="stride", action="store_const", const=16, default=1,
                        help="unary: every 16th input instead of every finite value (default: exhaustive)")
    parser.add_argument("--points", type=int_at_least(2), default=384,
                        help="binary: grid points per axis (default 384, at most 65536)")
    parser.add_argument("--lengths", type=int_list(2), default="10,1000,100000,1000000",
                        help="reductions: comma-separated lengths (integers >= 2)")
    parser.add_argument("--seed-tables", action="store_true",
                        help="also reproduce the appendix 3.3 and 3.4 tables of Paddle's low-precision operator guide")
    parser.add_argument("--conversion-stride", type=int_at_least(1), default=97,
                        help="3.4 table: use every k-th float32 value (1 = all 335M, ~70 s)")
    parser.add_argument("--out", type=output_dir, default=None,
                        help="folder for audit.csv, audit.json and audit.md (created if missing)")
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="torch threads (default 1: the audit's tensors are small and extra OpenMP threads "
                             "only help on an idle machine)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--gemm", action="store_true",
                        help="print only the GEMM accumulation table instead: error vs K of an fp8 (e4m3) matmul "
                             "with a 14-bit tensor-core accumulator, with and without promotion to fp32 every 128, "
                             "and with fp32 accumulation (docs/audit.md, 'GEMM accumulation')")
    parser.add_argument("--blocks", action="store_true",
                        help="print only the block-format table instead: SQNR of MXFP8/6/4 and NVFP4 x scale rounding, "
                             "with and without the random Hadamard transform, on Gaussian, heavy-tailed and "
                             "outlier-channel tensors (docs/audit.md, 'Block formats')")
    parser.add_argument("--gemm-ks", type=int_list(1), default="512,1024,2048,4096,8192",
                        help="--gemm: comma-separated inner dimensions K (default 512,1024,2048,4096,8192; "
                             f"at most {MAX_GEMM_K:,})")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp audit`` with the parsed ``args``; returns the exit status."""
    from lowp.audit.binary import audit_binary
    from lowp.audit.ops import BINARY_OPS, UNARY_OPS
    from lowp.audit.reductions import REDUCTIONS, audit_reductions
    from lowp.audit.unary import audit_unary
    import torch

    from lowp.report import text_table

    from lowp.audit.unary import METHODS

    if args.gemm:
        return run_gemm(args)
    if args.blocks:
        return run_blocks(args)
    kinds = _csv_list(args.kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        usage_error("audit", "--kinds", f"unknown {bad or '(none given)'}; expected some of {', '.join(KINDS)}")
    ops = None if args.ops is None else _csv_list(args.ops)
    if ops is not None:
        names: dict[str, list[str]] = {"unary": list(UNARY_OPS), "binary": list(BINARY_OPS),
                                       "reductions": list(REDUCTIONS)}
        known = {o for table in names.values() for o in table}
        chosen = {o for k in kinds for o in names[k]}
        if not ops:
            usage_error("audit", "--ops", f"expected comma-separated op names (leave --ops out to audit every op), "
                                          f"got {args.ops!r}")
        unknown = [o for o in ops if o not in known]
        if unknown:
            usage_error("audit", "--ops", f"unknown {unknown}; expected names from {', '.join(sorted(known))}")
        elsewhere = [o for o in ops if o not in chosen]
        if elsewhere:
            usage_error("audit", "--ops", f"{', '.join(elsewhere)} not among the ops of --kinds {','.join(kinds)}; "
                                          f"expected some of {', '.join(sorted(chosen))}")
    formats, methods, progress = args.formats, _csv_list(args.methods), not args.no_progress
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        usage_error("audit", "--methods", f"unknown {bad or '(none given)'}; expected some of {', '.join(METHODS)}")
    if "binary" in kinds:
        check_at_most("audit", "--points", args.points, 2**16, "every value of a 16-bit format")
        pairs = args.points ** 2
        check_memory("audit", "--points", pairs * BYTES_PER_PAIR, f"a {args.points}-point grid")
    if "reductions" in kinds:
        longest = max(args.lengths)
        check_memory("audit", "--lengths", longest * BYTES_PER_REDUCTION_ELEMENT, f"a reduction of length {longest:,}")
    check_at_most("audit", "--threads", args.threads, MAX_THREADS, "torch's thread pool")
    if args.out is not None:
        writable_folder("audit", "--out", args.out, OUTPUT_FILES)
    torch.set_num_threads(args.threads)

    def pick(table: object) -> "list[str] | None":
        return None if ops is None else [o for o in ops if o in table]  # type: ignore[operator]

    rows: list[dict[str, object]] = []
    try:
        if "unary" in kinds and pick(UNARY_OPS) != []:
            rows += audit_unary(pick(UNARY_OPS), formats, methods, stride=args.stride, progress=progress)
        if "binary" in kinds and pick(BINARY_OPS) != []:
            rows += audit_binary(pick(BINARY_OPS), formats, methods, points=args.points, progress=progress)
        if "reductions" in kinds and pick(REDUCTIONS) != []:
            rows += audit_reductions(pick(REDUCTIONS), formats, methods, lengths=args.lengths, progress=progress)
    except ValueError as exc:
        usage_error("audit", "--formats", str(exc))
    print(text_table(TABLE_COLUMNS, [[r.get(c) for c in TABLE_COLUMNS] for r in rows]))
    print("\nulp errors against the float64 reference; <= 0.5 means correctly rounded. native: torch kernel in the "
          "format's dtype; opmath: fp32 compute, one rounding; lowformat: every step rounded to the format.")
    if args.seed_tables:
        print("\n" + seed_tables_text(args.conversion_stride))
    if args.out is not None:
        write_outputs(rows, Path(args.out))
        print(f"\nwrote {Path(args.out) / 'audit.csv'}, audit.json, audit.md")
    return 0


def run_gemm(args: argparse.Namespace) -> int:
    """``lowp audit --gemm``: the GEMM accumulation table (:func:`lowp.audit.gemm.gemm_error_table`)."""
    import torch

    from lowp.audit.gemm import gemm_error_table
    from lowp.report import text_table

    check_at_most("audit", "--gemm-ks", max(args.gemm_ks), MAX_GEMM_K, "the emulation's loop over K")
    check_at_most("audit", "--threads", args.threads, MAX_THREADS, "torch's thread pool")
    torch.set_num_threads(args.threads)
    heads, rows = gemm_error_table(args.gemm_ks)
    print("GEMM accumulation: C = A B, A (16 x K) and B (K x 16) rounded to fp8 e4m3, products exact.\n"
          "14-bit: the h800_fp8 accumulator model (14 fraction bits, 32 products per step aligned to the largest "
          "exponent, truncated); fp32 every 128: its partial sums added into fp32 every 128 products; fp32: a "
          "sequential fp32 FMA chain.\n"
          "U(0,1): largest |C - C_exact| / |C_exact| over the 256 outputs; N(0,1): ||C - C_exact|| / ||C_exact||.")
    print(text_table(heads, rows))
    return 0


def run_blocks(args: argparse.Namespace) -> int:
    """``lowp audit --blocks``: the block-format table (:func:`lowp.audit.blocks.block_format_table`)."""
    import torch

    from lowp.audit.blocks import block_format_table
    from lowp.report import text_table

    check_at_most("audit", "--threads", args.threads, MAX_THREADS, "torch's thread pool")
    torch.set_num_threads(args.threads)
    heads, rows = block_format_table()
    print("Block formats: SQNR = 10 log10(sum x^2 / sum (x - q)^2) in dB (higher is better; 6.02 dB per bit) of "
          "q = fake_quantize(x) on 128 x 1024 tensors: N(0,1); Student t(3); N(0,1) with 1% of the channels x100 "
          "(and its other channels alone). hadamard: the random Hadamard transform over one block first.")
    print(text_table(heads, rows))
    return 0


def write_outputs(rows: list[dict[str, object]], out: Path) -> None:
    """audit.csv, audit.json and audit.md (one table per kind) under ``out``."""
    from lowp.report import csv_text, markdown_table, write_atomic

    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(c for r in rows for c in r))
    write_atomic(out / "audit.csv", csv_text(columns, [[r.get(c) for c in columns] for r in rows]))
    write_atomic(out / "audit.json", json.dumps(rows, indent=1, default=str))
    parts = ["## summary: max ulp error (number of results not correctly rounded)\n\n" + markdown_table(*pivot(rows))]
    for kind in dict.fromkeys(str(r["kind"]) for r in rows):
        sub = [r for r in rows if r["kind"] == kind]
        cols = [c for c in TABLE_COLUMNS if any(c in r for r in sub)]
        parts.append(f"## {kind}\n\n" + markdown_table(cols, [[r.get(c) for c in cols] for r in sub]))
    write_atomic(out / "audit.md", "# lowp audit\n\n" + "\n\n".join(parts) + "\n")


def pivot(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    """Headers and rows of a compact table: one row per (kind, op[, length]), one column per
    (format, method), cells ``"max_ulp (number of results not correctly rounded)"``."""
    cols = list(dict.fromkeys(f"{r['format']} {r['method']}" for r in rows))
    table: dict[tuple, dict[str, str]] = {}
    for r in rows:
        key = (r["kind"], r["op"], r.get("length", ""))
        wrong = round(int(r["n"]) * (1 - float(r["frac_correct"])))
        table.setdefault(key, {})[f"{r['format']} {r['method']}"] = f"{r['max_ulp']:.6g} ({wrong})"
    body = [[op if not length else f"{op} n={length}", *(cells.get(c, "-") for c in cols)]
            for (kind, op, length), cells in table.items()]
    return ["op", *cols], body


def seed_tables_text(conversion_stride: int) -> str:
    """The appendix 3.3 and 3.4 tables of Paddle's low-precision operator guide, measured, next to its
    printed values."""
    from lowp.audit.seed_tables import SEED_33, SEED_34, conversion_errors, family_table, math_vs_fp32
    from lowp.report import text_table

    fams = family_table(math_vs_fp32())
    rows33 = [r + ["|", *SEED_33[r[0]]] for r in fams]
    head33 = ["family (fp16 kernel vs fp32 kernel)", "max_abs", "max_rel", "mean_abs", "mean_rel", "|",
              "seed max_abs", "seed max_rel", "seed mean_abs", "seed mean_rel"]
    rows34 = []
    for key, sub in (("with_subnormals", True), ("normals_only", False)):
        e = conversion_errors(sub, stride=conversion_stride)
        rows34.append([key, e["max_abs"], e["max_rel"], e["mean_abs"], e["mean_rel"], e["mean_abs_uniform"],
                       e["mean_rel_uniform"], "|", *SEED_34[key]])
    head34 = ["fp32 -> fp16", "max_abs", "max_rel", "mean_abs", "mean_rel", "mean_abs (uniform)", "mean_rel (uniform)",
              "|", "seed max_abs", "seed max_rel", "seed mean_abs", "seed mean_rel"]
    return ("Paddle's operator guide, appendix 3.3, measured over every finite fp16 input in each op's domain:\n"
            + text_table(head33, rows33)
            + f"\n\nPaddle's operator guide, appendix 3.4, every {conversion_stride}-th float32 value of the range "
              "(means over fp32 values ~ log-uniform; 'uniform' weights by spacing = uniform real input):\n"
            + text_table(head34, rows34))
