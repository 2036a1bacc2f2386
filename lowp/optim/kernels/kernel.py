"""What every fused kernel shares: the :class:`Kernel` interface and its admission of slices.

A kernel runs one optimizer step over the slices it admits, from the optimizer's
:class:`~lowp.optim.spec.OptimizerSpec` alone; a backend (:class:`lowp.optim.backends.FusedBackend`)
pairs it with a fallback that runs everything it does not admit. Kernels count the elements
they updated in ``fused_elements``, so tests and users can see that a kernel really ran.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from typing import Any, Callable, ClassVar, Iterable, Protocol, Sequence, TypeVar

import torch

from lowp.optim.kernels.checks import PLAIN_TYPES, Span, check_slice
from lowp.optim.ordered_sum import Runs
from lowp.optim.randomness import Stream, stream_keys
from lowp.optim.rule import Program
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec
from lowp.optim import stalled
from lowp.optim.stalled import Stalled

__all__ = ["CHECKS", "Kernel", "KernelLaunch", "PiecesLaunch", "fusable", "fusable_dtypes", "partition", "grad_factor",
           "gradient_factor", "slice_keys", "by_signature", "stream_count", "step_numbers"]

#: the non-finite check a prepared launch runs (:meth:`KernelLaunch.call`): none, skip the
#: parameters whose gradient holds a NaN or an infinity, skip the whole launch
CHECKS = {"off": 0, "skip_param": 1, "skip_step": 2}

_LOW16 = (torch.bfloat16, torch.float16)
_KERNEL_FLOATS = (torch.float32, *_LOW16)
T = TypeVar("T")


def fusable(ctx: StepContext, s: ParamSlice, min_numel: int = 2, fp16_stochastic: bool = False,
            devices: tuple[str, ...] = ("cpu", "cuda"), spans: list[Span] | None = None) -> bool:
    """Whether slice ``s`` can take a fused step: the admission checks of
    :func:`~lowp.optim.kernels.checks.check_slice` (which raise for inputs no backend can run,
    before anything is written), kernel memory on one of ``devices`` for the weight, states and
    buffer (a gradient may be strided: the kernels copy it), elements that are one contiguous
    range of their parameter (the random streams count along it), and the dtypes the kernels
    support. ``fp16_stochastic``: the kernel rounds fp16 stochastically too (the weight in
    stochastic mode, the compensation in kahan mode, stochastically rounded states); ``spans``
    collects the byte ranges of the slice's tensors (:func:`~lowp.optim.kernels.checks.overlapping`)."""
    floats = _KERNEL_FLOATS
    weights, _, buffer = check_slice(ctx, s, floats, ctx.mode.buffer_dtypes(s.param.dtype), spans)
    param, grad = s.param, s.grad
    device = "cpu" if param.is_cpu else param.device.type
    if not (weights and buffer) or param.numel() < min_numel or device not in devices or not s.index.contiguous:
        return False
    if type(grad) not in PLAIN_TYPES or grad.is_neg() or grad.dtype not in floats:
        return False
    return _rounding_admits(ctx, param.dtype, [t.dtype for t in s.states.values()], fp16_stochastic)


def _rounding_admits(ctx: StepContext, weight: torch.dtype, states: Sequence[torch.dtype | None],
                     fp16_stochastic: bool) -> bool:
    """Whether the kernels round ``weight`` and ``states`` as ``ctx`` asks: a stochastically
    rounded weight in bf16 (fp16 too with ``fp16_stochastic``), stochastically rounded states in
    no fp16 unless ``fp16_stochastic``."""
    if ctx.mode.stochastic_weight_dtype and weight not in (_LOW16 if fp16_stochastic else (torch.bfloat16,)):
        return False
    stochastic_states = ctx.group["state_rounding"] == "stochastic"
    return fp16_stochastic or not (stochastic_states and torch.float16 in states)


def fusable_dtypes(ctx: StepContext, dtypes: tuple[torch.dtype | None, ...], fp16_stochastic: bool = False) -> bool:
    """The dtype part of :func:`fusable` for a slice of ``dtypes`` (weight, gradient, buffer or
    ``None``, states): whether the kernels support them in ``ctx``'s mode and state rounding (the
    slices a step makes while it writes, block-scaled states decoded into fp32, are judged by
    their dtypes before they exist)."""
    weight, grad, buffer, *states = dtypes
    if weight not in _KERNEL_FLOATS or grad not in _KERNEL_FLOATS or any(d not in _KERNEL_FLOATS for d in states):
        return False
    if buffer is not None and buffer not in ctx.mode.buffer_dtypes(weight):
        return False
    return _rounding_admits(ctx, weight, states, fp16_stochastic)


def partition(items: list[T], keep: Callable[[T], bool]) -> tuple[list[T], list[T]]:
    """``(items where keep, the others)``, each in the original order, in one pass."""
    kept: list[T] = []
    others: list[T] = []
    for s in items:
        (kept if keep(s) else others).append(s)
    return kept, others


def grad_factor(ctx: StepContext) -> float:
    """What the gradient is multiplied by: -1 for ``maximize``, times the GradScaler's 1/scale."""
    return gradient_factor(ctx.group, ctx.inv_scale)


def gradient_factor(group: dict, inv_scale: float | None) -> float:
    """:func:`grad_factor` of a step of ``group`` with the GradScaler's ``inv_scale`` (or ``None``)."""
    return (-1.0 if group["maximize"] else 1.0) * (1.0 if inv_scale is None else inv_scale)


def stream_count(states: int) -> int:
    """Random streams per slice: the weight's, the compensation's, one per state."""
    return Stream.STATE + states


def slice_keys(ctx: StepContext, s: ParamSlice) -> list[int]:
    """The stream keys of slice ``s`` at this step: ``Stream.WEIGHT``, ``Stream.COMPENSATION``
    and one per state (:func:`lowp.optim.randomness.stream_key`)."""
    return stream_keys(ctx.seed, ctx.step, s.param_id, stream_count(len(s.states)))


def by_signature(slices: Iterable[T], signature: Callable[[T], tuple]) -> dict[tuple, list[T]]:
    """The slices (or slices with their block scales) grouped by ``signature`` (one kernel launch
    each), in their order."""
    groups: dict[tuple, list[T]] = {}
    for s in slices:
        groups.setdefault(signature(s), []).append(s)
    return groups


def step_numbers(spec: OptimizerSpec, program: Program, ctx: StepContext, device: torch.device) -> torch.Tensor:
    """``h``: the gradient factor, then the numbers ``program`` reads (one small fp32 tensor)."""
    values = [grad_factor(ctx), *spec.step_numbers(program, ctx.group, ctx.step)]
    return torch.tensor(values, dtype=torch.float32, device=device)


class KernelLaunch(Protocol):
    """A kernel's launch over the slices of one job, prepared once (:meth:`Kernel.launches`) and
    kept by a cached step plan (:mod:`lowp.optim.cached_step`)."""

    @property
    def finite(self) -> Iterable[Any]:
        """Per member, whether its gradient was finite at the last checked call."""

    def stage(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
              check: int = 0) -> Callable[[], Stalled]:
        """The step with the members' gradients, the spec's numbers, the gradient factor, the
        optimizer's seed and the step count, after the non-finite ``check`` (:data:`CHECKS`),
        with everything it allocates made now (a strided gradient's copy, the arguments' device
        buffers); the returned call runs it and returns the stalled count
        (:mod:`lowp.optim.stalled`), allocating nothing. A step stages every launch before the
        first one writes, so an allocation that fails (out of memory) changes nothing."""

    def call(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
             check: int = 0) -> Stalled:
        """:meth:`stage` and run at once."""


class PiecesLaunch(Protocol):
    """A kernel's pass making the pieces of shards' per-tensor sums over the shards of one dtype
    signature, prepared once (:meth:`Kernel.pieces_launches`) and kept by a cached step plan."""

    def call(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float) -> list[Runs]:
        """Each member's :class:`~lowp.optim.ordered_sum.Runs` of its reduction's terms with the
        members' gradients, the spec's numbers and the gradient factor; nothing is written."""


class Kernel(ABC):
    """One way of running fused steps. Subclasses set ``name`` and the admission limits and
    implement :meth:`run`; ``fused_elements`` counts the elements they updated (summed over
    slices and steps; assign 0 to restart)."""

    name: ClassVar[str]
    #: whether :meth:`run_coded` decodes and encodes block-scaled states inside the step
    steps_codes: ClassVar[bool] = False
    #: the smallest tensor this kernel fuses, whether it rounds fp16 stochastically (:func:`fusable`),
    #: and the device types whose memory it addresses
    min_numel: ClassVar[int] = 2
    fp16_stochastic: ClassVar[bool] = False
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: whether :meth:`launches` prepares launches a cached step plan can keep
    keeps_plans: ClassVar[bool] = False

    def __init__(self) -> None:
        self.fused_elements = 0

    def device_types(self) -> tuple[str, ...]:
        """The device types whose memory this kernel addresses (default: :attr:`devices`)."""
        return self.devices

    def supports(self, spec: OptimizerSpec) -> bool:
        """Whether this kernel has a form of ``spec`` (default: any elementwise rule)."""
        return spec.rule is not None and spec.elementwise

    def admits(self, spec: OptimizerSpec, ctx: StepContext, s: ParamSlice, spans: list[Span]) -> bool:
        """Whether slice ``s`` takes this kernel (:func:`fusable` with its limits; ``spans``
        collects its byte ranges); ``ValueError`` when ``s`` lacks a state the optimizer reads,
        or has one it does not."""
        expected = spec.states(ctx.group)
        if tuple(s.states) != tuple(expected):
            raise ValueError(f"states: the {spec.name} optimizer reads the states {list(expected)} of this "
                             f"parameter, the slice has {list(s.states)}")
        return fusable(ctx, s, self.min_numel, self.fp16_stochastic, self.device_types(), spans)

    @abstractmethod
    def run(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """The step over ``slices`` (all admitted); returns the stalled count when ``ctx.count``."""

    def run_coded(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """The step over slices of a job with block-scaled states (``ctx.coded``; each slice with
        their block scales), all admitted by :func:`lowp.optim.kernels.coded_slices.admitted`;
        for kernels with ``steps_codes``. Returns the stalled count when ``ctx.count``."""
        raise NotImplementedError(f"the {self.name} kernel does not step block-scaled states")

    def launches(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                 ) -> Sequence[tuple[KernelLaunch, list[ParamSlice]]]:
        """The checked launches over admitted ``slices`` of one job, each with its members (for
        kernels with :attr:`keeps_plans`)."""
        raise NotImplementedError(f"the {self.name} kernel prepares no launches")

    def prepare(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Callable[[], Stalled]:
        """The step over admitted ``slices`` (:meth:`run`, or :meth:`run_coded` when ``ctx.coded``),
        split in two: what can fail before the first write is done now, and the returned call
        does the rest. A kernel with :attr:`keeps_plans` builds, loads and checks its launches
        here (:meth:`launches`) and stages each (:meth:`KernelLaunch.stage`: what it allocates),
        so the call only runs them, allocating nothing; the others prepare nothing (their call
        is the whole step)."""
        if not self.keeps_plans:
            return partial(self.run_coded if ctx.coded else self.run, spec, ctx, slices)
        numbers, factor = spec.numbers(ctx.group, ctx.step), grad_factor(ctx)
        staged = [(launch.stage([s.grad for s in members], numbers, factor, ctx.seed, ctx.step),
                   [s.param_id for s in members]) for launch, members in self.launches(spec, ctx, slices)]
        return partial(self._run_staged, staged, sum(s.numel for s in slices), ctx.stepped, ctx.count)

    def _run_staged(self, staged: list[tuple[Callable[[], Stalled], list[int]]], numel: int,
                    stepped: set[int] | None, count: bool) -> Stalled:
        """Run a job's staged launches (:meth:`prepare`), each with its parameters' ids, which join
        ``stepped`` once it ran (the context's: a later launch, a Triton kernel's first-call
        compile, or a later part of the job may fail, :mod:`lowp.optim.journal`); the stalled
        count when ``count``."""
        counts = []
        for run, param_ids in staged:
            counts.append(run())
            if stepped is not None:
                stepped.update(param_ids)
        self.fused_elements += numel
        return stalled.of_job(counts, count)

    def load(self, spec: OptimizerSpec, ctx: StepContext, dtypes: tuple[torch.dtype | None, ...]) -> None:
        """Build and load now what a later :meth:`run` at ``ctx`` (plain states) over slices of
        ``dtypes`` (weight, gradient, buffer or ``None``, states) would build on its first call:
        the step of block-scaled states that are decoded outside the kernel (:mod:`lowp.optim.coded`)
        makes such slices only while it writes. Default: nothing to load."""
        return None

    def pieces_launches(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                        ) -> Sequence[tuple[PiecesLaunch, list[ParamSlice]]] | None:
        """The checked passes over admitted ``slices`` (shards, each with a
        :class:`~lowp.optim.slices.TensorSum`) that make the
        :func:`~lowp.optim.ordered_sum.pieces` of their per-tensor reduction's terms at ``ctx``'s
        step without writing anything, each with its members; ``None`` (default) when the kernel
        has no such pass (:mod:`lowp.optim.sharded_sums` then computes them with torch)."""
        return None

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool | None]:
        """Per gradient: finite (``True``/``False``) as this kernel checks it, ``None`` for the
        ones it leaves to the generic check (default: all)."""
        return [None] * len(grads)
