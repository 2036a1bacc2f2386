"""The block-format table of ``lowp audit --blocks``: how much of a realistic tensor each block
format keeps, per scale rounding, with and without the random Hadamard transform.

For a tensor ``x`` and its fake-quantized copy ``q`` (:func:`lowp.blocks.fake_quantize`), the
signal-to-quantization-noise ratio

    SQNR = 10 log10( sum x**2 / sum (x - q)**2 )   dB

(computed in fp64; each bit of a uniform quantizer is worth about 6.02 dB), on three tensors of
``rows x cols`` values with a fixed seed:

* ``gaussian``: N(0, 1);
* ``heavy``: Student's t with 3 degrees of freedom (the heavy tails of activation and gradient
  distributions);
* ``outliers``: N(0, 1) with 1 % of the columns (channels) scaled by 100, the outlier channels of
  LLM activations (Dettmers et al. 2022, "LLM.int8()", arXiv:2208.07339) that a per-block scale
  must absorb. The outliers hold about half of its energy, so its SQNR is mostly theirs; a fourth
  column gives the SQNR of the *other* channels, which lose their precision when a block's scale
  is set by an outlier.

Blocks run along the last dimension (rows), so an outlier channel shares every block it crosses
with ordinary values; the random Hadamard transform (``hadamard``: the block size) spreads it over
its block before quantizing (NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv:2509.25149). Scale roundings are those of :mod:`lowp.blocks.scales`.
"""
from __future__ import annotations

import math

import torch

from lowp.blocks import fake_quantize, get_block_format

__all__ = ["BLOCK_PRESETS", "TENSORS", "SCALE_ROUNDINGS", "outlier_channels", "sample_tensor", "sqnr_db",
           "block_format_table"]

BLOCK_PRESETS: tuple[str, ...] = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "nvfp4")
TENSORS: tuple[str, ...] = ("gaussian", "heavy", "outliers")
SCALE_ROUNDINGS: tuple[str, ...] = ("floor", "ceil", "rceil", "even")


def outlier_channels(cols: int, seed: int = 0) -> torch.Tensor:
    """The columns that :func:`sample_tensor` scales by 100 in its ``outliers`` tensor (1 %, at least one)."""
    return torch.randperm(cols, generator=torch.Generator().manual_seed(seed + 1))[:max(1, cols // 100)]


def sample_tensor(kind: str, rows: int = 128, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    """The fp32 tensor ``kind`` (module docstring) of shape ``(rows, cols)``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=gen)
    if kind == "heavy":   # Student's t, 3 degrees of freedom: N(0,1) / sqrt(chi2_3 / 3)
        z = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        chi2 = (torch.randn(3, rows, cols, generator=gen, dtype=torch.float64) ** 2).sum(0)
        return (z / torch.sqrt(chi2 / 3)).float()
    if kind == "outliers":
        x = torch.randn(rows, cols, generator=gen)
        x[:, outlier_channels(cols, seed)] *= 100.0
        return x
    raise ValueError(f"kind: expected one of {', '.join(TENSORS)}, got {kind!r}")


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    """``10 log10(sum x**2 / sum (x - q)**2)`` in fp64 (``inf`` when ``q == x``)."""
    x64, q64 = x.double(), q.double()
    noise = float(((x64 - q64) ** 2).sum())
    return math.inf if noise == 0 else 10.0 * math.log10(float((x64 ** 2).sum()) / noise)


def block_format_table(presets: tuple[str, ...] = BLOCK_PRESETS, rows: int = 128, cols: int = 1024,
                       seed: int = 0) -> tuple[list[str], list[list[object]]]:
    """Headers and rows: per preset, scale rounding and Hadamard transform (off, or over one
    block), the SQNR in dB on each tensor of :data:`TENSORS`."""
    tensors = {kind: sample_tensor(kind, rows, cols, seed) for kind in TENSORS}
    others = torch.ones(cols, dtype=torch.bool)
    others[outlier_channels(cols, seed)] = False
    heads = ["format", "scale rounding", "hadamard", *(f"{kind} SQNR dB" for kind in TENSORS),
             "outliers: other channels SQNR dB"]
    body: list[list[object]] = []
    for preset in presets:
        base = get_block_format(preset)
        for rounding in SCALE_ROUNDINGS:
            for hadamard in (0, base.block_size):
                fmt = base.replace(name=f"{preset}/{rounding}/{hadamard}", scale_rounding=rounding,
                                   hadamard=hadamard, aliases=())
                q = {kind: fake_quantize(x, fmt) for kind, x in tensors.items()}
                body.append([preset, rounding, hadamard or "-",
                             *(f"{sqnr_db(x, q[kind]):.2f}" for kind, x in tensors.items()),
                             f"{sqnr_db(tensors['outliers'][:, others], q['outliers'][:, others]):.2f}"])
    return heads, body
