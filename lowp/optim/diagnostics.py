"""The optimizer's ``diagnostics()`` (:func:`report`, bound as its method): per parameter group,
how much of the last step rounding lost and how large the Kahan compensation has grown.

``stalled_fraction`` counts, over the jobs of the last step (the optimizer's ``_last_stalled``: per
group, a (count, elements, weight) triple per job, weight 0 for plain parameters, else this rank's
share of a sum over ranks), the elements whose stored weight did not change; ``compensation_rel``
is ``||k|| / ||theta||`` over the group's Kahan buffers ``k`` and their weights ``theta``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Protocol

import torch

from lowp.optim import sharding

__all__ = ["report"]


class LowpOptimizer(Protocol):
    """What the diagnostics read of the optimizer (:class:`lowp.optim.base.LowpOptimizer`, which
    imports this module)."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]
    skipped_params: int
    skipped_steps: int
    _last_stalled: dict[int, list[tuple[torch.Tensor | None, int, float]]]


def report(optimizer: LowpOptimizer) -> list[dict[str, float]]:
    """Per parameter group: ``stalled_fraction`` (elements of the last step whose stored
    weight did not change: their update was lost to rounding, or zero), ``compensation_rel``
    (``||k|| / ||theta||`` over the group's Kahan buffers, 0 without any) and skip counters.
    With DTensor parameters the counts and squares are summed over ranks (one all-reduce:
    every rank must call it)."""
    sums = []   # per group: stalled, elements, ||k||^2, ||theta||^2; plain (local) then DTensor shares
    for i, group in enumerate(optimizer.param_groups):
        plain, shared = [0.0] * 4, [0.0] * 4
        for stalled, n, weight in optimizer._last_stalled.get(i, []):
            acc, w = (plain, 1.0) if weight == 0 else (shared, weight)
            acc[0] += w * float(stalled) if stalled is not None else math.nan
            acc[1] += w * n
        for p in group["params"]:
            k = optimizer.state.get(p, {}).get("compensation")
            if k is not None:
                acc, w = (shared, 1.0 / sharding.replicas(p)) if sharding.is_dtensor(p) else (plain, 1.0)
                acc[2] += w * float(sharding.local(k).float().square().sum())
                acc[3] += w * float(sharding.local(p).detach().float().square().sum())
        sums.append((plain, shared))
    if any(sharding.is_dtensor(p) for g in optimizer.param_groups for p in g["params"]):
        reduced = iter(sharding.global_sums([v for _, shared in sums for v in shared]))
        sums = [(plain, [next(reduced) for _ in shared]) for plain, shared in sums]
    out: list[dict[str, float]] = []
    for plain, shared in sums:
        stalled_sum, count, comp_sq, weight_sq = (a + b for a, b in zip(plain, shared))
        out.append({
            "stalled_fraction": stalled_sum / count if count and not math.isnan(stalled_sum) else 0.0,
            "compensation_rel": math.sqrt(comp_sq / weight_sq) if weight_sq else 0.0,
            "skipped_params": float(optimizer.skipped_params),
            "skipped_steps": float(optimizer.skipped_steps),
        })
    return out
