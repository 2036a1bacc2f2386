"""lowp through accelerate's FSDP2 path (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))``, ``prepare``, ``save_state``, ``load_state``) on 2 CPU processes and gloo:
``tests/accelerate_worker.py`` under ``torchrun --nproc_per_node 2`` (accelerate 1.15, torch 2.13).

**What does not run on CPU as is.** accelerate 1.15 never takes its FSDP path on CPU, and says
nothing: with ``Accelerator(cpu=True, fsdp_plugin=...)`` under torchrun the distributed type is
``MULTI_CPU`` and ``prepare`` wraps the model in ``DistributedDataParallel``, because
``AcceleratorState.__init__`` (``accelerate/state.py``) sets ``DistributedType.FSDP`` only when the
type is ``MULTI_GPU``, ``MULTI_MLU``, ``MULTI_SDAA``, ``MULTI_MUSA``, ``MULTI_NPU``, ``MULTI_XPU``,
``MULTI_HPU`` or ``MULTI_NEURON``; without ``cpu=True`` on a host without an accelerator
``PartialState._prepare_backend`` picks no backend and each process trains alone
(``DistributedType.NO``); and ``accelerate launch --cpu --num_processes 2`` starts a single
process (its ``simple_launcher``; multi-CPU launches need ``mpirun`` with a hostfile). So the
worker sets the distributed type to ``FSDP`` right after building the ``Accelerator``
(:func:`accelerate_worker.fsdp2_accelerator`), and everything after that is accelerate's own FSDP2
code: ``fsdp2_prepare_model`` (``fully_shard`` on a CPU mesh), ``save_fsdp_model`` /
``save_fsdp_optimizer`` (``get_optimizer_state_dict`` with the ``StateDictOptions`` of
``_prepare_sd_options``, written with ``torch.distributed.checkpoint``) and ``load_fsdp_optimizer``
(``get_optimizer_state_dict`` of the fresh optimizer, ``dcp.load``, ``set_optimizer_state_dict``).
``test_accelerate_ignores_its_fsdp_plugin_on_cpu`` pins the first fact.

Per configuration: prepare (model, lowp AdamW, LR scheduler), train ``N`` steps, ``save_state``,
train ``N`` more (the reference); prepare a fresh model and an optimizer built with another seed,
``load_state``, train ``N``: gathered weights, gathered optimizer state dict, scheduler state and
every loss on both ranks equal the reference bit for bit, and the seed is the saved one. A control
run from scratch with the resumed run's seed ends elsewhere where the step draws random bits.

Default run: one launch (25 to 30 s measured on 2 cores shared with other jobs, load average 10
to 13) of lowp's defaults and ``mode="exact8"`` with int8 / uint8 moments, resumed in the same
processes after ``free_memory()``. ``-m slow``: two launches, resumed in fresh processes, adding
``mode="stochastic"`` and ``state_dict_type="FULL_STATE_DICT"`` (one optimizer file written by
rank 0, loaded with ``broadcast_from_rank0``; 45 to 65 s there).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import accelerate_worker as w  # noqa: E402
from lowp.distributed.launch import free_port  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402
from stack_helpers import FAST, OTHER_SEED, RANDOM, ROOT, SEED, SLOW, clean_env, run_launch  # noqa: E402


def launch(out: Path, phase: str, configs: tuple[str, ...], seed: int, control: bool = False,
           timeout: float = 400) -> str:
    """torchrun the worker on 2 processes; fail on a non-zero exit, an abort or a hang."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(ROOT / "tests" / "accelerate_worker.py"), "--out", str(out),
               "--phase", phase, "--configs", ",".join(configs), "--seed", str(seed),
               *(["--control"] if control else [])]
    return run_launch(command, clean_env(("ACCELERATE_", "FSDP_")), out, phase, timeout)


def records(out: Path, configs: tuple[str, ...]) -> dict[tuple[str, str, int], dict]:
    return {(c, run, r): torch.load(out / f"{c}-{run}-rank{r}.pt", weights_only=False)
            for c in configs for run in ("reference", "control", "resumed") for r in range(2)
            if (out / f"{c}-{run}-rank{r}.pt").exists()}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc-fsdp2")
    launch(out, "both", FAST, SEED, control=True)
    return out, records(out, FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc-fsdp2-slow")
    launch(out, "first", FAST + SLOW, SEED, control=True)
    launch(out, "resume", FAST + SLOW, OTHER_SEED)
    return out, records(out, FAST + SLOW)


def _tuples(group: dict) -> dict:
    """A param group with its lists as tuples: torch's ``broadcast_from_rank0`` load flattens the
    state dict and rebuilds its tuples (``betas``) as lists, for every optimizer alike."""
    return {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}


def check_resume(runs: dict, config: str) -> None:
    ref, resumed = runs[config, "reference", 0], runs[config, "resumed", 0]
    for rank in range(2):
        f, r = runs[config, "reference", rank], runs[config, "resumed", rank]
        # accelerate's FSDP2 path ran: a fully_shard'ed model, Shard(0) DTensor parameters
        assert (r["distributed_type"], r["is_fsdp2"], r["model_type"]) == ("DistributedType.FSDP", True,
                                                                           "FSDPSequential")
        assert r["optimizer_type"] == "lowp.optim.adamw.AdamW" and r["dtypes"] == ["torch.bfloat16"]
        assert r["placements"] == ["(Shard(dim=0),)"] and f["steps"] == r["steps"] == [2 * w.STEPS]
        assert len(f["losses"]) == 2 * w.STEPS and r["losses"] == f["losses"][w.STEPS:], rank
        assert r["scheduler"] == f["scheduler"]
        assert (f["seed"], r["seed"]) == (SEED, SEED) and r["constructed_seed"] != SEED
    assert ref["weights"].keys() == resumed["weights"].keys() == {f"{i}.{k}" for i in (0, 2, 4)
                                                                  for k in ("weight", "bias")}
    for name, a in ref["weights"].items():
        b = resumed["weights"][name]
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    got, want = resumed["optimizer"], ref["optimizer"]
    if config.endswith("@full"):
        got = {**got, "param_groups": [_tuples(g) for g in got["param_groups"]]}
    assert_nested_equal(got, want)
    assert want["param_groups"][0]["lowp"]["seed"] == SEED
    if config.partition("@")[0] in RANDOM:
        control = runs[config, "control", 0]
        assert control["constructed_seed"] == control["seed"] == SEED + 1
        assert any(not torch.equal(a, control["weights"][n]) for n, a in ref["weights"].items())
    assert sum(ref["losses"][-2:]) < sum(ref["losses"][:2])


@pytest.mark.parametrize("config", FAST)
def test_resume_is_bit_identical(fast, config):
    check_resume(fast[1], config)


@pytest.mark.slow
@pytest.mark.parametrize("config", FAST + SLOW)
def test_resume_in_fresh_processes_is_bit_identical(slow, config):
    check_resume(slow[1], config)


def test_accelerate_ignores_its_fsdp_plugin_on_cpu(fast):
    """Why the worker overrides the distributed type. If this fails, accelerate takes its FSDP
    path on CPU by itself: drop the override (``accelerate_worker.fsdp2_accelerator``) and the
    note in docs/integrations.md."""
    chosen = fast[1]["defaults", "reference", 0]["chosen"]
    assert chosen == {"distributed_type": "DistributedType.MULTI_CPU", "plugin_taken": False}


def test_saved_state_holds_the_lowp_state(fast, tmp_path):
    """``save_state`` wrote DCP folders for model and optimizer; converted to one file, the
    optimizer holds every lowp state in its dtype, the dtype names and the extras."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, _ = fast
    folder = w.state_dir(out, "exact8-codes")
    assert {"optimizer_0", "pytorch_model_fsdp_0", "scheduler.bin"} <= {p.name for p in folder.iterdir()}
    dcp_to_torch_save(folder / "optimizer_0", tmp_path / "optimizer.pt")
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=False)["optimizer"]
    (group,) = saved["param_groups"]
    assert group["mode"] == "exact8" and group["state_dtype"] == {"exp_avg": "torch.int8", "exp_avg_sq": "torch.uint8"}
    assert group["lowp"]["seed"] == SEED and group["lowp"]["optimizer"] == "adamw"
    assert sorted(saved["state"]) == sorted(group["params"]) and len(group["params"]) == 6
    for entry in saved["state"].values():
        assert int(entry["step"]) == w.STEPS
        assert (entry["exp_avg"].dtype, entry["exp_avg_sq"].dtype, entry["remainder8"].dtype) == (
            torch.int8, torch.uint8, torch.int8)
        assert entry["exp_avg_scale"].dtype == entry["exp_avg_sq_scale"].dtype == torch.bfloat16
        assert entry["remainder8"].shape == entry["exp_avg"].shape
