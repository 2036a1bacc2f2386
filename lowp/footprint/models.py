"""Parameter counts for ``lowp memory``: a count written as ``7e9``, ``125M`` or ``1.3B``, or the
parameters of the model a ``--model`` argument names (:mod:`lowp.model_spec`: the built-in demo
model, ``module:factory``, a Hugging Face ``transformers`` model type, a local ``config.json`` or a
cached hub id), built on the meta device (no download, no memory).
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lowp.model_spec import ModelSource

__all__ = ["parse_count", "MAX_COUNT", "meta_model", "build_meta", "DEMO"]

#: The largest count accepted (10**15 parameters, far beyond any model trained so far).
MAX_COUNT = 10**15
#: The name of the built-in demo model.
DEMO = "demo"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A parameter count from ``text``: a whole number, in scientific notation (``7e9``) or with
    a decimal suffix K (10**3), M (10**6), B or G (10**9), T (10**12), any case (``1.3B`` is
    1,300,000,000; underscores may separate digits, ``7_000_000_000``). ``ValueError``
    naming ``params`` unless the result is a whole number in ``[1, MAX_COUNT]``."""
    expected = f"expected a whole parameter count between 1 and 1e15 such as 7e9, 125M or 1.3B, got {text!r}"
    if not isinstance(text, str):
        raise ValueError(f"params: {expected}")
    body = text.strip().replace("_", "")
    scale = _SUFFIXES.get(body[-1:].upper(), 1)
    if scale != 1:
        body = body[:-1]
    try:
        value = Decimal(body) * scale
    except InvalidOperation:
        raise ValueError(f"params: {expected}") from None
    if not value.is_finite() or value != value.to_integral_value() or not 1 <= value <= MAX_COUNT:
        raise ValueError(f"params: {expected}")
    return int(value)


def meta_model(name: str) -> tuple[torch.nn.Module, str]:
    """(model on the meta device, description) of the model ``name`` names, as ``--model`` reads
    it (:func:`lowp.model_spec.resolve`, then :func:`build_meta`). ``ValueError`` naming ``model``
    for anything that names no model that can be built (the message says what was expected)."""
    from lowp.model_spec import ModelSpecError, resolve

    try:
        return build_meta(resolve(name))
    except ModelSpecError as exc:
        raise ValueError(f"model: {exc}") from None


def build_meta(source: ModelSource) -> tuple[torch.nn.Module, str]:
    """(model on the meta device, description) of ``source`` (:func:`lowp.model_spec.resolve`):
    ``demo`` is lowp's demo model (:class:`lowp.demo.model.CharLM` with its defaults);
    ``module:factory`` is called inside ``torch.device("meta")``, or plainly when that fails; a
    ``transformers`` model type (``gpt2``, ``llama``, ``t5``) is built from its config class's
    defaults, a ``config.json`` or a cached hub id from that file: the sequence-to-sequence LM of an
    encoder-decoder, the causal LM of other architectures that have one, else the base model.
    Nothing is downloaded or allocated; ``model.parameters()`` lists tied weights once.
    ``ModelSpecError`` (:mod:`lowp.model_spec`) when the model cannot be built."""
    from lowp.model_spec import build

    if source.kind == DEMO:
        from lowp.demo.model import CharLM

        with torch.device("meta"):
            demo = CharLM()
        return demo, "lowp demo model (CharLM defaults)"
    return build(source, meta=True)
