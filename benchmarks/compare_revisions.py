"""The optimizer step of this checkout against another git revision of lowp, in one run.

Checks a revision out into a temporary git worktree, then times the same AdamW step (bf16
weights, 8 tensors) in child processes that import either tree, alternating base and current run
after run so that a change in machine load hits both alike; prints the best step time of each
and their ratio per configuration. Used to show that a rewrite is no slower than what it
replaced (e.g. the spec-generated native kernel against the hand-written one)::

    python benchmarks/compare_revisions.py --base c40ecdf [--numel 8000000] [--runs 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: configuration name -> keyword arguments of lowp.optim.AdamW (the coded-state ones need a base
#: revision that has coded states; ``--only`` picks configurations)
CONFIGS = {
    "native kahan (defaults)": "dict(backend='native')",
    "native kahan, no diagnostics/finite check": "dict(backend='native', diagnostics=False, nonfinite='off')",
    "native kahan, states rounded to nearest": "dict(backend='native', state_rounding='nearest')",
    "native exact": "dict(backend='native', mode='exact')",
    "native exact8": "dict(backend='native', mode='exact8')",
    "native stochastic": "dict(backend='native', mode='stochastic')",
    "native kahan, int8 / uint8 states": "dict(backend='native', state_dtype=dict(exp_avg=torch.int8, "
                                         "exp_avg_sq=torch.uint8))",
    "native kahan, int8 / uint4 states": "dict(backend='native', state_dtype=dict(exp_avg=torch.int8, "
                                         "exp_avg_sq=torch.uint4))",
    "native kahan, e4m3 states": "dict(backend='native', state_dtype=dict(exp_avg=torch.float8_e4m3fn, "
                                 "exp_avg_sq=torch.float8_e4m3fn))",
    "native exact8, int8 / uint8 states (5 B/param)": "dict(backend='native', mode='exact8', state_dtype=dict("
                                                      "exp_avg=torch.int8, exp_avg_sq=torch.uint8))",
    "unfused kahan (fused=False)": "dict(fused=False)",
    "unfused kahan, states rounded to nearest": "dict(fused=False, state_rounding='nearest')",
}

_CHILD = """
import sys, time, torch
import lowp.optim as lo
numel, tensors, threads, steps = (int(v) for v in sys.argv[1:5])
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(0)
params = []
for _ in range(tensors):
    p = (torch.randn(numel // tensors, generator=gen) * 0.02).bfloat16()
    p.grad = (torch.randn(numel // tensors, generator=gen) * 1e-3).bfloat16()
    params.append(p)
opt = lo.AdamW(params, lr=1e-3, weight_decay=0.01, **eval(sys.argv[5]))
for _ in range(3):
    opt.step()
best = float("inf")
for _ in range(steps):
    t = time.perf_counter(); opt.step(); best = min(best, time.perf_counter() - t)
print(best)
"""


def _time(tree: Path, config: str, args: argparse.Namespace) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(args.numel), str(args.tensors), str(args.threads),
                          str(args.steps), config], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Parse the options, check out the base revision and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (e.g. a commit or tag)")
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per run (the best counts)")
    ap.add_argument("--runs", type=int, default=5, help="alternating runs per tree and configuration")
    ap.add_argument("--only", default=None, help="comma-separated substrings of configuration names")
    args = ap.parse_args()
    configs = {k: v for k, v in CONFIGS.items()
               if not args.only or any(s in k for s in args.only.split(","))}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            print(f"AdamW step, {args.numel:,} parameters in {args.tensors} tensors, {args.threads} thread(s); "
                  f"best of {args.runs} alternating runs x {args.steps} steps; base {args.base}")
            print(f"{'configuration':45s} {'base ms':>9s} {'current ms':>11s} {'current/base':>13s}")
            for name, config in configs.items():
                times: dict[str, list[float]] = {"base": [], "current": []}
                for _ in range(args.runs):
                    times["base"].append(_time(base, config, args))
                    times["current"].append(_time(ROOT, config, args))
                b, c = min(times["base"]) * 1e3, min(times["current"]) * 1e3
                print(f"{name:45s} {b:9.2f} {c:11.2f} {c / b:12.3f}x")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


if __name__ == "__main__":
    main()
