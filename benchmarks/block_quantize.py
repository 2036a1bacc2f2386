"""ms per call of lowp.blocks.quantize_blocks against torchao's mx_formats reference, same run, interleaved.

    python benchmarks/block_quantize.py [--numel 16777216] [--repeats 5] [--threads N] [--markdown]

Input: N(0,1) float32 values, shape (numel / 4096, 4096). Cases:
  mxfp8_e4m3 : lowp quantize_blocks(x, "mxfp8_e4m3")       vs torchao to_mx(x, float8_e4m3fn, 32, FLOOR)
  mxfp8_rceil: lowp with scale_rounding="rceil"            vs torchao to_mx(..., RCEIL)
  nvfp4      : lowp quantize_blocks(x, "nvfp4")            vs torchao nvfp4_quantize(x, 16, per_tensor_scale)
Both sides produce element values (lowp: float32 values; torchao: fp8 / packed fp4 codes) and block
scales. The two are timed alternately, repeat by repeat, so machine noise hits both alike; the table
has the best time of each and the ratio lowp / torchao (the target of issue 30: at most 2).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lowp.blocks import get_block_format, quantize_blocks
from lowp.report import markdown_table, text_table


def cases(x: torch.Tensor) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(name, lowp call, torchao call) for each case of the module docstring."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    rceil = get_block_format("mxfp8_e4m3").replace(scale_rounding="rceil")
    t_tensor = torch.tensor(x.abs().max().item() / 2688.0)  # the same per-tensor scale for both sides
    return [
        ("mxfp8_e4m3", lambda: quantize_blocks(x, "mxfp8_e4m3"),
         lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)),
        ("mxfp8_rceil", lambda: quantize_blocks(x, rceil),
         lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)),
        ("nvfp4", lambda: quantize_blocks(x, "nvfp4", tensor_scale=float(t_tensor)),
         lambda: nvfp4_quantize(x, 16, t_tensor)),
    ]


def interleaved_best_ms(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best wall time (ms) of ``a`` and of ``b`` over ``repeats`` alternating runs, after one warm-up each."""
    a(), b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - start)
        start = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - start)
    return best_a * 1e3, best_b * 1e3


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark described in the module docstring and print its table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements (a multiple of 4096)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.numel < 4096 or args.numel % 4096:
        parser.error(f"--numel: expected a positive multiple of 4096, got {args.numel}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.numel // 4096, 4096, generator=torch.Generator().manual_seed(0))
    columns = ["case", "numel", "lowp_ms", "torchao_ms", "lowp/torchao"]
    rows = []
    for name, lowp_fn, torchao_fn in cases(x):
        ms_lowp, ms_ao = interleaved_best_ms(lowp_fn, torchao_fn, args.repeats)
        rows.append([name, args.numel, round(ms_lowp, 2), round(ms_ao, 2), round(ms_lowp / ms_ao, 2)])
    print(markdown_table(columns, rows) if args.markdown else text_table(columns, rows))
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats} interleaved runs")


if __name__ == "__main__":
    main()
