"""The optimizer's ``diagnostics()`` (:func:`report`, bound as its method): per parameter group,
how much of the last step rounding lost and how large the Kahan compensation has grown.

``stalled_fraction`` counts, over the jobs of the last step (the optimizer's ``_last_stalled``:
per group, a (count, elements, :class:`~lowp.optim.sharding.Share`) triple per job: a plain
parameter's counts are its rank's, a DTensor's this rank's share of a sum over its mesh's ranks),
the elements whose stored weight did not change; ``compensation_rel`` is ``||k|| / ||theta||``
over the group's Kahan buffers ``k`` and their weights ``theta``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Protocol

import torch

from lowp.optim import collectives, sharding
from lowp.optim.stalled import Stalled, value

__all__ = ["report"]


class LowpOptimizer(Protocol):
    """What the diagnostics read of the optimizer (:class:`lowp.optim.base.LowpOptimizer`, which
    imports this module)."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]
    skipped_params: int
    skipped_steps: int
    _last_stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]]


def report(optimizer: LowpOptimizer) -> list[dict[str, float]]:
    """Per parameter group: ``stalled_fraction`` (elements of the last step whose stored
    weight did not change: their update was lost to rounding, or zero), ``compensation_rel``
    (``||k|| / ||theta||`` over the group's Kahan buffers, 0 without any) and skip counters.
    With DTensor parameters the counts and squares are summed over the ranks of their meshes
    (:func:`lowp.optim.collectives.sums_by_mesh`: every rank of a mesh must call it)."""
    n = len(optimizer.param_groups)
    plain = [[0.0] * 4 for _ in range(n)]   # per group: stalled, elements, ||k||^2, ||theta||^2
    meshes: dict[collectives.Groups, list[float]] = {}   # per mesh: those 4 sums of every group
    groups_of = sharding.MeshGroups()
    for g in optimizer.param_groups:   # the meshes in the order of their first parameter
        for p in g["params"]:
            if sharding.is_dtensor(p) and (groups := groups_of(p)):
                meshes.setdefault(groups, [0.0] * (4 * n))

    def add(i: int, share: sharding.Share, at: int, value: float) -> None:
        if share.weight == 0 or not share.groups:
            plain[i][at] += value * (share.weight or 1.0)
        else:
            meshes[share.groups][4 * i + at] += value * share.weight

    for i, group in enumerate(optimizer.param_groups):
        for stalled, numel, share in optimizer._last_stalled.get(i, []):
            add(i, share, 0, value(stalled))
            add(i, share, 1, numel)
        for p in group["params"]:
            k = optimizer.state.get(p, {}).get("compensation")
            if k is not None:
                share = sharding.Share(1.0 / sharding.replicas(p), groups_of(p)) \
                    if sharding.is_dtensor(p) else sharding.OWN
                add(i, share, 2, float(sharding.local(k).float().square().sum()))
                add(i, share, 3, float(sharding.local(p).detach().float().square().sum()))
    sums = [list(v) for v in plain]
    for vals in collectives.sums_by_mesh(meshes).values():
        for i in range(n):
            for at in range(4):
                sums[i][at] += vals[4 * i + at]
    out: list[dict[str, float]] = []
    for stalled_sum, count, comp_sq, weight_sq in sums:
        out.append({
            "stalled_fraction": stalled_sum / count if count and not math.isnan(stalled_sum) else 0.0,
            "compensation_rel": math.sqrt(comp_sq / weight_sq) if weight_sq else 0.0,
            "skipped_params": float(optimizer.skipped_params),
            "skipped_steps": float(optimizer.skipped_steps),
        })
    return out
