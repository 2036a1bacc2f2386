"""Fused optimizer steps (issue 7): every elementwise lowp optimizer in every write-back mode
from one shared mechanism, :mod:`rules` (the math, once per optimizer) x :mod:`step` (load, state
stores, write-back, once per mode), run by a backend: ``compiled`` (:func:`torch.compile`, CPU or
CUDA) or ``triton`` (hand-written multi-tensor Triton kernel for Adam/AdamW, CUDA or the Triton
interpreter). :func:`choose_backend` implements the optimizers' ``fused=`` option.
"""
from __future__ import annotations

import os
from typing import Any

from lowp.optim.backends import register_backend
from lowp.optim.kernels.compiled import CompiledBackend, compiler_available
from lowp.optim.kernels.triton_backend import TritonBackend, triton_available

__all__ = ["CompiledBackend", "TritonBackend", "choose_backend", "compiler_available", "triton_available",
           "AUTO_MIN_NUMEL"]

register_backend("compiled", CompiledBackend)
register_backend("triton", TritonBackend)

#: ``fused=None`` compiles on CPU only from this many parameter elements on: the first step then
#: costs 10-40 s of compilation (measured, docs/fused.md), which small models never win back.
AUTO_MIN_NUMEL = 1 << 22


def choose_backend(optimizer: Any, fused: bool | None, foreach: bool | None) -> str:
    """The backend name for the optimizers' ``fused`` option.

    ``False``: ``foreach`` (``eager`` when ``foreach=False``). ``True``: ``triton`` for CUDA
    parameters when Triton imports, else ``compiled``; a ``RuntimeError`` when torch.compile
    cannot build code here. ``None``: the same choice when it is available and (on CPU) the model
    holds at least :data:`AUTO_MIN_NUMEL` elements, else the unfused default. The environment
    variable ``LOWP_FUSED=0`` turns ``None`` into ``False``.
    """
    if fused not in (None, True, False):
        raise ValueError(f"fused: expected None, True or False, got {fused!r}")
    plain = "eager" if foreach is False else "foreach"
    if fused is False or (fused is None and os.environ.get("LOWP_FUSED") == "0"):
        return plain
    params = [p for g in optimizer.param_groups for p in g["params"]]
    on_cuda = any(p.is_cuda for p in params)
    if on_cuda and triton_available():
        return "triton"
    if fused is True:
        if not (on_cuda or compiler_available()):
            raise RuntimeError("fused=True: torch.compile cannot build CPU code here (no C++ compiler "
                               "on PATH); use fused=None or fused=False")
        return "compiled"
    big = on_cuda or sum(p.numel() for p in params) >= AUTO_MIN_NUMEL
    return "compiled" if big and (on_cuda or compiler_available()) and foreach is not False else plain
