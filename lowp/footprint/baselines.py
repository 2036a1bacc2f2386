"""Named baselines for ``lowp memory``: the memory layouts of AdamW in other libraries, each
computed from its documented layout with the source cited, and measured here (states' bytes
after one step on a probe, :func:`lowp.footprint.measure.measure`) when the library is
importable.

Bytes per parameter (weights + states + extra precision; gradients separately):

* torch fp32 AdamW: fp32 weights (4) + ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype
  (8); fp32 gradients (4). PyTorch documentation of ``torch.optim.AdamW``.
* Mixed precision (AMP, ``torch.autocast`` to bf16): the model keeps fp32 weights, which are the
  master weights (4), and fp32 AdamW moments (8); gradients are fp32 (4). Activations are bf16
  and not counted. PyTorch "Automatic Mixed Precision" documentation.
* Mixed precision with bf16 weights and an fp32 master copy (Megatron-LM, DeepSpeed ZeRO):
  bf16 weights (2) + fp32 master weights (4) + fp32 moments (8), bf16 gradients (2): the
  16 bytes per parameter of Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", SC 2020, section 3.1 (K = 12 for the optimizer).
* optimi AdamW with ``kahan_sum=True`` and bf16 weights: bf16 weights (2), bf16 moments (4),
  a bf16 Kahan compensation buffer (2); bf16 gradients (2). optimi documentation, "Low Precision
  Training with Kahan Summation" (https://optimi.benjaminwarner.dev).
* torchao ``AdamW8bit`` / ``AdamWFp8`` / ``AdamW4bit`` with bf16 weights: each moment stored as
  block-quantized codes plus one fp32 scale per block: 8-bit and fp8 codes (1 byte) with blocks
  of 256, 4-bit codes (1/2 byte) with blocks of 128 (torchao/optim/README.md, "block size is 256
  for 8-bit and FP8 optimizers, and 128 for 4-bit optimizers"; the scales are fp32 tensors in
  torchao/optim/subclass_8bit.py, subclass_4bit.py, subclass_fp8.py). So a moment costs
  ``1 + 4/256`` or ``1/2 + 4/128`` bytes. Tensors under 4096 elements, or not a multiple of the
  block size, keep plain moments in the parameter's dtype (torchao/optim/adam.py), so a small
  model measures above these figures.
* FlashOptim ``FlashAdamW`` with bf16 weights and the default ``master_weight_bits=24``: bf16
  weights (2), an int8 error-correction term (1), moments quantized to 8 bits in groups of 32
  with one fp16 scale per group, ``1 + 2/32`` bytes each; bf16 gradients (2). Gonzalez Ortiz et
  al., "FlashOptim: Optimizers for Memory Efficient Training", arXiv:2602.23349, section 3.2, and
  the FlashOptim README and ``flashoptim/optimizers.py`` docstrings (github.com/databricks/flashoptim).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

from lowp.footprint.measure import Footprint, measure, probe_model

__all__ = ["Baseline", "BASELINES", "REFERENCE", "measure_baseline"]


@dataclass(frozen=True)
class Baseline:
    """A named memory layout of another library.

    Args:
        name: the row's name.
        footprint: the documented bytes per parameter.
        source: where the layout is documented.
        library: the module to import to measure it here (``None``: not measured).
    """

    name: str
    footprint: Footprint
    source: str
    library: str | None = None


def _block_quantized(code_bytes: float, block: int, scale_bytes: int) -> float:
    """Bytes per element of a tensor stored as codes with one scale per ``block`` elements."""
    return code_bytes + scale_bytes / block


#: The row every other row is compared with.
REFERENCE = "torch fp32 AdamW"

BASELINES: tuple[Baseline, ...] = (
    Baseline(REFERENCE, Footprint(4, 8, 0, 4),
             "PyTorch docs, torch.optim.AdamW: exp_avg and exp_avg_sq in the parameter's dtype (fp32)", "torch"),
    Baseline("AMP bf16 autocast + fp32 AdamW", Footprint(4, 8, 0, 4),
             "PyTorch docs, Automatic Mixed Precision: fp32 weights (the master copy) and fp32 moments; bf16 "
             "activations are not counted"),
    Baseline("bf16 weights + fp32 master + fp32 AdamW", Footprint(2, 8, 4, 2),
             "Rajbhandari et al., ZeRO (SC 2020), sec. 3.1: 2 + 2 + 12 bytes per parameter (Megatron-LM, "
             "DeepSpeed)"),
    Baseline("optimi AdamW bf16 kahan", Footprint(2, 4, 2, 2),
             "optimi docs, Low Precision Training with Kahan Summation: bf16 weights, moments and compensation",
             "optimi"),
    Baseline("torchao AdamW8bit", Footprint(2, 2 * _block_quantized(1, 256, 4), 0, 2),
             "torchao/optim/README.md: block size 256 for 8-bit; one fp32 scale per block (subclass_8bit.py)",
             "torchao"),
    Baseline("torchao AdamWFp8", Footprint(2, 2 * _block_quantized(1, 256, 4), 0, 2),
             "torchao/optim/README.md: block size 256 for FP8; one fp32 scale per block (subclass_fp8.py)",
             "torchao"),
    Baseline("torchao AdamW4bit", Footprint(2, 2 * _block_quantized(0.5, 128, 4), 0, 2),
             "torchao/optim/README.md: block size 128 for 4-bit; one fp32 scale per block (subclass_4bit.py)",
             "torchao"),
    Baseline("FlashOptim FlashAdamW bf16", Footprint(2, 2 * _block_quantized(1, 32, 2), 1, 2),
             "FlashOptim (arXiv:2602.23349, sec. 3.2; github.com/databricks/flashoptim): int8 error term for "
             "24-bit master weights, 8-bit moments with an fp16 scale per group of 32"),
)


def _torch_adamw() -> tuple[torch.dtype, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    return torch.float32, lambda params: torch.optim.AdamW(params, foreach=False)


def _optimi_adamw() -> tuple[torch.dtype, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    import optimi

    return torch.bfloat16, lambda params: optimi.AdamW(params, lr=1e-3, kahan_sum=True)


def _torchao(name: str) -> Callable[[], tuple[torch.dtype, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]]:
    def make() -> tuple[torch.dtype, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.optim

        return torch.bfloat16, getattr(torchao.optim, name)
    return make


_MAKERS = {REFERENCE: _torch_adamw, "optimi AdamW bf16 kahan": _optimi_adamw,
           "torchao AdamW8bit": _torchao("AdamW8bit"), "torchao AdamWFp8": _torchao("AdamWFp8"),
           "torchao AdamW4bit": _torchao("AdamW4bit")}


def measure_baseline(baseline: Baseline) -> Footprint | None:
    """The footprint of ``baseline`` measured here: its optimizer built on the probe model
    (:func:`lowp.footprint.measure.probe_model`) in its weight dtype and stepped once; ``None``
    when it has no measurable optimizer or its library cannot be imported. torchao's step is
    wrapped in ``torch.compile``, which is replaced by the identity while measuring (the states'
    layout does not depend on it, and compiling takes tens of seconds on a CPU)."""
    maker = _MAKERS.get(baseline.name)
    if maker is None:
        return None
    try:
        dtype, build = maker()
    except ImportError:
        return None
    model = probe_model(dtype)
    opt = build(list(model.parameters()))
    with warnings.catch_warnings(), mock.patch("torch.compile", lambda fn, **kwargs: fn):
        warnings.simplefilter("ignore")
        opt.step()
    return measure(model.parameters(), opt)
