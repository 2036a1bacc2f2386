"""Backends: how one optimizer step is executed over the parameters of a group, and which
backend the optimizers' ``fused=`` option picks.

The optimizer (``update``) says *what* the new weights are, a :mod:`write-back mode
<lowp.optim.writeback>` says *how they are stored*; a backend decides *how the work is run*:
which tensors go together into one batch and which code executes the batch.

Every backend receives :class:`ParamSlice` objects (one parameter with its gradient, states and
mode buffer) that share a :class:`StepContext` (group, mode, step number, ...), and returns the
number of stalled elements. The reference pipeline for one batch is
:meth:`lowp.optim.base.LowpOptimizer.apply_batch`; ``eager`` and ``foreach`` call it, and a
:class:`FusedBackend` pairs a fused kernel (:mod:`lowp.optim.kernels`: ``native`` C++,
``compiled`` through torch.compile, ``triton``) with a fallback backend for what the kernel does
not admit. Kernels read the optimizer's spec (:mod:`lowp.optim.spec`) only.

Temporaries are bounded by design: elementwise optimizers see parameters cut into flat chunks
of at most ``chunk_size`` elements, so a step allocates a few fp32 copies of one chunk, never of
the whole model, and the batches of one backend call reuse them (:mod:`lowp.optim.scratch`).
The reference pipeline keeps each parameter whole should a batch fail part-way
(:func:`run_batches`, :mod:`lowp.optim.journal`): a copy of what each batch writes, and of a
parameter cut over several batches until its last one.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import replace
from functools import partial
from typing import Callable, ClassVar, Iterator, Protocol

import torch

from lowp.optim.kernels import CompiledKernel, Kernel, NativeKernel, TritonKernel, compiler_available, \
    native_available, triton_available
from lowp.optim.kernels import coded_slices
from lowp.optim.kernels.checks import Span, overlapping
from lowp.optim.kernels.kernel import fusable_dtypes, partition
from lowp.optim.coded import load_codec, run_coded
from lowp.optim.journal import Journal
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec
from lowp.optim.stalled import Stalled, added, total


__all__ = ["Backend", "EagerBackend", "ForeachBackend", "FusedBackend", "register_backend", "get_backend",
           "BACKENDS", "backend_for", "AUTO_MIN_NUMEL", "AUTO_MIN_NUMEL_NATIVE", "DEFAULT_CHUNK_SIZE",
           "DEFAULT_CUDA_CHUNK_SIZE", "default_chunk_size", "run_batches", "written"]

#: Elements per chunk (and per ``foreach`` batch) of the reference pipeline. Each torch op costs
#: a few microseconds of dispatch and thread wake-up besides its work: on 2 cores an AdamW step
#: with Kahan compensation and bf16 states over 8M parameters took 66 ms in chunks of 2**17,
#: 56 ms in chunks of 2**18 and 59 ms in chunks of 2**19 (states rounded to nearest; one thread:
#: equal at 2**17 and 2**18). The temporaries are about 11 fp32 copies of one chunk (11 MiB).
DEFAULT_CHUNK_SIZE = 1 << 18
#: The same on a GPU, where each op is a kernel launch of 5-10 microseconds: on an H100 that step
#: over 64M parameters took 277 ms in chunks of 2**18, 117 ms at 2**20, 31 ms at 2**22 and 17 ms
#: at 2**24 (torch 2.11); at 2**22 the temporaries are about 180 MiB.
DEFAULT_CUDA_CHUNK_SIZE = 1 << 22
#: Gradient dtypes whose finite check sums first (fp16's range would make large sums overflow).
_SUMMED = (torch.bfloat16, torch.float32, torch.float64)


def default_chunk_size(device: torch.device) -> int:
    """The chunk size a backend built with ``chunk_size=None`` uses for tensors on ``device``."""
    return DEFAULT_CUDA_CHUNK_SIZE if device.type == "cuda" else DEFAULT_CHUNK_SIZE


class LowpOptimizer(Protocol):
    """What a backend reads of the optimizer it runs (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    elementwise: bool

    def apply_batch(self, ctx: StepContext, batch: list[ParamSlice]) -> Stalled:
        """The reference pipeline for one batch; returns the stalled count."""

    def kernel_spec(self) -> OptimizerSpec | None:
        """The spec the kernels may run (``None``: the reference only)."""


class Backend(ABC):
    """Runs one step over a list of slices. Subclasses set ``name`` and implement ``run`` (plain
    states); the optimizer calls :meth:`step`, the one entry for every job.

    Args:
        chunk_size: the most elements of one chunk of a parameter of an elementwise optimizer,
            which bounds a step's fp32 temporaries; a positive int, else ``ValueError``; default
            ``None``: :func:`default_chunk_size` of the parameters' device.
    """

    name: ClassVar[str]

    def __init__(self, chunk_size: int | None = None) -> None:
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def chunk_for(self, device: torch.device) -> int:
        """The chunk size for tensors on ``device``: ``chunk_size``, or the device's default."""
        return self.chunk_size if self.chunk_size is not None else default_chunk_size(device)

    def step(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """Apply one job's step to every slice; return the stalled-element count (or ``None``):
        :meth:`prepare`, then its call."""
        return self.prepare(optimizer, ctx, slices)()

    def prepare(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]
                ) -> Callable[[], Stalled]:
        """One job's step split in two: what can fail before its first write (admission, a
        kernel's build, load and argument checks) is done now, and the returned call writes.
        A step prepares all its jobs before it calls the first (:mod:`lowp.optim.step_plan`).

        A job whose context names coded states (``ctx.coded``, their block scales on each slice)
        goes through :func:`lowp.optim.coded.run_coded`: the slices a kernel takes as they are
        (:meth:`take_coded`, prepared here), the others decoded, :meth:`run`, encoded; any other
        job is :meth:`prepare_run`'s. The native codec's library, which decodes and encodes the
        others on the CPU, is loaded here too (:func:`~lowp.optim.coded.load_codec`)."""
        if not ctx.coded:
            return self.prepare_run(optimizer, ctx, slices)
        taken, rest = self.take_coded(optimizer, ctx, slices)
        if rest:
            load_codec(rest)
            self.prepare_decoded(optimizer, ctx, rest)
        return partial(run_coded, self, optimizer, ctx, rest, taken)

    def prepare_decoded(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]) -> None:
        """Prepare what :meth:`run` will need for ``slices`` of a job with coded states once
        :func:`~lowp.optim.coded.run_coded` has decoded them (their coded states as fp32); the
        decoded slices exist only while the job writes. Default: nothing to prepare."""
        return None

    def prepare_run(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]
                    ) -> Callable[[], Stalled]:
        """:meth:`run` over slices of plain states, prepared (:meth:`prepare`); default: nothing
        to prepare, the call is :meth:`run`."""
        return partial(self.run, optimizer, ctx, slices)

    @abstractmethod
    def run(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """Apply the step to every slice, whose states are all plain tensors; return the
        stalled-element count (or ``None``)."""

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool]:
        """Per gradient: True when it holds no NaN or infinity; a tensor subclass (e.g. a
        DTensor shard's wrapper) is checked by its own ``isfinite``.

        A plain bf16/fp32/fp64 tensor is summed first (one pass at about half the cost of
        ``aminmax``): a NaN or an infinity makes the sum NaN or infinite, so a finite sum clears
        it. The others, and those whose sum is not finite (a NaN or infinity, or a sum beyond the
        dtype's range), take one ``aminmax`` pass (NaN propagates to both, an infinity shows in
        one). One host sync per round for all tensors."""
        plain = [i for i, g in enumerate(grads) if type(g) in (torch.Tensor, torch.nn.Parameter)]
        flags = [bool(torch.isfinite(g).all()) if type(g) not in (torch.Tensor, torch.nn.Parameter) else True
                 for g in grads]
        summed = [i for i in plain if grads[i].dtype in _SUMMED and grads[i].numel()]
        if summed:
            totals = torch.stack([grads[i].sum().float() for i in summed])
            cleared = {i for i, ok in zip(summed, torch.isfinite(totals).tolist()) if ok}
            plain = [i for i in plain if i not in cleared]
        if plain:
            extremes = torch.stack([torch.stack(torch.aminmax(grads[i])).float() if grads[i].numel() else torch.zeros(2)
                                    for i in plain])
            for i, ok in zip(plain, torch.isfinite(extremes).all(dim=1).tolist()):
                flags[i] = ok
        return flags

    def take_coded(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]
                   ) -> tuple[Callable[[], Stalled] | None, list[ParamSlice]]:
        """The step of the slices of a job with coded states (``ctx.coded``) that a kernel decodes
        and encodes itself, prepared (:meth:`prepare`). Returns (the call that steps them and
        returns their stalled count, ``None`` when none was taken; the slices left for the
        decode-run-encode passes of :mod:`lowp.optim.coded`). Default: none taken."""
        return None, list(slices)

    def pieces(self, optimizer: "LowpOptimizer", slices: list[ParamSlice]) -> Iterator[ParamSlice]:
        """The slices, cut into chunks when the optimizer's update is elementwise."""
        for s in slices:
            yield from (s.chunks(self.chunk_for(s.param.device)) if optimizer.elementwise else [s])


def written(ctx: StepContext, s: ParamSlice) -> list[torch.Tensor]:
    """The tensors a step at ``ctx`` writes for slice ``s``: its states, and unless the step is
    states-only its weight and mode buffer."""
    weights = [s.param, *([s.buffer] if s.buffer is not None else [])] if ctx.update_weights else []
    return [*weights, *s.states.values()]


def run_batches(optimizer: "LowpOptimizer", ctx: StepContext, batches: list[list[ParamSlice]]) -> Stalled:
    """The reference pipeline (``optimizer.apply_batch``) over one job's ``batches``, each parameter
    stepped whole or left as it was: what a batch writes is copied before it writes and put back
    if it fails, a parameter cut over several batches is held until its last piece is written, and
    the parameters written whole join ``ctx.stepped`` (:class:`~lowp.optim.journal.Journal`;
    ``None``: the caller keeps them whole, the batches just run). Returns the stalled count."""
    journal = Journal((s.param_id for batch in batches for s in batch), ctx.stepped)
    count: Stalled = None
    try:
        for batch in batches:
            journal.save([(s.param_id, written(ctx, s)) for s in batch])
            count = added([count, optimizer.apply_batch(ctx, batch)])   # before the batch counts as written
            journal.written(s.param_id for s in batch)
    except BaseException:
        journal.restore()
        raise
    return count


class EagerBackend(Backend):
    """One tensor (chunk) at a time: the simplest path and the smallest temporaries.

    Args:
        chunk_size: the most elements of one chunk of a parameter of an elementwise optimizer,
            which bounds a step's fp32 temporaries; a positive int, else ``ValueError``; default
            ``None``: :func:`default_chunk_size` of the parameters' device.
    """

    name = "eager"

    def run(self, optimizer, ctx, slices):
        """Each chunk through the reference pipeline on its own (:func:`run_batches`)."""
        return run_batches(optimizer, ctx, [[piece] for piece in self.pieces(optimizer, slices)])


class ForeachBackend(Backend):
    """Packs chunks into batches of about ``chunk_size`` elements and runs each batch with
    ``torch._foreach_*`` ops (one multi-tensor kernel per op on GPU, fewer dispatches on CPU).

    Args:
        chunk_size: the most elements of one chunk and of one batch (a larger parameter of a
            non-elementwise optimizer forms a batch alone); a positive int, else ``ValueError``;
            default ``None``: :func:`default_chunk_size` of the parameters' device.
    """

    name = "foreach"

    def run(self, optimizer, ctx, slices):
        """Each batch through the reference pipeline (:func:`run_batches`)."""
        return run_batches(optimizer, ctx, list(self.batches(optimizer, slices)))

    def batches(self, optimizer, slices) -> Iterator[list[ParamSlice]]:
        """The chunks packed into batches of at most ``chunk_size`` elements (a larger chunk alone)."""
        batch: list[ParamSlice] = []
        size = 0
        for piece in self.pieces(optimizer, slices):
            if batch and size + piece.numel > self.chunk_for(piece.param.device):
                yield batch
                batch, size = [], 0
            batch.append(piece)
            size += piece.numel
        if batch:
            yield batch


class FusedBackend(Backend):
    """A fused kernel plus a fallback backend: the slices the kernel admits
    (:meth:`~lowp.optim.kernels.kernel.Kernel.admits`) take the kernel, the others the fallback.
    Optimizers without a kernel form (no spec, no rule, a subclass with its own ``update``) run
    on the fallback whole.

    Two counters say where the elements of every step went (plain Python ints, added on the
    host, no device sync): ``fused_elements``, the elements a kernel updated (this backend's, and
    a fused fallback's), and ``reference_elements``, those that took the reference pipeline.
    Both sum over slices and steps (an element updated in 8 steps counts 8 times); assign 0 to
    restart them.

    The ``chunk_size`` is the fallback's. ``get_backend`` makes the stock fused backends
    (``native``, ``compiled``, ``triton``); build one directly only to pair another kernel.

    Args:
        kernel: the fused kernel (:class:`~lowp.optim.kernels.kernel.Kernel`), which says which
            specs it supports and which slices it admits.
        fallback: the backend for what the kernel does not take: a ``ForeachBackend`` for the
            stock backends, a ``compiled`` fused backend under ``triton``.
        name: the backend's name (its :attr:`Backend.name`; the stock ones use their key in
            :data:`BACKENDS`).
    """

    def __init__(self, kernel: Kernel, fallback: Backend, name: str) -> None:
        super().__init__(fallback.chunk_size)
        self.kernel, self.fallback, self.name = kernel, fallback, name  # type: ignore[misc]
        self._reference_elements = 0

    @property
    def fused_elements(self) -> int:
        """Elements updated by a kernel (see the class docstring)."""
        inner = self.fallback.fused_elements if isinstance(self.fallback, FusedBackend) else 0
        return self.kernel.fused_elements + inner

    @fused_elements.setter
    def fused_elements(self, value: int) -> None:
        self.kernel.fused_elements = value
        if isinstance(self.fallback, FusedBackend):
            self.fallback.fused_elements = 0

    @property
    def reference_elements(self) -> int:
        """Elements updated by the reference pipeline (see the class docstring)."""
        inner = self.fallback.reference_elements if isinstance(self.fallback, FusedBackend) else 0
        return self._reference_elements + inner

    @reference_elements.setter
    def reference_elements(self, value: int) -> None:
        self._reference_elements = value
        if isinstance(self.fallback, FusedBackend):
            self.fallback.reference_elements = 0

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool]:
        """The kernel's own check where it has one, the generic one for the rest."""
        flags = self.kernel.finite_flags(grads)
        rest = [i for i, f in enumerate(flags) if f is None]
        for i, ok in zip(rest, super().finite_flags([grads[i] for i in rest])):
            flags[i] = ok
        return [bool(f) for f in flags]

    def run(self, optimizer, ctx, slices):
        """The admitted slices through the kernel, the others through the fallback."""
        return self.prepare_run(optimizer, ctx, slices)()

    def prepare_run(self, optimizer, ctx, slices):
        """:meth:`run` prepared: the slices admitted now and the kernel's part prepared
        (:meth:`Kernel.prepare <lowp.optim.kernels.kernel.Kernel.prepare>`), a fused fallback's
        part too; the call runs the fallback's part, then the kernel's."""
        spec = optimizer.kernel_spec()
        if spec is None or not self.kernel.supports(spec):
            return self._fallback(optimizer, ctx, slices)
        spans: list[Span] = []
        fused, rest = partition(slices, lambda s: self.kernel.admits(spec, ctx, s, spans))
        if fused and overlapping(spans):  # written memory shared: every slice in the reference's order
            fused, rest = [], slices
        calls = [self._fallback(optimizer, ctx, rest)] if rest else []
        if fused:
            calls.append(self.kernel.prepare(spec, ctx, fused))
        return lambda: total([call() for call in calls])

    def take_coded(self, optimizer, ctx, slices):
        """A kernel with ``steps_codes`` (native, Triton) decodes and encodes block-scaled states
        inside its step for the slices :func:`~lowp.optim.kernels.coded_slices.admitted` lets
        through."""
        spec = optimizer.kernel_spec()
        if spec is None or not optimizer.elementwise or not self.kernel.steps_codes:
            return None, list(slices)
        taken, rest = coded_slices.admitted(self.kernel, spec, ctx, slices)
        return (self.kernel.prepare(spec, ctx, taken) if taken else None), rest

    def prepare_decoded(self, optimizer, ctx, slices):
        """The kernel's variants for the decoded slices' dtypes built and loaded
        (:meth:`Kernel.load <lowp.optim.kernels.kernel.Kernel.load>`), a fused fallback's too."""
        spec = optimizer.kernel_spec()
        if isinstance(self.fallback, FusedBackend):
            self.fallback.prepare_decoded(optimizer, ctx, slices)
        if spec is None or not self.kernel.supports(spec):
            return
        coded = {c.name for c in ctx.coded}
        plain = replace(ctx, coded=())
        signatures = {(s.param.dtype, s.grad.dtype, None if s.buffer is None else s.buffer.dtype,
                       *(torch.float32 if name in coded else t.dtype for name, t in s.states.items()))
                      for s in slices if s.param.device.type in self.kernel.device_types()}
        for dtypes in signatures:   # only those the kernel would admit: others take the fallback
            if fusable_dtypes(plain, dtypes, self.kernel.fp16_stochastic):
                self.kernel.load(spec, plain, dtypes)

    def _fallback(self, optimizer, ctx, slices) -> Callable[[], Stalled]:
        """The fallback's part, prepared; the reference's elements are counted when it runs."""
        run = self.fallback.prepare_run(optimizer, ctx, slices)
        if isinstance(self.fallback, FusedBackend):
            return run

        def counted() -> Stalled:
            self._reference_elements += sum(s.numel for s in slices)
            return run()
        return counted


def _fused(kernel: Callable[[], Kernel], name: str, fallback: Callable[[int | None], Backend] | None = None
           ) -> Callable[..., Backend]:
    def make(chunk_size: int | None = None) -> Backend:
        inner = fallback(chunk_size) if fallback else ForeachBackend(chunk_size)
        return FusedBackend(kernel(), inner, name)
    return make


_compiled = _fused(CompiledKernel, "compiled")
BACKENDS: dict[str, Callable[..., Backend]] = {
    "eager": EagerBackend, "foreach": ForeachBackend, "compiled": _compiled,
    "native": _fused(NativeKernel, "native"),
    # Triton leaves what it does not admit (fp16 stochastic rounding, reductions) to torch.compile
    "triton": _fused(TritonKernel, "triton", lambda chunk_size: _compiled(chunk_size)),
}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``backend=name`` available to every lowp optimizer."""
    BACKENDS[name] = factory


def get_backend(name: str, chunk_size: int | None = None) -> Backend:
    """A new backend instance by name; a clear error for an unknown one."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name](chunk_size=chunk_size)


#: ``fused=None`` uses torch.compile on CPU only from this many parameter elements on: the first
#: step then costs 10-40 s of compilation (measured, docs/fused.md), which small models never win back.
AUTO_MIN_NUMEL = 1 << 22
#: ``fused=None`` uses the native kernel from this many elements on: a variant compiles once per
#: machine in about 1 s (then loads from the on-disk cache), and a call costs tens of microseconds.
AUTO_MIN_NUMEL_NATIVE = 1 << 16


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
