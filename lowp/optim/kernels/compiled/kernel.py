"""The ``torch.compile`` kernel (``backend="compiled"``): the fused step of
:mod:`lowp.optim.kernels.compiled.step` through Inductor, one call per chunk of :data:`CHUNK` elements.

Two compiled functions exist per (spec variant, mode, state roundings, count): a static-shape one
for whole chunks and a dynamic-shape one for the remainders, so every parameter size shares two
graphs per dtype signature, and the step's numbers travel in a tensor, so LR schedules and step
counts never recompile. Inductor emits one vectorised, OpenMP-parallel C++ loop on CPU (Triton on
CUDA) that reads the weight, gradient, states and buffer once and writes them once.

A call can fail after the calls before it wrote: the first call of a function with a signature
(device, dtypes, a size of 0, 1 or more) compiles. The chunks of a parameter any of whose calls
has a signature not called before in this process are copied first and put back should one of
its calls fail, and a parameter counts the step once its last chunk is written
(:mod:`lowp.optim.journal`). The others are not copied: their calls allocate a few bytes (the
stalled count), and the copies would add half again to the step's memory traffic. (A recompile
of a signature already called, after ``torch.compiler.reset()`` or a dtype guard of torch's own,
is not foreseen.)

It fuses every spec with an elementwise rule; the backend runs the reference for the rest
(:func:`~lowp.optim.kernels.kernel.fusable`: fp64 weights, fp16 tensors with stochastic rounding,
non-contiguous tensors, tensors of fewer than two elements, shards along a later dimension).
"""
from __future__ import annotations

import functools
import shutil
from typing import Any, Callable

import torch

from lowp.optim.kernels.compiled.bitcast import vector_bitcasts
from lowp.optim.kernels.kernel import Kernel, slice_keys, step_numbers
from lowp.optim.kernels.compiled.step import chunk_keys, fused_step
from lowp.optim.journal import Journal
from lowp.optim.rule import Program
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec
from lowp.optim.stalled import Stalled, total

__all__ = ["CompiledKernel", "compiler_available", "CHUNK"]


@functools.lru_cache(maxsize=None)
def compiler_available() -> bool:
    """True when torch.compile can build CPU code here (Inductor imports and a C++ compiler is on PATH)."""
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # pragma: no cover - broken installs
        return False
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


#: Elements per call of the static-shape kernel. Inductor's code for dynamic shapes is tuned for
#: the size of the first call it sees (measured 4x slower on 8M elements after a first call on
#: 1000), so whole chunks go through a static-shape compile (one graph for every offset) and only
#: the remainders (< CHUNK) through the dynamic one. 2**21 elements keep the per-call overhead
#: (about 50 us of guards and wrappers, measured) near 1% of a call's memory traffic.
CHUNK = 1 << 21
#: the (function, size of 0, 1 or 2 for more, device, dtypes) signatures called in this process: compiled
_CALLED: set[tuple[Any, ...]] = set()

#: Compiled variants by (program, mode, state roundings, count, dynamic).
_FUNCTIONS: dict[tuple, Callable[..., Any]] = {}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D alias of contiguous ``t`` that is not a view (``detach``), so dynamo guards on its
    length only, not on the shape of the parameter behind it (which would recompile per rank)."""
    return t.view(-1).detach()


def _function(program: Program, mode: str, stochastic: tuple[bool, ...], count: bool,
              dynamic: bool) -> Callable[..., Any]:
    """The compiled step for one variant (compiled lazily on first call, then cached for the whole
    process, so new optimizers reuse it); ``dynamic=False`` is the static-shape version for chunks
    of exactly :data:`CHUNK` elements."""
    key = (program, mode, stochastic, count, dynamic)
    if key not in _FUNCTIONS:
        def variant(p, g, buf, states, h, keys):
            return fused_step(program, mode, stochastic, count, p, g, buf, states, h, keys)

        # A fresh code object per variant: dynamo keeps one cache per code object, limited to
        # 8 entries (recompile_limit), which the optimizer x mode variants would overflow.
        variant.__code__ = variant.__code__.replace()
        # cpp.dynamic_threads: with dynamic shapes Inductor sizes its OpenMP split from the
        # first call's size and runs serially when that was small; this keeps a parallel loop.
        # emulate_precision_casts keeps the roundings of ``x.to(dtype).float()`` that Inductor
        # otherwise elides (from torch 2.13 on CPU; the bf16 weight's rounding, which Kahan's
        # ``theta' - theta`` needs, is written in integers anyway: step.nearest).
        _FUNCTIONS[key] = torch.compile(variant, dynamic=dynamic, fullgraph=True,
                                        options={"emulate_precision_casts": True, "cpp.dynamic_threads": True})
    return _FUNCTIONS[key]


class CompiledKernel(Kernel):
    """Fused steps compiled by :func:`torch.compile`; see the module docstring."""

    name = "compiled"

    def run(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """Every slice through the compiled step, chunk by chunk."""
        device = slices[0].param.device
        names = list(slices[0].states)
        program = spec.program(ctx.group)
        stochastic = tuple(ctx.group["state_rounding"] == "stochastic" for _ in names)
        h = step_numbers(spec, program, ctx, device)
        counts = []
        journal = Journal((s.param_id for s in slices for _ in range(0, s.numel, CHUNK)), ctx.stepped)
        try:
            with vector_bitcasts():  # takes effect when a call compiles
                for s in slices:
                    tensors = [_flat(t) for t in (s.param, s.grad.reshape(-1), *(s.states[n] for n in names))]
                    buf = _flat(s.buffer) if s.buffer is not None else None
                    keys, first = slice_keys(ctx, s), s.index.first()
                    dtypes = (*(t.dtype for t in tensors), buf.dtype if buf is not None else None)
                    chunks = [(start, min(start + CHUNK, s.numel)) for start in range(0, s.numel, CHUNK)]
                    signatures = [(_function(program, ctx.mode.name, stochastic, ctx.count, dynamic=b - a != CHUNK),
                                   min(b - a, 2), device, dtypes) for a, b in chunks]   # sizes 0, 1: specialised
                    compiles = not _CALLED.issuperset(signatures)   # a call of this parameter compiles
                    for (start, end), signature in zip(chunks, signatures):
                        fn = signature[0]
                        part = [t[start:end].detach() for t in tensors]
                        if compiles:   # should a call fail, the parameter's chunks written before it go back
                            journal.save([(s.param_id, [part[0], *part[2:],
                                                        *([buf[start:end]] if buf is not None else [])])])
                        counts.append(fn(part[0], part[1], None if buf is None else buf[start:end].detach(), part[2:],
                                         h, chunk_keys(keys, first + start, end - start, device)))
                        _CALLED.add(signature)
                        journal.written([s.param_id])
        except BaseException:
            journal.restore()
            raise
        self.fused_elements += sum(s.numel for s in slices)
        return total(counts) if ctx.count else None
