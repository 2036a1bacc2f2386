"""``lowp demo``: train a small byte-level language model on Python's standard library sources in
fp32 and with bf16 weights under each update mode, then print a table and plot the losses."""
from __future__ import annotations

import argparse
import os

HELP = "train a tiny char-level LM on Python's stdlib in fp32 and bf16 (nearest/kahan/stochastic) and compare"

DEFAULT_RUNS = "fp32,bf16-nearest,bf16-kahan,bf16-stochastic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=700, help="training steps per run (default 700)")
    parser.add_argument("--modes", default=DEFAULT_RUNS,
                        help=f"comma-separated runs from fp32, bf16-nearest, bf16-kahan, bf16-stochastic, "
                             f"bf16-exact, fp16-kahan (default {DEFAULT_RUNS})")
    parser.add_argument("--out", default="lowp-report/demo", help="folder for demo_loss.png and demo.csv")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs trained in parallel, one single-threaded process each (default: CPU count, "
                             "at most the number of runs)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (cosine decay to 10%%)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-bytes", type=int, default=600_000, help="bytes of stdlib source to read")
    parser.add_argument("--keep-norms-fp32", action="store_true", help="keep LayerNorm weights in fp32 (seed 001 tip)")


def _check(args: argparse.Namespace, runs: list[str], known: dict) -> None:
    unknown = [r for r in runs if r not in known]
    if unknown or not runs:
        raise ValueError(f"--modes: unknown run(s) {', '.join(unknown) or '(none given)'}; expected a comma-separated "
                         f"list of {', '.join(known)}")
    for name in ("steps", "batch_size", "max_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs: expected a positive integer, got {args.jobs}")
    if not args.lr > 0:
        raise ValueError(f"--lr: expected a positive number, got {args.lr}")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from lowp.demo.data import load_data
    from lowp.demo.runner import train_all
    from lowp.demo.train import RUNS, DemoConfig
    from lowp.report import csv_text, text_table

    runs = [r.strip() for r in args.modes.split(",") if r.strip()]
    try:
        _check(args, runs, RUNS)
    except ValueError as err:
        print(f"lowp demo: error: {err}", file=sys.stderr)
        return 2
    cfg = DemoConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                     eval_every=max(1, args.steps // 20), keep_norms_fp32=args.keep_norms_fp32)
    data = load_data(args.max_bytes)
    jobs = min(args.jobs or os.cpu_count() or 1, len(runs))
    print(f"data: {data.train.numel() + data.val.numel():,} bytes from {len(data.files)} files of Python "
          f"{sys.version.split()[0]}'s standard library ({data.files[0]} .. {data.files[-1]}), "
          f"last 10% held out for validation")
    print(f"model: byte-level transformer, {cfg.layers} layers, dim {cfg.dim}, context {cfg.seq_len}; AdamW "
          f"lr {cfg.lr:g} (cosine), wd {cfg.weight_decay}, batch {cfg.batch_size}, {cfg.steps} steps; "
          f"{jobs} parallel single-threaded run(s)")
    results = train_all(runs, data, cfg, jobs)
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
    (out / "demo.csv").write_text(csv_text(headers, rows))
    try:
        from lowp.demo.plot import plot_curves
        plot_curves(results, out / "demo_loss.png")
        print(f"wrote {out / 'demo_loss.png'} and {out / 'demo.csv'}")
    except ImportError:
        print(f"matplotlib is not installed: skipped the plot (pip install 'lowp[report]'); wrote {out / 'demo.csv'}")
    return 0
