"""The optimizer step on FSDP2-sharded parameters (``Shard(0)`` DTensors on gloo ranks, CPU) whose
block-scaled states partly split blocks: lowp AdamW at 5 bytes/param (exact8 weights, int8 / uint8
states in blocks of 64) from its cached step plan, against the same optimizer taking a full step
every step (its plan dropped before each: what every step was while any parameter's shard split
blocks) and torch's fused fp32 AdamW on the same shapes, steps interleaved.

The parameter list is GPT-2's shapes scaled down (``step_vs_torch.gpt2_shapes``): at 2 ranks with
``--scale 4`` the matrices' rows (last dimensions of 192, 576, 768) hold whole blocks and are
planned, while with codes for every size (``coded_min_numel=0``) most vectors (192 and 576
elements: shards of 96 and 288) split blocks, so their codes are replicated and the plan leaves
them, its remainder, to a full step on gathered copies. The last row is the default, which keeps
the states of parameters under 4096 elements in bf16 (``coded_min_numel=4096``, bitsandbytes' and
torchao's threshold): the vectors no longer split blocks and the plan keeps all. Prints the
slowest rank's median step per row, the ratio against torch's row, and how many parameters the
plan keeps and leaves (without and with the threshold).

    python benchmarks/sharded_plan.py [--ranks 2] [--scale 4] [--steps 9] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowp.distributed.launch import run_local_group
from lowp.report import text_table
from step_vs_torch import gpt2_shapes

ROWS = ("torch AdamW fp32 fused", "lowp 5 B/param, coded_min_numel=0, full step",
        "lowp 5 B/param, coded_min_numel=0, cached plan", "lowp 5 B/param (default coded_min_numel=4096), cached plan")
#: what each lowp row gives its optimizer besides the shared options
EXTRA = {ROWS[1]: {"coded_min_numel": 0}, ROWS[2]: {"coded_min_numel": 0}, ROWS[3]: {}}
BASELINE = ROWS[0]


def fsdp_params(shapes: list[tuple[int, ...]], dtype: torch.dtype, world_size: int) -> list[torch.Tensor]:
    """Parameters of ``shapes`` (normal, seed 0) sharded ``Shard(0)`` over a 1-D mesh of the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g).to(dtype), mesh, [Shard(0)],
                                                 src_data_rank=None)) for s in shapes]


def fsdp_grads(params: list[torch.Tensor], step: int, scale: float = 1e-3) -> None:
    """Gradients of step ``step`` (normal, times ``scale``) placed like each parameter."""
    from torch.distributed.tensor import distribute_tensor
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        full = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _rank(rank: int, world_size: int, scale: int, steps: int, threads: int) -> dict[str, object]:
    import lowp.optim as lo
    torch.set_num_threads(threads)
    shapes = gpt2_shapes(scale)
    eight = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
    runs = {ROWS[0]: torch.optim.AdamW(fsdp_params(shapes, torch.float32, world_size), lr=1e-3, weight_decay=1e-2,
                                       fused=True)}
    for row in ROWS[1:]:
        runs[row] = lo.AdamW(fsdp_params(shapes, torch.bfloat16, world_size), lr=1e-3, weight_decay=1e-2,
                             mode="exact8", state_dtype=eight, fused=True, seed=0, **EXTRA[row])
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for t in range(steps + 2):   # two warm-up steps: the first full step, then the plan's first
        for row, opt in runs.items():
            fsdp_grads(opt.param_groups[0]["params"], t)
            if row == ROWS[1]:
                opt._plans.drop()   # noqa: SLF001 - this row measures the step without a plan
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.step()
            torch.distributed.barrier()
            if t >= 2:
                times[row].append(time.perf_counter() - start)
    plans = [runs[row]._plans.current for row in ROWS[2:]]   # noqa: SLF001 - what each plan keeps and leaves
    return {"median": {row: statistics.median(v) for row, v in times.items()},
            "cached_steps": [runs[row]._plans.cached_steps for row in ROWS[1:]],   # noqa: SLF001
            "planned": [0 if plan is None else len(plan.stepped) for plan in plans],
            "remainder": [0 if plan is None else len(plan.remainder) for plan in plans], "tensors": len(shapes)}


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark described in the module docstring and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scale", type=int, default=4, help="GPT-2's dimensions divided by this")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per row")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    results = run_local_group(_rank, args.ranks, args.scale, args.steps, args.threads, timeout_s=600)
    slowest = {row: max(r["median"][row] for r in results) for row in ROWS}
    first = results[0]
    print(f"{args.ranks} gloo ranks, GPT-2 shapes / {args.scale} ({first['tensors']} tensors), {args.threads} "
          f"thread(s) per rank; the plan keeps {first['planned'][0]} parameters and leaves "
          f"{first['remainder'][0]} (shards that split blocks of 64) to a full step with coded_min_numel=0; with "
          f"the default coded_min_numel=4096 it keeps {first['planned'][1]} and leaves {first['remainder'][1]}; "
          f"steps from the plan per row: {first['cached_steps']}")
    print(text_table(["row", "median step", f"vs {BASELINE}"],
                     [[row, f"{slowest[row] * 1e3:.2f} ms", f"{slowest[BASELINE] / slowest[row]:.2f}x"]
                      for row in ROWS]))


if __name__ == "__main__":
    main()
