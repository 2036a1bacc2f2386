"""``lowp reduce-sim``: simulate low-precision gradient reduction, explain seed 003, show where it hurts."""
from __future__ import annotations

import argparse
import os

from lowp.cli_args import int_at_least, output_dir, usage_error

HELP = "simulate bf16/fp16/fp8 gradient all-reduce (ring, tree, all-to-all): error tables and plots"

SECTIONS = ("seed", "mean", "microbatch", "fp16", "fp8", "premultiply", "outlier")
TITLES = {
    "seed": "Seed 003 grid: error std / sigma of a bf16 reduction of N(0, sigma^2) pre-divided by R "
            "(measured vs model); ring/noise = ring error / (sigma / sqrt(R))",
    "mean": "Non-zero mean across ranks (mu = ratio * sigma): stagnation bias of nearest rounding (bf16)",
    "microbatch": "Local accumulation of M micro-batch gradients g/M in a bf16 .grad",
    "fp16": "fp16 without loss scaling: g/R below fp16's range; dividing after an fp32 sum instead",
    "fp8": "fp8 per-hop rounding vs sending fp8 and accumulating in fp32",
    "premultiply": "NCCL-style averaging (premultiply by fl(1/R)): bias R*fl(1/R) - 1 in percent",
    "outlier": "One outlier rank with gradients `scale` times larger (bf16)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_dir, default=os.path.join("lowp-report", "reduce-sim"),
                        help="folder for the PNG plots and CSV tables (default: lowp-report/reduce-sim)")
    parser.add_argument("--only", choices=SECTIONS, action="append", default=None,
                        help="run only these sections (repeatable; default: all)")
    parser.add_argument("--elements", type=int_at_least(1), default=4096, help="elements per simulated tensor (default 4096)")
    parser.add_argument("--max-world-size", type=int_at_least(2), default=1024,
                        help="largest R in the seed grid (powers of two from 2; default 1024)")
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")


def _plot_seed(headers: list[str], rows: list[list[object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {h: i for i, h in enumerate(headers)}
    sigma0 = rows[0][col["sigma"]]
    sel = [r for r in rows if r[col["sigma"]] == sigma0]
    R = [r[0] for r in sel]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for alg, marker in (("ring", "o"), ("tree", "s"), ("alltoall", "^")):
        left.loglog(R, [r[col[f"{alg}/sigma"]] for r in sel], marker, label=f"{alg} (simulated)")
        left.loglog(R, [r[col[f"{alg}_model"]] for r in sel], "-", color=left.lines[-1].get_color(),
                    label=f"{alg} (model)")
    left.loglog(R, [r[col["seed_std/sigma"]] if r[col["seed_std/sigma"]] > 0 else float("nan") for r in sel], "kx",
                label="seed 003 metric (ring - fl(exact))")
    left.set(xlabel="world size R", ylabel="error std / sigma", title="bf16 reduction error (all sigmas coincide)")
    left.legend(fontsize=7)
    for alg in ("ring", "tree", "alltoall"):
        right.loglog(R, [r[col[f"{alg}/sigma"]] * r[0] ** 0.5 for r in sel], "o-", label=alg)
    right.axhline(1.0, color="k", lw=0.8)
    right.set(xlabel="world size R", ylabel="error / sampling noise (sigma/sqrt(R))", title="what training sees")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lines(headers: list[str], rows: list[list[object]], x: str, group: str, y: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {h: i for i, h in enumerate(headers)}
    fig, ax = plt.subplots(figsize=(6, 4))
    for g in dict.fromkeys(r[col[group]] for r in rows):
        sel = [r for r in rows if r[col[group]] == g]
        ax.plot([r[col[x]] for r in sel], [abs(r[col[y]]) for r in sel], "o-", label=f"{group}={g}")
    ax.set(xscale="log", yscale="log", xlabel=x, ylabel=f"|{y}|", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from lowp.distributed import experiments as ex
    from lowp.report import csv_text, markdown_table, text_table
    from lowp.threads import single_thread

    sections = args.only or list(SECTIONS)
    seed_sizes = [2**i for i in range(1, args.max_world_size.bit_length()) if 2**i <= args.max_world_size]
    n = args.elements
    runners = {
        "seed": lambda: ex.seed_grid(seed_sizes, elements=n),
        "mean": lambda: ex.mean_bias_table(elements=max(n // 2, 1)),
        "microbatch": lambda: ex.microbatch_table(elements=n),
        "fp16": lambda: ex.fp16_table(elements=n),
        "fp8": lambda: ex.fp8_table(elements=n),
        "premultiply": lambda: ex.premultiply_table(elements=2 * n),
        "outlier": lambda: ex.outlier_table(elements=n),
    }
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        usage_error("reduce-sim", "--out", f"cannot create the folder {args.out!r}: {exc.strerror}")
    with single_thread():
        for name in sections:
            headers, rows = runners[name]()
            print(f"\n## {TITLES[name]}\n")
            print(markdown_table(headers, rows) if args.markdown else text_table(headers, rows))
            with open(os.path.join(args.out, f"{name}.csv"), "w") as fh:
                fh.write(csv_text(headers, rows))
            if args.no_plots:
                continue
            if name == "seed":
                _plot_seed(headers, rows, os.path.join(args.out, "seed003_error_vs_R.png"))
            elif name == "mean":
                _plot_lines(headers, [r for r in rows if r[1] > 0], "R", "mu/sigma", "ring_bias%",
                            os.path.join(args.out, "stagnation_bias.png"), "bf16 ring: bias of the mean gradient (%)")
            elif name == "fp16":
                _plot_lines(headers, rows, "R", "sigma", "ring_err/noise", os.path.join(args.out, "fp16_underflow.png"),
                            "fp16 ring without loss scaling: error / noise")
    print(f"\ntables (CSV){'' if args.no_plots else ' and plots (PNG)'} written to {args.out}")
    return 0
