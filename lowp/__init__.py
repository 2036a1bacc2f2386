"""lowp: low-precision training and inference without losing accuracy.

Subpackages, each with one job:

- :mod:`lowp.formats`, :mod:`lowp.rounding`, :mod:`lowp.codec`, :mod:`lowp.ulp` — exact number
  formats, rounding to them, bit-level codes and ulp errors.
- :mod:`lowp.blocks` — block (microscaling) formats: MXFP8/MXFP6/MXFP4 and NVFP4, exactly.
- :mod:`lowp.summation` — error-free transforms and compensated sums.
- :mod:`lowp.optim` — compensated (Kahan), stochastic-rounding and exact-remainder optimizers.
- :mod:`lowp.norms` — L2 norm, RMSNorm and LayerNorm that never overflow or underflow.
- :mod:`lowp.distributed` — low-precision gradient reduction: simulator, comm hooks, advisor.
- :mod:`lowp.audit` — opmath upcasting, per-op ulp audit, overflow/underflow monitor.
"""
from lowp.blocks import BlockFormat, dequantize_blocks, get_block_format, quantize_blocks
from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize, quantize_ste

__version__ = "0.1.0"
__all__ = ["FloatFormat", "get_format", "quantize", "quantize_ste", "BlockFormat", "get_block_format",
           "quantize_blocks", "dequantize_blocks", "__version__"]
