"""The native step with block-scaled states decoded and encoded inside the kernel
(``native/coded_step.h``): the fast path of :func:`lowp.optim.coded.run_coded` for
``backend="native"``.

The generic coded step decodes a batch of pieces into fp32 buffers, runs the kernel on them and
encodes them back: three passes over memory and, per batch, a few C++ calls and their Python
around them. Here one kernel call per dtype signature does it all: the kernel decodes the codes
into registers next to the optimizer's rule, keeps the new values of each block in L1 until the
block's scale is known, and encodes them (one pass over the codes, as over a plain state). The
result is the generic step's, bit for bit (the module docstring of :mod:`lowp.optim.coded`).

A slice takes this path when the native kernel would admit it with its coded states left out
(:func:`~lowp.optim.kernels.kernel.fusable`), its codes and scales are CPU kernel memory of the
expected dtypes and sizes, and the optimizer has no per-tensor reduction (whose pre-pass reads
the states); anything else takes the generic step.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from lowp.optim.codes import SCALE_DTYPES, Code, codes_shape, scales_shape
from lowp.optim.kernels.checks import Span, check_kernel_args, kernel_memory, overlapping
from lowp.optim.kernels.cpp_source import CodedLayout, Variant
from lowp.optim.kernels.kernel import fusable, grad_factor, slice_keys
from lowp.optim.kernels.native import NativeKernel, call_step, slice_dtypes
from lowp.optim.kernels.native_codes import code_kind, fp8_table, grid_numbers, scale_code
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec

__all__ = ["CodedSlice", "admitted", "run"]

#: a slice with the block scales of its coded states, by state name
CodedSlice = tuple[ParamSlice, dict[str, torch.Tensor]]


def _without(s: ParamSlice, codes: dict[str, Code]) -> ParamSlice:
    """``s`` without its coded states (what the kernel's admission checks)."""
    return ParamSlice(s.param, s.grad, {k: v for k, v in s.states.items() if k not in codes}, s.buffer, s.param_id,
                      s.index)


def _codes_fit(s: ParamSlice, scales: dict[str, torch.Tensor], codes: dict[str, Code], block: int) -> bool:
    """Whether the codes and scales of ``s`` are CPU kernel memory of the right dtypes and sizes,
    with one scale dtype."""
    n = s.numel
    dtypes = {scales[name].dtype for name in codes if name in scales}
    if len(dtypes) != 1:
        return False
    for name, code in codes.items():
        t, sc = s.states.get(name), scales.get(name)
        if t is None or sc is None or not t.is_cpu:
            return False
        if not (kernel_memory(t, (code.storage,)) and kernel_memory(sc, SCALE_DTYPES)):
            return False
        if t.numel() != codes_shape(code, torch.Size([n]))[0] or sc.numel() != scales_shape(n, block)[0]:
            return False
    return True


def admitted(kernel: NativeKernel, spec: OptimizerSpec, ctx: StepContext, items: Sequence[CodedSlice],
             codes: dict[str, Code], block: int) -> tuple[list[CodedSlice], list[CodedSlice]]:
    """``(the slices this path takes, the others)``; none when the spec has no rule or a per-tensor
    reduction, or when written memory overlaps (``codes``: the coded states by name)."""
    if not kernel.supports(spec) or spec.tensor_numbers is not None:
        return [], list(items)
    expected = tuple(spec.states(ctx.group))
    spans: list[Span] = []
    taken: list[CodedSlice] = []
    rest: list[CodedSlice] = []
    for s, scales in items:
        # fusable first: its checks raise for inputs no backend can run, before anything is written
        ok = (fusable(ctx, _without(s, codes), kernel.min_numel, kernel.fp16_stochastic, kernel.device_types(), spans)
              and tuple(s.states) == expected and _codes_fit(s, scales, codes, block))
        if ok:
            for t in (*(s.states[name] for name in codes), *(scales[name] for name in codes)):
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), True))
        (taken if ok else rest).append((s, scales))
    if taken and overlapping(spans):
        return [], list(items)
    return taken, rest


def run(kernel: NativeKernel, spec: OptimizerSpec, ctx: StepContext, items: Sequence[CodedSlice],
        codes: dict[str, Code], block: int) -> int:
    """The step over ``items`` (all :func:`admitted`): one kernel call per dtype signature; returns
    the stalled count."""
    numbers = spec.numbers(ctx.group, ctx.step)
    stalled = 0
    groups: dict[tuple, list[CodedSlice]] = {}
    for s, scales in items:   # one kernel call per dtype signature (the scale dtype included)
        groups.setdefault((*slice_dtypes(s), scales[next(iter(codes))].dtype), []).append((s, scales))
    for signature, members in groups.items():
        stalled += _launch(spec, ctx, members, codes, block, numbers, signature[-1])
    kernel.fused_elements += sum(s.numel for s, _ in items)
    return stalled


def _launch(spec: OptimizerSpec, ctx: StepContext, members: list[CodedSlice], codes: dict[str, Code], block: int,
            numbers: dict[str, float], scale_dtype: torch.dtype) -> int:
    slices = [s for s, _ in members]
    names = list(spec.states(ctx.group))
    weight, grad, buffer, *states = slice_dtypes(slices[0])
    assert weight is not None and grad is not None
    dtypes = tuple(torch.float32 if name in codes else dtype for name, dtype in zip(names, states) if dtype is not None)
    assert len(dtypes) == len(names), "every state of an admitted slice is a tensor"
    layout = CodedLayout(tuple(code_kind(codes[name]) if name in codes else -1 for name in names),
                         scale_code(scale_dtype), block)
    variant = Variant(spec.program(ctx.group), None, ctx.mode.name, weight, grad, buffer,
                      dtypes, ctx.group["state_rounding"] == "stochastic",
                      ctx.count, layout)
    plain_names = [name for name in names if name not in codes]
    check_kernel_args([_without(s, codes) for s in slices], plain_names,
                      (weight, grad, buffer, *(d for name, d in zip(names, dtypes) if name not in codes)))
    for s, scales in members:
        if not _codes_fit(s, scales, codes, block):
            raise RuntimeError("kernel call: the codes or scales of a coded state are not CPU kernel memory of "
                               "their dtypes and sizes; the admission should have sent them elsewhere")
    n = len(members)
    scale_table = (ctypes.c_void_p * (len(names) * n))()
    for j, (_, scales) in enumerate(members):
        for k, name in enumerate(names):
            scale_table[k * n + j] = scales[name].data_ptr() if name in codes else None
    grids = (ctypes.c_double * (4 * len(names)))(*(x for name in names
                                                    for x in (grid_numbers(codes[name]) if name in codes
                                                              else (0.0, 0.0, 0.0, 0.0))))
    fp8 = [fp8_table(codes[name].storage) if name in codes and codes[name].storage.is_floating_point else None
           for name in names]
    tables = (ctypes.c_void_p * len(names))(*(t.data_ptr() if t is not None else None for t in fp8))
    return call_step(spec, variant, slices, numbers, [k for s in slices for k in slice_keys(ctx, s)], grad_factor(ctx),
                     (scale_table, grids, tables))
