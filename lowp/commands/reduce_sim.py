"""``lowp reduce-sim``: simulate low-precision gradient reduction, explain the post "Why reduction
precision matters", show where it hurts."""
from __future__ import annotations

import argparse
import os
from typing import Any

from lowp.cli_args import check_at_most, check_memory, int_at_least, output_dir, usage_error, writable_folder

HELP = "simulate bf16/fp16/fp8 gradient all-reduce (ring, tree, all-to-all): error tables and plots"

SECTIONS = ("seed", "mean", "microbatch", "fp16", "fp8", "premultiply", "outlier", "wire")
TITLES = {
    "seed": "The grid of \"Why reduction precision matters\": error std / sigma of a bf16 reduction of "
            "N(0, sigma^2) pre-divided by R (measured vs model); ring/noise = ring error / (sigma / sqrt(R))",
    "mean": "Non-zero mean across ranks (mu = ratio * sigma): stagnation bias of nearest rounding (bf16)",
    "microbatch": "Local accumulation of M micro-batch gradients g/M in a bf16 .grad",
    "fp16": "fp16 without loss scaling: g/R below fp16's range; dividing after an fp32 sum instead",
    "fp8": "fp8 per-hop rounding vs sending fp8 and accumulating in fp32",
    "premultiply": "NCCL-style averaging (premultiply by fl(1/R)): bias R*fl(1/R) - 1 in percent",
    "outlier": "One outlier rank with gradients `scale` times larger (bf16)",
    "wire": "8-bit wire (blocks of 32, e8m0 scales) with fp32 accumulation, with and without error feedback (EF), "
            "beside fp32 and the bf16 ring: error / noise of one reduction of a fixed gradient and of the average "
            "of T reductions",
}
#: the plot each section writes (besides its ``<section>.csv``), unless --no-plots
PLOTS = {"seed": "seed003_error_vs_R.png", "mean": "stagnation_bias.png", "fp16": "fp16_underflow.png"}


def output_files(sections: list[str], plots: bool) -> list[str]:
    """The names of the files a run of ``sections`` writes into --out.

    Args:
        sections: the sections run, from :data:`SECTIONS`.
        plots: whether the plots are drawn (not ``--no-plots``).
    """
    return [f"{s}.csv" for s in sections] + [PLOTS[s] for s in sections if plots and s in PLOTS]


def wire_steps(largest: int) -> list[int]:
    """The ``T`` columns of the wire section: 4, 16, 64, ... below ``largest``, then ``largest``."""
    steps = [4**i for i in range(1, 32) if 4**i < largest]
    return steps + [largest]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lowp reduce-sim`` to ``parser``."""
    parser.add_argument("--out", type=output_dir, default=os.path.join("lowp-report", "reduce-sim"),
                        help="folder for the PNG plots and CSV tables (default: lowp-report/reduce-sim)")
    parser.add_argument("--only", choices=SECTIONS, action="append", default=None,
                        help="run only these sections (repeatable; default: all)")
    parser.add_argument("--elements", type=int_at_least(1), default=4096,
                        help="elements per simulated tensor (default 4096)")
    parser.add_argument("--max-world-size", type=int_at_least(2), default=1024,
                        help="largest R in the seed grid (powers of two from 2; default 1024, at most 65536)")
    parser.add_argument("--wire-steps", type=int_at_least(1), default=16,
                        help="wire section: average the reductions of a fixed gradient over T = 4, 16, ... up to "
                             "this many steps (default 16)")
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")


def _plot_seed(headers: list[str], rows: list[list[Any]], path: str) -> None:
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
                label="the post's metric (ring - fl(exact))")
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


def _plot_lines(headers: list[str], rows: list[list[Any]], x: str, group: str, y: str, path: str,
                title: str) -> None:
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


#: the largest R any section simulates besides the seed grid (mean_bias_table's 4096)
LARGEST_FIXED_R = 4096
#: bytes per simulated value held at once (inputs, three algorithms' results, exact sums)
BYTES_PER_VALUE = 64


def _check_sizes(args: argparse.Namespace, sections: list[str]) -> None:
    """Usage errors, before any work, for a world size or element count beyond the simulator's
    limits (:data:`lowp.distributed.simulator.MAX_WORLD_SIZE`, ``MAX_SIMULATED_VALUES``) or memory."""
    from lowp.distributed.simulator import MAX_SIMULATED_VALUES, MAX_WORLD_SIZE

    check_at_most("reduce-sim", "--max-world-size", args.max_world_size, MAX_WORLD_SIZE, "simulated ranks")
    largest_r = max(args.max_world_size if "seed" in sections else 2, LARGEST_FIXED_R)
    # the seed grid simulates its five sigmas at once; premultiply uses 2 * elements
    per_r = 5 * args.elements if "seed" in sections else 2 * args.elements
    if largest_r * per_r > MAX_SIMULATED_VALUES:
        usage_error("reduce-sim", "--elements", f"{args.elements:,} elements make {largest_r * per_r:,} simulated "
                                                f"values at R = {largest_r}, more than the simulator's limit of "
                                                f"{MAX_SIMULATED_VALUES:,}")
    check_memory("reduce-sim", "--elements", largest_r * per_r * BYTES_PER_VALUE, f"R = {largest_r} ranks")


def run(args: argparse.Namespace) -> int:
    """Run ``lowp reduce-sim`` with the parsed ``args``; returns the exit status."""
    from tqdm import tqdm

    from lowp.distributed import experiments as ex
    from lowp.report import csv_text, markdown_table, staged_folder, text_table, write_atomic
    from lowp.threads import single_thread

    sections = list(dict.fromkeys(args.only or SECTIONS))
    _check_sizes(args, sections)
    writable_folder("reduce-sim", "--out", args.out, output_files(sections, not args.no_plots))
    seed_sizes = [2**i for i in range(1, args.max_world_size.bit_length()) if 2**i <= args.max_world_size]
    n = args.elements
    wire_sizes = [R for R in ex.WIRE_WORLD_SIZES if R <= args.max_world_size] or [2]
    runners = {
        "seed": lambda tick: ex.seed_grid(seed_sizes, elements=n, progress=tick),
        "mean": lambda tick: ex.mean_bias_table(elements=max(n // 2, 1), progress=tick),
        "microbatch": lambda tick: ex.microbatch_table(elements=n, progress=tick),
        "fp16": lambda tick: ex.fp16_table(elements=n, progress=tick),
        "fp8": lambda tick: ex.fp8_table(elements=n, progress=tick),
        "premultiply": lambda tick: ex.premultiply_table(elements=2 * n, progress=tick),
        "outlier": lambda tick: ex.outlier_table(elements=n, progress=tick),
        "wire": lambda tick: ex.wire_table(wire_sizes, elements=max(n // 4, 32), steps=wire_steps(args.wire_steps),
                                           progress=tick),
    }
    # every file goes to a staging folder, moved into --out only when all sections are done
    with single_thread(), staged_folder(args.out) as stage:
        for name in sections:
            with tqdm(desc=f"reduce-sim {name}", unit="row", leave=False) as bar:
                headers, rows = runners[name](bar.update)
            print(f"\n## {TITLES[name]}\n")
            print(markdown_table(headers, rows) if args.markdown else text_table(headers, rows))
            write_atomic(os.path.join(stage, f"{name}.csv"), csv_text(headers, rows))
            if args.no_plots:
                continue
            if name == "seed":
                _plot_seed(headers, rows, os.path.join(stage, PLOTS["seed"]))
            elif name == "mean":
                _plot_lines(headers, [r for r in rows if r[1] > 0], "R", "mu/sigma", "ring_bias%",
                            os.path.join(stage, PLOTS["mean"]), "bf16 ring: bias of the mean gradient (%)")
            elif name == "fp16":
                _plot_lines(headers, rows, "R", "sigma", "ring_err/noise", os.path.join(stage, PLOTS["fp16"]),
                            "fp16 ring without loss scaling: error / noise")
    print(f"\ntables (CSV){'' if args.no_plots else ' and plots (PNG)'} written to {args.out}")
    return 0
