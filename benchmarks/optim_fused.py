"""Fused optimizer step speed: lowp's fused bf16 + Kahan AdamW against torch and optimi.

For each size (parameters split into a few tensors like a model's layers) and in the same run on
the same machine (optimizers take turns; the best of ``--rounds`` steps counts): parameters/second, effective bandwidth (bytes an ideal fused step must move,
divided by the step time) as a fraction of a measured copy bandwidth, and peak extra memory of
one step. Baselines: ``torch.optim.AdamW(fused=True)`` and ``foreach=True`` in fp32, optimi's
AdamW with Kahan summation in bf16 (when ``torch-optimi`` is installed), lowp's unfused
``foreach`` backend. The fused lowp rows use the native kernel on CPU, Triton on CUDA.

Bytes per parameter of an ideal step: fp32 AdamW reads weight, grad, m, v (16) and writes weight,
m, v (12) = 28; bf16 + Kahan reads weight, grad, m, v, compensation (10), writes 4 of them (8) = 18.

    python benchmarks/optim_fused.py --sizes 8M,32M,64M --threads 2
"""
from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace
from typing import Callable

import torch

import lowp.optim as lo
from lowp.report import text_table

BYTES_FP32_ADAMW = 28
BYTES_BF16_KAHAN = 18
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


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


def time_all(makers: dict[str, tuple[torch.dtype, Callable]], sizes: list[int], device: torch.device,
             rounds: int) -> dict[str, dict[str, float]]:
    """First-step time, best step time over ``rounds`` and peak extra memory per optimizer.

    The optimizers take turns, one step each per round, and the best round counts: on a shared
    machine other processes slow some steps down, never speed them up."""
    opts, out = {}, {}
    for name, (dtype, make) in makers.items():
        params = [torch.randn(n, device=device).mul_(0.1).to(dtype) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p).mul_(0.01)
        opts[name] = make(params)
        out[name] = {"first": timed(opts[name].step, device), "step": math.inf}
    for _ in range(rounds):
        for name, opt in opts.items():
            out[name]["step"] = min(out[name]["step"], timed(opt.step, device))
    for name, opt in opts.items():
        out[name]["peak"] = peak_extra_bytes(opt.step, device)
    return out


def contenders(device: torch.device, with_compiled: bool) -> list[tuple[str, torch.dtype, int, Callable]]:
    """(name, parameter dtype, ideal bytes/parameter, constructor) of every optimizer compared."""
    fused_backend = "triton" if device.type == "cuda" else "native"
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
    if with_compiled and device.type == "cpu":
        rows.insert(4, ("lowp AdamW bf16 kahan compiled", torch.bfloat16, BYTES_BF16_KAHAN,
                        lambda ps: lo.AdamW(ps, mode="kahan", backend="compiled", **HYPER)))
    try:
        import optimi
    except ImportError:
        print("optimi not installed (pip install torch-optimi): its row is left out")
    else:
        rows.insert(2, ("optimi AdamW bf16 kahan", torch.bfloat16, BYTES_BF16_KAHAN,
                        lambda ps: optimi.AdamW(ps, kahan_sum=True, foreach=True, **HYPER)))
    return rows


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8M,32M", help="parameter counts, e.g. 8M,32M,64M")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per optimizer (best one counts)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--with-compiled", action="store_true",
                        help="add lowp's torch.compile backend on CPU (10-40 s to compile)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, {args.threads} threads, torch {torch.__version__}")
    for total in (parse_size(s) for s in args.sizes.split(",")):
        rows_in = contenders(device, args.with_compiled)
        makers = {name: (dtype, make) for name, dtype, _, make in rows_in}
        timings = time_all({COPY: (torch.float32, copier), IN_PLACE: (torch.float32, updater), **makers},
                           split(total), device, args.rounds)
        copy = 8 * total / timings[COPY]["step"]
        in_place = 8 * total / timings[IN_PLACE]["step"]
        results = {name: (nbytes, timings[name]) for name, _, nbytes, _ in rows_in}
        ref = results["torch AdamW fused fp32"][1]["step"]
        optimi_row = results.get("optimi AdamW bf16 kahan")
        rows = []
        for name, (nbytes, r) in results.items():
            gbs = nbytes * total / r["step"]
            rows.append([name, f"{total / r['step'] / 1e6:.1f}", f"{ref / r['step']:.2f}",
                         f"{optimi_row[1]['step'] / r['step']:.2f}" if optimi_row else "-",
                         f"{gbs / 1e9:.2f}", f"{gbs / copy:.0%}", f"{gbs / in_place:.0%}", f"{r['first']:.2f}",
                         "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}"])
        print(f"\n{total / 2**20:.0f}M parameters; copy bandwidth {copy / 1e9:.2f} GB/s, "
              f"in-place update bandwidth {in_place / 1e9:.2f} GB/s")
        print(text_table(["optimizer", "Mparams/s", "x torch fused", "x optimi", "GB/s (ideal bytes)",
                          "of copy", "of in-place", "first step s", "peak extra MiB"], rows))


if __name__ == "__main__":
    main()
