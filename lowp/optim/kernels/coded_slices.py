"""Which slices with block-scaled states (:mod:`lowp.optim.codes`) a kernel may step with the
decode and encode inside it: the admission shared by the kernels that do (``steps_codes``: the
native C++ kernel on the CPU, the Triton kernel on CUDA).

The generic coded step (:mod:`lowp.optim.coded`) decodes a batch of pieces into fp32 buffers,
runs the kernel on them and encodes them back: three passes over memory. Such a kernel does it
in one: it decodes the codes into registers next to the optimizer's rule, keeps the new values of
each block until the block's scale is known, and encodes them, with the generic step's result
bit for bit.

A slice is admitted when the kernel would admit it with its coded states left out
(:func:`~lowp.optim.kernels.kernel.fusable`), its codes and scales are kernel memory
(:func:`~lowp.optim.kernels.checks.kernel_memory`) of the expected dtypes and sizes on the
weight's device, with one scale dtype, and the optimizer has no per-tensor reduction (whose
pre-pass reads the states); no two admitted tensors that a step writes may overlap.
"""
from __future__ import annotations

from typing import Sequence

import torch

from lowp.optim.codes import SCALE_DTYPES, Code, codes_shape, scales_shape
from lowp.optim.kernels.checks import Span, kernel_memory, overlapping
from lowp.optim.kernels.kernel import Kernel, fusable, partition
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec

__all__ = ["admitted", "without", "codes_of", "codes_fit", "check_coded_args"]


def codes_of(ctx: StepContext) -> dict[str, Code]:
    """The codes of a job's coded states, by state name."""
    return {c.name: c.code for c in ctx.coded}


def without(s: ParamSlice, codes: dict[str, Code]) -> ParamSlice:
    """``s`` without its coded states (what the kernel's admission checks)."""
    return ParamSlice(s.param, s.grad, {k: v for k, v in s.states.items() if k not in codes}, s.buffer, s.param_id,
                      s.index)


def codes_fit(s: ParamSlice, codes: dict[str, Code], block: int) -> bool:
    """Whether the codes and scales of ``s`` are kernel memory of the right dtypes and sizes on
    the weight's device, with one scale dtype."""
    n, scales = s.numel, s.scales
    if len({scales[name].dtype for name in codes if name in scales}) != 1:
        return False
    for name, code in codes.items():
        t, sc = s.states.get(name), scales.get(name)
        if t is None or sc is None or t.device != s.param.device or sc.device != s.param.device:
            return False
        if not (kernel_memory(t, (code.storage,)) and kernel_memory(sc, SCALE_DTYPES)):
            return False
        if t.numel() != codes_shape(code, torch.Size([n]))[0] or sc.numel() != scales_shape(n, block)[0]:
            return False
    return True


def check_coded_args(devices: tuple[str, ...], slices: Sequence[ParamSlice], codes: dict[str, Code],
                     block: int) -> None:
    """Raise ``RuntimeError`` unless every slice's codes and scales fit (:func:`codes_fit`) on one of
    the device types ``devices``, with one scale dtype over all ``slices``: a kernel's last check
    before it reads them (:func:`admitted` should have sent anything else elsewhere). Nothing to
    check without ``codes``."""
    if not codes:
        return
    if len({s.scales[name].dtype for s in slices for name in codes if name in s.scales}) != 1 or not all(
            s.param.device.type in devices and codes_fit(s, codes, block) for s in slices):
        raise RuntimeError("kernel call: the codes or scales of a coded state are not kernel memory of their dtypes "
                           "and sizes on the weight's device, with one scale dtype per call; the admission should "
                           "have sent them elsewhere")


def admitted(kernel: Kernel, spec: OptimizerSpec, ctx: StepContext, slices: Sequence[ParamSlice]
             ) -> tuple[list[ParamSlice], list[ParamSlice]]:
    """``(the slices ``kernel`` takes with their codes, the others)`` of a job with coded states
    (``ctx.coded``); none when the kernel has no form of the spec, the spec a per-tensor
    reduction, or when written memory overlaps."""
    if not kernel.supports(spec) or spec.tensor_numbers is not None:
        return [], list(slices)
    codes, block = codes_of(ctx), ctx.group["state_block"]
    expected = tuple(spec.states(ctx.group))
    spans: list[Span] = []

    def admit(s: ParamSlice) -> bool:
        # fusable first: its checks raise for inputs no backend can run, before anything is written
        ok = (fusable(ctx, without(s, codes), kernel.min_numel, kernel.fp16_stochastic, kernel.device_types(), spans)
              and tuple(s.states) == expected and codes_fit(s, codes, block))
        if ok:
            for t in (*(s.states[name] for name in codes), *(s.scales[name] for name in codes)):
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), True))
        return ok

    taken, rest = partition(list(slices), admit)
    if taken and overlapping(spans):
        return [], list(slices)
    return taken, rest
