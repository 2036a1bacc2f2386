"""Fused optimizer kernels, each run from an optimizer's spec (:mod:`lowp.optim.spec`) alone, one
sub-package per backend: ``native`` (C++ generated from the spec's rule, :mod:`.native`),
``compiled`` (the rule through :func:`torch.compile`, :mod:`.compiled`) and ``triton`` (a Triton
kernel generated from the rule, :mod:`.triton`; CUDA, or the Triton interpreter). What they share
is here: the interface (:mod:`.kernel`), the admission checks (:mod:`.checks`) and the slices with
block-scaled states (:mod:`.coded_slices`). :class:`lowp.optim.backends.FusedBackend` pairs a
kernel with a fallback backend.
"""
from __future__ import annotations

from lowp.optim.kernels.compiled.kernel import CompiledKernel, compiler_available
from lowp.optim.kernels.kernel import Kernel
from lowp.optim.kernels.native.build import native_available
from lowp.optim.kernels.native.kernel import NativeKernel
from lowp.optim.kernels.triton.kernel import TritonKernel, triton_available

__all__ = ["Kernel", "CompiledKernel", "NativeKernel", "TritonKernel", "compiler_available", "native_available",
           "triton_available"]
