"""Bytes on the wire and local cost per element of lowp's gradient reductions, in one run.

    python benchmarks/wire_codec.py [--numel 4194304] [--world-sizes 2,8,64] [--repeats 5] [--threads N]
        [--clock cpu] [--markdown]

For a bucket of ``numel`` fp32 gradients on R ranks, per rank and reduction step:

* **bytes sent**, from the sizes of the buffers each reduction hands its collectives (not a
  formula): the fp32 and bf16 ring all-reduces send ``2 (R-1)/R`` of their buffer (reduce-scatter
  plus all-gather); the 8-bit wire (``lowp.distributed.compressed``) sends ``R - 1`` pieces of
  ``wire.encode``'s buffer for its shard in the all-to-all and ``R - 1`` pieces in the all-gather,
  scales included; the ratio column is against the bf16 ring's bytes (issue 29's target: at most
  0.55);
* **local work per element** (the rank's own arithmetic, no communication), timed: the bf16 ring's
  casts (``x.bfloat16()``, and back to fp32 once); the 8-bit wire's encode of the whole bucket with
  the residual update (``v = g + e``, ``encode``, ``e = v - decode``), the decode and fp32 sum of R
  received shards, and the encode and decode of the all-gather (shard size ``numel / R``).
  ``--clock cpu`` sums the CPU time of all threads (steadier on a busy machine).
"""
from __future__ import annotations

import argparse
import time

import torch

from lowp.distributed.wire import WireFormat, decode, encode, wire_bytes
from lowp.report import markdown_table, text_table
from timing import best_seconds

FORMATS = [WireFormat(), WireFormat(element="fp8_e5m2"), WireFormat(element="int8"),
           WireFormat(rounding="stochastic")]


def wire_step(g: torch.Tensor, residual: torch.Tensor, piece: torch.Tensor, fmt: WireFormat, R: int) -> int:
    """One rank's local work of one 8-bit reduction of ``g`` on ``R`` ranks, ``piece`` standing for
    each received piece of its shard (communication left out); returns the bytes it sends."""
    key = 7 if fmt.rounding == "stochastic" else None
    n, shard = g.numel(), g.numel() // R
    v = g + residual
    sent = encode(v, fmt, key)                      # the bucket, cut into R pieces for the all-to-all
    residual.copy_(v - decode(sent, fmt, n))        # error feedback
    total = torch.zeros(shard)
    for _ in range(R):                              # the R pieces of this rank's shard, summed in fp32
        total += decode(piece, fmt, shard)
    encode(total / R, fmt, key)                     # the reduced shard for the all-gather
    decode(sent, fmt, n)                            # stands for decoding the R gathered pieces
    return (R - 1) * 2 * wire_bytes(fmt, shard)


def main(argv: list[str] | None = None) -> None:
    """Print the table of the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--world-sizes", default="2,8,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    n = args.numel
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    rows = []
    for R in (int(r) for r in args.world_sizes.split(",")):
        if n % R:
            raise SystemExit(f"--numel {n} is not a multiple of the world size {R}")
        ring = 2 * (R - 1) * (n // R)            # elements a ring all-reduce sends per rank
        bf16_bytes = ring * torch.empty(0, dtype=torch.bfloat16).element_size()
        bf16_time = best_seconds(lambda: g.bfloat16().float(), args.repeats, clock)
        rows.append([R, "fp32 ring all-reduce", ring * 4, f"{ring * 4 / bf16_bytes:.3f}", "0.00"])
        rows.append([R, "bf16 ring all-reduce", bf16_bytes, "1.000", f"{bf16_time / n * 1e9:.2f}"])
        for fmt in FORMATS:
            residual = torch.zeros(n)
            piece = encode(g[:n // R], fmt, 7 if fmt.rounding == "stochastic" else None)
            sent = wire_step(g, residual, piece, fmt, R)
            seconds = best_seconds(lambda: wire_step(g, residual, piece, fmt, R), args.repeats, clock)
            rows.append([R, f"8-bit wire {fmt} + feedback", sent, f"{sent / bf16_bytes:.3f}",
                         f"{seconds / n * 1e9:.2f}"])
    header = ["R", "reduction", "bytes sent per rank", "x bf16 ring", "local ns/element"]
    print(f"{n:,} fp32 gradients per rank; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.clock} clock, best of {args.repeats}")
    print((markdown_table if args.markdown else text_table)(header, rows))


if __name__ == "__main__":
    main()
