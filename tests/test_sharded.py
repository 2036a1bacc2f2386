"""lowp optimizers on DTensor parameters (FSDP2 ``fully_shard``, tensor parallel placements) and
torch.distributed.checkpoint, on real gloo process groups of spawned ranks.

The ranks run everything in three launches (module fixtures; a launch is mostly process start
and torch's import): 1 rank saving checkpoints, 2 ranks for the step cases, checkpoints (saved
here and resumed from 1 rank) and mixed precision, then 1 rank resuming the 2-rank checkpoints.
``run_local_group`` fails the test when a rank raises, hangs or dies by a signal. Every
comparison is bit for bit against a single-process run on plain tensors.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch

import sharded_worker as w
from lowp.distributed.advisor import FSDP_REDUCES_IN_PARAM_DTYPE
from lowp.distributed.launch import run_local_group
from lowp.optim import sharding
from lowp.optim.kernels.native import rebuild as native_rebuild

STEP_CASES = [("fsdp", name, mode, backend, None, "skip_param")
              for name in w.OPTIMIZERS for mode in w.MODES for backend in ("fused", "unfused")]
TP_CASES = [("shard1", "AdamW", "kahan", "fused", None, "skip_param"),
            ("shard1", "StableAdamW", "exact", "fused", None, "skip_param"),
            ("shard1", "Adafactor", "kahan", "unfused", None, "skip_param"),
            ("replicate", "AdamW", "exact", "fused", None, "skip_param"),
            ("replicate", "Lion", "kahan", "unfused", None, "skip_param"),
            ("shard1", "AdamW", "exact8", "fused", None, "skip_param")]
# flat element 29 of the (6, 5) parameter is in the last row: rank 1's shard of 2, rank 3's... of 4
NAN_CASES = [("fsdp", "AdamW", "kahan", "fused", (0, 29), "skip_param"),
             ("fsdp", "Lion", "exact", "unfused", (0, 29), "skip_step"),
             ("fsdp", "Adafactor", "kahan", "fused", (0, 29), "skip_param")]
# the NaN at the last step, which the ranks take from their cached plans (lowp.optim.cached_step):
# the flags must agree over the ranks there too, also when one rank takes a full step instead
# (its plan dropped before the last step: a 7th entry names it), which makes the same collective;
# with nonfinite="off" no rank makes one
PLAN_NAN_CASES = [("fsdp", "AdamW", "kahan", "fused", (0, 29, 2), "skip_param"),
                  ("fsdp", "SGD", "exact", "fused", (0, 29, 2), "skip_step"),
                  ("fsdp", "AdamW", "kahan", "fused", (0, 29, 2), "skip_param", 0),
                  ("fsdp", "AdamW", "kahan", "fused", (0, 29, 2), "skip_param", 1),
                  ("fsdp", "Lion", "exact", "fused", (0, 29, 2), "skip_step", 1),
                  ("fsdp", "AdamW", "kahan", "fused", None, "skip_param", 1),
                  ("fsdp", "AdamW", "exact", "fused", None, "off"),
                  ("fsdp", "AdamW", "kahan", "fused", None, "off", 0),
                  # StableAdamW's plan exchanges the sums each step: a rank on its full step meets it
                  ("fsdp", "StableAdamW", "kahan", "fused", (0, 29, 2), "skip_param"),
                  ("fsdp", "StableAdamW", "kahan", "fused", (0, 29, 2), "skip_step", 1),
                  ("fsdp", "StableAdamW", "exact", "fused", None, "skip_param", 0)]
# the modes that draw the weight stream (indexed by global element: the shards must draw the whole
# tensor's bits)
SR_CASES = [("fsdp", name, mode, backend, None, "skip_param") for mode in ("stochastic", "exact8")
            for name in ("AdamW", "SGD") for backend in ("fused", "unfused")]
CASES = STEP_CASES + TP_CASES + NAN_CASES + PLAN_NAN_CASES + SR_CASES
SD_CASES = [("AdamW", "kahan"), ("Adafactor", "exact")]
# torch.compile is slow to start: the compiled backend runs in the slow test only
COMPILED_CASES = [("fsdp", "AdamW", "kahan", "compiled", None, "skip_param"),
                  ("shard1", "Lion", "exact", "compiled", None, "skip_param")]


def split(results: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A case's tensors (parameters and states) and its extras (skip counts, checks, diagnostics)."""
    extras = ("skipped", "meta", "diag", "elements")
    return ({k: v for k, v in results.items() if k not in extras},
            {k: v for k, v in results.items() if k in extras})


def assert_same_diagnostics(got: torch.Tensor, want: torch.Tensor) -> None:
    """Stalled fractions are ratios of exact counts; compensation_rel sums squares per shard."""
    assert got[0] == want[0]
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, f"{what}: {k}"
        assert torch.equal(_bits(got[k]), _bits(want[k])), f"{what}: {k} differs"


@functools.cache
def coded_dicts() -> dict[str, dict[str, dict]]:
    """Per coded case's states: single-process state dicts after all but the last step, loaded by
    sharded optimizers (block-scaled states, and bf16 states that the load encodes)."""
    return {states: {"from_plain": w.coded_state_dict(states, w.STEPS - 1),
                     "from_bf16": w.coded_state_dict(states, w.STEPS - 1, torch.bfloat16)}
            for states in w.CODED_STATES}


@pytest.fixture(scope="module")
def first_rank(tmp_path_factory):
    """1 rank: checkpoints for the 2 ranks to resume, and the 1-rank mixed-precision run."""
    folder = tmp_path_factory.mktemp("dcp")
    spec = {"folder": str(folder), "save": ["kahan", "exact", w.CODED], "mp": ["fp32"],
            "coded": ONE_RANK_CODED_CASES, "coded_state_dicts": coded_dicts()}
    return folder, run_local_group(w.session, 1, spec, timeout_s=120)[0]


@pytest.fixture(scope="module")
def two_ranks(first_rank):
    folder, _ = first_rank
    state_dicts = [(name, mode, w.plain_state_dict(name, mode, w.STEPS - 1)) for name, mode in SD_CASES]
    spec = {"folder": str(folder), "steps": CASES, "state_dict": state_dicts, "save": ["kahan", "exact", w.CODED],
            "reload": True, "load": ["kahan-1", "exact-1", f"{w.CODED}-1"], "mp": ["fp32", "bf16"],
            "reduce_scatter": True, "errors": True, "gather": True, "coded": w.CODED_CASES,
            "plan_changes": list(w.PLAN_CHANGES), "grad_scaler": GRAD_SCALER_CASES, "coded_plans": w.CODED_PLAN_CASES,
            "remainder_failure": True, "decode": True, "per_tensor_coded": True, "sums": True,
            "coded_state_dicts": coded_dicts()}
    return folder, run_local_group(w.session, 2, spec, timeout_s=120)


@pytest.fixture(scope="module")
def one_rank(two_ranks):
    """1 rank resuming the 2-rank checkpoints."""
    folder, _ = two_ranks
    return run_local_group(w.session, 1, {"folder": str(folder), "load": ["kahan-2", "exact-2", f"{w.CODED}-2"]},
                           timeout_s=120)[0]


def _case_id(case) -> str:
    layout, name, mode, backend, nan_at, nonfinite, *full_step_rank = case
    return (f"{layout}-{name}-{mode}-{backend}" + (f"-nan{'-at-last' if nan_at and len(nan_at) > 2 else ''}-{nonfinite}"
                                                  if nan_at else "")
            + "".join(f"-rank{r}-full" for r in full_step_rank))


def expected_plan_counts(case, rank: int) -> tuple[int, int]:
    """(cached, agreed) steps of ``rank`` (lowp.optim.cached_step.Plans): DTensor parameters whose
    local boxes are contiguous ranges (FSDP rows, replicas) of an elementwise optimizer on the
    native kernel, or shards of one that exchanges its sums (StableAdamW), take every step from
    a plan after the first full step whose gradients were all finite, and (unless
    nonfinite="off") agree their flags over the ranks in each. A NaN at the first step makes no
    plan; at the last, a plan skips the step whole (skip_step, counted) or
    agrees and hands it to a full step (skip_param: the kernel cannot skip a tensor for another
    rank's shard). A rank whose plan was dropped before the last step takes it in full."""
    layout, name, mode, backend, nan_at, nonfinite, *full_step_rank = case
    cls = w.OPTIMIZERS[name][0]
    sums = cls.shards_sums() and layout in ("fsdp", "shard1")   # shard1: the vectors', the matrices its remainder
    if backend != "fused" or not (sums or (cls.elementwise and layout != "shard1")):
        return 0, 0
    at_first = nan_at is not None and len(nan_at) < 3
    planned = w.STEPS - 1 - at_first - (full_step_rank == [rank])   # steps that met a plan
    handed = nan_at is not None and not at_first and nonfinite == "skip_param" and full_step_rank != [rank]
    return planned - handed, 0 if nonfinite == "off" else planned


def assert_sharded_elements(layout: str, name: str, backend: str, ranks: list[torch.Tensor],
                            want: torch.Tensor) -> None:
    """Where the elements of a sharded run went, per rank ``(fused, reference)`` element-steps,
    against the single-process run's ``want``: FSDP shards (contiguous rows) split the same
    elements over the ranks, and so do per-tensor optimizers that exchange their sums (StableAdamW,
    :func:`assert_sums_case`; under ``Shard(1)`` only the vectors' sums, the matrices gathered);
    replicated ranks and the other per-tensor optimizers (gathered full tensors: Adafactor) each
    run all of them, and ``Shard(1)`` slices of a matrix (not one contiguous range) take the
    reference pipeline. The compiled backend leaves one-element shards (4 ranks) to the reference
    too. ``-1``: a backend without kernels."""
    total = torch.stack(ranks).sum(0)
    if backend == "unfused":
        assert torch.equal(want, torch.tensor([-1, -1])) and all(torch.equal(r, want) for r in ranks)
        return
    assert (int(want[0]) == 0) == (name == "Adafactor"), f"{name}: {want.tolist()}"  # no fused form of Adafactor
    cls = w.OPTIMIZERS[name][0]
    exchanged = cls.shards_sums() and backend == "fused"   # the native kernel's threshold is 0 (sharded_sums)
    if layout == "replicate" or not (cls.elementwise or exchanged):
        assert all(torch.equal(r, want) for r in ranks), f"{ranks} against {want}"
    elif not cls.elementwise and layout == "shard1":   # the vectors' sums exchanged, the matrices gathered
        assert all(0 < int(r.sum()) < int(want.sum()) for r in ranks) and int(total.sum()) > int(want.sum()), \
            f"{ranks} against {want}"
    elif layout == "fsdp":
        assert int(total.sum()) == int(want.sum()), f"{ranks} against {want}"
        assert torch.equal(total, want) if backend == "fused" else int(total[0]) > 0, f"{ranks} against {want}"
    else:   # shard1: every element once, the matrices' shards through the reference, the vectors fused
        assert int(total.sum()) == int(want.sum()) and 0 < int(total[0]) < int(want[0]), f"{ranks} against {want}"
        assert all(int(r[1]) > 0 for r in ranks), ranks


@pytest.mark.parametrize("case", STEP_CASES + TP_CASES + NAN_CASES + PLAN_NAN_CASES, ids=_case_id)
def test_sharded_step_equals_unsharded(two_ranks, case):
    _, ranks = two_ranks
    index = CASES.index(case)
    layout, name, mode, backend, nan_at, nonfinite, *full_step_rank = case
    want, want_extra = split(w.reference(name, mode, backend, nan_at, nonfinite))
    assert_sharded_elements(layout, name, backend, [split(r["steps"][index])[1]["elements"] for r in ranks],
                            want_extra["elements"])
    for rank, results in enumerate(ranks):
        got, extra = split(results["steps"][index])
        skipped, meta = extra["skipped"], extra["meta"]
        assert_same(got, want, f"rank {rank}")
        assert_same_diagnostics(extra["diag"], want_extra["diag"])
        assert int(meta[0]) == 1, "to_local() must alias the parameter's storage"
        assert int(meta[2]) == (backend == "fused"), "fused=True runs the native kernel on CPU"
        if nan_at is not None:   # every rank skipped, also the one whose shard was finite
            assert skipped.tolist() == ([1, 0] if nonfinite == "skip_param" else [0, 1])
            assert skipped.tolist() == want_extra["skipped"].tolist()
        counts = expected_plan_counts(case, rank)
        assert (int(meta[3]), int(meta[4])) == counts, f"rank {rank}: (cached, agreed) steps, expected {counts}"
        if layout == "fsdp" and "p0.exp_avg" in want:   # moments sharded: about half per rank
            assert int(meta[1]) < sum(v.numel() for k, v in want.items() if k.endswith(".exp_avg"))


# FSDP2's ShardedGradScaler: clean, and a NaN in rank 1's shard at the last step (found_inf,
# all-reduced by the scaler, skips the step on every rank); AdamW, and StableAdamW, whose plan
# exchanges sums of the unscaled gradients' terms
GRAD_SCALER_CASES = [(name, nan_at) for name in ("AdamW", "StableAdamW") for nan_at in (None, (0, 29, 2))]


@pytest.mark.parametrize("case", GRAD_SCALER_CASES, ids=lambda c: f"{c[0]}-{'NaN at the last step' if c[1] else 'ok'}")
def test_sharded_grad_scaler_steps_take_the_plan(two_ranks, case):
    """GradScaler hands the optimizer gradients it has checked: the plan runs without a check or
    a collective of its own (no agreed steps) and gives the unscaled single-process run's bits
    (a scale of 16 is exact)."""
    _, ranks = two_ranks
    name, nan_at = case
    want, want_extra = split(w.reference(name, "kahan", "fused", nan_at, "skip_step"))
    for rank, results in enumerate(ranks):
        got = dict(results["grad_scaler"][GRAD_SCALER_CASES.index(case)])
        plans, skipped = got.pop("plans"), got.pop("skipped")
        assert plans.tolist() == [1 if nan_at else 2, 0], f"rank {rank}: (cached, agreed) steps"
        assert skipped.tolist() == want_extra["skipped"].tolist() == [0, int(nan_at is not None)]
        assert_same(got, want, f"rank {rank}")


@pytest.mark.parametrize("change", list(w.PLAN_CHANGES))
def test_a_change_to_sharded_parameters_takes_the_full_step(two_ranks, change):
    """A cached plan of DTensor parameters sees what its signature covers: gradients placed
    unlike their parameters (redistributed by the full step), a parameter swapped onto a new local
    tensor (``torch.utils.swap_tensors``), a state replaced. The last step is then a full one
    (one cached step, the second), and every rank holds the single-process run's bits."""
    _, ranks = two_ranks
    want, _ = split(w.reference("AdamW", "kahan", "fused"))
    for rank, results in enumerate(ranks):
        got = dict(results["plan_changes"][change])
        assert int(got.pop("cached")) == 1, f"rank {rank}"
        assert_same(got, want, f"rank {rank}")


@pytest.mark.parametrize("case", SR_CASES, ids=_case_id)
def test_stochastic_rounding_same_bits_at_any_world_size(two_ranks, case):
    """Counter-based random bits indexed by the global element (lowp.optim.randomness): the bits
    of a 2-rank run equal the single-process run's. Needs the stochastic-rounding backends drawn
    from ``random16(global index, stream_key(...))``; generator-based draws depend on the shard."""
    _, ranks = two_ranks
    layout, name, mode, backend, nan_at, nonfinite = case
    want, want_extra = split(w.reference(name, mode, backend, nan_at, nonfinite))
    assert_sharded_elements(layout, name, backend, [split(r["steps"][CASES.index(case)])[1]["elements"] for r in ranks],
                            want_extra["elements"])
    for rank, results in enumerate(ranks):
        got, _ = split(results["steps"][CASES.index(case)])
        assert_same(got, want, f"rank {rank}")


@pytest.mark.parametrize("mode", ["kahan", "exact", w.CODED])
def test_fsdp_training_equals_unsharded_and_checkpoint_resumes(first_rank, two_ranks, one_rank, mode):
    """``coded``: int8 / uint8 states in blocks of 32 on an MLP whose shards hold whole blocks
    (the weights, the 64-bias) or split them (the 8-bias: replicated codes), saved at one world
    size and resumed at another."""
    _, ranks = two_ranks
    plain = w.plain_train(mode)
    saved = ranks[0]["save"][mode]
    assert saved["sharded"], "DCP must see DTensor optimizer states"
    # FSDP2's gradients, reduce-scattered, stepped from the cached plan after the first step (the
    # coded MLP's 8-bias splits blocks: its codes are replicated, and the plan leaves it to a full
    # step, gathered, at each of its steps); one rank: a mesh that splits nothing
    assert [r["save"][mode]["cached"] for r in ranks] == [3] * 2
    assert first_rank[1]["save"][mode]["cached"] == 3
    assert saved["losses"] == plain["losses"]
    assert_same(saved["model"], plain["model"], "weights after 4 FSDP steps")
    assert_same(saved["optim"], plain["optim"], "states after 4 FSDP steps")
    remainder = "remainder" if mode == "exact" else "compensation"
    if mode == w.CODED:
        assert (saved["dtypes"]["0.exp_avg"], saved["dtypes"]["0.exp_avg_sq"]) == ("torch.int8", "torch.uint8")
        assert saved["dtypes"]["0.exp_avg_scale"] == "torch.bfloat16"
    else:
        assert saved["dtypes"]["0.exp_avg"] == "torch.float32"
    assert saved["dtypes"][f"0.{remainder}"] == ("torch.int16" if mode == "exact" else "torch.bfloat16")
    for rank, results in enumerate(ranks):   # same world size, fresh model and optimizer
        resumed = results["load"][f"{mode}-2"]
        assert resumed["losses"] == plain["losses"][2:]
        assert resumed["dtypes"] == saved["dtypes"]
        assert_same(resumed["model"], plain["model"], f"rank {rank} resumed weights")
        assert_same(resumed["optim"], plain["optim"], f"rank {rank} resumed states")
    resumed = one_rank["load"][f"{mode}-2"]   # saved at 2 ranks, loaded at 1
    assert resumed["dtypes"] == saved["dtypes"]
    assert resumed["losses"] == plain["losses"][2:]
    assert_same(resumed["model"], plain["model"], "resumed at 1 rank")
    assert_same(resumed["optim"], plain["optim"], "resumed at 1 rank")
    assert_same(first_rank[1]["save"][mode]["optim"], plain["optim"], "1 rank")
    for rank, results in enumerate(ranks):   # saved at 1 rank, loaded at 2
        resumed = results["load"][f"{mode}-1"]
        assert resumed["losses"] == plain["losses"][2:]
        assert_same(resumed["model"], plain["model"], f"rank {rank} resumed from 1 rank")
        assert_same(resumed["optim"], plain["optim"], f"rank {rank} resumed from 1 rank")


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_mixed_precision_policy_fp32_params(first_rank, two_ranks, reduce):
    """fp32 parameters, bf16 compute: with the same batch on every rank the reduced gradient is
    exact (g + g in either dtype, halved), so 2 ranks equal 1 rank bit for bit."""
    _, ranks = two_ranks
    two = ranks[0]["mp"][reduce]
    assert all(d == "torch.float32" for d in two["dtypes"].values())
    assert [r["mp"][reduce]["cached"] for r in ranks] == [3, 3], "FSDP2's fp32 gradients take the cached plan"
    assert_same(ranks[1]["mp"][reduce]["model"], two["model"], "rank 1 vs rank 0")
    if reduce in first_rank[1]["mp"]:
        one = first_rank[1]["mp"][reduce]
        assert two["losses"] == one["losses"]
        assert_same(two["model"], one["model"], "2 ranks vs 1")
        assert_same(two["optim"], one["optim"], "2 ranks vs 1")
    assert two["losses"][-1] < two["losses"][0]


@pytest.mark.parametrize("case", SD_CASES, ids="-".join)
def test_optimizer_state_dict_between_sharded_and_plain(two_ranks, case):
    """``opt.state_dict()`` of sharded parameters holds DTensor states; it loads into a fresh
    sharded optimizer and into a single-process one, and a single-process dict loads into a sharded
    optimizer; each continues bit-identically to the uninterrupted single-process run."""
    _, ranks = two_ranks
    want, _ = split(w.reference(*case, "fused"))
    for rank, results in enumerate(ranks):
        got = results["state_dict"][SD_CASES.index(case)]
        assert got["sharded_states"]
        for tag in ("resumed", "from_plain", "to_plain"):
            assert_same(got[tag], want, f"rank {rank} {tag}")


#: per coded parameter (:data:`sharded_worker.CODED_SHAPES` and the fp32 vector of 32), at 2 ranks:
#: whether its shards hold whole blocks of 32 (codes sharded like it) or not (codes replicated)
CODED_LAYOUTS = {"fsdp": ["(Shard(dim=0),)", "(Shard(dim=0),)", "(Replicate(),)", "(Shard(dim=0),)",
                          "(Replicate(),)"],
                 "shard1": ["(Shard(dim=1),)", "(Shard(dim=0),)", "(Replicate(),)", "(Shard(dim=1),)",
                            "(Replicate(),)"]}


# one rank: nothing is split, so every parameter's codes keep its placements, except the flat codes
# (one dimension) of the (5, 40) matrix in blocks of 32, which Shard(1) cannot place
ONE_RANK_CODED_CASES = [(layout, states, "fused") for layout in ("fsdp", "shard1") for states in w.CODED_STATES]
ONE_RANK_CODED_LAYOUTS = {"fsdp": ["(Shard(dim=0),)"] * 5,
                          "shard1": ["(Shard(dim=1),)", "(Shard(dim=0),)", "(Replicate(),)", "(Shard(dim=1),)",
                                     "(Shard(dim=0),)"]}


@pytest.mark.parametrize("case", ONE_RANK_CODED_CASES, ids="-".join)
def test_block_scaled_states_on_a_mesh_of_one_rank(first_rank, case):
    got = first_rank[1]["coded"][ONE_RANK_CODED_CASES.index(case)]
    assert got["placements"] == ONE_RANK_CODED_LAYOUTS[case[0]]
    assert_coded_case(case, got, "1 rank", world_size=1)


# (cached, agreed) steps of each rank in each of sharded_worker.CODED_PLAN_CASES (3 steps): the
# plan takes the second and third (its flags agreed unless nonfinite="off"), except where a NaN
# under "skip_param" hands the third to a full step with the agreed flags, a rank's plan was
# dropped before it, or a gradient placed otherwise ends the plan; with coded_min_numel=256 the
# parameters whose shards split blocks (5 x 40 and the fp32 vector of 32 at 2 ranks) keep 16-bit
# states and the plan keeps them too
CODED_PLAN_COUNTS = [[(1, 2)] * 2, [(2, 2)] * 2, [(1, 1), (1, 2)], [(2, 2), (1, 1)], [(2, 0)] * 2,
                     [(1, 0), (2, 0)], [(1, 1)] * 2, [(2, 2)] * 2, [(1, 2)] * 2]
#: the size of the last plan's remainder in each case (-1: the last step was a full one, which
#: leaves no plan)
CODED_PLAN_REMAINDERS = [[-1] * 2, [2] * 2, [-1] * 2, [2] * 2, [2] * 2, [2] * 2, [2] * 2, [0] * 2, [-1] * 2]


def _coded_plan_id(case) -> str:
    nan_at, nonfinite, drop_rank, replicate, coded_min_numel = case
    return "-".join([f"nan-in-p{nan_at[0]}" if nan_at else "finite", nonfinite,
                     *([f"rank{drop_rank}-full"] if drop_rank is not None else []),
                     *(["replicated-grad"] if replicate else []),
                     *([f"coded-min-{coded_min_numel}"] if coded_min_numel else [])])


@pytest.mark.parametrize("case", w.CODED_PLAN_CASES, ids=_coded_plan_id)
def test_a_plan_leaves_parameters_that_split_blocks_to_a_full_step(two_ranks, case):
    """Block-scaled states of FSDP2 parameters whose shards split blocks are replicated and
    stepped on gathered copies; the cached plan keeps the other parameters and leaves those, its
    remainder, to a full step at each of its steps. The ranks agree the flags of all parameters
    in one collective (the remainder's included), then gather, as a full step does: a NaN in a
    remainder parameter's shard on one rank, one rank's plan dropped, and a remainder gradient
    placed otherwise (the plan ends) all give the single-process bits, on both ranks."""
    _, ranks = two_ranks
    index = w.CODED_PLAN_CASES.index(case)
    nan_at, nonfinite, _, _, coded_min_numel = case
    want = w.coded_plan_reference(nan_at, nonfinite, coded_min_numel)
    want_skipped = want.pop("skipped")
    if nan_at is not None:
        assert want_skipped.tolist() == ([1, 0] if nonfinite == "skip_param" else [0, 1])
    for rank, results in enumerate(ranks):
        got = dict(results["coded_plans"][index])
        plans, skipped, remainder = got.pop("plans"), got.pop("skipped"), got.pop("remainder")
        assert_same(got, want, f"rank {rank}")
        assert skipped.tolist() == want_skipped.tolist(), f"rank {rank}"
        assert tuple(plans.tolist()) == CODED_PLAN_COUNTS[index][rank], f"rank {rank}: (cached, agreed) steps"
        assert int(remainder) == CODED_PLAN_REMAINDERS[index][rank], f"rank {rank}: the plan's remainder"


def test_codes_of_sharded_parameters_decode_when_coded_min_numel_rises(two_ranks):
    """FSDP2 parameters below a raised ``coded_min_numel`` (a vector whose shards hold whole
    blocks, a matrix whose codes are replicated, an fp32 vector): their codes decode into 16-bit
    states on the ``state_dict`` round trip, and the next step gives the single-process bits."""
    _, ranks = two_ranks
    params = [p.clone().requires_grad_() for p in w.coded_full(0)]
    want = w.decode_run(w.coded_optimizer(params, "int8-uint4"), params, w._set_plain_grad)
    small = [i for i, p in enumerate(params) if p.numel() < w.DECODE_MIN_NUMEL]
    assert small == [1, 2, 4] and all(want[f"p{i}.exp_avg"].dtype == params[i].dtype for i in small)
    assert "p0.exp_avg_scale" in want and not [k for k in want if k.endswith("_scale") and int(k[1]) in small]
    for rank, results in enumerate(ranks):
        assert_same(results["decode"], want, f"rank {rank}")


def test_block_scaled_states_of_a_per_tensor_optimizer(two_ranks):
    """StableAdamW steps each FSDP2 parameter on gathered copies; their block scales are gathered
    and written back with the codes (sharded ones too: before, the step got the rank's shard of
    the scales and refused the parameter), giving the single-process bits."""
    _, ranks = two_ranks
    params = [p.clone().requires_grad_() for p in w.coded_full(0)]
    want = w.per_tensor_coded_run(params, w._set_plain_grad)
    assert "p0.exp_avg_scale" in want
    for rank, results in enumerate(ranks):
        assert_same(results["per_tensor_coded"], want, f"rank {rank}")


def assert_sums_case(ranks: list[dict], world_size: int) -> None:
    """StableAdamW on FSDP2 shards with the whole tensors' sums exchanged (lowp.optim.sharded_sums):
    the single-process bits on every rank, native kernel and reference, every parameter's sum
    exchanged (a threshold of 0, the native kernel's default) with nothing gathered, or (65,536)
    the large parameter's exchanged and the small ones gathered in the same step; the native kernel makes
    the pieces of its shards (no terms computed with torch), the reference computes them; the
    native kernel's element-steps add up to the single process's only when nothing is gathered;
    on the native kernel every step after the first is taken from the cached plan, which exchanges
    the sums itself (with the small parameters gathered as its remainder) with the pieces passes
    it prepared in the first step; each exchange's sums are rebuilt in C++ (on either backend)."""
    sharded = (len(w.SUMS_SHAPES) + 1) * w.STEPS if world_size > 1 else 0
    for backend, threshold in w.SUMS_RUNS:
        large = sum(math.prod(s) >= threshold for s in w.SUMS_SHAPES) * w.STEPS if world_size > 1 else 0
        params = [p.clone().requires_grad_() for p in w.sums_full(0)]
        want = w.sums_run(params, w._set_plain_grad, backend, threshold)
        assert want["counts"] == {"gathered": 0, "exchanged": 0, "torch terms": 0}
        fused = 0
        for rank, results in enumerate(ranks):
            got = results["sums"][f"{backend}-{threshold}"]
            assert_same(got["snapshot"], want["snapshot"], f"{backend}, rank {rank} of {world_size}")
            terms = got["counts"].pop("torch terms")   # the native kernel makes its shards' pieces itself
            holds_none = (world_size, rank) == (4, 3)   # empty shards of every parameter
            assert terms == 0 if backend == "fused" else terms > 0 or holds_none, (backend, rank, terms)
            if threshold == 0:
                assert got["counts"] == {"gathered": 0, "exchanged": sharded}, (backend, rank, got["counts"])
            else:   # the small parameters' weight, gradient, two states and buffer (the fp32 one has none)
                small = len(w.SUMS_SHAPES) - large // w.STEPS
                assert got["counts"]["exchanged"] == large and 0 < large < sharded, (rank, got["counts"])
                assert got["counts"]["gathered"] == (5 * small + 4) * w.STEPS, (rank, got["counts"])
            fused += got["fused"]
            assert got["cached"] == (w.STEPS - 1 if backend == "fused" else 0), (backend, rank, got["cached"])
            assert got["new variants"] == 0, (backend, rank)   # the plan's pieces pass is the full step's variant
            # the native kernel's pieces passes are prepared in the first (full) step, the plan's kept after it
            sums_passes = got["prepared"][0] > 0 if backend == "fused" and not holds_none else got["prepared"][0] == 0
            assert sums_passes and got["prepared"][1:] == [0] * (w.STEPS - 1), (backend, rank, got["prepared"])
            rebuilds = w.STEPS if world_size > 1 and native_rebuild.available() else 0
            assert got["rebuilt"] == rebuilds, (backend, rank, got["rebuilt"])
        if backend == "fused" and threshold == 0:
            assert fused == want["fused"] > 0, (fused, want["fused"])


def test_per_tensor_sums_exchanged_not_gathered(two_ranks):
    _, ranks = two_ranks
    assert_sums_case(ranks, 2)


@pytest.mark.parametrize("where", w.FAILURES)
def test_an_error_in_a_step_with_a_remainder_changes_nothing(two_ranks, where):
    """A step from a plan runs its remainder's full step on gathered copies (block scales
    included) before the plan's own writes and writes the copies back last, and a full step runs
    the jobs of gathered copies before those of the rank's own shards: when the remainder's step
    fails, or the plan's own launch after it, or a full step's gathered job (out of memory), no
    weight, state, block scale or counter of either rank has changed, and the step taken again
    gives the single-process bits."""
    _, ranks = two_ranks
    want = w.coded_plan_reference(None, "skip_param", 0)
    want.pop("skipped")
    for rank, results in enumerate(ranks):
        got = results["remainder_failure"][where]
        assert got["error"] == f"injected into the {where}", f"rank {rank}: the step did not fail there"
        assert got["from_plan"], f"rank {rank}: the failed step was not taken from the plan (a full one: {where})"
        assert got["unchanged"] and got["counters"], f"rank {rank}: the failed step changed tensors or counters"
        assert_same(got["retried"], want, f"rank {rank}")


@pytest.mark.parametrize("case", w.CODED_CASES, ids="-".join)
def test_block_scaled_states_of_sharded_parameters(two_ranks, case):
    """Block-scaled states of DTensor parameters are blocks of the whole tensor whoever holds
    them: the codes and scales of a parameter whose shards hold whole blocks are sharded like it,
    the others replicated (the parameter is stepped whole on every rank), and either way the
    weights, codes and scales equal the single-process run bit for bit, with stochastic rounding
    drawn by global element. The sharded ``state_dict`` resumes on the same ranks and in a single
    process, a single-process one (coded, or bf16 states encoded on load) on the ranks."""
    _, ranks = two_ranks
    layout, states, backend = case
    for rank, results in enumerate(ranks):
        got = results["coded"][w.CODED_CASES.index(case)]
        assert got["placements"] == CODED_LAYOUTS[layout], f"rank {rank}"
        assert_coded_case(case, got, f"rank {rank}")


def assert_coded_case(case: tuple[str, str, str], got: dict, what: str, world_size: int = 2) -> None:
    """One rank's results of :func:`sharded_worker.coded_case` against the single-process runs."""
    layout, states, backend = case
    want = w.coded_reference(states, backend)
    from_bf16 = w.coded_resumed(states, backend, coded_dicts()[states]["from_bf16"])
    assert not torch.equal(from_bf16["p0.exp_avg"], want["p0.exp_avg"])   # the two resumes differ
    sizes = [math.prod(s) for s in w.CODED_SHAPES] + [32]
    for n, placed, held in zip(sizes, got["placements"], got["local_codes"]):
        assert held == n if "Replicate" in placed or world_size == 1 else 0 <= held < n, f"{what}: {held} of {n} codes"
    if backend == "fused" and layout == "fsdp":   # whole rows: the native kernel's in-step codec
        assert int(got["elements"][0]) > 0, got["elements"]
    # the native kernel's plan takes the steps after the first; at 2 ranks its remainder, the
    # parameters whose shards split blocks, is gathered and stepped in full at each of them (and at
    # 4 ranks rank 3's empty shards need no launch); Shard(1) boxes of 2 ranks (not one range of
    # the tensor) take the reference pipeline: no plan
    planned = backend == "fused" and (layout == "fsdp" or world_size == 1)
    assert got["cached"] == (w.STEPS - 1 if planned else 0), f"{what}: {got['cached']} steps from the plan"
    for tag in ("run", "resumed", "from_plain", "to_plain"):
        assert_same(got[tag], want, f"{what} {tag}")
    assert_same(got["from_bf16"], from_bf16, f"{what} from bf16 states")


def test_unsupported_placement_is_refused(two_ranks):
    _, ranks = two_ranks
    for results in ranks:
        assert "params" in results["errors"]["partial"] and "Partial" in results["errors"]["partial"]
        assert results["errors"]["unchanged"]
        assert re.search(r"local tensor of shape \(3,\) where Shard's rule \(torch\.chunk\) gives \(8,\)",
                         results["errors"]["off_rule"]), results["errors"]["off_rule"]
        split, whole = results["errors"]["warned"][(3, 33000)], results["errors"]["warned"][(2, 33024)]
        assert len(split) == 1 and "(3, 33000)" in split[0][0] and "replicated" in split[0][0], split
        assert split[0][1] == "sharded_worker.py", split   # points at the user's step() call
        assert whole == []


def test_gathered_tensors_are_contiguous(two_ranks):
    """The full copies a per-tensor optimizer steps are kernel memory even where a dimension
    after the first is split unevenly (torch 2.11 gathers those as a view of padded rows)."""
    _, ranks = two_ranks
    for results in ranks:
        assert results["gather"] == {"torch.bfloat16": (True, True), "torch.int16": (True, True)}


def assert_gather_many(results: dict, world_size: int) -> None:
    """``sharding.gather_many`` gives every tensor's ``gather`` bits (a contiguous copy of the
    dtype) from one all-gather for all the sharded ones, or one each when the cap on the received
    bytes leaves room for only one; under a cap below all the messages and above each tensor's,
    no all-gather receives more than the cap (all ranks' messages counted)."""
    sharded = sum(placement.startswith("Shard") for _, _, placement in w.GATHER_MANY)
    for tag, collectives in (("one", 1), ("capped", sharded), ("bytes", None)):
        got = results["gather_many"][tag]
        if collectives is None:
            assert 1 < got["all_gathers"] < sharded, f"{world_size} ranks, {tag}: {got['all_gathers']} all-gathers"
            assert got["received"] <= w.GATHER_CAP, f"{world_size} ranks: {got['received']} bytes received"
        else:
            assert got["all_gathers"] == collectives, f"{world_size} ranks, {tag}: {got['all_gathers']} all-gathers"
        for (shape, dtype, placement), check in zip(w.GATHER_MANY, got["checks"]):
            assert check[:3] == (True, True, True), f"{world_size} ranks, {tag}: {shape} {dtype} {placement}: {check}"
        # the replica's too: a gathered step writes its full copies before the shards are written back
        assert all(check[3] for check in got["checks"][:-1]), "a DTensor's full copy is a new tensor"


def test_gather_many_gathers_all_in_one(two_ranks):
    """A step's gathers (every parameter whose shards split blocks, or of a per-tensor optimizer)
    are one all-gather of all their tensors' bytes."""
    for results in two_ranks[1]:
        assert_gather_many(results, 2)


def _compressed_inputs(world_size: int) -> torch.Tensor:
    """Every rank's reduce-scatter input as it crosses the wire (bf16), in fp64, [rank, element]."""
    return torch.stack([w.rs_input(r, world_size).bfloat16().double() for r in range(world_size)])


def test_fp32_reduce_scatter_against_fp64(two_ranks):
    """bf16 on the wire, fp32 sum: rank r's output is its shard of the fp64 sum of the compressed
    inputs within one fp32 rounding per addition (``(R - 1) u32 sum |x|``); the AVG is that
    divided by R; a bf16 output is that sum rounded once more."""
    _, ranks = two_ranks
    R = len(ranks)
    wire = _compressed_inputs(R)
    for rank, results in enumerate(ranks):
        got = results["reduce_scatter"]
        shard = slice(rank * w.RS_NUMEL, (rank + 1) * w.RS_NUMEL)
        exact = wire[:, shard].sum(0)
        bound = (R - 1) * 2.0 ** -24 * wire[:, shard].abs().sum(0)
        assert got["sum"].dtype == torch.float32
        assert ((got["sum"].double() - exact).abs() <= bound).all()
        assert ((got["avg"].double() - exact / R).abs() <= bound / R).all()
        assert torch.equal(got["sum_bf16"], got["sum"].bfloat16())
        # stochastic compression: each addend is one of its two bf16 neighbours
        x = torch.stack([w.rs_input(r, R).double() for r in range(R)])[:, shard]
        ulp_bound = (2.0 ** -7 * x.abs()).sum(0) + bound + 2.0 ** -24 * x.abs().sum(0)
        assert ((got["stochastic"].double() - x.sum(0)).abs() <= ulp_bound).all()
        assert not torch.equal(got["stochastic"], got["sum"])
        # unbiased: 1 + 2**-10 (1/8 of a bf16 ulp above 1) sums to R (1 + 2**-10) on average;
        # rounding to nearest loses the 2**-10 on every rank
        sigma = 2.0 ** -7 * (1 / 8 * 7 / 8) ** 0.5 * R ** 0.5 / w.RS_NUMEL ** 0.5
        assert abs(got["stochastic_tiny"].double().mean() - R * (1 + 2.0 ** -10)) < 5 * sigma
        assert torch.equal(got["nearest_tiny"], torch.full((w.RS_NUMEL,), float(R)))
        assert "set_force_sum_reduction_for_comms" in got["premul_error"]


def test_fp32_reduce_scatter_in_fsdp_and_advisor(two_ranks):
    _, ranks = two_ranks
    for results in ranks:
        got = results["reduce_scatter"]
        assert got["fsdp_calls"] > 0
        assert_same(got["fsdp_custom"], got["fsdp_default"], "custom reduce-scatter, exact sums")
        assert got["advice_fp32"] == [] and got["advice_pure_bf16_fixed"] == []
        assert got["advice_bf16_reduce"] and all("reduce_dtype=torch.bfloat16" in m for m in got["advice_bf16_reduce"])
        assert got["advice_pure_bf16"] and all("reduce_dtype is None" in m for m in got["advice_pure_bf16"])
        # fp32 parameters computed in bf16: reduce_dtype=None reduces in bf16 only before torch 2.15
        assert bool(got["advice_fp32_params_reduce_none"]) == FSDP_REDUCES_IN_PARAM_DTYPE


@pytest.mark.slow
def test_four_ranks_and_one_to_many_reshard(tmp_path):
    """4 ranks (one with an empty shard of the (6, 5) parameter), the compiled backend too,
    StableAdamW's exchanged sums (:func:`assert_sums_case`); a
    1-rank checkpoint resumed at 4; block-scaled states where fewer blocks fit the shards than at
    2 ranks (the 64-vector's codes are replicated at 4 ranks, sharded at 2)."""
    modes = ["kahan", "exact", w.CODED]
    one = run_local_group(w.session, 1, {"folder": str(tmp_path), "save": modes}, timeout_s=120)[0]
    cases = CASES + COMPILED_CASES
    spec = {"folder": str(tmp_path), "steps": cases, "load": [f"{m}-1" for m in modes], "coded": w.CODED_CASES,
            "coded_state_dicts": coded_dicts(), "gather": True, "sums": True}
    ranks = run_local_group(w.session, 4, spec, timeout_s=300)
    assert_sums_case(ranks, 4)   # the (3, 40000) parameter leaves rank 3 an empty shard
    for rank, results in enumerate(ranks):
        assert_gather_many(results, 4)
        for case, got in zip(w.CODED_CASES, results["coded"]):
            assert "Replicate" in got["placements"][1], got["placements"]
            assert_coded_case(case, got, f"4 ranks, rank {rank}")
    for mode in modes:
        for results in ranks:
            resumed = results["load"][f"{mode}-1"]
            assert resumed["losses"] == one["save"][mode]["losses"][2:]
            assert_same(resumed["model"], one["save"][mode]["model"], "1 -> 4 ranks")
            assert_same(resumed["optim"], one["save"][mode]["optim"], "1 -> 4 ranks")
    # the stochastic cases last: they need the counter-based random streams (see above)
    for index, case in sorted(enumerate(cases), key=lambda c: c[1] in SR_CASES):
        want, want_extra = split(w.reference(*case[1:4], case[4], case[5]))
        assert_sharded_elements(case[0], case[1], case[3], [split(r["steps"][index])[1]["elements"] for r in ranks],
                                want_extra["elements"])
        for rank, results in enumerate(ranks):
            got, _ = split(results["steps"][index])
            assert_same(got, want, f"{_case_id(case)} rank {rank}")


def test_element_index_of_boxes():
    """``box_index`` gives the global row-major positions of a box's elements: Shard(0) ranges,
    Shard(1)/Shard(2) strided boxes, 2-D boxes (two sharded dimensions) and empty boxes."""
    full = torch.arange(6 * 5 * 4).reshape(6, 5, 4)
    for shape, offset in [((2, 5, 4), (2, 0, 0)), ((6, 2, 4), (0, 3, 0)), ((3, 2, 4), (3, 1, 0)),
                          ((1, 2, 4), (4, 1, 0)), ((6, 5, 1), (0, 0, 3)), ((2, 5, 2), (4, 0, 2)),
                          ((0, 5, 4), (6, 0, 0)), ((6, 5, 4), (0, 0, 0)), ((2, 2, 4), (1, 3, 0))]:
        index = sharding.box_index(shape, offset, tuple(full.shape))
        region = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].reshape(-1)
        assert torch.equal(index.tensor(region.numel()), region), (shape, offset)
        half = region.numel() // 2   # a chunk starting half way
        assert torch.equal(index.shifted(half).tensor(region.numel() - half), region[half:]), (shape, offset)
    with pytest.raises(ValueError, match="params"):
        sharding.box_index((2, 2, 2), (0, 0, 0), (6, 5, 4))


def test_boxes_are_kept_per_layout_and_rank(monkeypatch):
    """``_box_of`` asks torch once per (global shape, mesh shape, this rank's coordinate,
    placements) and then answers from its table; another coordinate or placement is another
    box, and a placement that cannot be hashed is computed every time."""
    from torch.distributed.tensor import _utils

    calls = []

    def fake(shape, mesh, placements):
        calls.append((tuple(shape), tuple(mesh.get_coordinate()), tuple(placements)))
        return torch.Size([shape[0] // 2, *shape[1:]]), (mesh.get_coordinate()[0] * shape[0] // 2, 0)

    class Mesh:
        def __init__(self, coordinate):
            self.shape, self.coordinate = (2,), [coordinate]

        def get_coordinate(self):
            return self.coordinate

    class Unhashable:
        __hash__ = None

    monkeypatch.setattr(_utils, "compute_local_shape_and_global_offset", fake)
    monkeypatch.setattr(sharding, "_BOXES", {})
    first = sharding._box_of((8, 3), Mesh(1), ("S0",))
    assert first == ((4, 3), (4, 0)) and len(calls) == 1
    assert sharding._box_of([8, 3], Mesh(1), ["S0"]) == first and len(calls) == 1   # from the table
    assert sharding._box_of((8, 3), Mesh(0), ("S0",)) == ((4, 3), (0, 0)) and len(calls) == 2
    assert sharding._box_of((8, 3), Mesh(1), ("S1",)) == first and len(calls) == 3
    odd = (Unhashable(),)
    assert sharding._box_of((8, 3), Mesh(1), odd) == first and sharding._box_of((8, 3), Mesh(1), odd) == first
    assert len(calls) == 5
