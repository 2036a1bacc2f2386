"""The MX presets of :mod:`lowp.blocks` against gfloat's block formats (Graphcore's reference
implementation of the OCP MX formats: ``gfloat.quantize_block`` with ``compute_scale_amax``, the
spec's floor scale, and saturating elements rounded to nearest-even), block by block: the same
scale and the same decoded values, bit for bit. gfloat rounds each element in Python, so the
blocks are chosen rather than many: every element value at scale exponents across e8m0's range,
every midpoint between neighbouring elements (the ties) and one fp32 ulp either side, values
above the element's largest (saturation after the floor scale), a zero block and random blocks
over many binades."""
from __future__ import annotations

import math

import gfloat
import numpy as np
import pytest
import torch
from gfloat import formats

from lowp.blocks import fake_quantize, quantize_blocks
from lowp.codec import all_values

#: preset -> (gfloat block format, lowp element format)
PRESETS = {
    "mxfp8_e4m3": (formats.format_info_mxfp8_e4m3, "fp8_e4m3fn"),
    "mxfp8_e5m2": (formats.format_info_mxfp8_e5m2, "fp8_e5m2"),
    "mxfp6_e2m3": (formats.format_info_mxfp6_e2m3, "fp6_e2m3"),
    "mxfp6_e3m2": (formats.format_info_mxfp6_e3m2, "fp6_e3m2"),
    "mxfp4": (formats.format_info_mxfp4_e2m1, "fp4_e2m1"),
}
BLOCK = 32


def _blocks(element: str, seed: int = 0) -> torch.Tensor:
    """Rows of 32 fp32 values (see the module docstring)."""
    values = all_values(element).to(torch.float32)
    values = values[values >= 0]
    pos = values[values > 0]
    mids = (pos[:-1] + pos[1:]) / 2
    top = float(values.max())
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for k in (-126, -100, -20, -1, 0, 1, 20, 100):   # scale exponents (values stay inside fp32's range)
        scale = math.ldexp(1.0, k)
        below, above = torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(math.inf))
        for chunk in (values, mids, below, above):
            flat = torch.cat([chunk, torch.full((BLOCK - 1,), top)])   # every row holds the top value: scale 2**k
            for start in range(0, chunk.numel(), BLOCK - 1):
                row = torch.cat([flat[start:start + BLOCK - 1], torch.tensor([top])])
                row = torch.cat([row, torch.zeros(BLOCK - row.numel())]) * scale
                sign = torch.where(torch.rand(BLOCK, generator=gen) < 0.5, -1.0, 1.0)
                rows.append(row * sign)
    rows.append(torch.zeros(BLOCK))
    rows.append(torch.linspace(0.5, 1.9, BLOCK) * top)                      # beyond the top after the floor scale
    for e in range(-140, 121, 10):                                          # random blocks, many binades
        rows.append(torch.randn(BLOCK, generator=gen) * math.ldexp(1.0, e))
    return torch.stack(rows).float()


def _gfloat(fi, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """gfloat's decoded values and scales of each row (fp64)."""
    out, scales = [], []
    for row in rows.double().numpy():
        scale = gfloat.compute_scale_amax(fi.etype.emax, row)
        out.append(gfloat.quantize_block(fi, row, gfloat.compute_scale_amax))
        scales.append(scale)
    return np.stack(out), np.array(scales)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_mx_presets_equal_gfloat(preset):
    fi, element = PRESETS[preset]
    rows = _blocks(element)
    expected, expected_scales = _gfloat(fi, rows)
    got = fake_quantize(rows, preset)
    q = quantize_blocks(rows, preset)
    assert torch.equal(q.scales.double().reshape(-1), torch.from_numpy(expected_scales)), preset
    want = torch.from_numpy(expected).float()
    differ = (got != want).nonzero()
    assert differ.numel() == 0, (preset, differ[:5].tolist())
    assert rows.numel() > 1500 and bool((got != rows).any())   # the comparison covers real rounding
