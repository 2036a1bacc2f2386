"""Per-rank optimizer memory and step time on an FSDP2-sharded model (gloo ranks on CPU): lowp
AdamW on bf16 weights (kahan, exact; bf16 moments) against ``torch.optim.AdamW`` on fp32 master
weights with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

Memory is measured from the tensors each rank holds: the local shards of the parameters (the
weights the optimizer updates: bf16 for lowp, fp32 master weights for torch) plus the local
shards of every optimizer state. Step time is the median of ``opt.step()`` over the timed steps
(forward and backward excluded; they run between steps to produce real sharded gradients),
the slowest rank's. Ratios are against torch's default (foreach) AdamW, measured in the same run;
torch's ``fused=True`` AdamW is listed too.

    python benchmarks/sharded_memory.py [--width 1024] [--layers 4] [--steps 8] [--ranks 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowp.distributed.launch import run_local_group
from lowp.report import text_table

CONFIGS = ("lowp AdamW kahan (bf16 weights)", "lowp AdamW exact (bf16 weights)",
           "torch AdamW (fp32 master, bf16 compute)", "torch AdamW fused (fp32 master, bf16 compute)")
BASELINE = CONFIGS[2]


def _model(width: int, layers: int, config: str, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    model = torch.nn.Sequential(*blocks)
    lowp_run = config.startswith("lowp")
    if lowp_run:
        model = model.bfloat16()
    policy = MixedPrecisionPolicy() if lowp_run else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                           reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _optimizer(config: str, params) -> torch.optim.Optimizer:
    import lowp.optim as lo
    if config.startswith("torch"):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused="fused" in config)
    return lo.AdamW(params, lr=1e-3, weight_decay=1e-2, mode=config.split()[2])


def _local_bytes(t: torch.Tensor) -> int:
    from lowp.optim.sharding import local
    loc = local(t)
    return loc.numel() * loc.element_size()


def _rank(rank: int, world_size: int, width: int, layers: int, steps: int) -> dict[str, tuple[int, int, float]]:
    import torch.distributed as dist
    out = {}
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    for config in CONFIGS:
        model = _model(width, layers, config, world_size)
        opt = _optimizer(config, model.parameters())
        times = []
        for step in range(steps + 2):
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            opt.zero_grad(set_to_none=True)
            if step >= 2:   # the first steps create the states
                times.append(float(elapsed))
        weights = sum(_local_bytes(p) for p in model.parameters())
        states = sum(_local_bytes(v) for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        out[config] = (weights, states, statistics.median(times))
    return out


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    results = run_local_group(_rank, args.ranks, args.width, args.layers, args.steps, timeout_s=600)
    numel = args.layers * (args.width * args.width + args.width)
    base_w, base_s, base_t = results[0][BASELINE]
    rows = []
    for config in CONFIGS:
        weights, states, seconds = results[0][config]
        rows.append([config, f"{weights / 2**20:.2f}", f"{states / 2**20:.2f}",
                     f"{(weights + states) * args.ranks / numel:.2f}",
                     f"{(weights + states) / (base_w + base_s):.3f}", f"{seconds * 1e3:.1f}",
                     f"{seconds / base_t:.2f}"])
    print(f"{numel / 1e6:.2f}M parameters, {args.ranks} gloo ranks, rank 0's shards; step time: slowest rank, median")
    print(text_table(["optimizer", "weights MiB/rank", "states MiB/rank", "bytes/param (all ranks)",
                      "memory ratio", "step ms", "time ratio"], rows))


if __name__ == "__main__":
    main()
