"""``backend="compiled"``: the fused step of :mod:`lowp.optim.kernels.step` through
:func:`torch.compile` (Inductor), one call per chunk of :data:`CHUNK` elements.

Two compiled functions exist per (rule, mode, structural config, state roundings, count): a
static-shape one for whole chunks and a dynamic-shape one for the remainders, so every parameter
size shares two graphs per dtype signature, and the step's numbers travel in a tensor, so LR schedules and step counts never recompile. Inductor
emits one vectorised, OpenMP-parallel C++ loop on CPU (Triton on CUDA) that reads the weight,
gradient, states and buffer once and writes them once.

Cases without a fused form run the optimizer's reference pipeline
(:meth:`~lowp.optim.base.LowpOptimizer.apply_batch`, batched like the ``foreach`` backend):
optimizers without an elementwise rule, fp64 weights, fp16 tensors with stochastic rounding (fp16
weights in stochastic or kahan mode, fp16 states rounded stochastically), non-contiguous tensors,
tensors of fewer than two elements, slices whose elements are not one contiguous range of their
parameter (a shard along a later dimension), and whatever the admission checks of
:mod:`~lowp.optim.kernels.checks` keep from the kernels (they raise for inputs no backend can run).
"""
from __future__ import annotations

import contextlib
import functools
import shutil
from typing import Any, Callable, Iterator

import torch

from lowp.optim.backends import ForeachBackend, ParamSlice, StepContext
from lowp.optim.kernels.checks import PLAIN_TYPES, Span, check_slice, overlapping
from lowp.optim.kernels.rules import Rule, rule_for
from lowp.optim.kernels.step import STREAMS, chunk_keys, fused_step
from lowp.optim.randomness import stream_keys

__all__ = ["CompiledBackend", "compiler_available", "fusable", "partition", "step_numbers", "step_values", "slice_keys",
           "grad_factor", "by_signature"]


@functools.lru_cache(maxsize=None)
def compiler_available() -> bool:
    """True when torch.compile can build CPU code here (Inductor imports and a C++ compiler is on PATH)."""
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # pragma: no cover - broken installs
        return False
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def fusable(ctx: StepContext, s: ParamSlice, stochastic_states: bool, min_numel: int = 2,
            fp16_stochastic: bool = False, devices: tuple[str, ...] = ("cpu", "cuda"),
            spans: list[Span] | None = None) -> bool:
    """Whether slice ``s`` can take the fused step: the admission checks of
    :func:`~lowp.optim.kernels.checks.check_slice` (which raise for inputs no backend can run,
    before anything is written), kernel memory on one of ``devices`` for the weight, states and
    buffer (a gradient may be strided: the backends copy it), elements that are one contiguous
    range of their parameter (the random streams count along it), and the dtypes the kernels
    support. The default ``min_numel`` is torch.compile's: dynamo specializes sizes 0 and 1, so
    one-element tensors would compile twice more; ``fp16_stochastic``: the backend rounds fp16
    stochastically too (the weight in stochastic mode, the compensation in kahan mode,
    stochastically rounded states); ``spans`` collects the byte ranges of the slice's tensors
    (:func:`~lowp.optim.kernels.checks.overlapping`)."""
    floats = _KERNEL_FLOATS
    weights, _, buffer = check_slice(ctx, s, floats, (torch.int16,) if ctx.mode.name == "exact" else floats, spans)
    param, grad = s.param, s.grad
    device = "cpu" if param.is_cpu else param.device.type
    if not (weights and buffer) or param.numel() < min_numel or device not in devices or not s.index.contiguous:
        return False
    if type(grad) not in PLAIN_TYPES or grad.is_neg() or grad.dtype not in floats:
        return False
    if ctx.mode.name in ("stochastic", "kahan") and param.dtype not in (_LOW16 if fp16_stochastic else (torch.bfloat16,)):
        return False
    return fp16_stochastic or not (stochastic_states and any(t.dtype == torch.float16 for t in s.states.values()))


_LOW16 = (torch.bfloat16, torch.float16)
_KERNEL_FLOATS = (torch.float32, *_LOW16)


def partition(slices: list[ParamSlice], keep: Callable[[ParamSlice], bool]) -> tuple[list[ParamSlice], list[ParamSlice]]:
    """``(slices where keep, the others)``, each in the original order, in one pass."""
    kept: list[ParamSlice] = []
    others: list[ParamSlice] = []
    for s in slices:
        (kept if keep(s) else others).append(s)
    return kept, others


def grad_factor(ctx: StepContext) -> float:
    """What the gradient is multiplied by: -1 for ``maximize``, times the GradScaler's 1/scale."""
    return (-1.0 if ctx.group["maximize"] else 1.0) * (1.0 if ctx.inv_scale is None else ctx.inv_scale)


def step_values(rule: Rule, ctx: StepContext) -> list[float]:
    """The gradient factor followed by the rule's numbers (float64, computed on the host)."""
    return [grad_factor(ctx), *rule.hyper(ctx.group, ctx.step)]


def step_numbers(rule: Rule, ctx: StepContext, device: torch.device) -> torch.Tensor:
    """``h``: :func:`step_values` as one small fp32 tensor."""
    return torch.tensor(step_values(rule, ctx), dtype=torch.float32, device=device)


def slice_keys(ctx: StepContext, s: ParamSlice) -> list[int]:
    """The stream keys of slice ``s`` at this step, at the kernels' fixed places: ``Stream.WEIGHT``,
    ``Stream.COMPENSATION`` and three states (:func:`lowp.optim.randomness.stream_key`)."""
    return stream_keys(ctx.seed, ctx.step, s.param_id, STREAMS)


def by_signature(slices: list[ParamSlice], signature: Callable[[ParamSlice], tuple]
                 ) -> dict[tuple, list[ParamSlice]]:
    """The slices grouped by ``signature`` (one kernel launch each), in their order."""
    groups: dict[tuple, list[ParamSlice]] = {}
    for s in slices:
        groups.setdefault(signature(s), []).append(s)
    return groups


#: Elements per call of the static-shape kernel. Inductor's code for dynamic shapes is tuned for
#: the size of the first call it sees (measured 4x slower on 8M elements after a first call on
#: 1000), so whole chunks go through a static-shape compile (one graph for every offset) and only
#: the remainders (< CHUNK) through the dynamic one. 2**21 elements keep the per-call overhead
#: (about 50 us of guards and wrappers, measured) near 1% of a call's memory traffic.
CHUNK = 1 << 21

def _vector_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
    """Inductor CPU vector code for ``x.view(dtype)`` between equally wide dtypes: one
    ``c10::bit_cast`` of the whole vector (a register reinterpretation). Inductor itself scalarizes
    every bitcast (store, 16 scalar copies, load), which cost about 30% of a fused AdamW step with
    stochastically rounded bf16 states (measured, docs/fused.md)."""
    from torch._inductor.codegen.cpp import DTYPE_TO_CPP, CppVecKernel
    from torch._inductor.virtualized import V

    kernel = V.kernel
    source = getattr(x, "dtype", None)
    if not isinstance(kernel, CppVecKernel) or source not in _BITCASTABLE or dtype not in _BITCASTABLE \
            or dtype.itemsize != source.itemsize:
        return _SCALARIZED_BITCAST(x, dtype, src_dtype)
    n = kernel._get_num_vectors(source)
    target = f"at::vec::Vectorized<{DTYPE_TO_CPP[dtype]}>" if n == 1 else \
        f"at::vec::VectorizedN<{DTYPE_TO_CPP[dtype]},{n}>"
    return f"c10::bit_cast<{target}>({x})"


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
    CppVecOverrides.to_dtype_bitcast = staticmethod(_vector_bitcast)
    try:
        yield
    finally:
        CppVecOverrides.to_dtype_bitcast = original


#: Compiled variants by (rule, mode, config, state roundings, count, dynamic).
_FUNCTIONS: dict[tuple, Callable[..., Any]] = {}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D alias of contiguous ``t`` that is not a view (``detach``), so dynamo guards on its
    length only, not on the shape of the parameter behind it (which would recompile per rank)."""
    return t.view(-1).detach()


class CompiledBackend(ForeachBackend):
    """Fused optimizer steps compiled by :func:`torch.compile`; see the module docstring.

    Two counters say where the elements of every step went (plain Python ints, added to on the
    host, no device sync): ``fused_elements``, the elements a kernel of this backend updated,
    and ``reference_elements``, those that took the reference pipeline instead. Both sum over
    slices and steps (an element updated in 8 steps counts 8 times); assign 0 to restart them."""

    name = "compiled"

    def __init__(self, chunk_size: int = 1 << 17) -> None:
        super().__init__(chunk_size)
        self.fused_elements = 0
        self.reference_elements = 0

    def function(self, rule: Rule, mode: str, cfg: tuple, stochastic: tuple[bool, ...], count: bool,
                 dynamic: bool):
        """The compiled step for one variant (compiled lazily on first call, then cached for the
        whole process, so new optimizers reuse it); ``dynamic=False`` is the static-shape version
        for chunks of exactly :data:`CHUNK` elements."""
        key = (rule.name, mode, cfg, stochastic, count, dynamic)
        if key not in _FUNCTIONS:
            def variant(p, g, buf, states, h, keys):
                return fused_step(rule, mode, cfg, stochastic, count, p, g, buf, states, h, keys)

            # A fresh code object per variant: dynamo keeps one cache per code object, limited to
            # 8 entries (recompile_limit), which 28 optimizer x mode variants would overflow.
            variant.__code__ = variant.__code__.replace()
            # cpp.dynamic_threads: with dynamic shapes Inductor sizes its OpenMP split from the
            # first call's size and runs serially when that was small; this keeps a parallel loop.
            # emulate_precision_casts keeps the bf16 rounding of ``(w + v).to(bf16).float()`` that
            # Inductor otherwise elides; Kahan's ``theta' - theta`` needs it.
            _FUNCTIONS[key] = torch.compile(variant, dynamic=dynamic, fullgraph=True,
                                            options={"emulate_precision_casts": True, "cpp.dynamic_threads": True})
        return _FUNCTIONS[key]

    #: the smallest tensor this backend fuses, and whether it rounds fp16 stochastically (see :func:`fusable`)
    min_numel = 2
    fp16_stochastic = False

    def fuses(self, rule: Rule | None) -> bool:
        """Whether this backend has a fused form of ``rule`` (the tensor math, for torch.compile)."""
        return rule is not None and rule.fn is not None

    #: device types whose memory the kernels of this backend address
    devices: tuple[str, ...] = ("cpu", "cuda")

    def admits(self, optimizer, rule: Rule | None, ctx: StepContext, s: ParamSlice, spans: list[Span]) -> bool:
        """Whether slice ``s`` takes the fused step (:func:`fusable` with this backend's limits;
        ``spans`` collects its byte ranges); ``ValueError`` when ``s`` lacks a state the
        optimizer reads, or has one it does not."""
        if not self.fuses(rule):
            return False
        expected = optimizer.state_names(ctx.group, s.param)
        if tuple(s.states) != tuple(expected):
            raise ValueError(f"states: {type(optimizer).__name__} reads the states {list(expected)} of this "
                             f"parameter, the slice has {list(s.states)}")
        return fusable(ctx, s, ctx.group["state_rounding"] == "stochastic", self.min_numel, self.fp16_stochastic,
                       self.devices, spans)

    def run(self, optimizer, ctx, slices):
        rule = rule_for(optimizer)
        spans: list[Span] = []
        fused, rest = partition(slices, lambda s: self.admits(optimizer, rule, ctx, s, spans))
        if fused and overlapping(spans):  # written memory shared: every slice in the reference's order
            fused, rest = [], slices
        counts = [self.run_reference(optimizer, ctx, rest)] if rest else []
        if fused:
            counts.append(self.run_fused(rule, ctx, fused))
        counts = [c for c in counts if c is not None]
        return torch.stack(counts).sum() if counts else None

    def run_reference(self, optimizer, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """The reference pipeline (batched as on ``foreach``) over ``slices``, counted in
        ``reference_elements``; returns the stalled count."""
        stalled = ForeachBackend.run(self, optimizer, ctx, slices)
        self.reference_elements += sum(s.numel for s in slices)
        return stalled

    def run_fused(self, rule: Rule, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """The compiled step over ``slices`` (admitted by :meth:`admits`), counted in
        ``fused_elements``; returns the stalled count."""
        device = slices[0].param.device
        names = list(slices[0].states)
        stochastic = tuple(ctx.group["state_rounding"] == "stochastic" for _ in names)
        h = step_numbers(rule, ctx, device)
        variant = (rule, ctx.mode.name, rule.config(ctx.group), stochastic, ctx.count)
        counts = []
        with vector_bitcasts():  # takes effect when a call compiles
            for s in slices:
                tensors = [_flat(t) for t in (s.param, s.grad.reshape(-1), *(s.states[n] for n in names))]
                buf = _flat(s.buffer) if s.buffer is not None else None
                keys, first = slice_keys(ctx, s), s.index.first()
                for start in range(0, s.numel, CHUNK):
                    end = min(start + CHUNK, s.numel)
                    fn = self.function(*variant, dynamic=end - start != CHUNK)
                    part = [t[start:end].detach() for t in tensors]
                    counts.append(fn(part[0], part[1], None if buf is None else buf[start:end].detach(), part[2:],
                                     h, chunk_keys(keys, first + start, end - start, device)))
        self.fused_elements += sum(s.numel for s in slices)
        return torch.stack(counts).sum(dtype=torch.int64) if ctx.count else None
