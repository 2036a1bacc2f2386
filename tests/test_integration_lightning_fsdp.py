"""lowp inside Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``,
DCP checkpoints through ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) on 2 CPU
processes and gloo, run as a user runs it: ``python tests/lightning_fsdp_worker.py`` with
``Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1), precision="bf16-true")``; Lightning's launcher starts the second process.
The strategy needs no CUDA: with ``accelerator="cpu"`` its device mesh is a CPU mesh and its
process group gloo (Lightning 2.6.6, torch 2.13).

Per configuration a Trainer fits ``N`` steps with a ``ModelCheckpoint`` (a DCP folder, one file
per rank); a fresh Trainer and LightningModule, whose lowp AdamW is built with another seed,
``fit(ckpt_path=...)`` continue to ``2N``; a third Trainer fits ``2N`` uninterrupted. The gathered
weights, the gathered optimizer state dict (codes, scales, remainders, step counts, extras) and
every loss on both ranks are equal bit for bit, and the resumed optimizer's seed is the saved
one. In the configurations that draw random bits (stochastic rounding of the weights or of the
int8 / uint8 moments) a control fit from scratch with the resumed run's seed ends elsewhere: the
seed from the checkpoint is what makes the resume exact.

Default run: one launch of 2 processes (40 to 51 s measured on 2 cores shared with other
jobs, load average 10 to 12) for lowp's defaults (Kahan, bf16 states) and ``mode="exact8"`` with
int8 / uint8 moments, the resumed fits in the same processes. ``-m slow``: two launches, the
resumed fits in fresh processes, adding ``mode="stochastic"`` and
``save_distributed_checkpoint=False`` (one full checkpoint file written by rank 0 and loaded with
``broadcast_from_rank0``; 80 to 110 s there).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning_fsdp_worker as w  # noqa: E402
from lowp.distributed.launch import free_port  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402
from stack_helpers import FAST, OTHER_SEED, RANDOM, ROOT, SEED, SLOW, clean_env, run_launch  # noqa: E402


def launch(out: Path, phase: str, configs: tuple[str, ...], seed: int, control: bool = False,
           timeout: float = 400) -> str:
    """Run the worker script (rank 0; Lightning starts rank 1), return its output; fail on a
    non-zero exit of either rank, an abort or a hang (the whole process group is killed)."""
    env = clean_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, str(ROOT / "tests" / "lightning_fsdp_worker.py"), "--out", str(out), "--phase", phase,
               "--configs", ",".join(configs), "--seed", str(seed), *(["--control"] if control else [])]
    return run_launch(command, env, out, phase, timeout)


def records(out: Path, configs: tuple[str, ...]) -> dict[tuple[str, str, int], dict]:
    runs = ("saved", "reference", "control", "resumed")
    return {(c, run, r): torch.load(out / f"{c}-{run}-rank{r}.pt", weights_only=False)
            for c in configs for run in runs for r in range(w.WORLD) if (out / f"{c}-{run}-rank{r}.pt").exists()}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """One launch: per configuration the saved, reference and control fits, then the resumed fit
    with a fresh Trainer and module in the same two processes."""
    out = tmp_path_factory.mktemp("pl-fsdp")
    output = launch(out, "both", FAST, SEED, control=True)
    assert output.count("Restored all states from the checkpoint") == len(FAST), output[-4000:]
    return out, records(out, FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """Two launches: the resumed fits run in fresh processes, their optimizers built with ``OTHER_SEED``."""
    out = tmp_path_factory.mktemp("pl-fsdp-slow")
    launch(out, "first", FAST + SLOW, SEED, control=True)
    output = launch(out, "resume", FAST + SLOW, OTHER_SEED)
    assert output.count("Restored all states from the checkpoint") == len(FAST + SLOW), output[-4000:]
    return out, records(out, FAST + SLOW)


def _tuples(group: dict) -> dict:
    """A param group with its lists as tuples: torch's ``broadcast_from_rank0`` load (the full
    checkpoint layout) flattens a state dict and rebuilds its tuples as lists (``betas``), for
    every optimizer alike."""
    return {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}


def check_resume(runs: dict, config: str) -> None:
    ref, resumed = runs[config, "reference", 0], runs[config, "resumed", 0]
    assert resumed["optimizer_type"] == "lowp.optim.adamw.AdamW"
    assert resumed["dtypes"] == ["torch.bfloat16"] and resumed["placements"] == ["(Shard(dim=0),)"]
    for rank in range(w.WORLD):
        r, s, f = runs[config, "resumed", rank], runs[config, "saved", rank], runs[config, "reference", rank]
        assert f["global_step"] == r["global_step"] == 2 * w.STEPS and s["global_step"] == w.STEPS
        assert s["losses"] == f["losses"][:w.STEPS]         # the saved run is the reference's first half
        assert r["losses"] == f["losses"][w.STEPS:], rank   # every later loss, on every rank
        # the seed is the checkpoint's, not the one the resumed optimizer was built with
        assert (s["seed"], r["seed"]) == (SEED, SEED) and r["constructed_seed"] != SEED
    assert ref["weights"].keys() == resumed["weights"].keys() == {f"net.{i}.{k}" for i in (0, 2, 4)
                                                                  for k in ("weight", "bias")}
    for name, a in ref["weights"].items():
        b = resumed["weights"][name]
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    got, want = resumed["optimizer"], ref["optimizer"]
    if config.endswith("@full"):
        got = {**got, "param_groups": [_tuples(g) for g in got["param_groups"]]}
    assert_nested_equal(got, want)
    assert want["param_groups"][0]["lowp"]["seed"] == SEED
    if config.partition("@")[0] in RANDOM:      # another seed, other bits: the seed matters
        assert runs[config, "control", 0]["constructed_seed"] == SEED + 1
        control = runs[config, "control", 0]["weights"]
        assert any(not torch.equal(a, control[n]) for n, a in ref["weights"].items())
    assert sum(ref["losses"][-2:]) < sum(ref["losses"][:2])


@pytest.mark.parametrize("config", FAST)
def test_resume_is_bit_identical(fast, config):
    check_resume(fast[1], config)


@pytest.mark.slow
@pytest.mark.parametrize("config", FAST + SLOW)
def test_resume_in_fresh_processes_is_bit_identical(slow, config):
    check_resume(slow[1], config)


def test_checkpoint_is_dcp_and_holds_the_lowp_state(fast, tmp_path):
    """The saved folder is a DCP checkpoint (one file per rank, DCP's .metadata, Lightning's meta.pt); converted to
    one file, its optimizer holds every lowp state in its dtype, the extras and the dtype names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, _ = fast
    folder = w.checkpoint(out, "exact8-codes")
    assert folder.is_dir() and sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                      "meta.pt"]
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    (group,) = saved["optimizer_0"]["param_groups"]
    assert group["mode"] == "exact8" and group["state_dtype"] == {"exp_avg": "torch.int8", "exp_avg_sq": "torch.uint8"}
    assert group["lowp"]["seed"] == SEED and group["lowp"]["optimizer"] == "adamw"
    state = saved["optimizer_0"]["state"]
    assert sorted(state) == sorted(saved["state_dict"]) == sorted(group["params"])
    for name, entry in state.items():
        weight = saved["state_dict"][name]
        assert weight.dtype == torch.bfloat16 and int(entry["step"]) == w.STEPS
        assert (entry["exp_avg"].dtype, entry["exp_avg_sq"].dtype, entry["remainder8"].dtype) == (
            torch.int8, torch.uint8, torch.int8)
        assert entry["exp_avg_scale"].dtype == entry["exp_avg_sq_scale"].dtype == torch.bfloat16
        assert entry["remainder8"].shape == weight.shape and entry["exp_avg"].numel() == weight.numel()
