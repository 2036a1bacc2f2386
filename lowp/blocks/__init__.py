"""Block (microscaling) formats: OCP MX (MXFP8, MXFP6, MXFP4) and NVFP4, emulated exactly.

- :mod:`lowp.blocks.scales` — scale formats (e8m0, e4m3, bf16, fp32) and the scale roundings
  (floor, ceil, rceil, even).
- :mod:`lowp.blocks.hadamard` — the seeded random Hadamard transform and its inverse.
- :mod:`lowp.blocks.core` — :class:`BlockFormat`, the presets, :func:`quantize_blocks`,
  :func:`dequantize_blocks`, :func:`fake_quantize`.
- :mod:`lowp.blocks.linear` — fake-quantized training: :class:`BlockRecipe` (presets ``"mxfp8"``,
  ``"nvfp4"``, ``"bf16"``, ``"none"``), :class:`BlockQuantLinear`, :func:`quantize_linears`.

docs/blocks.md has the formulas, the presets and the cross-checks against torchao.
"""
from lowp.blocks.core import (BLOCK_PRESETS, BlockFormat, BlockQuantized, dequantize_blocks, fake_quantize,
                              get_block_format, quantize_blocks, register_block_format)
from lowp.blocks.linear import RECIPES, BlockQuantLinear, BlockRecipe, get_recipe, quantize_linears
from lowp.blocks.hadamard import hadamard_matrix, inverse_random_hadamard, random_hadamard
from lowp.blocks.scales import (SCALE_FORMATS, SCALE_ROUNDINGS, ScaleFormat, block_scales, e8m0_decode, e8m0_encode,
                                get_scale_format)

__all__ = ["BLOCK_PRESETS", "BlockFormat", "BlockQuantized", "dequantize_blocks", "fake_quantize", "get_block_format",
           "quantize_blocks", "register_block_format", "hadamard_matrix", "inverse_random_hadamard", "random_hadamard",
           "SCALE_FORMATS", "SCALE_ROUNDINGS", "ScaleFormat", "block_scales", "e8m0_decode", "e8m0_encode",
           "get_scale_format", "RECIPES", "BlockQuantLinear", "BlockRecipe", "get_recipe", "quantize_linears"]
