"""lowp.distributed.checkpoint: a checkpoint is loaded only when every file of one save is on disk.

Single process: round trips, refusal of torn folders (marker removed, file truncated, file added,
unfinished ``.tmp`` folders), crashes injected at each phase of a save (the exception stops the
save where a kill would), and real ``kill -9`` of a worker that saves in a loop (tests/checkpoint_worker.py),
after which the newest complete checkpoint loads bit for bit. Two gloo ranks: FSDP2-sharded
parameters and lowp AdamW states through the helper (``run_local_group``).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import CheckpointException

import checkpoint_worker as w
from lowp.distributed import checkpoint as ck
from lowp.distributed.launch import run_local_group

ROOT = Path(__file__).resolve().parents[1]


class Killed(BaseException):
    """Stands for a SIGKILL at the point where it is raised (nothing after it runs)."""


def _loaded(root: Path, **kw) -> tuple[int, dict]:
    state = w.empty_state()
    step = ck.load(state, root, **kw)
    return step, state


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_round_trip_and_marker(tmp_path):
    for step in (1, 2):
        assert ck.save(w.state_of(step), tmp_path, step) == tmp_path / ck.folder_name(step)
    assert ck.folder_name(2) == "step-000000002"
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [1, 2]
    assert ck.latest(tmp_path) == tmp_path / "step-000000002"
    step, state = _loaded(tmp_path)
    assert step == 2 and w.same_bits(state, w.state_of(2))
    step, state = _loaded(tmp_path, step=1)
    assert step == 1 and w.same_bits(state, w.state_of(1))
    step, state = _loaded(tmp_path / "step-000000001")       # a checkpoint folder named directly
    assert step == 1 and w.same_bits(state, w.state_of(1))
    marker = ck.verify(tmp_path / "step-000000002")
    assert marker["step"] == 2 and marker["world_size"] == 1 and ".metadata" in marker["files"]
    assert all(size == (tmp_path / "step-000000002" / f).stat().st_size for f, size in marker["files"].items())
    assert _leftovers(tmp_path) == []


def test_codes_are_never_cast_into_values(tmp_path):
    """A checkpoint whose small parameter's states are int8/uint8 codes (``coded_min_numel=0``)
    loaded into the default layout (16-bit states under 4096 elements) would be cast by
    ``dcp.load``: refused by name before anything is loaded; with the options it was saved with it
    loads and resumes bit for bit."""
    import torch

    import lowp.optim as lo

    def trained(**kw):
        p = torch.nn.Parameter(torch.arange(100.0).bfloat16() / 7)
        opt = lo.AdamW([p], seed=2, state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, **kw)
        p.grad = torch.ones_like(p)
        opt.step()
        return p, opt
    p, opt = trained(coded_min_numel=0)
    ck.save({"optim": opt.state_dict()}, tmp_path, 1)
    q, default = trained()
    template = {"optim": default.state_dict()}
    before = {k: v.clone() for k, v in default.state[q].items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"state\['optim\.state\.0\.exp_avg'\]: the checkpoint holds torch\.int8 "
                                         r"there and this run torch\.bfloat16.*coded_min_numel=0"):
        ck.load(template, tmp_path)
    assert all(torch.equal(default.state[q][k], v) for k, v in before.items())
    q, same = trained(coded_min_numel=0)
    template = {"optim": same.state_dict()}
    ck.load(template, tmp_path)
    same.load_state_dict(template["optim"])
    assert all(torch.equal(same.state[q][k], v) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor))


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="step: expected a non-negative int"):
        ck.save(w.state_of(1), tmp_path, -1)
    with pytest.raises(ValueError, match="step: expected a non-negative int"):
        ck.save(w.state_of(1), tmp_path, True)
    with pytest.raises(ValueError, match="keep: expected None or a positive int"):
        ck.save(w.state_of(1), tmp_path, 1, keep=0)
    with pytest.raises(FileNotFoundError, match="root: no complete checkpoint"):
        ck.load(w.empty_state(), tmp_path)
    assert ck.latest(tmp_path / "missing") is None and ck.complete_checkpoints(tmp_path / "missing") == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_same_step_refused_or_swapped_whole(tmp_path, monkeypatch, exchange):
    ck.save(w.state_of(1), tmp_path, 5)
    with pytest.raises(FileExistsError, match="step-000000005: step 5 was saved before; pass replace=True"):
        ck.save(w.state_of(2), tmp_path, 5)
    assert w.same_bits(_loaded(tmp_path)[1], w.state_of(1))
    if not exchange:
        monkeypatch.setattr(ck, "_exchange", lambda a, b: False)
    ck.save(w.state_of(2), tmp_path, 5, replace=True)
    step, state = _loaded(tmp_path)
    assert step == 5 and w.same_bits(state, w.state_of(2))
    assert _leftovers(tmp_path) == []


def test_torn_folders_are_never_loaded(tmp_path):
    for step in (1, 2, 3, 4):
        ck.save(w.state_of(step), tmp_path, step)
    (tmp_path / "step-000000004" / ck.MARKER).unlink()                      # marker removed
    data = next((tmp_path / "step-000000003").glob("*.distcp"))
    with open(data, "r+b") as f:                                             # a file truncated
        f.truncate(data.stat().st_size - 1)
    (tmp_path / "step-000000002" / "notes.txt").write_text("x")             # a file added
    # an unfinished save of step 9, even with a marker, and a name that is not save()'s
    (tmp_path / ".step-000000009.tmp-abcdef").mkdir()
    os.rename(tmp_path / "step-000000001", tmp_path / "step-1")
    assert ck.complete_checkpoints(tmp_path) == [] and ck.latest(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint") as info:
        ck.load(w.empty_state(), tmp_path)
    assert "step-000000004: no lowp-checkpoint.json" in str(info.value)
    for step, reason in [(4, "no lowp-checkpoint.json: the save that wrote it did not finish"),
                         (3, f"resized {data.name}"), (2, "files written after the save: notes.txt"),
                         (1, "no such folder")]:
        with pytest.raises(ck.IncompleteCheckpointError, match=reason) as info:
            ck.load(w.empty_state(), tmp_path, step=step)
        assert info.value.folder == tmp_path / ck.folder_name(step)
        assert str(tmp_path / ck.folder_name(step)) in str(info.value)
    with pytest.raises(ck.IncompleteCheckpointError, match="step-000000003.*resized"):
        ck.load(w.empty_state(), tmp_path / "step-000000003")    # named directly
    os.rename(tmp_path / "step-1", tmp_path / "step-000000001")
    step, state = _loaded(tmp_path)
    assert step == 1 and w.same_bits(state, w.state_of(1))
    ck.save(w.state_of(5), tmp_path, 5)       # a successful save clears the dead .tmp folder, not the torn ones
    assert _leftovers(tmp_path) == []
    assert (tmp_path / "step-000000004").is_dir()


def test_keep_prunes_complete_checkpoints_and_warns_about_later_steps(tmp_path):
    for step in range(1, 6):
        ck.save(w.state_of(step), tmp_path, step, keep=2)
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [4, 5]
    with pytest.warns(UserWarning, match="later steps \\(4, 5\\): latest\\(\\) and load\\(\\) pick those"):
        ck.save(w.state_of(3), tmp_path, 3, keep=3)
    ck.save(w.state_of(2), tmp_path, 2, keep=1)          # the checkpoint just saved always stays
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2]
    assert _leftovers(tmp_path) == []


def test_shutdown_without_a_process_group_and_its_arguments():
    from lowp.distributed import shutdown
    assert shutdown() == 0
    with pytest.raises(ValueError, match="timeout: expected a positive number of seconds"):
        shutdown(timeout=0)
    with pytest.raises(TypeError, match="timeout: expected None, seconds or a datetime.timedelta"):
        shutdown(timeout="1s")


def _crash_in(monkeypatch, phase: str) -> None:
    """Make the next save stop (as if killed) at ``phase``."""
    real_fsync, real_rename = os.fsync, os.rename
    if phase == "data":           # DCP has written a data file and is syncing it: no .metadata yet
        def fsync(fd):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
                raise Killed
            return real_fsync(fd)
        monkeypatch.setattr(os, "fsync", fsync)
    elif phase == "marker":       # the marker half written
        def dump(obj, f, **kw):
            f.write('{"format": "lowp.distri')
            f.flush()
            raise Killed
        monkeypatch.setattr(ck.json, "dump", dump)
    elif phase in ("publish", "swap"):    # complete with its marker, not yet renamed / old one renamed aside
        def rename(src, dst, *a, **kw):
            if phase == "publish" or ".old-" not in Path(dst).name:
                if ".tmp-" in Path(src).name:
                    raise Killed
            return real_rename(src, dst, *a, **kw)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(ck, "_exchange", lambda a, b: False)
    elif phase == "prune":        # an old checkpoint renamed out of sight, half deleted
        def rmtree(path, ignore_errors=False):
            files = sorted(Path(path).iterdir())
            files[0].unlink()
            raise Killed
        monkeypatch.setattr(ck.shutil, "rmtree", rmtree)


@pytest.mark.parametrize("phase", ["data", "marker", "publish", "swap", "prune"])
def test_a_save_stopped_at_any_phase_leaves_the_last_complete_state(tmp_path, monkeypatch, phase):
    ck.save(w.state_of(1), tmp_path, 1)
    ck.save(w.state_of(2), tmp_path, 2)
    with monkeypatch.context() as m:
        _crash_in(m, phase)
        # DCP reports an exception in its write phase as a CheckpointException; the files stay as they are
        with pytest.raises((Killed, CheckpointException)):
            if phase == "swap":
                ck.save(w.state_of(3), tmp_path, 2, replace=True)
            else:
                ck.save(w.state_of(3), tmp_path, 3, keep=1 if phase == "prune" else None)
    # the last complete state, whole: step 2, or step 1 when the crash hit between the swap's renames;
    # after "prune", step 3 was published before the crash
    expect = {"swap": 1, "prune": 3}.get(phase, 2)
    step, state = _loaded(tmp_path)
    assert step == expect and w.same_bits(state, w.state_of(expect))
    assert _leftovers(tmp_path)     # the dead save's folder
    ck.save(w.state_of(4), tmp_path, 4)
    assert _leftovers(tmp_path) == []
    step, state = _loaded(tmp_path)
    assert step == 4 and w.same_bits(state, w.state_of(4))


def _kill_during_saves(root: Path, rng: random.Random) -> tuple[int, bool]:
    """Start the saving loop, SIGKILL it at a random moment, check what loads; (step loaded, whether
    a save was cut off: its .tmp folder is there)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "checkpoint_worker.py"), "loop", str(root)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", line + proc.stderr.read() if proc.stderr else ""
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    cut = any(".tmp-" in name for name in _leftovers(root))
    done = ck.complete_checkpoints(root)
    assert done and done[0][0] >= 1 and [s for s, _ in done] == list(range(done[0][0], done[-1][0] + 1))
    for step, folder in done:                      # every complete one is exactly its own step's state
        assert w.same_bits(_loaded(folder)[1], w.state_of(step))
    step, state = _loaded(root)
    assert step == done[-1][0] >= 2 and w.same_bits(state, w.state_of(step))
    ck.save(w.state_of(step + 1), root, step + 1, keep=3)       # and saving goes on, clearing the dead folder
    assert _leftovers(root) == []
    return step, cut


def test_kill_9_during_saves(tmp_path):
    rng = random.Random(1)
    for i in range(2):
        _kill_during_saves(tmp_path / str(i), rng)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_9_during_saves_many_times(tmp_path):
    rng = random.Random(2)
    outcomes = [_kill_during_saves(tmp_path / str(i), rng) for i in range(20)]
    print(f"{sum(cut for _, cut in outcomes)} of {len(outcomes)} kills cut a save short; steps loaded: "
          f"{[step for step, _ in outcomes]}")
    assert any(cut for _, cut in outcomes)    # some kills did land inside a save
    assert any(step > 2 for step, _ in outcomes)


def test_torch_dcp_load_into_another_layout_is_refused_on_every_fsdp2_rank(tmp_path):
    """FSDP2 at 2 gloo ranks, torch's own ``dcp.load`` + ``set_state_dict`` with a template of
    the default threshold and a checkpoint of ``coded_min_numel=0``: every rank refuses naming the
    entry, and its next step refuses the states ``dcp.load`` wrote into; the saving options
    load the same bits."""
    out = run_local_group(w.fsdp_layout_cast, 2, str(tmp_path), timeout_s=120)
    for r, res in enumerate(out):
        assert "['exp_avg']: arrived as bfloat16, the dtype this optimizer's options give it, while the " \
               "checkpoint's options (state_dtype={'exp_avg': 'int8', 'exp_avg_sq': 'uint8'}, coded_min_numel=0) " \
               "store it as int8: it looks cast" in res.get("refused", ""), (r, res)
        assert "this optimizer's states hold what a loader wrote into them" in res.get("step", ""), (r, res)
        assert res["bits"] and res["int8"], (r, res)


def test_fsdp2_round_trip_on_two_gloo_ranks_then_shutdown(tmp_path):
    out = run_local_group(w.fsdp_round_trip, 2, str(tmp_path), timeout_s=60)
    for r, res in enumerate(out):
        # shutdown() freed the process group (FSDP2's DeviceMesh stays in DTensor's caches otherwise)
        # and with it gloo's worker threads; what runs on is the main thread and multiprocessing's feeder
        assert res["groups_alive"] == 0, r
        assert res["threads"] is None or res["threads"] <= 2, (r, res["threads"])
        assert res["sharded"], r
        assert (res["latest"], res["latest_bits"]) == (3, True), r
        assert (res["step2"], res["step2_bits"]) == (2, True), r
        assert "step 3 was saved before" in res["again"], r
        assert "step: every rank must pass the same value to save(), got 10 on rank 0, 11 on rank 1" in res["disagree"]
        assert (res["fallback"], res["fallback_bits"]) == (2, True), r
        assert "step-000000003: not a complete checkpoint (no lowp-checkpoint.json" in res["explicit"], r
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2]
    assert ck.verify(tmp_path / "step-000000002")["world_size"] == 2
