"""A job's stalled count (lowp/optim/stalled.py): kept as its producers made it, added when read."""
from __future__ import annotations

import math

import torch

from lowp.optim import stalled


def test_total_keeps_the_counts_without_arithmetic():
    t = torch.tensor([2, 5], dtype=torch.int32)
    assert stalled.total([]) is None and stalled.total([None, None]) is None
    assert stalled.total([None, 7]) == 7
    assert stalled.total([t, None]) is t
    kept = stalled.total([3, None, t])
    assert isinstance(kept, tuple) and kept[0] == 3 and kept[1] is t


def test_added_sums_each_devices_tensors_into_one_and_the_ints_into_one():
    chunks = [torch.tensor(3), torch.tensor([1, 2], dtype=torch.int32), None, (torch.tensor(4), 5)]
    kept = stalled.added(chunks)
    assert isinstance(kept, tuple) and kept[0] == 5 and torch.equal(kept[1], torch.tensor(10))
    assert kept[1].dtype == torch.int64
    assert stalled.added([7, 8]) == 15 and stalled.added([None]) is None
    assert stalled.value(stalled.added(chunks)) == stalled.value(tuple(chunks[:2] + chunks[3:])) == 15


def test_value_adds_every_part_exactly():
    per_block = torch.tensor([1, 2, 3], dtype=torch.int32)      # Triton's per-block counts
    reference = torch.tensor(10, dtype=torch.int64)             # the reference pipeline's
    nested = (4, (per_block, (reference, 2**40)), torch.zeros(0, dtype=torch.int32))
    assert stalled.value(nested) == 4 + 6 + 10 + 2**40
    assert stalled.value(0) == 0.0 and stalled.value(per_block) == 6.0
    assert math.isnan(stalled.value(None))


def test_a_job_without_elements_counts_zero_on_the_cached_plan_as_on_a_full_step():
    """A group whose fp32 parameter is empty has a job with no kernel launch: it counts 0
    stalled elements (not "not counted", which would make the group's fraction unknown), on
    the step from the cached plan as on a full step."""
    import lowp.optim as lo
    from lowp.optim.kernels import native_available

    backend = "native" if native_available() else "foreach"
    weights = [torch.zeros(64, dtype=torch.bfloat16), torch.zeros(0)]   # zero updates: every element stalls
    opt = lo.AdamW([{"params": weights}], lr=1e-3, weight_decay=0.0, backend=backend, seed=0)
    fractions = []
    for _ in range(3):
        for w in weights:
            w.grad = torch.zeros_like(w)
        opt.step()
        fractions.append(opt.diagnostics()[0]["stalled_fraction"])
    assert fractions == [1.0, 1.0, 1.0]
    if backend == "native":
        assert opt._plans.cached_steps == 2
