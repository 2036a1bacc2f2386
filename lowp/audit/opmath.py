"""Opmath: compute in fp32, store in the low format, round once.

PaddlePaddle's low-precision operator guide (fp16/bf16) asks every fp16/bf16 kernel to load its inputs,
convert them to a wider *math type* (``MPTypeTrait<T>::Type``, fp32 for fp16 and bf16), do all
arithmetic and accumulation there, and convert the result back once. PyTorch's kernels do the
same with ``at::opmath_type``. Here that rule is available to any Python function:

* :func:`opmath_dtype` gives the compute dtype for a storage dtype or a lowp format.
* :func:`opmath` (decorator) runs a whole function in the compute dtype and rounds each
  floating-point output once to the storage format: one rounding per *function*.
* :func:`opmath_ops` (context manager) intercepts every torch call made inside it and runs each
  on upcast inputs, rounding each result once: one rounding per *op*, like framework kernels.

For a storage format that has no torch dtype (fp8 variants without one, DLFloat16, fp6 ...)
values live in an fp32 container; pass ``format=`` and outputs are rounded with
:func:`lowp.rounding.quantize`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lowp.formats import FloatFormat, get_format
from lowp.rounding import container_for, quantize

__all__ = ["opmath_dtype", "opmath", "opmath_ops", "LOW_PRECISION_DTYPES"]

F = TypeVar("F", bound=Callable[..., Any])

LOW_PRECISION_DTYPES: frozenset[torch.dtype] = frozenset(
    d for d in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
                getattr(torch, "float8_e5m2fnuz", None)) if d is not None)


def opmath_dtype(dtype: "torch.dtype | str | FloatFormat") -> torch.dtype:
    """The dtype to compute in for values stored as ``dtype``.

    fp16, bf16 and fp8 dtypes -> ``torch.float32``; fp32, fp64 and non-float dtypes are returned
    unchanged. A lowp format (or its name) maps to the narrowest of fp32/fp64 that holds it
    exactly: ``"dlfloat16"``, ``"fp8_e4m3fn"``, ``"tf32"`` -> fp32, ``"fp64"`` -> fp64.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in LOW_PRECISION_DTYPES:
            return torch.float32
        return dtype
    if not isinstance(dtype, (str, FloatFormat)):
        raise TypeError(f"dtype: expected a torch.dtype, a format name or a FloatFormat, got {type(dtype).__name__}")
    return container_for(get_format(dtype))


class _Storage:
    """How to bring a compute-dtype result back to storage: a torch cast or a lowp rounding."""

    def __init__(self, dtype: torch.dtype | None, fmt: FloatFormat | None) -> None:
        self.dtype = dtype
        self.fmt = fmt

    def store(self, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return value
        if self.fmt is not None:
            return quantize(value, self.fmt)
        if self.dtype is not None and value.dtype != self.dtype:
            return value.to(self.dtype)
        return value


def _low_dtypes(args: Any) -> set[torch.dtype]:
    found: set[torch.dtype] = set()

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            found.add(x.dtype)
        return x

    tree_map(visit, args)
    return found


def _upcast(args: Any, compute: torch.dtype) -> Any:
    return tree_map(lambda x: x.to(compute) if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION_DTYPES else x,
                    args)


def _storage_for(floats: set[torch.dtype], format: FloatFormat | None) -> _Storage | None:
    """Storage of the result: the one low dtype when every float input has it, else none (mixed
    precision promotes to the wider dtype natively, so nothing is rounded back)."""
    if format is not None:
        return _Storage(None, format)
    if len(floats) == 1 and next(iter(floats)) in LOW_PRECISION_DTYPES:
        return _Storage(next(iter(floats)), None)
    return None


def opmath(fn: F | None = None, *, format: "str | FloatFormat | None" = None) -> Any:
    """Decorator: run ``fn`` with low-precision tensor arguments upcast to fp32, round its outputs once.

    Every fp16/bf16/fp8 tensor among the (nested) arguments becomes fp32; the floating-point
    tensors ``fn`` returns are cast back to that storage dtype (one rounding at the end, so
    intermediates such as ``exp(x)`` in a softmax or a long running sum never see fp16). With
    ``format=`` the inputs are taken as fp32 containers holding that format and the outputs are
    rounded to it with :func:`~lowp.rounding.quantize` (for formats without a torch dtype).

    Example::

        @opmath
        def softmax(x):
            e = torch.exp(x - x.amax(-1, keepdim=True))
            return e / e.sum(-1, keepdim=True)
    """
    fmt = None if format is None else get_format(format)

    def wrap(f: F) -> F:
        if not callable(f):
            raise TypeError(f"fn: expected a callable, got {type(f).__name__}")

        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            storage = _storage_for(_low_dtypes((args, kwargs)), fmt)
            out = f(*_upcast(args, torch.float32), **_upcast(kwargs, torch.float32))
            return out if storage is None else tree_map(storage.store, out)

        return run  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


# Calls that move, view, convert or inspect data: they must see the tensors as they are.
_PASS_THROUGH = {"to", "type", "half", "bfloat16", "float", "double", "copy_", "__getitem__", "__setitem__",
                 "view", "reshape", "clone", "detach", "contiguous", "size", "dim", "numel", "item", "tolist",
                 "__repr__", "__format__", "__bool__", "__len__", "__iter__", "numpy", "data_ptr", "element_size",
                 "stride", "storage_offset", "is_floating_point", "requires_grad_", "backward", "__get__", "__set__",
                 "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "empty_like", "zeros_like",
                 "ones_like", "full_like", "fill_", "zero_"}


_IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                     "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def _passes_through(name: str) -> bool:
    """Data movement, conversion, inspection and in-place ops (``add_``, ``__iadd__``) run unchanged."""
    in_place = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS
    return in_place or name in _PASS_THROUGH


class _OpmathMode(TorchFunctionMode):
    def __init__(self, format: FloatFormat | None) -> None:
        super().__init__()
        self.format = format

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _passes_through(name):
            return func(*args, **kwargs)
        floats = _low_dtypes((args, kwargs))
        storage = _storage_for(floats, self.format) if floats else None
        if storage is None:
            return func(*args, **kwargs)
        out = func(*_upcast(args, torch.float32), **_upcast(kwargs, torch.float32))
        return tree_map(storage.store, out)


@contextmanager
def opmath_ops(format: "str | FloatFormat | None" = None) -> Iterator[None]:
    """Context manager: every torch op inside runs on fp32 copies of its low-precision inputs and
    its floating-point result is rounded once back to the inputs' storage dtype (or to ``format``).

    This is the per-kernel opmath of Paddle's ``MPTypeTrait``: ``torch.exp(x_fp16)`` returns fp16,
    computed as ``exp(float(x))`` rounded once; ``x_fp16.sum()`` accumulates in fp32. Ops whose float
    inputs mix dtypes run natively (they already promote). In-place ops and data movement
    (``.to``, indexing, views, ``copy_``) pass through unchanged.
    """
    fmt = None if format is None else get_format(format)
    with _OpmathMode(fmt):
        yield
