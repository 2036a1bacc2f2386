"""Per-tensor sums of parameters sharded over ranks, exchanged instead of gathering the tensors.

A per-tensor optimizer (StableAdamW: ``lr_t = lr / max(1, RMS_t)`` with ``RMS_t**2`` the mean of
``g**2 / max(v_hat, eps**2)`` over the tensor; Wortsman et al., 2023) needs one number of the
whole tensor before any element's step. On a DTensor parameter whose local box is one contiguous
range of the tensor (FSDP2's ``Shard(0)``), each rank has the terms of its range; the sum of the
whole tensor in :func:`~lowp.optim.ordered_sum.ordered_sum`'s order (what a single process and
every backend add) follows from each range's :func:`~lowp.optim.ordered_sum.pieces`: the sums of
the units and blocks the range holds whole, the raw terms of the at most two blocks it shares.
So per step and parameter a rank sends a few numbers per shard boundary (at most 2,047 block sums
and 15 terms on each side) instead of all-gathering the weight, gradient, states and buffer, and
steps its shard only; the result is the single process's, bit for bit.

:func:`exchange` runs before the step's first write (:meth:`lowp.optim.step_plan.StepPlan.run_jobs`):
the terms come from the optimizer's ``tensor_terms`` on the reference's fp32 working copies
(:func:`~lowp.optim.reference.working_grads`), which the kernels match bit for bit, and nothing
is written; one all-gather (:func:`~lowp.optim.sharding.all_rows`) carries every parameter's
pieces, keyed by the parameter's position in the groups (the same on every rank).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from lowp.optim import sharding
from lowp.optim.ordered_sum import pieces, total_from_pieces
from lowp.optim.reference import working_grads
from lowp.optim.scratch import Scratch
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.storage import working_copy

__all__ = ["exchange"]


class SumsOptimizer(Protocol):
    """What :func:`exchange` reads of the optimizer (StableAdamW's ``tensor_terms``)."""

    def tensor_terms(self, group: dict[str, Any], grads: list[torch.Tensor], states: dict[str, list[torch.Tensor]],
                     step: int) -> list[torch.Tensor]:
        """Per tensor, the fp32 terms of its sum before the step (nothing written)."""


def exchange(optimizer: SumsOptimizer, jobs: Sequence[tuple[StepContext, list[ParamSlice]]]) -> None:
    """Set ``tensor_sum.total`` of every slice of ``jobs`` that has a
    :class:`~lowp.optim.slices.TensorSum`: its terms cut into pieces, one all-gather of the pieces
    of all of them, each whole tensor's sum rebuilt from every rank's pieces. Every rank calls it
    with the same parameters (the collective); a rank with no such slice makes no call, and
    neither does any other (they step the same parameters)."""
    mine: list[torch.Tensor] = []
    sharded: list[ParamSlice] = []
    for ctx, slices in jobs:
        todo = [s for s in slices if s.tensor_sum is not None]
        if not todo:
            continue
        scratch = Scratch()
        grads = working_grads(ctx, todo, scratch)
        states = {n: [working_copy(s.states[n]) for s in todo] for n in todo[0].states}
        for s, terms in zip(todo, optimizer.tensor_terms(ctx.group, grads, states, ctx.step)):
            assert s.tensor_sum is not None
            rows = pieces(terms, s.index.first(), s.tensor_sum.numel)
            mine.append(torch.cat([torch.full((rows.shape[0], 1), float(s.param_id), dtype=torch.float64), rows], 1))
            sharded.append(s)
    if not sharded:
        return
    everyone = sharding.all_rows(torch.cat(mine))
    by_param = everyone[:, 0]
    for s in sharded:
        assert s.tensor_sum is not None
        s.tensor_sum.total = total_from_pieces(everyone[by_param == s.param_id, 1:], s.tensor_sum.numel)
