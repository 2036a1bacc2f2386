"""Fused optimizer steps: every elementwise lowp optimizer in every write-back mode
from one shared mechanism, :mod:`rules` (the math, once per optimizer) x :mod:`step` (load, state
stores, write-back, once per mode), run by a backend: ``compiled`` (:func:`torch.compile`, CPU or
CUDA) or ``triton`` (hand-written multi-tensor Triton kernel for Adam/AdamW, CUDA or the Triton
interpreter). :func:`choose_backend` implements the optimizers' ``fused=`` option.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from lowp.optim.backends import register_backend
from lowp.optim.kernels.compiled import CompiledBackend, compiler_available
from lowp.optim.kernels.native_backend import NativeBackend
from lowp.optim.kernels.native_build import native_available
from lowp.optim.kernels.triton_backend import TritonBackend, triton_available

__all__ = ["CompiledBackend", "NativeBackend", "TritonBackend", "choose_backend", "backend_for", "compiler_available",
           "native_available", "triton_available", "AUTO_MIN_NUMEL", "AUTO_MIN_NUMEL_NATIVE"]

register_backend("compiled", CompiledBackend)
register_backend("native", NativeBackend)
register_backend("triton", TritonBackend)

#: ``fused=None`` uses torch.compile on CPU only from this many parameter elements on: the first
#: step then costs 10-40 s of compilation (measured, docs/fused.md), which small models never win back.
AUTO_MIN_NUMEL = 1 << 22
#: ``fused=None`` uses the native kernel from this many elements on: a variant compiles once per
#: machine in about 1 s (then loads from the on-disk cache), and a call costs tens of microseconds.
AUTO_MIN_NUMEL_NATIVE = 1 << 16


def choose_backend(optimizer: Any, fused: bool | None, foreach: bool | None) -> str:
    """The backend name for the optimizers' ``fused`` option (see :func:`backend_for`)."""
    return backend_for([p for g in optimizer.param_groups for p in g["params"]], fused, foreach)


def backend_for(params: list[torch.Tensor], fused: bool | None, foreach: bool | None) -> str:
    """The backend name that ``fused`` / ``foreach`` select for an optimizer over ``params``.

    ``False``: ``foreach`` (``eager`` when ``foreach=False``). ``True``: ``triton`` for CUDA
    parameters when Triton imports; on CPU ``native`` where it builds (x86-64 with AVX2), else
    ``compiled``; a ``RuntimeError`` when neither can build code here. ``None``: the same choice
    when the model holds at least :data:`AUTO_MIN_NUMEL_NATIVE` (native) or :data:`AUTO_MIN_NUMEL`
    (compiled) elements, else the unfused default. The environment variable ``LOWP_FUSED=0``
    turns ``None`` into ``False``.
    """
    if fused not in (None, True, False):
        raise ValueError(f"fused: expected None, True or False, got {fused!r}")
    plain = "eager" if foreach is False else "foreach"
    if fused is False or (fused is None and os.environ.get("LOWP_FUSED") == "0"):
        return plain
    on_cuda = any(p.is_cuda for p in params)
    if on_cuda and triton_available():
        return "triton"
    if fused is True:
        native = not on_cuda and native_available()
        if not (on_cuda or native or compiler_available()):
            raise RuntimeError("fused=True: no fused CPU backend can build code here (no C++ compiler "
                               "on PATH); use fused=None or fused=False")
        return "native" if native else "compiled"
    if foreach is False:
        return plain
    numel = sum(p.numel() for p in params)
    # native_available() builds a test kernel the first time (about 2 s): only asked when it matters
    if not on_cuda and numel >= AUTO_MIN_NUMEL_NATIVE and native_available():
        return "native"
    return "compiled" if on_cuda or (numel >= AUTO_MIN_NUMEL and compiler_available()) else plain
