"""Every torch checkpoint route resumes lowp AdamW bit for bit on 2 gloo ranks.

The routes: ``get/set_optimizer_state_dict`` (the model through ``get/set_model_state_dict``) and
``get/set_state_dict`` of ``torch.distributed.checkpoint.state_dict`` with every combination of
``StateDictOptions`` torch accepts (``full_state_dict``, ``cpu_offload``, ``broadcast_from_rank0``
(only with ``full_state_dict``; rank 0 alone holds the checkpoint on load),
``flatten_optimizer_state_dict``, ``strict``), the checkpoint kept in memory (a fresh model and
optimizer in the same group), in files (full dicts; a fresh process group) or through
``torch.distributed.checkpoint.save`` / ``load`` (sharded dicts; a fresh process group, also at
another world size). lowp AdamW runs in three configurations (defaults: kahan weights and bf16
states rounded stochastically; ``exact8`` weights with int8 / uint8 block-scaled states; the
same with ``coded_min_numel=256``, which keeps the biases' states in bf16 beside the codes),
on an FSDP2 (``fully_shard``) MLP and on a plain module replicated on every rank.

Each case trains 2 steps (one skipped for a NaN gradient), checkpoints, trains 2 more; the
resumed run is built with another model seed and optimizer seed, loads, and trains the same 2
steps. Every rank's weights, states (local shards and full tensors), skip counters and seed equal
the uninterrupted run's bit for bit. ``torch.optim.AdamW`` runs the same cases: where a route
fails for lowp it fails for torch's own optimizer too (torch 2.13's helpers, see
:func:`torch_failure`), and the slow run shows torch's AdamW resuming wherever lowp does.

The default run takes a cross-section of the matrix in 4 launches (1 rank saving, 2 ranks saving,
2 fresh ranks loading, 1 fresh rank loading); ``-m slow`` runs the rest of it.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import checkpoint_routes_worker as w
from checkpoint_routes_worker import Case
from lowp.distributed.launch import run_local_group

LOWP = ("default", "exact8", "exact8-min")
FULL, CPU, BCAST, FLAT, NONSTRICT = w.FLAGS


def cases(apis, flag_sets, configs, kinds=w.KINDS, stores=None) -> list[Case]:
    """Every combination; ``stores=None``: each flag set's stores (:func:`checkpoint_routes_worker.store_for`)."""
    return [Case(api, flags, config, kind, store)
            for api, flags, config, kind in itertools.product(apis, flag_sets, configs, kinds)
            for store in (stores or w.store_for(flags))]


def torch_failure(case: Case) -> str | None:
    """Why torch 2.13's helpers fail a case for ``torch.optim.AdamW`` too; ``None``: they do not.

    ``full_state_dict`` with ``flatten_optimizer_state_dict``: on load, ``_load_optim_state_dict``
    unflattens the checkpoint into torch's nested layout, then builds the local dict to distribute
    into with ``_get_optim_state_dict``, which flattens it (the option is still on), and mixes the
    two layouts: ``_distribute_state_dict`` copies the nested dict's plain values into the flat one
    under keys its mapping lacks, and ``_unflatten_state_dict`` raises
    ``KeyError: 'param_groups.0.params.0'`` on every rank. With ``broadcast_from_rank0`` those
    values are dropped instead: the other ranks' result has no ``param_groups`` (``KeyError:
    'param_groups'`` in ``_load_optim_state_dict``), rank 0's has no ``state`` and goes to the
    optimizer's ``load_state_dict``: ``KeyError: 'state'`` from torch's AdamW, ``ValueError: ...
    expected an optimizer state_dict() with 'state' ...`` from lowp's."""
    if FULL in case.flags and FLAT in case.flags:
        return "full_state_dict with flatten_optimizer_state_dict: torch mixes flat and nested layouts on load"
    return None


def twin(case: Case) -> Case:
    """The same case for ``torch.optim.AdamW``."""
    return case._replace(config="torch")


# ---- the default cross-section ------------------------------------------------------------------
APIS = w.APIS
DEFAULT_FLAGS = {"memory": [(), (FULL,), (FLAT,)], "dcp": [(), (FLAT,)], "file": [(FULL, CPU, BCAST)]}
DEFAULT = [c for store, flag_sets in DEFAULT_FLAGS.items() for c in cases(APIS, flag_sets, LOWP, stores=[store])]
#: torch's failures, shown on the optimizer route of the FSDP module (the slow run has them all)
DEFAULT_FAILING = cases(["optim"], [(FULL, FLAT), (FULL, BCAST, FLAT)], LOWP[:1], ["fsdp"], ["memory"])
#: saved at one world size and loaded at the other, both ways: the default route through DCP
DEFAULT_RESHARD = cases(["state_dict"], [()], LOWP, stores=["dcp"])
#: lowp's extras removed from a checkpoint: the load warns and the resumed run draws other bits
CONTROL = Case("state_dict", (), "default", "fsdp", "memory", strip=True)

#: everything the default launches run
DEFAULT_SET = set(DEFAULT + DEFAULT_FAILING + [twin(c) for c in DEFAULT_FAILING] + [CONTROL] + DEFAULT_RESHARD)

# ---- the rest of the matrix (slow) --------------------------------------------------------------
#: every API, option set, configuration (torch's AdamW too), module and store of its flag set
SLOW = [c for c in cases(APIS, w.option_sets(), (*LOWP, "torch")) if c not in DEFAULT_SET]
SLOW_RESHARD = [c for c in cases(APIS, [()], (*LOWP, "torch"), stores=["dcp"]) if c not in DEFAULT_RESHARD]


def _launch(world_size: int, spec: dict, folder, join_timeout_s: float = 400) -> list[dict]:
    return run_local_group(w.session, world_size, {"folder": str(folder), **spec}, timeout_s=60,
                           join_timeout_s=join_timeout_s)


def _run_all(folder, matrix: list[Case], reshard: list[Case]) -> dict[str, list[dict]]:
    """Save at 1 rank (``reshard``), save at 2 (``matrix``, ``reshard``; the memory cases resume
    there), load at 2 fresh ranks (the disk cases, and ``reshard`` from 1 rank), load at 1 fresh
    rank (``reshard`` from 2 ranks)."""
    disk = [c for c in matrix if c.store != "memory"]
    out = {"save1": _launch(1, {"save": reshard}, folder) if reshard else [{}]}
    out["save2"] = _launch(2, {"save": list(dict.fromkeys(matrix + reshard))}, folder)
    out["load2"] = _launch(2, {"load": [(c, 2) for c in disk] + [(c, 1) for c in reshard]}, folder)
    out["load1"] = _launch(1, {"load": [(c, 2) for c in reshard]}, folder) if reshard else [{}]
    return out


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("routes")
    matrix = DEFAULT + DEFAULT_FAILING + [twin(c) for c in DEFAULT_FAILING] + [CONTROL]
    return _run_all(folder, matrix, DEFAULT_RESHARD)


class _SlowRuns:
    """The slow matrix, launched per API on first use (each launch well inside the test timeout)."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.runs: dict[str, dict[str, list[dict]]] = {}

    def get(self, api: str) -> dict[str, list[dict]]:
        if api not in self.runs:
            self.runs[api] = _run_all(self.folder / api, [c for c in SLOW if c.api == api],
                                      [c for c in SLOW_RESHARD if c.api == api])
        return self.runs[api]


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    return _SlowRuns(tmp_path_factory.mktemp("routes-slow"))


def _runs(request, case: Case, reshard: bool = False) -> dict[str, list[dict]]:
    if case in (DEFAULT_RESHARD if reshard else DEFAULT_SET):
        return request.getfixturevalue("default_runs")
    return request.getfixturevalue("slow_runs").get(case.api)


def _result(entry: dict, what: str) -> dict:
    assert "error" not in entry, f"{what}: {entry['error']}\n{entry.get('trace', '')}"
    return entry


def outcomes(runs: dict[str, list[dict]], case: Case, saved_at: int = 2, loaded_at: int = 2
             ) -> list[tuple[dict, dict]]:
    """Per rank of the loading group: (the uninterrupted run at that world size, the resumed run)."""
    out = []
    for rank in range(loaded_at):
        saved = _result(runs[f"save{loaded_at}"][rank][case.id], f"rank {rank}: {case.id} (save)")
        if case.store == "memory":
            resumed = _result(saved["resumed"], f"rank {rank}: {case.id} (resume)")
        else:
            entry = _result(runs[f"load{loaded_at}"][rank][f"{case.id}@{saved_at}"], f"rank {rank}: {case.id} (load)")
            resumed = _result(entry["resumed"], f"rank {rank}: {case.id} (resume)")
        out.append((saved["reference"], resumed))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def differences(got: dict, want: dict) -> list[str]:
    """The entries (weights, states, full tensors, counters, seed) where ``got`` differs from
    ``want`` in bits, dtype, shape or value."""
    bad = [f"{k}: missing" for k in want if k not in got]
    for k in want:
        if k not in got:
            continue
        a, b = want[k], got[k]
        if isinstance(a, torch.Tensor):
            same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(_bits(a), _bits(b)))
        else:
            same = type(a) is type(b) and a == b
        if not same:
            bad.append(k if isinstance(a, torch.Tensor) else f"{k}: {b!r}, expected {a!r}")
    return bad


def assert_resumes(case: Case, pairs: list[tuple[dict, dict]]) -> None:
    for rank, (want, got) in enumerate(pairs):
        assert not differences(got, want), f"rank {rank}: {case.id}: {differences(got, want)}"
        if case.config != "torch":
            assert got["loaded_seed"] == want["seed"] == w.SAVE_SEED, f"rank {rank}"
            assert want["skipped_params"] == 1, "the NaN step must have been skipped (and its count saved)"
            assert not [m for m in got["warnings"] if "lowp" in m], got["warnings"]
        assert any(k.endswith(".step") for k in want), "the optimizer must have states"
        if case.config == "exact8-min":   # both kinds of state in the one group
            dtypes = {want[f"p{i}.exp_avg"].dtype for i in range(4)}
            assert dtypes == {torch.int8, torch.bfloat16}, dtypes


def _id(case: Case) -> str:
    return case.id


def _slow(matrix: list[Case]) -> list:
    return [pytest.param(c, marks=pytest.mark.slow, id=c.id) for c in matrix]


@pytest.mark.parametrize("case", DEFAULT + _slow([c for c in SLOW if torch_failure(c) is None]), ids=_id)
def test_route_resumes_bit_for_bit(request, case):
    """The torch cases (slow) show the same routes resuming torch's own AdamW."""
    assert_resumes(case, outcomes(_runs(request, case), case))


def _errors(runs: dict[str, list[dict]], case: Case) -> list[str | None]:
    """Each rank's error in ``case`` (``None`` where it resumed)."""
    phase = "save2" if case.store == "memory" else "load2"
    key = case.id if case.store == "memory" else f"{case.id}@2"
    out = []
    for rank in range(2):
        entry = runs[phase][rank][key]
        out.append(entry["error"] if "error" in entry else entry["resumed"].get("error"))
    return out


@pytest.mark.parametrize("case", DEFAULT_FAILING + _slow([c for c in SLOW if torch_failure(c) and c.config != "torch"]),
                         ids=_id)
def test_a_route_that_fails_fails_for_torch_adamw_too(request, case):
    """:func:`torch_failure`: the same exceptions on every rank for torch's AdamW, except where
    torch's helper hands rank 0's optimizer a dict without ``state``, which lowp's
    ``load_state_dict`` refuses by name (torch's by ``KeyError``). Where torch's helpers take
    the route for torch's AdamW (another torch version), lowp must resume through it."""
    theirs = _errors(_runs(request, twin(case)), twin(case))
    if not any(theirs):
        assert_resumes(case, outcomes(_runs(request, case), case))
        return
    ours = _errors(_runs(request, case), case)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a is not None and b is not None, f"rank {rank}: lowp {a!r}, torch {b!r}"
        if a.startswith("ValueError: state_dict: expected an optimizer state_dict() with 'state'"):
            assert BCAST in case.flags and rank == 0 and b == "KeyError: 'state'", (a, b)
        else:
            assert a == b, f"rank {rank}: lowp {a!r}, torch {b!r}"
        assert a.startswith(("KeyError", "ValueError")), a


@pytest.mark.parametrize("case", DEFAULT_RESHARD + _slow(SLOW_RESHARD), ids=_id)
@pytest.mark.parametrize("saved_at, loaded_at", [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_dcp_resumes_at_another_world_size(request, case, saved_at, loaded_at):
    """Saved at one world size, loaded at the other: equal to the uninterrupted run at the
    loading world size, which equals the run at the saving one (full tensors, counters)."""
    runs = _runs(request, case, reshard=True)
    assert_resumes(case, outcomes(runs, case, saved_at, loaded_at))
    one, two = (runs["save1"][0][case.id]["reference"], runs["save2"][0][case.id]["reference"])
    full = {k: v for k, v in one.items() if k.startswith("full:") or not isinstance(v, torch.Tensor)}
    assert not differences(two, full), differences(two, full)


def test_a_checkpoint_without_lowps_extras_warns_and_resumes_other_bits(default_runs):
    """The control: the comparison sees the seed. Without the extras the optimizer keeps its own
    seed (with a warning) and the stochastic rounding draws other bits."""
    for rank, (want, got) in enumerate(outcomes(default_runs, CONTROL)):
        assert got["loaded_seed"] == w.LOAD_SEED
        assert any("lacks its 'lowp' extras" in m for m in got["warnings"]), got["warnings"]
        assert differences(got, want), f"rank {rank}: resumed the same bits without the seed"


@pytest.mark.slow
def test_torch_set_state_dict_broadcast_hangs_without_model_keys(tmp_path):
    """Why :func:`checkpoint_routes_worker.resume` gives ``set_state_dict`` the model's keys on the
    ranks other than 0: with ``broadcast_from_rank0`` and an empty ``model_state_dict`` there,
    torch 2.13's ``set_state_dict`` takes ``optim_only=not model_state_dict``, skips the model's
    broadcast that rank 0 enters (``_load_model_state_dict`` returns at once where
    ``info.handle_model`` is false), and the collectives no longer match: torch's own AdamW
    times out (the process-group timeout, 5 s here), rank 0 in ``broadcast_object_list``,
    rank 1 in its next forward's all-gather."""
    case = Case("state_dict", (FULL, BCAST), "torch", "fsdp", "memory", keys=False)
    ranks = run_local_group(w.session, 2, {"folder": str(tmp_path), "save": [case]}, timeout_s=5)
    entries = [result[case.id] for result in ranks]
    entries = [entry if "error" in entry else entry["resumed"] for entry in entries]
    assert all(entry.get("error", "").startswith("RuntimeError") for entry in entries), entries
    # rank 0 waits in the model's broadcast, rank 1 went on to train (FSDP's all-gather)
    assert "broadcast_object_list" in entries[0]["trace"], entries[0]["trace"]
    assert "all_gather" in entries[1]["trace"], entries[1]["trace"]
