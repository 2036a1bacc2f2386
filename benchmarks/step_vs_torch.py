"""lowp's optimizer step against the fp32 step users run today, on real models' parameter lists.

Every configuration steps its own copy of the same parameter list (the same values, gradients
fixed), all built in one process; the timed steps are interleaved configuration by configuration
(so a change in machine load hits every row alike) and the median counts. The ratio is the
baseline's time over the row's: above 1.0 the row is faster than torch's fused fp32 step.

Parameter lists:

* ``16x8M``, ``16x32M``: 16 equal tensors of 8M and 32M elements in all;
* ``gpt2``: the 148 tensors of GPT-2 small (124M parameters: token and position embeddings,
  12 blocks of two layer norms, the attention and MLP matrices and biases, the final norm);
* ``gpt2/8``: the same 148 tensors with every dimension divided by 8 (1.95M parameters);
* ``500x1000``: 500 tensors of 1,000 elements, where host time per tensor is the step.

Rows (``--optimizer adamw``): torch's AdamW on fp32 weights, ``fused=True`` (the baseline) and
foreach; DeepSpeed's ``DeepSpeedCPUAdam`` on fp32 weights when ``deepspeed`` is importable; lowp's
AdamW on bf16 weights with its defaults (``kahan``, bf16 states) and in the 5 bytes/param
configuration (``exact8``, int8/uint8 states, codes for every tensor: ``coded_min_numel=0``, so
that the lists of small tensors measure it too); optimi's AdamW on bf16 weights with Kahan
summation when ``optimi`` is importable. ``--optimizer sgd`` (momentum 0.9) and ``lion`` give the
same table for SGD (torch's fused SGD the baseline) and Lion (optimi's the baseline: torch has
none). Host time per tensor is the ``500x1000`` row's time divided by its 500 tensors.

``--device cuda`` runs the same lists on a GPU (lowp's Triton backend; DeepSpeed's CPUAdam left
out, torch's fused AdamW on bf16 weights added as a second baseline); each step is followed by a
synchronization, so a row's time is the whole step, host and device. ``--profile`` adds, per row,
the time of the step's GPU kernels (``torch.profiler``: one profiled step after the timed ones)
and the bandwidth they reach: the bytes a step must move at least (each weight read and written,
its gradient read, each state tensor read and written) over the kernels' time, against the
card's copy bandwidth measured in the same run. On the CPU the last lines give the copy bandwidth
of the process: on a shared virtual machine it can differ from one process to the next (the
2-vCPU machine of docs/fused.md has two kinds of process), and torch's fused fp32 step, bound by
memory, follows it while lowp's native step, bound by its arithmetic, does not.

``--dtensor`` makes every parameter and gradient a DTensor ``Shard(0)`` over a mesh of one rank
(a process group of one in this process), as FSDP2's ``fully_shard`` holds them: the host work
of a sharded step per tensor, which torch's optimizers pay in DTensor's dispatch and lowp in its
plan's checks of the local tensors and one all-reduce of the non-finite flags
(lowp.optim.cached_step). DeepSpeed's CPUAdam and optimi, which take plain tensors only (optimi's
foreach step calls ``_foreach_copy_``, for which DTensor has no sharding rule), are left out;
the Lion table has no torch baseline then: lowp's rows compare with each other.

    python benchmarks/step_vs_torch.py [--optimizer adamw|sgd|lion] [--lists 16x8M gpt2 ...]
        [--steps 9] [--threads N] [--device cpu|cuda] [--profile] [--dtensor] [--markdown]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch

import lowp.optim as lo
from lowp.report import markdown_table, text_table

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

LR, WD = 1e-3, 1e-2
EIGHT_BIT = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
#: the coded rows' option: codes for tensors of every size (the default keeps those under 4096
#: elements in 16 bits, which would turn the 500 x 1000 list into bf16 states)
EVERY_SIZE = {"coded_min_numel": 0}


def gpt2_shapes(scale: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (Radford et al., 2019: 12 blocks, width 768, 1024
    positions, 50257 tokens; 148 tensors), every dimension divided by ``scale``."""
    d, vocab, ctx = 768 // scale, 50257 // scale, 1024 // scale
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *block * 12, (d,), (d,)]


LISTS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "16x8M": lambda: [(500_000,)] * 16,
    "16x32M": lambda: [(2_000_000,)] * 16,
    "gpt2": lambda: gpt2_shapes(1),
    "gpt2/8": lambda: gpt2_shapes(8),
    "500x1000": lambda: [(1000,)] * 500,
}

Maker = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _deepspeed_adam() -> Callable | None:
    """DeepSpeed's CPUAdam when it imports and its extension builds here (a first use builds it)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], lr=LR).step()
    except Exception:   # not installed, or its extension does not build here
        return None
    return DeepSpeedCPUAdam


def _optimi(name: str) -> Callable | None:
    try:
        import optimi
    except ImportError:
        return None
    return getattr(optimi, name)


def configs(optimizer: str, device: str = "cpu", dtensor: bool = False
            ) -> tuple[str, dict[str, tuple[torch.dtype, Maker]]]:
    """(the baseline's name, every row: weight dtype and how to build it) for ``optimizer`` on
    ``device`` (``"cpu"`` or ``"cuda"``); ``dtensor``: rows that take DTensor parameters only."""
    rows: dict[str, tuple[torch.dtype, Maker]] = {}
    if optimizer == "adamw":
        rows["torch AdamW fp32 fused"] = (torch.float32, lambda ps: torch.optim.AdamW(ps, LR, weight_decay=WD,
                                                                                       fused=True))
        if device == "cuda":
            rows["torch AdamW bf16 fused"] = (torch.bfloat16, lambda ps: torch.optim.AdamW(
                ps, LR, weight_decay=WD, fused=True))
        rows["torch AdamW fp32 foreach"] = (torch.float32, lambda ps: torch.optim.AdamW(ps, LR, weight_decay=WD,
                                                                                         foreach=True))
        cpu_adam = _deepspeed_adam() if device == "cpu" and not dtensor else None
        if cpu_adam is not None:
            rows["DeepSpeed CPUAdam fp32"] = (torch.float32, lambda ps: cpu_adam(ps, lr=LR, weight_decay=WD))
        rows["lowp bf16 defaults"] = (torch.bfloat16, lambda ps: lo.AdamW(ps, LR, weight_decay=WD, seed=0))
        rows["lowp 5 B/param"] = (torch.bfloat16, lambda ps: lo.AdamW(ps, LR, weight_decay=WD, mode="exact8",
                                                                       state_dtype=EIGHT_BIT, seed=0, **EVERY_SIZE))
        optimi_adamw = None if dtensor else _optimi("AdamW")
        if optimi_adamw is not None:
            rows["optimi AdamW bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_adamw(ps, lr=LR, weight_decay=WD,
                                                                                       kahan_sum=True, foreach=True))
        return "torch AdamW fp32 fused", rows
    if optimizer == "sgd":
        rows["torch SGD fp32 fused"] = (torch.float32, lambda ps: torch.optim.SGD(ps, LR, momentum=0.9, fused=True))
        rows["torch SGD fp32 foreach"] = (torch.float32, lambda ps: torch.optim.SGD(ps, LR, momentum=0.9,
                                                                                     foreach=True))
        rows["lowp bf16 defaults"] = (torch.bfloat16, lambda ps: lo.SGD(ps, LR, momentum=0.9, seed=0))
        rows["lowp bf16 exact8, int8 momentum"] = (torch.bfloat16, lambda ps: lo.SGD(
            ps, LR, momentum=0.9, mode="exact8", state_dtype=torch.int8, seed=0, **EVERY_SIZE))
        optimi_sgd = None if dtensor else _optimi("SGD")
        if optimi_sgd is not None:
            rows["optimi SGD bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_sgd(ps, lr=LR, momentum=0.9,
                                                                                   kahan_sum=True, foreach=True))
        return "torch SGD fp32 fused", rows
    optimi_lion = None if dtensor else _optimi("Lion")
    if optimi_lion is not None:
        rows["optimi Lion fp32"] = (torch.float32, lambda ps: optimi_lion(ps, lr=LR, foreach=True))
        rows["optimi Lion bf16 Kahan"] = (torch.bfloat16, lambda ps: optimi_lion(ps, lr=LR, kahan_sum=True,
                                                                                 foreach=True))
    rows["lowp Lion bf16 defaults"] = (torch.bfloat16, lambda ps: lo.Lion(ps, LR, seed=0))
    rows["lowp Lion bf16 exact8, int8 momentum"] = (torch.bfloat16, lambda ps: lo.Lion(
        ps, LR, mode="exact8", state_dtype=torch.int8, seed=0, **EVERY_SIZE))
    return next(iter(rows)), rows


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str, mesh: DeviceMesh | None = None
            ) -> list[torch.Tensor]:
    """Parameters of ``shapes`` with gradients, the same values for every row; DTensors
    ``Shard(0)`` over ``mesh`` when given."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape in shapes:
        weight = (torch.randn(shape, generator=gen) * 0.02).to(device, dtype)
        grad = (torch.randn(shape, generator=gen) * 1e-3).to(device, dtype)
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor
            weight, grad = (distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, grad))
        p = torch.nn.Parameter(weight)
        p.grad = grad
        out.append(p)
    return out


def one_rank_mesh(device: str) -> DeviceMesh:
    """A mesh of this process alone (a gloo or NCCL group of one, in-memory store)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(shapes: list[tuple[int, ...]], rows: dict[str, tuple[torch.dtype, Maker]], steps: int,
            cached: dict[str, int] | None = None, device: str = "cpu",
            profile: dict[str, tuple[float, int]] | None = None, mesh: DeviceMesh | None = None) -> dict[str, float]:
    """Median seconds per step of every row on ``shapes``, the rows' steps interleaved; ``cached``
    collects, per lowp row, how many of its steps took the cached plan (lowp.optim.cached_step);
    ``profile`` (CUDA only) receives per row the GPU kernels' seconds in one step and the bytes
    that step moves at least (:func:`min_bytes`); ``mesh``: DTensor parameters sharded over it."""
    built = {}
    for name, (dtype, make) in rows.items():
        params = _params(shapes, dtype, device, mesh)
        opt = make(params)
        for _ in range(2):   # states created, kernels built
            opt.step()
        built[name] = opt
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(steps):
        for name, opt in built.items():
            start = time.perf_counter()
            opt.step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    if cached is not None:
        for name, opt in built.items():
            if isinstance(opt, lo.LowpOptimizer):
                cached[name] = cached.get(name, 0) + opt._plans.cached_steps
    if profile is not None:
        for name, opt in built.items():
            try:
                seconds, longest = kernel_seconds(opt)
            except RuntimeError as err:   # a profiler that cannot read the device keeps the timings
                print(f"{name}: no kernel profile ({err})")
                seconds, longest = 0.0, []
            profile[name] = (seconds, min_bytes(opt))
            if longest and isinstance(opt, lo.LowpOptimizer):
                print(f"{len(shapes)} tensors, {name}: " + ", ".join(f"{k[:40]} {t * 1e6:.0f} us" for k, t in longest))
    return {name: statistics.median(t) for name, t in times.items()}


def min_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes one step of ``opt`` must move at least: every weight read and written, its
    gradient read, every state tensor of more than one element read and written."""
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            total += 2 * p.nbytes + p.grad.nbytes
            total += sum(2 * t.nbytes for t in opt.state[p].values() if torch.is_tensor(t) and t.numel() > 1)
    return total


def kernel_seconds(opt: torch.optim.Optimizer) -> tuple[float, list[tuple[str, float]]]:
    """The summed time of the GPU kernels (and device copies) that one step of ``opt`` runs, and
    the four longest (name, seconds), read from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total * 1e-6) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda kv: -kv[1])
    return sum(t for _, t in kernels), kernels[:4]


def copy_bandwidth(device: str, numel: int = 1 << 28) -> float:
    """Bytes per second of a device-to-device copy of ``numel`` fp32 elements (read + written)."""
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark described in the module docstring and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=("adamw", "sgd", "lion"), default="adamw")
    ap.add_argument("--lists", nargs="+", choices=list(LISTS), default=list(LISTS))
    ap.add_argument("--steps", type=int, default=9, help="timed steps per row and list (the median counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", action="store_true", help="CUDA: kernel time and bandwidth per row")
    ap.add_argument("--dtensor", action="store_true", help="DTensor parameters on a mesh of one rank (FSDP2's)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.profile and args.device != "cuda":
        ap.error("--profile needs --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline, rows = configs(args.optimizer, args.device, args.dtensor)
    own_group = args.dtensor and not torch.distributed.is_initialized()
    mesh = one_rank_mesh(args.device) if args.dtensor else None
    header = ["parameter list", *rows]
    table, kernel_table = [], []
    per_tensor = {}
    cached: dict[str, int] = {}
    for name in args.lists:
        shapes = LISTS[name]()
        profiled: dict[str, tuple[float, int]] | None = {} if args.profile else None
        medians = measure(shapes, rows, args.steps, cached, args.device, profiled, mesh)
        base = medians[baseline]
        label = f"{name} ({len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.2f}M)"
        table.append([label, *(f"{medians[r] * 1e3:.2f} ms ({base / medians[r]:.2f}x)" for r in rows)])
        if profiled:
            kernel_table.append([label, *(_kernel_cell(*profiled[r]) for r in rows)])
        if name == "500x1000":
            per_tensor = {r: medians[r] / len(shapes) * 1e6 for r in rows}
    where = (f"{torch.cuda.get_device_name()}, one synchronized step at a time" if args.device == "cuda"
             else f"{platform.processor() or platform.machine()}, lowp's native kernel: {native_isa()} build")
    print(f"{args.optimizer} step on {args.device}{', DTensor parameters (one rank)' if mesh else ''}, "
          f"median ms (baseline {baseline} / row); "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, {where}")
    render = markdown_table if args.markdown else text_table
    print(render(header, table))
    if kernel_table:
        print(f"GPU kernels of one step (torch.profiler) and the bandwidth of the bytes it must move; "
              f"device-to-device copy here: {copy_bandwidth(args.device) / 1e9:.0f} GB/s")
        print(render(header, kernel_table))
    if args.device == "cpu":
        print(f"memory copy bandwidth in this process: {copy_bandwidth('cpu', 1 << 24) / 1e9:.0f} GB/s "
              "(torch's fused fp32 step is bound by it, lowp's native step by its arithmetic: see docs/fused.md)")
    if per_tensor:
        print("host time per tensor (500x1000): " + ", ".join(f"{r} {us:.1f} us" for r, us in per_tensor.items()))
    steps = len(args.lists) * (args.steps + 2)
    print("steps taken from the cached plan: " + ", ".join(f"{r} {n} of {steps}" for r, n in cached.items()))
    if own_group:
        torch.distributed.destroy_process_group()


def _kernel_cell(seconds: float, moved: int) -> str:
    return f"{seconds * 1e3:.2f} ms, {moved / seconds / 1e9:.0f} GB/s" if seconds > 0 else "no kernels"


def native_isa() -> str:
    """The instruction set of lowp's native kernel builds here (``none`` without the kernel)."""
    from lowp.optim.kernels.native.build import isa, native_available
    return isa() if native_available() else "none"


if __name__ == "__main__":
    main()
