"""Backends: how one optimizer step is executed over the parameters of a group.

The optimizer (``update``) says *what* the new weights are, a :mod:`write-back mode
<lowp.optim.writeback>` says *how they are stored*; a backend decides *how the work is run*:
which tensors go together into one batch and which code executes the batch.

Every backend receives :class:`ParamSlice` objects (one parameter with its gradient, states and
mode buffer) that share a :class:`StepContext` (group, mode, step number, ...), and returns the
number of stalled elements. The reference pipeline for one batch is
:meth:`lowp.optim.base.LowpOptimizer.apply_batch`; a backend may call it (``eager``,
``foreach``), compile it, or replace it with a kernel of its own for the optimizers and modes it
knows, falling back to ``apply_batch`` for the others.

Temporaries are bounded by design: elementwise optimizers see parameters cut into flat chunks
of at most ``chunk_size`` elements, so a step allocates a few fp32 copies of one chunk, never of
the whole model, and the batches of one backend call reuse them (:mod:`lowp.optim.scratch`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

import torch

from lowp.optim.randomness import ElementIndex, RandomStreams
from lowp.optim.scratch import Scratch
from lowp.optim.writeback import WriteBack

if TYPE_CHECKING:
    from lowp.optim.base import LowpOptimizer

__all__ = ["ParamSlice", "StepContext", "Backend", "EagerBackend", "ForeachBackend", "register_backend",
           "get_backend", "BACKENDS", "DEFAULT_CHUNK_SIZE"]

#: Elements per chunk (and per ``foreach`` batch) of the reference pipeline. Each torch op costs
#: a few microseconds of dispatch and thread wake-up besides its work: on 2 cores an AdamW step
#: with Kahan compensation and bf16 states over 8M parameters took 66 ms in chunks of 2**17,
#: 56 ms in chunks of 2**18 and 59 ms in chunks of 2**19 (states rounded to nearest; one thread:
#: equal at 2**17 and 2**18). The temporaries are about 11 fp32 copies of one chunk (11 MiB).
DEFAULT_CHUNK_SIZE = 1 << 18


@dataclass
class ParamSlice:
    """One parameter (or a flat chunk of it) with everything its update touches.

    ``states`` maps state names to tensors (possibly of other dtypes than ``param``);
    ``buffer`` is the mode's compensation/remainder (``None`` for nearest/stochastic).
    ``param_id`` (the parameter's position in the flat list of all parameters of the optimizer)
    and ``index`` (where the local elements sit in the whole parameter) select the random
    streams of stochastic rounding (:mod:`lowp.optim.randomness`).
    """

    param: torch.Tensor
    grad: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    buffer: torch.Tensor | None = None
    param_id: int = 0
    index: ElementIndex = field(default_factory=ElementIndex)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def chunks(self, size: int) -> list["ParamSlice"]:
        """Flat views of at most ``size`` elements (the slice itself when it is small or not
        contiguous). Writing through a chunk writes the parameter and its states."""
        tensors = [self.param, *self.states.values(), *([self.buffer] if self.buffer is not None else [])]
        if self.numel <= size or not all(t.is_contiguous() and t.shape == self.param.shape for t in tensors):
            return [self]
        grad = self.grad.reshape(-1).split(size)
        states = {k: v.view(-1).split(size) for k, v in self.states.items()}
        buffer = self.buffer.view(-1).split(size) if self.buffer is not None else None
        return [ParamSlice(p, grad[i], {k: v[i] for k, v in states.items()}, buffer[i] if buffer else None,
                           self.param_id, self.index.shifted(i * size))
                for i, p in enumerate(self.param.view(-1).split(size))]


@dataclass
class StepContext:
    """What all slices of one backend call share.

    ``inv_scale`` unscales gradients (from :class:`torch.amp.GradScaler`), ``count`` asks the
    write-back for the stalled-element count, ``seed`` (the optimizer's) keys the random streams
    of stochastic rounding, ``scratch`` holds the temporaries that the batches of this call reuse.
    """

    group: dict[str, Any]
    mode: WriteBack
    step: int
    inv_scale: float | None = None
    seed: int = 0
    count: bool = True
    scratch: Scratch = field(default_factory=Scratch, repr=False, compare=False)

    def streams(self, s: ParamSlice) -> RandomStreams:
        """The random streams of slice ``s`` at this step."""
        return RandomStreams(self.seed, self.step, s.param_id, s.index)


class Backend(ABC):
    """Runs one step over a list of slices. Subclasses set ``name`` and implement ``run``."""

    name: ClassVar[str]

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    @abstractmethod
    def run(self, optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """Apply the step to every slice; return the stalled-element count (or ``None``)."""

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool]:
        """Per gradient: True when it holds no NaN or infinity. One ``aminmax`` pass per plain
        tensor (NaN propagates to both, an infinity shows in one) and one host sync for all of them;
        a tensor subclass (e.g. a DTensor shard's wrapper) is checked by its own ``isfinite``."""
        plain = [i for i, g in enumerate(grads) if type(g) in (torch.Tensor, torch.nn.Parameter)]
        flags = [bool(torch.isfinite(g).all()) if type(g) not in (torch.Tensor, torch.nn.Parameter) else True
                 for g in grads]
        if plain:
            extremes = torch.stack([torch.stack(torch.aminmax(grads[i])).float() if grads[i].numel() else torch.zeros(2)
                                    for i in plain])
            for i, ok in zip(plain, torch.isfinite(extremes).all(dim=1).tolist()):
                flags[i] = ok
        return flags

    def pieces(self, optimizer: "LowpOptimizer", slices: list[ParamSlice]) -> Iterator[ParamSlice]:
        """The slices, cut into chunks when the optimizer's update is elementwise."""
        for s in slices:
            yield from (s.chunks(self.chunk_size) if optimizer.elementwise else [s])


def _total(counts: list[torch.Tensor | None]) -> torch.Tensor | None:
    counts = [c for c in counts if c is not None]
    return torch.stack(counts).sum() if counts else None


class EagerBackend(Backend):
    """One tensor (chunk) at a time: the simplest path and the smallest temporaries."""

    name = "eager"

    def run(self, optimizer, ctx, slices):
        return _total([optimizer.apply_batch(ctx, [piece]) for piece in self.pieces(optimizer, slices)])


class ForeachBackend(Backend):
    """Packs chunks into batches of about ``chunk_size`` elements and runs each batch with
    ``torch._foreach_*`` ops (one multi-tensor kernel per op on GPU, fewer dispatches on CPU)."""

    name = "foreach"

    def run(self, optimizer, ctx, slices):
        return _total([optimizer.apply_batch(ctx, batch) for batch in self.batches(optimizer, slices)])

    def batches(self, optimizer, slices) -> Iterator[list[ParamSlice]]:
        batch: list[ParamSlice] = []
        size = 0
        for piece in self.pieces(optimizer, slices):
            if batch and size + piece.numel > self.chunk_size:
                yield batch
                batch, size = [], 0
            batch.append(piece)
            size += piece.numel
        if batch:
            yield batch


BACKENDS: dict[str, Callable[..., Backend]] = {"eager": EagerBackend, "foreach": ForeachBackend}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``backend=name`` available to every lowp optimizer (e.g. a compiled or Triton backend)."""
    BACKENDS[name] = factory


def get_backend(name: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Backend:
    """A new backend instance by name; a clear error for an unknown one."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return BACKENDS[name](chunk_size=chunk_size)
