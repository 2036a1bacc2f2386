"""AdamW steps with block-scaled 8-bit, fp8 and 4-bit states against the same step with bf16
states (the named baseline, measured in the same run), on the native backend, plus the native
codec alone (decode + encode, ns per element); with ``--device cuda``, on the Triton backend.

On the CPU each step is also set against its memory floor: the bytes it must move (every tensor
it reads, and writes back, once) at the bandwidth of an in-place ``Tensor.add_`` on the same threads and a
working set of the same size. A step well above its floor is bound by its instructions, and there
the fewer bytes of coded states do not show; the last column says below what bandwidth (shared
by the same threads) the bf16-state step's floor alone would take longer than the int8 / uint8
step measured here, the machines where coded states are the faster ones.

    python benchmarks/codes_step.py --sizes 8000000,32000000 --threads 1,2 [--rounds 3]
    python benchmarks/codes_step.py --device cuda --sizes 64M,256M

The default sizes are not powers of two on purpose: on a machine whose large allocations are
physically contiguous (a fresh VM; transparent huge pages), tensors of 2**23 or 2**25 elements
start at addresses a few pages apart modulo 1 MiB, and a step over five or six such streams ran
1.5x slower at 2**25 than at 32,000,000 elements (bf16 states; the coded states' smaller tensors
alias less, so their ratio looks better than it is). ``--sizes 8M,32M`` measures that case.

bf16 weights, Kahan write-back (AdamW's default for them), states rounded stochastically (the
default), blocks of 64 with bf16 scales (the defaults).
"""
from __future__ import annotations

import argparse
import time

import torch

import lowp.optim as lo
from lowp.optim.codes import CODES, codes_shape, scales_shape
from lowp.optim.kernels.native import codec as native_codec
from lowp.optim.speed import parse_size

#: name -> state_dtype (``None``: bf16 states, the baseline)
CONFIGS: dict[str, dict[str, torch.dtype] | None] = {
    "bf16 states": None,
    "int8 / uint8": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
    "e4m3 / e4m3": {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.float8_e4m3fn},
    "int8 / uint4": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint4},  # type: ignore[attr-defined]
}


def step_seconds(numel: int, rounds: int, chunk_size: int | None,
                 device: torch.device) -> tuple[dict[str, float], dict[str, int]]:
    """Per configuration, the fastest of ``rounds`` AdamW steps over one bf16 parameter of
    ``numel`` elements (the configurations take turns, so a change of the machine's load touches
    them all alike), and the bytes the step moves (``moved_bytes``)."""
    gen = torch.Generator(device=device).manual_seed(0)
    steps = {}
    moved = {}
    for name, state_dtype in CONFIGS.items():
        p = torch.nn.Parameter(torch.randn(numel, generator=gen, device=device).bfloat16())
        p.grad = torch.randn(numel, generator=gen, device=device).bfloat16()
        extra: dict = {} if state_dtype is None else {"state_dtype": state_dtype}
        if chunk_size is not None:
            extra["chunk_size"] = chunk_size
        opt = lo.AdamW([p], lr=1e-3, backend="triton" if device.type == "cuda" else "native", **extra)
        opt.step()
        steps[name] = opt.step
        moved[name] = moved_bytes(p, opt.state[p])
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return best, moved


def moved_bytes(p: torch.Tensor, state: dict) -> int:
    """Bytes one step must move at least: the weight and every tensor state (codes, scales,
    compensation) read and written once, the gradient read once."""
    assert p.grad is not None
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return 2 * (p.nbytes + sum(t.nbytes for t in tensors)) + p.grad.nbytes


def rmw_bandwidth(nbytes: int, rounds: int) -> float:
    """Bytes per second that an in-place ``add_`` moves (each byte read and written back, as the
    step does: no write-allocate traffic) over a buffer of ``nbytes / 2`` bytes, on torch's
    current threads: the fastest of ``rounds`` passes."""
    buf = torch.zeros(max(nbytes // 2 // 4, 1), dtype=torch.int32)
    buf.add_(1)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        buf.add_(1)
        best = min(best, time.perf_counter() - start)
    return 2 * buf.nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def codec_ns(numel: int, code_dtype: torch.dtype, rounds: int) -> tuple[float, float]:
    """(decode, encode with stochastic rounding) of ``numel`` elements, ns per element."""
    code = CODES[code_dtype]
    x = torch.randn(numel)
    x = x if code.signed else x.square()
    codes = torch.empty(codes_shape(code, x.shape), dtype=code.storage)
    scales = torch.empty(scales_shape(numel, 64), dtype=torch.bfloat16)
    out = torch.empty(numel)
    bits = native_codec.CountedBits(0, 12345)
    times = []
    for fn in (lambda: native_codec.decode(codes, scales, code, 64, numel, out),
               lambda: native_codec.encode(x, code, 64, codes, scales, bits)):
        native_codec.encode(x, code, 64, codes, scales, bits)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        times.append(best / numel * 1e9)
    return times[0], times[1]


def main() -> None:
    """Run the benchmark described in the module docstring and print its tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8000000,32000000",
                        help="parameter counts, e.g. 8000000,32000000 or 8M,32M (powers of two: see above)")
    parser.add_argument("--threads", default="1,2", help="CPU thread counts, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per configuration (the best counts)")
    parser.add_argument("--chunk-size", type=int, default=None, help="the backend's chunk_size (default: lowp's)")
    parser.add_argument("--device", default="cpu", help="cpu (native backend) or cuda (Triton backend)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, AdamW, bf16 weights, Triton backend; "
              "ratio = step time / bf16-state step time")
        print()
        print("| params | " + " | ".join(CONFIGS) + " |")
        print("|---|" + "---|" * len(CONFIGS))
        for size in args.sizes.split(","):
            times, _ = step_seconds(parse_size(size), args.rounds, args.chunk_size, device)
            base = times["bf16 states"]
            print(f"| {size} | " + " | ".join(f"{t * 1e3:.2f} ms ({t / base:.2f}x)" for t in times.values()) + " |")
        return
    if not native_codec.available():
        raise SystemExit("codes_step: the native backend does not build here (x86-64 with AVX2 and g++ needed)")
    print(f"torch {torch.__version__}, AdamW, bf16 weights, native backend; ratio = step time / bf16-state step time; "
          "floor = bytes moved / memory bandwidth")
    print()
    print("| params | threads | memory bandwidth | " + " | ".join(CONFIGS) + " | coded faster below |")
    print("|---|---|---|" + "---|" * len(CONFIGS) + "---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for size in args.sizes.split(","):
            numel = parse_size(size)
            times, moved = step_seconds(numel, args.rounds, args.chunk_size, device)
            bandwidth = rmw_bandwidth(moved["bf16 states"], args.rounds)
            base = times["bf16 states"]
            cells = [f"{t * 1e3:.1f} ms ({t / base:.2f}x; {t * bandwidth / moved[name]:.1f}x floor, "
                     f"{moved[name] / numel:.2f} B/param)" for name, t in times.items()]
            crossover = moved["bf16 states"] / times["int8 / uint8"]
            print(f"| {size} | {threads} | {bandwidth / 1e9:.1f} GB/s | " + " | ".join(cells)
                  + f" | {crossover / 1e9:.1f} GB/s |")
    print()
    print("| codec alone, 8M elements, 1 thread | decode ns/element | encode ns/element (stochastic) |")
    print("|---|---|---|")
    torch.set_num_threads(1)
    for dtype in CODES:
        decode_ns, encode_ns = codec_ns(1 << 23, dtype, args.rounds)
        print(f"| {CODES[dtype].name} | {decode_ns:.2f} | {encode_ns:.2f} |")


if __name__ == "__main__":
    main()
