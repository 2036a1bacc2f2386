"""Optimizer-step speed, measured here: lowp's fused bf16 + Kahan AdamW against torch and optimi
(``lowp optim-speed`` and ``benchmarks/optim_fused.py``).

For one parameter count (split into a few tensors like a model's layers) and in the same run on
the same machine (optimizers take turns; the best of ``rounds`` steps counts): parameters/second,
effective bandwidth (bytes an ideal fused step must move, divided by the step time) against two
measured bandwidths (an fp32 copy and an in-place fp32 update), first-step time and peak extra
memory of one step. Baselines: ``torch.optim.AdamW(fused=True)`` and ``foreach=True`` in fp32,
optimi's AdamW with Kahan summation in bf16 (when ``torch-optimi`` is installed), lowp's unfused
``foreach`` backend. The fused lowp rows use the native kernel on CPU (where it builds, else
``compiled``) and Triton on CUDA.

Bytes per parameter of an ideal step: fp32 AdamW reads weight, grad, m, v (16) and writes weight,
m, v (12) = 28; bf16 + Kahan reads weight, grad, m, v, compensation (10), writes 4 of them (8) = 18.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, TypedDict

import torch

import lowp.optim as lo
from lowp.report import text_table

__all__ = ["measure", "report", "parse_size", "split", "peak_extra_bytes", "profiled_peak_bytes",
           "BYTES_FP32_ADAMW", "BYTES_BF16_KAHAN"]

#: the smallest parameter count :func:`split` can cut into its model-like pieces
MIN_SIZE = 1 << 16
BYTES_FP32_ADAMW = 28
BYTES_BF16_KAHAN = 18
HYPER: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_extra_bytes(fn: Callable[[], None], device: torch.device) -> int | None:
    """Peak memory a call adds above what was resident before it (CUDA allocator peak, or Linux
    peak RSS after resetting it through /proc/self/clear_refs); ``None`` where neither works."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_kib("VmRSS:")
        fn()
        return max(0, _rss_kib("VmHWM:") - base) * 1024
    except OSError:
        return None


COPY = "copy (fp32, read + write)"
IN_PLACE = "in-place update (fp32 x += 1)"


def profiled_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak of (allocated - freed) CPU bytes during ``fn()``: the running sum of torch.profiler's
    memory events (the ``[memory]`` instant events of its trace, in time order). Unlike
    :func:`peak_extra_bytes` it sees every allocation of torch's CPU allocator, small ones too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    running = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        running += e["args"]["Bytes"]
        peak = max(peak, running)
    return peak


def copier(params: list[torch.Tensor]) -> SimpleNamespace:
    """A stand-in optimizer whose ``step`` copies fp32 tensors as large as ``params`` together:
    the copy bandwidth is timed in the same rounds as the optimizers. A copy into another buffer
    also reads each destination line before writing it (write-allocate) on most CPUs, so it moves
    12 bytes per element while counting 8."""
    src = torch.randn(sum(p.numel() for p in params), device=params[0].device)
    dst = torch.empty_like(src)
    return SimpleNamespace(step=lambda: dst.copy_(src))


def updater(params: list[torch.Tensor]) -> SimpleNamespace:
    """A stand-in optimizer whose ``step`` adds 1 in place to fp32 tensors as large as ``params``:
    read and write the same lines, as an optimizer step does (8 bytes per element, no
    write-allocate), the bandwidth an in-place step can hope for."""
    x = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    return SimpleNamespace(step=lambda: x.add_(1))


def split(numel: int, pieces: int = 8) -> list[int]:
    """Tensor sizes of a model-like split: ``pieces`` tensors plus one small bias-like tensor."""
    base = numel // pieces
    return [base] * (pieces - 1) + [numel - base * (pieces - 1) - 4096, 4096]


def timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


class Timing(TypedDict):
    """Seconds of the first and of the best step, and peak extra bytes (``None``: not measurable)."""

    first: float
    step: float
    peak: int | None


def time_all(makers: dict[str, tuple[torch.dtype, Callable]], sizes: list[int], device: torch.device,
             rounds: int) -> dict[str, Timing]:
    """First-step time, best step time over ``rounds`` and peak extra memory per optimizer.

    The optimizers take turns, one step each per round, and the best round counts: on a shared
    machine other processes slow some steps down, never speed them up."""
    opts: dict[str, Any] = {}
    out: dict[str, Timing] = {}
    for name, (dtype, make) in makers.items():
        params = [torch.randn(n, device=device).mul_(0.1).to(dtype) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p).mul_(0.01)
        opts[name] = make(params)
        out[name] = {"first": timed(opts[name].step, device), "step": math.inf, "peak": None}
    for _ in range(rounds):
        for name, opt in opts.items():
            out[name]["step"] = min(out[name]["step"], timed(opt.step, device))
    for name, opt in opts.items():
        out[name]["peak"] = peak_extra_bytes(opt.step, device)
    return out


def _fused_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    from lowp.optim.kernels import native_available
    return "native" if native_available() else "compiled"


def contenders(device: torch.device, with_compiled: bool) -> list[tuple[str, torch.dtype, int, Callable]]:
    """(name, parameter dtype, ideal bytes/parameter, constructor) of every optimizer compared."""
    fused_backend = _fused_backend(device)
    rows = [
        ("torch AdamW fused fp32", torch.float32, BYTES_FP32_ADAMW,
         lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)),
        ("torch AdamW foreach fp32", torch.float32, BYTES_FP32_ADAMW,
         lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER)),
        ("lowp AdamW bf16 kahan foreach", torch.bfloat16, BYTES_BF16_KAHAN,
         lambda ps: lo.AdamW(ps, mode="kahan", backend="foreach", **HYPER)),
        (f"lowp AdamW bf16 kahan {fused_backend}", torch.bfloat16, BYTES_BF16_KAHAN,
         lambda ps: lo.AdamW(ps, mode="kahan", backend=fused_backend, **HYPER)),
        ("  same, diagnostics off", torch.bfloat16, BYTES_BF16_KAHAN,
         lambda ps: lo.AdamW(ps, mode="kahan", backend=fused_backend, diagnostics=False, **HYPER)),
        ("  same, nearest-rounded states", torch.bfloat16, BYTES_BF16_KAHAN,
         lambda ps: lo.AdamW(ps, mode="kahan", backend=fused_backend, diagnostics=False, state_rounding="nearest",
                             **HYPER)),
        ("  same, non-finite check off", torch.bfloat16, BYTES_BF16_KAHAN,
         lambda ps: lo.AdamW(ps, mode="kahan", backend=fused_backend, diagnostics=False, state_rounding="nearest",
                             nonfinite="off", **HYPER)),
    ]
    if with_compiled and fused_backend == "native":
        rows.insert(4, ("lowp AdamW bf16 kahan compiled", torch.bfloat16, BYTES_BF16_KAHAN,
                        lambda ps: lo.AdamW(ps, mode="kahan", backend="compiled", **HYPER)))
    try:
        import optimi
    except ImportError:
        pass  # report() says so
    else:
        rows.insert(2, ("optimi AdamW bf16 kahan", torch.bfloat16, BYTES_BF16_KAHAN,
                        lambda ps: optimi.AdamW(ps, kahan_sum=True, foreach=True, **HYPER)))
    return rows


def parse_size(text: str) -> int:
    """``"8M"`` -> 8 * 2**20 (suffixes K, M, G are powers of 1024); a ``ValueError`` otherwise."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = float(text.rstrip("KMG"))
    if not math.isfinite(number) or number * scale < MIN_SIZE or number * scale != int(number * scale):
        raise ValueError(f"size: expected a whole parameter count of at least 64K such as 8M, got {text!r}")
    return int(number * scale)


def measure(total: int, device: torch.device, rounds: int, with_compiled: bool = False) -> dict:
    """Time every contender and both bandwidth probes on ``total`` parameters; returns
    ``{"total", "results": {name: (ideal bytes/param, timings)}, "copy" and "in_place": bytes/s,
    "optimi": whether optimi ran}`` for :func:`report`."""
    if not isinstance(total, int) or total < MIN_SIZE:
        raise ValueError(f"total: expected a parameter count of at least {MIN_SIZE}, got {total!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected a positive int, got {rounds!r}")
    rows_in = contenders(device, with_compiled)
    makers = {name: (dtype, make) for name, dtype, _, make in rows_in}
    timings = time_all({COPY: (torch.float32, copier), IN_PLACE: (torch.float32, updater), **makers},
                       split(total), device, rounds)
    results = {name: (nbytes, timings[name]) for name, _, nbytes, _ in rows_in}
    return {"total": total, "results": results, "copy": 8 * total / timings[COPY]["step"],
            "in_place": 8 * total / timings[IN_PLACE]["step"], "optimi": "optimi AdamW bf16 kahan" in results}


def report(measured: dict) -> str:
    """The table of :func:`measure` as text."""
    total, results = measured["total"], measured["results"]
    ref = results["torch AdamW fused fp32"][1]["step"]
    optimi_row = results.get("optimi AdamW bf16 kahan")
    rows = []
    for name, (nbytes, r) in results.items():
        gbs = nbytes * total / r["step"]
        rows.append([name, f"{total / r['step'] / 1e6:.1f}", f"{ref / r['step']:.2f}",
                     f"{optimi_row[1]['step'] / r['step']:.2f}" if optimi_row else "-",
                     f"{gbs / 1e9:.2f}", f"{gbs / measured['copy']:.0%}", f"{gbs / measured['in_place']:.0%}",
                     f"{r['first']:.2f}", "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}"])
    lines = [f"{total / 2**20:.0f}M parameters; copy bandwidth {measured['copy'] / 1e9:.2f} GB/s, "
             f"in-place update bandwidth {measured['in_place'] / 1e9:.2f} GB/s",
             text_table(["optimizer", "Mparams/s", "x torch fused", "x optimi", "GB/s (ideal bytes)",
                         "of copy", "of in-place", "first step s", "peak extra MiB"], rows)]
    if not measured["optimi"]:
        lines.append("optimi is not installed (pip install torch-optimi): its row is left out")
    return "\n".join(lines)


