"""StableAdamW on FSDP2-sharded parameters (``Shard(0)`` DTensors on gloo ranks, CPU): the step with
each parameter's per-tensor sum exchanged between the ranks (:mod:`lowp.optim.sharded_sums`: every
rank steps its shard only) against the step on gathered copies (every rank all-gathers each
parameter's weight, gradient, states and compensation and steps the whole tensor: what every
StableAdamW step under FSDP2 did before), with torch's fused fp32 AdamW on the same shards as a
scale, steps interleaved. Both lowp rows give the same bits (checked at the end).

Prints the slowest rank's median step per row, its ratio against the gathered row, and the bytes
each rank received in ``all_gather`` per step. ``--backend foreach`` runs both lowp rows on the
reference pipeline (``fused=False``), whose pieces come from torch (the route CUDA takes too).

    python benchmarks/sharded_sums.py [--ranks 2] [--scale 2] [--steps 7] [--threads 1] [--sums-min-numel N]
                                      [--backend native|foreach]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowp.distributed.launch import run_local_group
from lowp.report import text_table
from sharded_plan import fsdp_grads, fsdp_params
from step_vs_torch import gpt2_shapes

ROWS = ("torch AdamW fp32 fused (elementwise)", "lowp StableAdamW, gathered copies", "lowp StableAdamW, sums exchanged")
BASELINE = ROWS[1]


def _rank(rank: int, world_size: int, scale: int, steps: int, threads: int, min_numel: int | None,
          fused: bool) -> dict[str, object]:
    import torch.distributed as dist

    import lowp.optim as lo
    from lowp.optim import sharded_sums
    from lowp.optim.sharding import gather
    if min_numel is not None:
        sharded_sums.MIN_NUMEL = sharded_sums.CUDA_REFERENCE_MIN_NUMEL = min_numel

    class Gathered(lo.StableAdamW):
        """StableAdamW stepping gathered copies (its sums not exchanged)."""

        @classmethod
        def shards_sums(cls) -> bool:
            return False

    torch.set_num_threads(threads)
    shapes = gpt2_shapes(scale)
    runs = {ROWS[0]: torch.optim.AdamW(fsdp_params(shapes, torch.float32, world_size), lr=1e-3, fused=True),
            ROWS[1]: Gathered(fsdp_params(shapes, torch.bfloat16, world_size), lr=1e-3, fused=fused, seed=0),
            ROWS[2]: lo.StableAdamW(fsdp_params(shapes, torch.bfloat16, world_size), lr=1e-3, fused=fused, seed=0)}
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    received = {row: 0 for row in ROWS}
    real_all_gather = dist.all_gather
    counting = [ROWS[0]]

    def all_gather(tensors, tensor, *args, **kwargs):
        received[counting[0]] += sum(t.numel() * t.element_size() for t in tensors)
        return real_all_gather(tensors, tensor, *args, **kwargs)
    dist.all_gather = all_gather
    try:
        for t in range(steps + 1):   # one warm-up step (kernel builds)
            for row, opt in runs.items():
                fsdp_grads(opt.param_groups[0]["params"], t, 10.0 ** (t % 3 - 2))   # the RMS clip acts
                counting[0] = row
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                dist.barrier()
                if t >= 1:
                    times[row].append(time.perf_counter() - start)
    finally:
        dist.all_gather = real_all_gather
    same = all(torch.equal(gather(a.detach()).view(torch.int16), gather(b.detach()).view(torch.int16))
               for a, b in zip(runs[ROWS[1]].param_groups[0]["params"], runs[ROWS[2]].param_groups[0]["params"]))
    return {"median": {row: statistics.median(v) for row, v in times.items()},
            "min_numel": sharded_sums.min_numel(runs[ROWS[2]]),
            "received": {row: received[row] / (steps + 1) for row in ROWS}, "same": same, "tensors": len(shapes),
            "numel": sum(p.numel() for p in runs[ROWS[2]].param_groups[0]["params"])}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark described in the module docstring and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scale", type=int, default=2, help="GPT-2's dimensions divided by this")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--sums-min-numel", type=int, default=None,
                    help="the smallest parameter whose sum is exchanged (default: lowp's for the backend, "
                         "sharded_sums.min_numel)")
    ap.add_argument("--backend", choices=("native", "foreach"), default="native",
                    help="the lowp rows' backend: the native kernel (fused=True) or the reference (fused=False)")
    args = ap.parse_args(argv)
    results = run_local_group(_rank, args.ranks, args.scale, args.steps, args.threads, args.sums_min_numel,
                              args.backend == "native", timeout_s=900)
    min_numel = results[0]["min_numel"]
    slowest = {row: max(r["median"][row] for r in results) for row in ROWS}
    first = results[0]
    print(f"{args.ranks} gloo ranks, GPT-2 shapes / {args.scale} ({first['tensors']} tensors, "
          f"{first['numel'] / 1e6:.1f}M parameters), {args.threads} thread(s) per rank, lowp on {args.backend}, "
          f"sums exchanged from "
          f"{min_numel} elements; the two StableAdamW rows "
          f"give the same bits: {all(r['same'] for r in results)}")
    print(text_table(["row", "median step", f"vs {BASELINE}", "all_gather received per step and rank"],
                     [[row, f"{slowest[row] * 1e3:.2f} ms", f"{slowest[BASELINE] / slowest[row]:.2f}x",
                       f"{max(r['received'][row] for r in results) / 2**20:.2f} MiB"] for row in ROWS]))


if __name__ == "__main__":
    main()
