"""Training with the 8-bit gradient wire (issue 29): DDP on local gloo groups, one run per model,
world size and reduction, validation loss and bytes on the wire per step.

For each world size (``--world-sizes``, default 2,4) and model (``--models``: ``demo``, lowp
demo's CharLM on Python's stdlib sources; ``recall``, a causal ``nn.TransformerEncoder`` on
multi-query associative recall), trains one run per reduction (``--reductions``, default
``fp32,bf16-ring,fp8-ef,fp8``; ``int8-ef`` is offered too) with the same initialisation, the same
per-rank data shards and order and ``torch.optim.AdamW`` on fp32 weights, so the reduction is the
only difference (see :mod:`lowp.distributed.training_runs`). Prints one line per finished run,
then the table (final validation loss = mean of the last three evaluations, its gap against the
fp32 reduction, bytes per step and rank and their ratio to a bf16 ring all-reduce of the same
buckets) and the targets' verdicts; writes the plot to ``--out`` and the raw results to ``--json``.
With several seeds (``--seeds 0,1,2``, or several ``--from-json`` files of one seed each) it also
prints the gaps paired by seed (mean and standard error over seeds), judges the targets on the
mean, and plots them beside ``--out`` (``*_seeds.png``).

Runs are sequential (one process group at a time). Defaults: about 20 minutes per seed on 2 vCPUs.

Run: ``PYTHONPATH=. python benchmarks/compressed_training.py --out docs/img/compressed_training.png``.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from lowp.distributed.training_runs import (MODELS, REDUCTIONS, RunResult, RunSpec, plot, plot_seeds, run,
                                            seed_table, summarize, summarize_seeds, table)

TARGET_GAP = 0.5          # % of fp32's final validation loss
TARGET_BYTES = 0.55       # x a bf16 ring all-reduce's bytes


def _names(text: str, allowed: dict[str, str] | None, what: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        bad = [n for n in names if n not in allowed]
        if bad:
            raise SystemExit(f"--{what}: unknown {', '.join(bad)}; expected some of {', '.join(allowed)}")
    return names


def _verdict(label: str, gap: float, ratio: float) -> str:
    return (f"{label}: gap {gap:+.3f}% ({'met' if abs(gap) <= TARGET_GAP else 'NOT met'}: |gap| <= {TARGET_GAP}%"
            f"{'; lower than fp32' if gap < -TARGET_GAP else ''}), bytes {ratio:.3f}x bf16 ring "
            f"({'met' if ratio <= TARGET_BYTES else 'NOT met'}: <= {TARGET_BYTES}x)")


def verdicts(rows: list[dict], seed_rows: list[dict] | None = None) -> list[str]:
    """One line per (model, R) and error-feedback wire: its gap against the targets (with
    ``seed_rows``: the mean of the gaps paired by seed) and its byte ratio (the largest over seeds)."""
    feedback = ("fp8-ef", "int8-ef")
    if seed_rows is None:
        return [_verdict(f"{r['model']} R={r['R']} {r['reduction']}", r["gap vs fp32 %"], r["vs bf16 ring"])
                for r in rows if r["reduction"] in feedback and r["gap vs fp32 %"] is not None]
    ratios: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["R"], r["reduction"])
        ratios[key] = max(ratios.get(key, 0.0), r["vs bf16 ring"])
    return [_verdict(f"{r['model']} R={r['R']} {r['reduction']} (mean of {r['seeds']} seeds, s.e. {r['s.e. %']:.2f}%)",
                     r["mean gap vs fp32 %"], ratios[(r["model"], r["R"], r["reduction"])])
            for r in seed_rows if r["reduction"] in feedback]


def report(results: list[RunResult], reductions: list[str], out: str) -> None:
    """Print the table(s), the legend and the verdicts; write the plot(s) (``out``; with several
    seeds also ``out`` with ``_seeds`` before its suffix)."""
    rows = summarize(results)
    seeds = sorted({r.spec["seed"] for r in results})
    seed_rows = summarize_seeds(results) if len(seeds) > 1 else None
    print()
    print(table(rows))
    if seed_rows is not None:
        print(f"\nseeds {', '.join(map(str, seeds))}: gaps paired by seed\n")
        print(seed_table(seed_rows))
    print()
    for name in reductions:
        print(f"- {name}: {REDUCTIONS[name]}")
    print()
    print("\n".join(verdicts(rows, seed_rows)))
    plot([r for r in results if r.spec["seed"] == seeds[0]], out)
    print(f"plot: {out} (seed {seeds[0]})")
    if seed_rows is not None:
        stem, dot, suffix = out.rpartition(".")
        path = f"{stem}_seeds.{suffix}" if dot else f"{out}_seeds"
        plot_seeds(seed_rows, path)
        print(f"plot: {path}")


def main(argv: list[str] | None = None) -> list[RunResult]:
    """Parse the options, run every (model, R, reduction) in turn, print and plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="gloo ranks, comma-separated (default 2,4)")
    parser.add_argument("--models", default="demo,recall", help=f"some of {', '.join(MODELS)} (default both)")
    parser.add_argument("--reductions", default="fp32,bf16-ring,fp8-ef,fp8",
                        help=f"some of {', '.join(REDUCTIONS)} (default fp32,bf16-ring,fp8-ef,fp8)")
    parser.add_argument("--steps", type=int, default=3000, help="steps of the demo model (default 3000)")
    parser.add_argument("--recall-steps", type=int, default=2000, help="steps of the recall model (default 2000)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations (default 100)")
    parser.add_argument("--seeds", default="0", help="initialisation and data seeds, comma-separated (default 0)")
    parser.add_argument("--out", default="compressed_training.png", help="PNG of the loss curves")
    parser.add_argument("--json", default=None, help="write the raw results here (optional)")
    parser.add_argument("--from-json", default=None,
                        help="do not train: tables and plots from earlier --json files (comma-separated)")
    args = parser.parse_args(argv)
    if args.from_json:
        loaded = []
        for name in _names(args.from_json, None, "from-json"):
            with open(name) as f:
                loaded += [RunResult.from_dict(d) for d in json.load(f)]
        report(loaded, sorted({r.spec["reduction"] for r in loaded}, key=list(REDUCTIONS).index), args.out)
        return loaded
    world_sizes = [int(w) for w in _names(args.world_sizes, None, "world-sizes")]
    models = _names(args.models, MODELS, "models")
    reductions = _names(args.reductions, REDUCTIONS, "reductions")
    if "fp32" not in reductions:
        reductions.insert(0, "fp32")          # the reference of every gap
    shapes = {"demo": {"steps": args.steps, "lr": 2e-3}, "recall": {"steps": args.recall_steps, "lr": 3e-3}}
    results: list[RunResult] = []
    start = time.perf_counter()
    try:
        seeds = [int(s) for s in _names(args.seeds, None, "seeds")]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated ints, got {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("--seeds: expected at least one seed")
    for seed in seeds:
        for model in models:
            for R in world_sizes:
                for reduction in reductions:
                    spec = RunSpec(model=model, reduction=reduction, world_size=R, eval_every=args.eval_every,
                                   seed=seed, **shapes[model])
                    t0 = time.perf_counter()
                    result = run(spec)
                    results.append(result)
                    print(f"seed {seed} {model:7s} R={R} {reduction:10s} final val loss {result.final_loss:.4f}  "
                          f"{result.bytes_per_step:,.0f} B/step/rank  {time.perf_counter() - t0:.0f} s "
                          f"(loop {result.seconds:.0f} s)", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    report(results, reductions, args.out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
