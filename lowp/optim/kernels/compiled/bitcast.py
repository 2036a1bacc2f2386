"""A patch of Inductor's CPU code generator, applied only while lowp compiles its fused steps:
bitcasts between equally wide dtypes as one register reinterpretation of the whole vector.
Inductor itself scalarizes every bitcast (store, 16 scalar copies, load), which cost about 30%
of a fused AdamW step with stochastically rounded bf16 states (measured, docs/fused.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["vector_bitcasts"]


def _vector_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
    """Inductor CPU vector code for ``x.view(dtype)`` between equally wide dtypes: a copy of the
    whole vector's bytes into a vector of the target type (a register reinterpretation once
    compiled). Inductor itself scalarizes every bitcast (store, 16 scalar copies, load), which cost
    about 30% of a fused AdamW step with stochastically rounded bf16 states (measured,
    docs/fused.md). Not ``c10::bit_cast``: it asks for a trivially constructible target, which
    the AVX-512 vectors of torch 2.11 are not (their build failed)."""
    from torch._inductor.codegen.cpp import CppVecKernel
    from torch._inductor.virtualized import V

    kernel = V.kernel
    source = getattr(x, "dtype", None)
    if not isinstance(kernel, CppVecKernel) or source not in _BITCASTABLE or dtype not in _BITCASTABLE \
            or dtype.itemsize != source.itemsize:
        assert _SCALARIZED_BITCAST is not None  # set while the patch is active
        return _SCALARIZED_BITCAST(x, dtype, src_dtype)
    n = kernel._get_num_vectors(source)
    target = _vector_type(dtype, n)
    return f"[]({_vector_type(source, n)} v) {{ {target} r; __builtin_memcpy(&r, &v, sizeof(r)); return r; }}({x})"


def _vector_type(dtype: torch.dtype, n: int) -> str:
    """The C++ type of Inductor's CPU vector of ``n`` registers of ``dtype``."""
    from torch._inductor.codegen.cpp import DTYPE_TO_CPP
    return f"at::vec::Vectorized<{DTYPE_TO_CPP[dtype]}>" if n == 1 else \
        f"at::vec::VectorizedN<{DTYPE_TO_CPP[dtype]},{n}>"


_SCALARIZED_BITCAST: Callable[..., Any] | None = None
#: dtypes whose Inductor vectors are plain ``Vectorized``/``VectorizedN`` (not ``VecMask``).
_BITCASTABLE = (torch.float64, torch.int64, torch.float32, torch.int32, torch.bfloat16, torch.float16, torch.int16)


@contextlib.contextmanager
def vector_bitcasts() -> Iterator[None]:
    """While active, Inductor's CPU vector code generator emits whole-vector bitcasts
    (:func:`_vector_bitcast`); restored afterwards, so other compiles are unaffected. A no-op
    when this torch's Inductor is laid out differently."""
    global _SCALARIZED_BITCAST
    try:
        from torch._inductor.codegen.cpp import CppVecOverrides
        original = CppVecOverrides.__dict__["to_dtype_bitcast"]
    except (ImportError, KeyError):  # pragma: no cover - other Inductor versions
        yield
        return
    _SCALARIZED_BITCAST = original.__func__
    CppVecOverrides.to_dtype_bitcast = staticmethod(_vector_bitcast)  # type: ignore[method-assign]
    try:
        yield
    finally:
        CppVecOverrides.to_dtype_bitcast = original  # type: ignore[method-assign]
