"""Rank functions for tests/test_integration_torchtune.py, run by
:func:`lowp.distributed.launch.run_local_group` (spawned processes on a gloo group).

torchtune 0.6.1 does not import beside torchao 0.18 (it imports ``torchao.dtypes.nf4tensor``,
which torchao no longer has), so the calls of its full-finetune distributed recipe are reproduced
here from its source (``torchtune/training/_distributed.py``,
``torchtune/training/checkpointing/_checkpoint_client.py``, ``recipes/full_finetune_distributed.py``):

- save (:func:`train_and_save`): the model gathered to full CPU tensors on rank 0
  (``gather_cpu_state_dict``: ``full_tensor()`` per entry, a barrier after each), the optimizer
  through ``get_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True, cpu_offload=True)`` (``get_full_optimizer_state_dict``), both written
  by rank 0 with ``torch.save`` (the recipe state file holds the optimizer);
- load (:func:`resume`, in a fresh process group): every rank reads the files with
  ``torch.load(..., weights_only=True)`` (``safe_torch_load``), builds the model on the meta
  device, shards it, loads the full model state as ``load_from_full_model_state_dict`` does
  (``distribute_tensor`` per entry, ``load_state_dict(assign=True)``), builds the optimizer from
  its configuration section (``config.instantiate(cfg.optimizer, model.parameters())``, here the
  section as a dict) and loads the optimizer state either as 0.6.1's
  ``load_from_full_optimizer_state_dict`` does (``_DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE`` is
  ``False`` there: ``_init_optim_state``, every saved group key copied, each saved state
  ``distribute_tensor``-ed like the fresh one, ``opt.load_state_dict``) or through the branch
  behind that switch (``set_optimizer_state_dict`` with ``full_state_dict=True,
  broadcast_from_rank0=True``).

Each run trains :data:`STEPS` steps after the checkpoint (one gradient element NaN at step 1, so a
skip counter is saved) and returns each rank's local shards of the weights and states and the
optimizer's counters.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
# imported before the rank joins its process group (see tests/checkpoint_worker.py)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _init_optim_state, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from stack_helpers import local_snapshot

#: steps before the checkpoint, and again after it
STEPS = 3
#: the model seed and optimizer seed of the run that saves, and of the run that resumes
SAVE_SEED, LOAD_SEED = 1, 99
#: optimizer sections as a recipe's YAML gives them (``_component_`` left out: the test calls it)
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"optimizer": "AdamW", "lr": 3e-3, "weight_decay": 0.01},
    "exact8": {"optimizer": "AdamW", "lr": 3e-3, "weight_decay": 0.01, "mode": "exact8",
               "state_dtype": {"exp_avg": "int8", "exp_avg_sq": "uint8"}, "coded_min_numel": 0},
}
#: how the resumed run loads the optimizer state
LOADERS = ("torchtune-0.6.1", "distributed-state-dict")


def _model(world_size: int, meta: bool = False) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(SAVE_SEED)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 8)).bfloat16()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: torch.nn.Module, config: str, seed: int):
    from lowp.integrations.torchtune import build_optimizer
    return build_optimizer(model.parameters(), seed=seed, **CONFIGS[config])


def _train(model, opt, steps: range, rank: int) -> None:
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank)).bfloat16()
        model(x).float().square().mean().backward()
        if step == 1 and rank == 0:   # one non-finite gradient element: a skip counter to save
            next(model.parameters()).grad.to_local()[0, 0] = float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)


def _gather_cpu_state_dict(model, is_rank_zero: bool) -> dict[str, torch.Tensor]:
    """torchtune's ``gather_cpu_state_dict`` (no NF4 tensors here)."""
    out = {}
    for name, param in model.state_dict().items():
        if isinstance(param, DTensor):
            param = param.full_tensor()
        if is_rank_zero:
            out[name] = param.cpu()
        torch.distributed.barrier()
    return out


def _load_full_model_state_dict(model, full_sd: dict[str, torch.Tensor]) -> None:
    """torchtune 0.6.1's ``load_from_full_model_state_dict`` (its non-NF4 fallback branch)."""
    meta_sharded_sd = model.state_dict()
    sharded_sd = {}
    for name, full_tensor in full_sd.items():
        meta = meta_sharded_sd[name]
        full_tensor = full_tensor.to(meta.dtype)
        sharded = distribute_tensor(full_tensor, meta.device_mesh, meta.placements) if hasattr(meta, "device_mesh") \
            else full_tensor
        sharded_sd[name] = torch.nn.Parameter(sharded)
    model.load_state_dict(sharded_sd, strict=True, assign=True)


def _load_full_optimizer_state_dict(model, opt, full_sd: dict[str, Any], loader: str) -> None:
    """torchtune 0.6.1's ``load_from_full_optimizer_state_dict``: its fallback (the default there), or
    the branch behind ``_DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE``."""
    device = torch.device("cpu")
    if loader == "distributed-state-dict":
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                   cpu_offload=device is torch.device("cpu"))
        set_optimizer_state_dict(model=model, optimizers=opt, optim_state_dict=full_sd, options=options)
        return
    _init_optim_state(opt)
    param_groups = opt.state_dict()["param_groups"]
    state = opt.state_dict()["state"]
    for param_group, full_param_group in zip(param_groups, full_sd["param_groups"]):
        for key, value in full_param_group.items():
            if key != "params":
                param_group[key] = value
        for pid, full_pid in zip(param_group["params"], full_param_group["params"]):
            if pid not in state:
                continue
            param_state = state[pid]
            for attr, full_tensor in full_sd["state"][full_pid].items():
                sharded_tensor = param_state[attr]
                if isinstance(sharded_tensor, DTensor):
                    param_state[attr] = distribute_tensor(full_tensor, sharded_tensor.device_mesh,
                                                          sharded_tensor.placements)
                else:
                    param_state[attr] = full_tensor
    opt.load_state_dict({"param_groups": param_groups, "state": state})


def train_and_save(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Per configuration: train, save as the recipe does, train on; each rank's final snapshot."""
    out = {}
    for config in CONFIGS:
        model = _model(world_size)
        opt = _optimizer(model, config, SAVE_SEED)
        _train(model, opt, range(STEPS), rank)
        model_sd = _gather_cpu_state_dict(model, rank == 0)
        optim_sd = get_optimizer_state_dict(model=model, optimizers=opt, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True))
        if rank == 0:
            root = Path(folder) / config
            root.mkdir(parents=True)
            torch.save(model_sd, root / "model.pt")
            torch.save({"optimizer": optim_sd, "seed": SAVE_SEED, "epochs_run": 0}, root / "recipe_state.pt")
        else:
            assert not model_sd
        torch.distributed.barrier()
        _train(model, opt, range(STEPS, 2 * STEPS), rank)
        out[config] = local_snapshot(model, opt)
    return out


def resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Per configuration and loader: a fresh model (meta device, sharded, loaded from the full state)
    and a differently seeded optimizer loaded from the recipe state, trained on."""
    out = {}
    for config in CONFIGS:
        root = Path(folder) / config
        for loader in LOADERS:
            model_sd = torch.load(root / "model.pt", weights_only=True, mmap=True)
            recipe_state = torch.load(root / "recipe_state.pt", weights_only=True, mmap=False)
            model = _model(world_size, meta=True)
            _load_full_model_state_dict(model, model_sd)
            opt = _optimizer(model, config, LOAD_SEED)
            fresh_seed = opt.seed
            _load_full_optimizer_state_dict(model, opt, recipe_state["optimizer"], loader)
            out[f"{config}/{loader}/fresh_seed"] = fresh_seed
            _train(model, opt, range(STEPS, 2 * STEPS), rank)
            out[f"{config}/{loader}"] = local_snapshot(model, opt)
    return out
