"""lowp's optimizers on meshes that are not the whole default group: pipeline stages (each stage's
parameters FSDP2-sharded over its own sub-mesh, another number of them per stage) and HSDP
(``(Replicate(), Shard(0))``) and a parameter cut twice (``(Shard(0), Shard(0))``), on 4 real
gloo ranks (tests/mesh_worker.py).

The step's collectives (the non-finite flags' agreement, StableAdamW's exchanged sums, the
gathers, the diagnostics' sums) run over each parameter's mesh: the stages neither wait for nor
mix with each other, and an HSDP sum travels over the sharded dimension only. Every stage's
result equals its single-process run bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import mesh_worker as w
from lowp.distributed.launch import run_local_group


@pytest.fixture(scope="module")
def four_ranks():
    return run_local_group(w.session, 4, w.MESH_CASES, timeout_s=60)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("k", range(len(w.MESH_CASES)), ids=lambda k: "-".join(map(str, w.MESH_CASES[k][:3])))
def test_each_mesh_steps_as_one_process(four_ranks, k):
    """Per rank: the full parameters and states of its stage equal the single-process run's bit
    for bit, and so do the diagnostics' counts (``compensation_rel`` sums squares per shard: to
    rounding); StableAdamW's parameters from ``sharded_sums.min_numel`` up exchange their sums
    once per step over the groups of the sharded dimensions (a stage's ``dp``, HSDP's sharded
    one, both dimensions of a tensor cut twice), the smaller ones gathered; an elementwise
    optimizer gathers and exchanges nothing. The NaN of a case is skipped on every rank of its
    mesh, and only there."""
    layout, name, nonfinite, nan_at = w.MESH_CASES[k]
    wants = {stage: w.reference(layout, stage, name, nonfinite, nan_at) for stage in (0, 1)}
    for rank, results in enumerate(four_ranks):
        got = results["cases"][k]
        stage = got["stage"]
        assert stage == (rank // 2 if layout == "stages" else 0)
        want = wants[stage]
        assert sorted(got["snapshot"]) == sorted(want["snapshot"])
        for key, t in want["snapshot"].items():
            assert torch.equal(_bits(got["snapshot"][key]), _bits(t)), f"rank {rank}, {key} differs"
        for step, (g, r) in enumerate(zip(got["diagnostics"], want["diagnostics"])):
            assert g[0] == r[0] and g[2:] == r[2:], (rank, step, g, r)
            assert math.isclose(g[1], r[1], rel_tol=1e-6), (rank, step, g, r)
        small = sum(math.prod(s) < (got["min_numel"] or 0) for s in w.shapes(layout, stage))
        if name == "StableAdamW":
            stepped = w.STEPS - (nan_at is not None and nonfinite == "skip_step")
            assert got["exchanges"] == w.EXCHANGE_GROUPS[layout] * stepped, (rank, got["exchanges"])
            assert got["gathered"] == [5 * small * stepped], (rank, got["gathered"])   # weight, grad, 2 states, buffer
        elif name == "AdamW":
            assert got["exchanges"] == [] and got["gathered"] == [0], (rank, got)
        else:
            assert got["exchanges"] == [] and got["gathered"][0] > 0, (rank, got)
    if nan_at is not None:   # the NaN's parameter (its whole step) skipped on its mesh, nothing elsewhere
        counter = 2 if nonfinite == "skip_param" else 3
        skipped = {stage: want["diagnostics"][-1][counter] for stage, want in wants.items()}
        assert skipped[nan_at[0]] == 1 and (layout != "stages" or skipped[1 - nan_at[0]] == 0), skipped
        for rank, results in enumerate(four_ranks):   # every rank of the NaN's stage skipped as its reference
            got = results["cases"][k]
            if got["stage"] == nan_at[0]:
                assert got["diagnostics"][-1][counter] == 1, (rank, got["diagnostics"])


#: per failure of mesh_worker.FAILURES: the error the other rank of the stage raises
PEER_ERRORS = {"pieces": "ExchangeError: sharded sums: another rank failed before its part",
               "stage": "ExchangeError: sharded sums: another rank failed before its part",
               "flags": "PeerFailed: another rank failed before the ranks agreed on their checks",
               "load": "PeerFailed: another rank failed before the ranks agreed on their checks",
               "translate": "PeerFailed: another rank failed before the ranks agreed on their checks",
               "read": "PeerFailed: another rank failed before the ranks agreed on their checks",
               "place": "PeerFailed: another rank failed before the ranks agreed on their checks",
               "states": "PeerFailed: another rank failed before the ranks agreed on their checks"}


def test_messages_of_the_lengths_of_the_last_exchange_take_one_all_gather(four_ranks):
    """``collectives.all_messages`` on each stage's group: every rank gets both messages in group
    order; the group's first exchange takes two all-gathers (the lengths are not known yet), the
    same lengths again one, a longer message two; shorter ones one (the padded length is kept
    until a message is shorter than a quarter of it, then the shorter one is the new length); a
    failed rank's ``None`` reaches both ranks in the one all-gather; empty messages give an empty
    one."""
    want_gathers = [2, 1, 2, 1, 1, 2, 1, 1]
    for rank, results in enumerate(four_ranks):
        got = results["messages"]
        assert got["gathers"] == want_gathers, (rank, got["gathers"])
        for k, lengths in enumerate(w.MESSAGE_LENGTHS):
            if None in lengths:
                assert got["got"][k] is None, (rank, k)
                continue
            want = [100.0 * k + 10 * i + j for i, n in enumerate(lengths) for j in range(n)]
            assert got["got"][k] == want, (rank, k, got["got"][k])


@pytest.mark.parametrize("k", range(len(w.FAILURES)), ids=lambda k: "-".join(w.FAILURES[k]))
def test_a_rank_that_fails_before_a_collective_fails_its_stage_cleanly(four_ranks, k):
    """Rank 3 fails (injected) while making its pieces of StableAdamW's sums, preparing its step
    before their exchange (staging the kernel's launches; the reference's preparation), checking
    its gradients for the agreement on non-finite ones, making the states of a full step of
    StableAdamW or Adafactor (made before that agreement, so its failure travels in it), or in a
    load: translating the state dict (which may run a third-party ``dequantize``), reading a
    group, checking a
    state laid out again while rank 2 goes on to lay out the next parameter's (a redistribution),
    checking the values. It still takes part in the next collective, so rank 2 raises instead of
    waiting for it, rank 3 raises its own error, neither changed anything (the load, made again
    on both, succeeds), and the step taken again gives the single-process bits;
    the other stage never noticed. On the native kernel the failing step is the cached plan's
    (StableAdamW's plan exchanges its sums itself), on the reference a full step. Each case makes
    its mesh again (a process's second ``init_device_mesh``: its gradients' mesh is equal to the
    parameters', not the same object), which the plan takes. A Ctrl-C on rank 3 right after the
    exchange of the plan's sums is held until the step is done: both ranks step (rank 2 would
    otherwise write alone), rank 3 raises ``KeyboardInterrupt`` after it."""
    name, where, backend = w.FAILURES[k]
    want = {stage: w.reference("stages", stage, name, "skip_param", None) for stage in (0, 1)}
    errors = [r["failures"][k]["error"] for r in four_ranks]
    if where == "interrupt":
        assert errors[:3] == [None, None, None] and errors[3].startswith("KeyboardInterrupt"), errors
    else:
        assert errors[:2] == [None, None], errors
        assert errors[2].startswith(PEER_ERRORS[where]), errors
        assert errors[3] == f"MemoryError: injected into rank 3's {where}", errors
    for rank, results in enumerate(four_ranks):
        got = results["failures"][k]
        unchanged = None if rank < 2 else where != "interrupt"
        assert got["unchanged"] is unchanged, (rank, got["unchanged"])
        if rank >= 2:   # on the native kernel the failing step is the cached plan's (StableAdamW: its own exchange)
            assert got["planned"] is (backend == "native"), (rank, got)
        for key, t in want[got["stage"]]["snapshot"].items():
            assert torch.equal(_bits(got["snapshot"][key]), _bits(t)), f"rank {rank}, {key} differs"


def test_states_made_for_a_parameter_another_rank_skips_are_taken_back(four_ranks):
    """A NaN in rank 2's shard of a parameter at the first step: rank 3, whose shard is finite,
    makes the parameter's states before the ranks agree on the flags (so that running out of
    memory there would reach rank 2), then takes them back: right after the step neither rank
    holds a state of it, as the single-process run, whose snapshot after every step both equal."""
    want = {stage: w.reference("stages", stage, "AdamW", "skip_param", (1, 1, 5, 0)) for stage in (0, 1)}
    for rank, results in enumerate(four_ranks):
        got = results["first_step_nan"]
        if rank >= 2:
            assert got["keys"][1] == [], (rank, got["keys"])
            assert got["keys"][0] and got["keys"][2], (rank, got["keys"])
        else:
            assert all(got["keys"]), (rank, got["keys"])
        assert sorted(got["snapshot"]) == sorted(want[got["stage"]]["snapshot"])
        for key, t in want[got["stage"]]["snapshot"].items():
            assert torch.equal(_bits(got["snapshot"][key]), _bits(t)), f"rank {rank}, {key} differs"


@pytest.mark.parametrize("k", range(len(w.COUNTS)), ids=lambda k: "-".join(w.COUNTS[k]))
def test_step_counts_that_differ_between_ranks_stop_the_step_on_each(four_ranks, k):
    """One rank holds a parameter's step count one ahead of the others' (a step that failed
    part-way on it and a loop that went on): the non-finite flags' all-reduce compares the
    DTensor parameters' counts too, so every rank that holds the parameter raises
    ``CountsDiffer`` before anything is written: on a full step (``foreach``), on a cached plan's
    (``native``: rank 2 takes the plan, rank 3, whose count no longer matches it, a full step;
    their all-reduces are the same), and for a parameter on a sub-mesh (``submesh``: its count
    differs within one column; every position's count travels in the whole mesh's all-reduce too,
    so the other column, which holds the same count twice, raises as well, and no rank writes its
    shards of the parameter on the whole mesh). With the count put back, the run gives the
    single-process bits; under ``stages`` the other stage never noticed."""
    layout, backend = w.COUNTS[k]
    stages = (0, 1) if layout == "stages" else (0,)
    want = {stage: w.reference(layout, stage, "AdamW", "skip_param", None) for stage in stages}
    involved = [rank >= 2 if layout == "stages" else True for rank in range(4)]
    position = w.AHEAD[layout][1]
    errors = [r["counts"][k]["error"] for r in four_ranks]
    for rank, error in enumerate(errors):
        if not involved[rank]:
            assert error is None, errors
            continue
        assert error.startswith(f"CountsDiffer: step counts differ between the ranks that hold 1 parameter(s) (the "
                                f"first, at position {position} of the step's parameters with a gradient: 1 on one "
                                f"rank, 2 on another)"), errors
    for rank, results in enumerate(four_ranks):
        got = results["counts"][k]
        assert got["unchanged"] is (True if involved[rank] else None), (rank, got["unchanged"])
        if involved[rank]:
            assert got["planned"] is (backend == "native"), (rank, got)
        for key, t in want[got["stage"]]["snapshot"].items():
            assert torch.equal(_bits(got["snapshot"][key]), _bits(t)), f"rank {rank}, {key} differs"


def test_a_plan_with_exchanged_sums_and_a_gathered_remainder(four_ranks):
    """StableAdamW with one parameter per stage gathered (cut along dimension 1) and the others'
    sums exchanged, on a mesh made again in the process: every step after the first comes from
    the cached plan (the gathered parameter its remainder), bit-identical to the single process;
    also when run again, where the gathered parameter's gradient holds an equal mesh, not its
    parameter's own object."""
    want = {stage: w.reference("stages", stage, "StableAdamW", "skip_param", None) for stage in (0, 1)}
    for rank, results in enumerate(four_ranks):
        for run, got in enumerate(results["remainder"]):
            assert (got["cached"], got["remainder"]) == (w.STEPS - 1, 1), (rank, run, got["cached"], got["remainder"])
            for key, t in want[got["stage"]]["snapshot"].items():
                assert torch.equal(_bits(got["snapshot"][key]), _bits(t)), f"rank {rank}, run {run}, {key} differs"
        assert not all(got["same mesh"] for got in results["remainder"]), rank   # the equal mesh was met
