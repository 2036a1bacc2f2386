"""Rank functions for tests/test_integration_torchtitan.py, run by
:func:`lowp.distributed.launch.run_local_group` (spawned processes on a gloo group).

Each rank builds a small bf16 MLP sharded with FSDP2 (``fully_shard`` on every linear layer and
the root), torchtitan's own components around it: the optimizer container from
:func:`lowp.integrations.torchtitan.lowp_adamw`, torchtitan's ``LRSchedulersContainer`` (warmup
then linear decay) and torchtitan's ``CheckpointManager`` (torch.distributed.checkpoint into
``<folder>/checkpoint/step-N``). :func:`train_and_save` trains :data:`STEPS` steps, handing every
step to the checkpointer, which saves every :data:`SAVE_AT` steps; :func:`resume` builds everything
anew with another model seed and another lowp seed, lets the checkpointer load step
:data:`SAVE_AT` and trains to :data:`STEPS`. Both return each
rank's local shards of the weights and of every optimizer state, the optimizer's counters and the
scheduler's state, for the test to compare bit for bit.
"""
from __future__ import annotations

from typing import Any

import torch
# imported before the rank joins its process group (see tests/checkpoint_worker.py)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stack_helpers import local_snapshot

#: training steps in all, and the step whose end is checkpointed
STEPS, SAVE_AT = 6, 3
#: the model seed and lowp seed of the run that saves, and of the run that resumes
SAVE_SEED, LOAD_SEED = 1, 99
#: lowp configurations: torchtitan-style group options of ``lowp_adamw`` (dtypes as names, as a
#: config file or command line gives them)
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},   # mode kahan (auto), bf16 states rounded stochastically: random bits in play
    "exact8": {"mode": "exact8", "state_dtype": "int8/uint8", "coded_min_numel": 0},
}


class Progress(Stateful):
    """The training step, checkpointed beside the model (torchtitan's trainer keeps its own)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def _model(seed: int, world_size: int) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8)).bfloat16()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _components(config: str, seed: int, world_size: int, folder: str, options: dict[str, Any] | None = None):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from lowp.integrations.torchtitan import lowp_adamw
    model = _model(seed, world_size)
    options = CONFIGS[config] if options is None else options
    optimizers = lowp_adamw(lr=3e-3, factory_kwargs={"seed": seed}, **options).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(
        optimizers=optimizers, training_steps=STEPS)
    progress = Progress()
    checkpointer = CheckpointManager.Config(enable=True, interval=SAVE_AT, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": progress}, sd_adapter=None, base_folder=f"{folder}/{config}")
    return model, optimizers, schedulers, progress, checkpointer


def _train(model, optimizers, schedulers, progress, rank: int, checkpointer=None) -> None:
    while progress.step < STEPS:
        progress.step += 1
        g = torch.Generator().manual_seed(100 * progress.step + rank)
        x = torch.randn(8, 16, generator=g).bfloat16()
        model(x).float().square().mean().backward()
        if progress.step == 1 and rank == 0:   # one non-finite gradient element: a skip counter to save
            next(model.parameters()).grad.to_local()[0, 0] = float("nan")
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        if checkpointer is not None:
            checkpointer.save(progress.step)


def _snapshot(model, optimizers, schedulers) -> dict[str, Any]:
    (opt,) = optimizers.optimizers
    return {**local_snapshot(model, opt), "lr": [g["lr"] for g in opt.param_groups],
            "scheduler": schedulers.state_dict(), "backend": opt.backend.name}


def train_and_save(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Per configuration: train :data:`STEPS` steps, checkpointing at :data:`SAVE_AT`."""
    out = {}
    for config in CONFIGS:
        model, optimizers, schedulers, progress, checkpointer = _components(config, SAVE_SEED, world_size, folder)
        _train(model, optimizers, schedulers, progress, rank, checkpointer)
        out[config] = _snapshot(model, optimizers, schedulers)
        checkpointer.close()
    return out


def resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Per configuration: fresh components (other seeds), load the latest checkpoint, train on."""
    out = {}
    for config in CONFIGS:
        model, optimizers, schedulers, progress, checkpointer = _components(config, LOAD_SEED, world_size, folder)
        fresh_seed = optimizers.optimizers[0].seed
        loaded = checkpointer.load(step=SAVE_AT)   # it also saved step 2 * SAVE_AT
        out[f"{config}/loaded"] = (loaded, progress.step, fresh_seed)
        _train(model, optimizers, schedulers, progress, rank)
        out[config] = _snapshot(model, optimizers, schedulers)
        checkpointer.close()
    return out


def resume_with_the_default_threshold(rank: int, world_size: int, folder: str) -> dict[str, str]:
    """The exact8 checkpoint (codes for every parameter, ``coded_min_numel=0``) loaded by
    torchtitan's checkpointer into components built with the default threshold (16-bit states for
    these small parameters): what the load and then a step raise on this rank."""
    options = {k: v for k, v in CONFIGS["exact8"].items() if k != "coded_min_numel"}
    model, optimizers, schedulers, progress, checkpointer = _components("exact8", LOAD_SEED, world_size, folder,
                                                                        options)
    out = {}
    try:
        checkpointer.load(step=SAVE_AT)
    except ValueError as exc:
        out["load"] = str(exc)
    try:
        _train(model, optimizers, schedulers, progress, rank)
    except RuntimeError as exc:
        out["step"] = str(exc)
    checkpointer.close()
    return out
