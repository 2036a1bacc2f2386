"""A job's count of stalled elements: those whose stored weight the step left unchanged (the
update was lost to rounding, or was zero), as ``diagnostics()`` reports them.

A count is kept as its producer made it, with no arithmetic once the step has written: a host
``int`` (the native kernel), a tensor (the reference pipeline; Triton's per-block counts, on the
device), a tuple of such parts (a job whose slices took several paths), or ``None`` (not
counted). :func:`value` adds the parts when the diagnostics read them; :func:`added` adds
them at once, for the reference pipeline. After a job's first write
nothing may allocate until its parameters' counters have advanced: an allocation failing there
(out of memory on a GPU) would leave a parameter with new weights and states but its old step
count.
"""
from __future__ import annotations

import math
from typing import Iterable, Union

import torch

__all__ = ["Stalled", "total", "of_job", "added", "value"]

#: a stalled count: an ``int``, a tensor of counts, a tuple of parts, or ``None`` (not counted)
Stalled = Union[int, torch.Tensor, tuple["Stalled", ...], None]


def total(counts: Iterable[Stalled]) -> Stalled:
    """``counts`` as one count, without arithmetic: ``None`` when none was counted, else the one
    count or the tuple of them."""
    present = tuple(c for c in counts if c is not None)
    return None if not present else present[0] if len(present) == 1 else present


def of_job(counts: list[Stalled], counted: bool) -> Stalled:
    """A kernel job's count from its launches' ``counts`` (:func:`total`): 0 for a job without
    launches (its shards are all empty: nothing stepped, nothing stalled), ``None`` when the step
    does not count (``counted`` false)."""
    if not counted:
        return None
    return total(counts) if counts else 0


def _parts(counts: Iterable[Stalled]) -> tuple[list[int], dict[torch.device, list[torch.Tensor]]]:
    """The ints and, per device, the flattened int64 tensors of ``counts`` (tuples opened)."""
    flat: list[Stalled] = list(counts)
    ints: list[int] = []
    tensors: dict[torch.device, list[torch.Tensor]] = {}
    while flat:
        part = flat.pop()
        if isinstance(part, tuple):
            flat.extend(part)
        elif isinstance(part, torch.Tensor):
            tensors.setdefault(part.device, []).append(part.reshape(-1).to(torch.int64))
        elif part is not None:
            ints.append(part)
    return ints, tensors


def added(counts: Iterable[Stalled]) -> Stalled:
    """``counts`` added now, for the paths that allocate anyway (the reference pipeline, whose
    chunks would otherwise keep a tensor each until the next step): the tensors of one device
    into one int64 tensor, the ints into one int; ``None`` when none was counted."""
    ints, tensors = _parts(counts)
    sums: list[Stalled] = [torch.cat(parts).sum() for parts in tensors.values()]
    return total(([sum(ints)] if ints else []) + sums)


def value(count: Stalled) -> float:
    """The number of elements ``count`` stands for: the sum of all its parts' elements (one
    int64 sum per device for the tensors); NaN for ``None``."""
    if count is None:
        return math.nan
    ints, tensors = _parts([count])
    return float(sum(ints)) + sum(float(torch.cat(parts).sum()) for parts in tensors.values())
