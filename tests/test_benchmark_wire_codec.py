"""``benchmarks/wire_codec.py``: a small run prints a row per reduction and world size, the bytes
counted from the wire buffers (the 8-bit wire at most 0.55x a bf16 ring all-reduce's, scales
included), and the residual it carries changes what the next step sends."""
import torch
from benchmark_helpers import benchmark

from lowp.distributed.wire import WireFormat, decode, encode


def test_a_small_run_prints_every_row(capsys):
    benchmark("wire_codec").main(["--numel", "4096", "--world-sizes", "2,4", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = out.splitlines()[3:]   # after the heading, the header and its rule: one per world size and reduction
    wire = [line for line in rows if "8-bit wire" in line]
    assert len(wire) == 2 * 4
    for line in wire:
        assert float(line.split()[-2]) <= 0.55
    assert sum("bf16 ring all-reduce" in line for line in rows) == 2 and len(rows) == 2 * 6


def test_the_step_keeps_what_compression_lost():
    bench = benchmark("wire_codec")
    g = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    residual = torch.zeros(1024)
    fmt = WireFormat()
    piece = encode(g[:512], fmt)
    bench.wire_step(g, residual, piece, fmt, 2)
    assert torch.equal(residual, g - decode(encode(g, fmt), fmt, 1024))
    assert residual.abs().max() > 0
