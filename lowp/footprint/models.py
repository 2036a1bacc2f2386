"""Parameter counts for ``lowp memory``: a count written as ``7e9``, ``125M`` or ``1.3B``, or the
parameters of a named model: the built-in demo model, or a Hugging Face ``transformers``
architecture built from its config class's defaults on the meta device (no download, no memory).
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

import torch

__all__ = ["parse_count", "MAX_COUNT", "meta_model", "DEMO"]

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


def _build(transformers: Any, config: Any) -> torch.nn.Module:
    """The training model of ``config`` on the meta device: the sequence-to-sequence LM of an
    encoder-decoder, else the causal LM, falling back to the base model when the architecture
    has no such head."""
    head = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        try:
            return head.from_config(config)
        except ValueError:   # no such head for this architecture
            return transformers.AutoModel.from_config(config)


def meta_model(name: str) -> tuple[torch.nn.Module, str]:
    """(model on the meta device, description) of the model called ``name`` (any case): ``"demo"``
    (lowp's demo model, :class:`lowp.demo.model.CharLM` with its defaults) or a ``transformers``
    model type (a key of ``transformers.CONFIG_MAPPING``, e.g. ``gpt2``, ``llama``, ``t5``), built
    from that config class's defaults: the sequence-to-sequence LM of an encoder-decoder, the
    causal LM of other architectures that have one, else the base model. ``model.parameters()``
    lists tied weights once. ``ValueError`` naming ``model`` for an unknown name, a model that
    cannot be built from its defaults (missing packages, required sub-configs), or when
    ``transformers`` is not installed."""
    name = name.strip().lower()
    if name == DEMO:
        from lowp.demo.model import CharLM

        with torch.device("meta"):
            demo = CharLM()
        return demo, "lowp demo model (CharLM defaults)"
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model: {name!r} is not 'demo', and Hugging Face model types need transformers "
                         f"(pip install transformers)") from None
    try:
        config = transformers.CONFIG_MAPPING[name]()
    except KeyError:
        raise ValueError(f"model: expected 'demo' or a transformers model type such as gpt2, llama or bert "
                         f"(a key of transformers.CONFIG_MAPPING), got {name!r}") from None
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = _build(transformers, config)
    except Exception as exc:   # a third-party constructor: any failure becomes a usage error
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"model: {name!r} cannot be built from {type(config).__name__}()'s defaults: "
                         f"{reason}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model, f"{type(model).__name__}({type(config).__name__}())"
