"""The reference pipeline of one batch of slices (the optimizer's ``apply_batch``): what a step
means, bit for bit, for every backend.

For a batch of slices of one job it makes fp32 working copies of the gradients (times ``-1``
under ``maximize`` and times the inverse loss scale under GradScaler), of the weights (through the
write-back mode's ``load``, :class:`~lowp.optim.writeback.WriteBack`) and of the states, runs the
optimizer's ``update``, stores each state back with the group's ``state_rounding``
(:func:`~lowp.optim.storage.store`; state ``j`` rounds stochastically with stream
``Stream.STATE + j``) and writes each weight back with the mode's ``apply``; a states-only step
(``ctx.update_weights`` false) stops after the states. The ``eager`` and ``foreach`` backends
call it; the fused kernels match it (:mod:`lowp.optim.backends`). Working copies, random bits and
the write-back's temporaries live in ``ctx.scratch`` (:mod:`lowp.optim.scratch`).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from lowp.optim.randomness import Stream
from lowp.optim.scratch import Scratch
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.stalled import Stalled, added
from lowp.optim.storage import store, working_copy
from lowp.optim.writeback import LOW_PRECISION

__all__ = ["apply_batch", "working_grads"]

#: Batches of fewer elements take fresh temporaries: the heap serves them without page faults,
#: and the scratch's bookkeeping would cost more than it saves.
_SCRATCH_MIN_NUMEL = 1 << 14


class LowpOptimizer(Protocol):
    """What the reference pipeline reads of the optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    def update(self, group: dict[str, Any], weights: list[torch.Tensor], grads: list[torch.Tensor],
               states: dict[str, list[torch.Tensor]], step: int, **sums: Any) -> list[torch.Tensor]:
        """The intended weight changes (fresh fp32 tensors); a per-tensor optimizer that steps
        shards (:attr:`ParamSlice.tensor_sum <lowp.optim.slices.ParamSlice.tensor_sum>`) takes
        ``sums``: per tensor its whole tensor's ``(total, numel)`` or ``None``."""


def _scratch_copies(tensors: list[torch.Tensor], scratch: Scratch, name: str, device: torch.device
                    ) -> list[torch.Tensor | None]:
    """Uninitialised fp32 tensors of the shapes of ``tensors`` in ``scratch``'s buffer ``name``
    (``None`` each for a batch too small to be worth it)."""
    if sum(t.numel() for t in tensors) < _SCRATCH_MIN_NUMEL:
        return [None] * len(tensors)
    copies: list[torch.Tensor | None] = [*scratch.split(name, [t.shape for t in tensors], torch.float32, device)]
    return copies


def _working_copies(tensors: list[torch.Tensor], scratch: Scratch, name: str, device: torch.device
                    ) -> list[torch.Tensor]:
    """:func:`~lowp.optim.storage.working_copy` of each tensor, the copies in ``scratch``'s buffer ``name``."""
    outs = iter(_scratch_copies([t for t in tensors if t.dtype not in (torch.float32, torch.float64)], scratch, name,
                                device))
    return [t if t.dtype in (torch.float32, torch.float64) else working_copy(t, next(outs)) for t in tensors]


def working_grads(ctx: StepContext, batch: list[ParamSlice], scratch: Scratch) -> list[torch.Tensor]:
    """The gradients of ``batch`` as ``update`` reads them: fp32 working copies (in ``scratch``)
    times ``-1`` under ``maximize`` and times ``ctx.inv_scale``; an fp32 gradient needing no
    factor is the gradient itself."""
    grads = _working_copies([s.grad for s in batch], scratch, "grads", batch[0].param.device)
    factor = (-1.0 if ctx.group["maximize"] else 1.0) * (1.0 if ctx.inv_scale is None else ctx.inv_scale)
    if factor != 1.0:
        grads = [g.mul_(factor) if g is not s.grad else g * factor for g, s in zip(grads, batch)]
    return grads


def apply_batch(optimizer: LowpOptimizer, ctx: StepContext, batch: list[ParamSlice]) -> Stalled:
    """The reference pipeline for one batch: fp32 working copies, ``update``, store states
    with their rounding, write the weights back with the mode. Returns the stalled count.
    Working copies, random bits and the write-back's temporaries live in ``ctx.scratch``."""
    group, mode, scratch = ctx.group, ctx.mode, ctx.scratch
    device = batch[0].param.device
    grads = working_grads(ctx, batch, scratch)
    loaded = iter(_scratch_copies([s.param for s in batch if s.param.dtype in LOW_PRECISION], scratch, "weights",
                                  device))
    weights = [mode.load(s.param, s.buffer, next(loaded) if s.param.dtype in LOW_PRECISION else None)
               for s in batch]
    names = list(batch[0].states)
    states = {n: _working_copies([s.states[n] for s in batch], scratch, f"state {n}", device) for n in names}
    whole = [s.tensor_sum for s in batch] if ctx.update_weights else []   # a states-only step discards the update
    sums = {"sums": [None if t is None else (t.total, t.numel) for t in whole]} if any(whole) else {}
    updates = optimizer.update(group, weights, grads, states, ctx.step, **sums)
    counts: list[Stalled] = []
    rounding = group["state_rounding"]
    for i, s in enumerate(batch):
        streams = ctx.streams(s)
        streams.prefetch([Stream.STATE + j for j, n in enumerate(names)
                          if rounding == "stochastic" and s.states[n].dtype in LOW_PRECISION]
                         + (list(mode.draws(s.param, s.buffer)) if ctx.update_weights else []),
                         s.numel, device, scratch)
        for j, n in enumerate(names):
            store(s.states[n], states[n][i], rounding, streams, Stream.STATE + j)
        if not ctx.update_weights:
            continue
        stalled = mode.apply(s.param, weights[i], updates[i], s.buffer, streams, ctx.count, scratch)
        if stalled is not None:
            counts.append(stalled)
    return added(counts) if ctx.count else None
