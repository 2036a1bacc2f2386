"""Optimizer-step throughput and memory: lowp AdamW in every mode against torch.optim.AdamW
(fp32 foreach, fp32 fused, bf16 foreach) and optimi's AdamW (when installed), measured in the
same run on the same tensors. lowp rows use ``fused=None`` (column "backend": on CPU the
``native`` kernel from 2**16 parameters on x86-64 with AVX2 and a C++ compiler, else ``compiled``
from 2**22; ``triton`` on CUDA), and two rows force the unfused ``foreach`` reference
(``fused=False``; the second with states rounded to nearest, like optimi's).

Prints, per configuration: parameters/second (median over timed steps, configurations
interleaved step by step so that load changes on a shared machine hit all alike), bytes/parameter of
weights + gradients + optimizer state, and the peak extra memory a step allocates (from
torch.profiler's CPU memory events: the running sum of allocations minus frees during one
step), in bytes/parameter and MiB. Then, for the unfused rows, their time per step over
optimi's foreach Kahan AdamW's and the number of aten ops per chunk that pass over the data.

    python benchmarks/optim_step.py [--numel 8000000] [--tensors 8] [--steps 5] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import lowp.optim as lo
from lowp.optim.speed import profiled_peak_bytes
from lowp.report import text_table

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
UNFUSED = "unfused (fused=False)"
UNFUSED_NEAREST = "unfused, states rounded to nearest"
OPTIMI = "optimi AdamW bf16 kahan"
#: ops that only make views or uninitialised tensors: not passes over the data
_METADATA_OPS = {"view", "slice", "select", "unsqueeze", "split", "split_with_sizes", "unbind", "alias", "as_strided",
                 "_unsafe_view", "expand", "detach", "empty", "empty_like", "empty_strided"}


def _make(numel: int, tensors: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    size = numel // tensors
    params = []
    for _ in range(tensors):
        p = (torch.randn(size, generator=gen) * 0.02).to(dtype).requires_grad_()
        p.grad = (torch.randn(size, generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def _configs(has_optimi: bool) -> dict[str, tuple[torch.dtype, Callable]]:
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    configs = {
        "torch AdamW fp32 foreach": (torch.float32, lambda p: torch.optim.AdamW(p, foreach=True, **kw)),
        "torch AdamW fp32 fused": (torch.float32, lambda p: torch.optim.AdamW(p, fused=True, **kw)),
        "torch AdamW bf16 foreach": (torch.bfloat16, lambda p: torch.optim.AdamW(p, foreach=True, **kw)),
        "lowp AdamW fp32": (torch.float32, lambda p: lo.AdamW(p, **kw)),
    }
    for mode in lo.MODES:
        configs[f"lowp AdamW bf16 {mode}"] = (torch.bfloat16, lambda p, m=mode: lo.AdamW(p, mode=m, **kw))
    variants = {"fp32 states": dict(state_dtype=torch.float32),
                "states rounded to nearest": dict(state_rounding="nearest"),
                "no diagnostics, no finite check": dict(diagnostics=False, nonfinite="off"),
                UNFUSED: dict(fused=False),
                UNFUSED_NEAREST: dict(fused=False, state_rounding="nearest")}
    for label, extra in variants.items():
        configs[f"lowp AdamW bf16 kahan, {label}"] = (
            torch.bfloat16, lambda p, e=extra: lo.AdamW(p, mode="kahan", **e, **kw))
    if has_optimi:
        import optimi
        configs[OPTIMI] = (torch.bfloat16, lambda p: optimi.AdamW(p, foreach=True, **kw))
    return configs


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _ops_per_chunk(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    """aten ops per chunk of one step that touch at least 2**15 elements (the passes over the data
    of the unfused pipeline, counted under a ``TorchDispatchMode``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if func.overloadpacket.__name__ not in _METADATA_OPS and max(sizes, default=0) >= 1 << 15:
                Count.ops += 1
            return out

    with Count():
        opt.step()
    chunk = opt.backend.chunk_for(params[0].device)
    return Count.ops / sum(-(-p.numel() // chunk) for p in params)


def _op_times(opt: torch.optim.Optimizer, params: list[torch.Tensor], rounds: int = 3
              ) -> list[tuple[str, float, float]]:
    """(aten op, calls per chunk, microseconds per chunk) of one step, the slowest first: each op
    timed inside a ``TorchDispatchMode`` (its kernel and the dispatch below Python), the minimum
    over ``rounds`` steps per position in the step's op sequence."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[tuple[str, float]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.log.append((func.overloadpacket.__name__, time.perf_counter() - t0))
            return out

    logs = []
    for _ in range(rounds):
        with Timed() as timed:
            opt.step()
        logs.append(timed.log)
    chunks = sum(-(-p.numel() // opt.backend.chunk_for(p.device)) for p in params)
    totals: dict[str, list[float]] = {}
    for i, (name, _) in enumerate(logs[0]):
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += min(log[i][1] for log in logs)
    return sorted(((name, n / chunks, t * 1e6 / chunks) for name, (n, t) in totals.items()),
                  key=lambda row: -row[2])


def main() -> None:
    """Run the benchmark described in the module docstring and print its results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=8_000_000)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings of configuration names")
    ap.add_argument("--op-times", action="store_true",
                    help="also print the unfused rows' time per aten op and chunk (ops of at least 1 us)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import optimi  # noqa: F401
        has_optimi = True
    except ImportError:
        has_optimi = False
    configs = _configs(has_optimi)
    if args.only:
        configs = {k: v for k, v in configs.items() if any(s in k for s in args.only.split(","))}
    built = {}
    for name, (dtype, make) in configs.items():
        params = _make(args.numel, args.tensors, dtype)
        opt = make(params)
        opt.step()                                         # creates the state
        peak = profiled_peak_bytes(opt.step)
        built[name] = (params, opt, peak)
    # interleaved rounds: a load change on a shared machine hits every configuration alike
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.steps):
        for name, (_, opt, _) in built.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    rows, rates = [], {}
    for name, (params, opt, peak) in built.items():
        n = sum(p.numel() for p in params)
        rates[name] = n / statistics.median(times[name])
        held = sum(p.numel() * p.element_size() * 2 for p in params) + _state_bytes(opt)   # weights + grads
        backend = getattr(getattr(opt, "backend", None), "name", "-")
        rows.append([name, backend, f"{rates[name] / 1e6:.1f}", f"{held / n:.1f}", f"{peak / n:.2f}",
                     f"{peak / 2**20:.1f}"])
    base = rates.get("torch AdamW fp32 fused")
    for row in rows:
        row.append(f"{rates[row[0]] / base:.2f}x" if base else "-")
        row.append(f"{rates[row[0]] / rates[OPTIMI]:.2f}x" if OPTIMI in rates else "-")
    print(f"AdamW step, {args.numel:,} parameters in {args.tensors} tensors, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}" + ("" if has_optimi else "; optimi not installed (pip install torch-optimi)"))
    print(text_table(["configuration", "backend", "Mparams/s", "bytes/param", "peak extra B/param", "peak extra MiB",
                      "vs torch fused fp32", "vs optimi"], rows))
    for label in (UNFUSED, UNFUSED_NEAREST):
        name = f"lowp AdamW bf16 kahan, {label}"
        if name in rates and OPTIMI in rates:
            params, opt, _ = built[name]
            print(f"{name}: {rates[OPTIMI] / rates[name]:.2f}x optimi's foreach Kahan AdamW time per step "
                  f"(project target <= 1.5x), {_ops_per_chunk(opt, params):.0f} aten ops per chunk of "
                  f"{opt.backend.chunk_for(params[0].device)} elements")
        if args.op_times and name in built:
            params, opt, _ = built[name]
            rows = [[op, f"{calls:.2f}", f"{us:.1f}"] for op, calls, us in _op_times(opt, params) if us >= 1.0]
            print(text_table(["aten op", "calls per chunk", "us per chunk"], rows))


if __name__ == "__main__":
    main()
