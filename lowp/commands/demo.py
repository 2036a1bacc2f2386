"""``lowp demo``: train a small byte-level language model on Python's standard library sources in
fp32 and with bf16 weights under each update mode, then print a table and plot the losses."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from lowp.cli_args import (SEED_MAX, check_at_most, check_memory, float_in, int_at_least, int_in, output_dir,
                           usage_error, writable_folder)

if TYPE_CHECKING:
    from lowp.demo.train import DemoConfig

HELP = "train a tiny char-level LM on Python's stdlib in fp32 and bf16 (nearest/kahan/stochastic) and compare"

DEFAULT_RUNS = "fp32,bf16-nearest,bf16-kahan,bf16-stochastic"
#: sane limits: 10M steps is weeks of CPU time; more processes than this only queue up
MAX_STEPS = 10_000_000
MAX_JOBS = 256
#: the batches are drawn from ``seed + 1`` (:func:`lowp.demo.train.train_loop`), itself a 64-bit seed
MAX_SEED = SEED_MAX - 1
#: the files written into --out
OUTPUT_FILES = ("demo.csv", "demo_loss.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp demo`` to ``parser``."""
    parser.add_argument("--steps", type=int_at_least(1), default=700, help="training steps per run (default 700)")
    parser.add_argument("--modes", default=DEFAULT_RUNS,
                        help=f"comma-separated runs from fp32, bf16-nearest, bf16-kahan, bf16-stochastic, "
                             f"bf16-exact, bf16-exact8, bf16-8bit, bf16-4bit, fp16-kahan (bf16-8bit: exact8 with "
                             f"int8/uint8 states, 5.06 bytes/param; bf16-4bit: stochastic, int8/uint4 states, 3.56; "
                             f"default {DEFAULT_RUNS})")
    parser.add_argument("--out", type=output_dir, default="lowp-report/demo",
                        help="folder for demo_loss.png and demo.csv")
    parser.add_argument("--jobs", type=int_at_least(1), default=None,
                        help="runs trained in parallel, one single-threaded process each (default: CPU count, "
                             "at most the number of runs)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=16)
    parser.add_argument("--lr", type=float_in(0, 10, low_open=True), default=2e-3,
                        help="peak AdamW learning rate in (0, 10] (cosine decay to 10%%)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED, " (the batches are drawn with seed + 1, a 64-bit seed)"),
                        default=0, help="seed of the initialisation, batches and stochastic rounding, in "
                                        "[0, 2**64 - 2] (default 0)")
    parser.add_argument("--max-bytes", type=int_at_least(4096), default=600_000,
                        help="bytes of stdlib source to read (at least 4096)")
    parser.add_argument("--keep-norms-fp32", action="store_true",
                        help="keep LayerNorm weights in fp32 (a tip of optimi's low-precision training guide)")


def _check(args: argparse.Namespace, runs: list[str], known: dict, cfg: DemoConfig) -> int:
    """Usage errors for bad runs and for limits and memory, before any data is read; returns the
    number of parallel runs."""
    unknown = [r for r in runs if r not in known]
    if unknown or not runs:
        usage_error("demo", "--modes", f"unknown run(s) {', '.join(unknown) or '(none given)'}; expected a "
                                       f"comma-separated list of {', '.join(known)}")
    check_at_most("demo", "--steps", args.steps, MAX_STEPS, "steps per run")
    if args.jobs is not None:
        check_at_most("demo", "--jobs", args.jobs, MAX_JOBS, "processes")
    jobs = min(args.jobs or os.cpu_count() or 1, len(runs))
    # per sample: about 40 activations of width dim per layer and position, attention scores, logits (fp32)
    per_sample = 4 * cfg.seq_len * (40 * cfg.layers * cfg.dim + 4 * cfg.layers * cfg.heads * cfg.seq_len + 4 * 256)
    check_memory("demo", "--batch-size", jobs * args.batch_size * per_sample,
                 f"{jobs} run(s) of batch {args.batch_size}")
    check_memory("demo", "--max-bytes", (jobs + 1) * 8 * args.max_bytes, f"{jobs + 1} copies of the data")
    return jobs


def run(args: argparse.Namespace) -> int:
    """Run ``lowp demo`` with the parsed ``args``; returns the exit status."""
    import signal
    import sys
    from pathlib import Path

    from lowp.demo.data import load_data
    from lowp.demo.runner import Terminated, train_all
    from lowp.demo.train import RUNS, DemoConfig
    from lowp.report import atomic_path, csv_text, text_table, write_atomic

    runs = [r.strip() for r in args.modes.split(",") if r.strip()]
    cfg = DemoConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                     eval_every=max(1, args.steps // 20), keep_norms_fp32=args.keep_norms_fp32)
    jobs = _check(args, runs, RUNS, cfg)
    writable_folder("demo", "--out", args.out, OUTPUT_FILES)
    data = load_data(args.max_bytes)
    print(f"data: {data.train.numel() + data.val.numel():,} bytes from {len(data.files)} files of Python "
          f"{sys.version.split()[0]}'s standard library ({data.files[0]} .. {data.files[-1]}), "
          f"last 10% held out for validation")
    print(f"model: byte-level transformer, {cfg.layers} layers, dim {cfg.dim}, context {cfg.seq_len}; AdamW "
          f"lr {cfg.lr:g} (cosine), wd {cfg.weight_decay}, batch {cfg.batch_size}, {cfg.steps} steps; "
          f"{jobs} parallel single-threaded run(s)")
    try:
        results = train_all(runs, data, cfg, jobs)
    except Terminated:
        print("lowp demo: terminated (SIGTERM); workers stopped, nothing written", file=sys.stderr)
        return 128 + signal.SIGTERM
    base = next((r.val_loss for r in results if r.name == "fp32"), None)
    headers = ["run", "val loss", "vs fp32", "bytes/param", "time s", "stalled %"]
    rows = [[r.name, f"{r.val_loss:.4f}", f"{100 * (r.val_loss / base - 1):+.2f}%" if base else "-",
             f"{r.bytes_per_param:.1f}", f"{r.seconds:.0f}", f"{100 * r.stalled_fraction:.1f}"] for r in results]
    print(text_table(headers, rows))
    print("bytes/param: weights + gradients + optimizer states (AdamW moments, Kahan compensation).\n"
          "stalled %: elements whose stored weight did not move in the last step (the update was rounded away).\n"
          "Layers compute in fp32; weights, gradients and states are stored in the run's dtype.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "demo.csv", csv_text(headers, rows))
    try:
        from lowp.demo.plot import plot_curves
        with atomic_path(out / "demo_loss.png") as tmp:
            plot_curves(results, tmp)
        print(f"wrote {out / 'demo_loss.png'} and {out / 'demo.csv'}")
    except ImportError:
        print(f"matplotlib is not installed: skipped the plot (pip install 'lowp[report]'); wrote {out / 'demo.csv'}")
    return 0
