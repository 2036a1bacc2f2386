"""A Lightning ``ModelParallelStrategy`` (FSDP2) training script on 2 CPU processes, run by
``tests/test_integration_lightning_fsdp.py`` as a user runs one: ``python lightning_fsdp_worker.py
...``. Lightning's subprocess launcher starts rank 1 by running this script again (with
``LOCAL_RANK=1`` in its environment) and both ranks join a gloo group on
``MASTER_ADDR``/``MASTER_PORT``; nothing here is CUDA-specific (``accelerator="cpu"``).

``--phase first``, per configuration: a Trainer fits ``N`` steps and its ``ModelCheckpoint``
saves the step-``N`` checkpoint ("saved"); another Trainer fits ``2N`` steps uninterrupted
("reference"); with ``--control``, the configurations that draw random bits fit ``2N`` steps once
more with another seed ("control").
``--phase resume``, per configuration: a fresh LightningModule whose lowp AdamW is built with the
``--seed`` given (another one than the first phase's) and a fresh Trainer ``fit(ckpt_path=<the
step-N checkpoint>)`` up to ``2N`` steps ("resumed"). ``--phase both`` runs the first phase and
then the resumed fits (seed + 1) in the same two processes: one launch instead of two.

Each fit leaves ``<out>/<config>-<run>-rank<r>.pt``: that rank's losses, its optimizer's seed
and more; rank 0's file also holds the gathered weights and optimizer state dict
(``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True``). Rank 0 waits for the
process Lightning started and exits non-zero if it failed.
"""
from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
# imported before Lightning starts the process group: torch.distributed.nn.functional (imported by
# torch.distributed.fsdp) binds the default group when imported, which keeps it alive past
# lowp's shutdown() (see lowp.distributed.shutdown)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lowp.distributed.shutdown import shutdown
from lowp.optim import AdamW
from stack_helpers import worker_arguments

STEPS = 4                      # N: the checkpoint's step; the runs end at 2N (2 epochs of N steps)
BATCH, WORLD = 8, 2            # per rank
CONFIGS = {
    "defaults": {},            # mode="auto" (Kahan for bf16 weights), bf16 states
    "stochastic": {"mode": "stochastic"},
    # AdamW at about 5 bytes per parameter: one-byte remainder, int8 / uint8 block-scaled
    # moments (stochastically rounded: state_rounding's default)
    "exact8-codes": {"mode": "exact8", "state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                     "coded_min_numel": 0},
}


def data() -> DataLoader:
    """A fixed-order regression set: one epoch is ``STEPS`` batches per rank (Lightning puts a
    non-shuffling ``DistributedSampler`` in the loader)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH * WORLD, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 8, generator=g) / 4)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Regression(L.LightningModule):
    """Linear -> GELU -> Linear -> GELU -> Linear; ``configure_model`` shards every Linear and the
    root with FSDP2 over the strategy's data-parallel mesh; ``"bf16-true"`` casts it to bf16."""

    def __init__(self, options: dict, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
        self.options, self.seed = options, seed
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, seed=self.seed, **self.options)


def trainer(steps: int, callbacks: list, sharded: bool = True) -> L.Trainer:
    # data_parallel_size=2: the default ("auto") is the number of nodes (1), which would make the
    # 2 processes a tensor-parallel group and leave FSDP a mesh of one rank
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1,
                                     save_distributed_checkpoint=sharded, timeout=timedelta(seconds=60))
    return L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-true", max_steps=steps,
                     callbacks=callbacks, enable_checkpointing=bool(callbacks), logger=False,
                     enable_progress_bar=False, enable_model_summary=False)


def checkpoint_dir(out: Path, config: str, run: str) -> Path:
    return out / f"checkpoints-{config}-{run}"


def checkpoint(out: Path, config: str) -> Path:
    """The saved run's step-``N`` checkpoint: a folder of one DCP file per rank and Lightning's
    ``meta.pt`` (``config@full``: one ``torch.save`` file written by rank 0)."""
    return checkpoint_dir(out, config, "saved") / f"epoch=0-step={STEPS}.ckpt"


def fit(out: Path, config: str, run: str, seed: int, steps: int, resume: Path | None = None) -> L.Trainer:
    """One ``Trainer.fit`` of ``config`` (a :data:`CONFIGS` name, ``@full`` for
    ``save_distributed_checkpoint=False``) with a lowp AdamW built with ``seed``; the "saved"
    and "resumed" runs checkpoint every ``N`` steps."""
    name, _, layout = config.partition("@")
    module = Regression(CONFIGS[name], seed)
    callbacks = ([ModelCheckpoint(dirpath=checkpoint_dir(out, config, run), every_n_train_steps=STEPS, save_top_k=-1)]
                 if run in ("saved", "resumed") else [])
    t = trainer(steps, callbacks, sharded=layout != "full")
    t.fit(module, data(), ckpt_path=None if resume is None else str(resume))
    optimizer = t.optimizers[0]
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)     # collectives: every rank
    weights = get_model_state_dict(t.strategy.model, options=full)
    optimizer_state = get_optimizer_state_dict(t.strategy.model, optimizer, options=full)
    record = {"losses": module.losses, "seed": optimizer.seed, "constructed_seed": seed, "global_step": t.global_step,
              "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
              "placements": sorted({str(getattr(p, "placements", None)) for p in module.parameters()}),
              "optimizer_type": type(optimizer).__module__ + "." + type(optimizer).__qualname__}
    if t.global_rank == 0:     # full_state_dict: the gathered tensors are on rank 0 only
        record.update(weights=weights, optimizer=optimizer_state)
    torch.save(record, out / f"{config}-{run}-rank{t.global_rank}.pt")
    return t


def train(args: argparse.Namespace) -> list:
    """Every fit of ``args.phase``; returns the processes Lightning started (on rank 0), with
    everything that holds the process group (trainers, modules, meshes) gone."""
    children: list = []
    for config in args.configs.split(","):
        runs = []
        if args.phase in ("first", "both"):
            runs += [("saved", args.seed, STEPS), ("reference", args.seed, 2 * STEPS)]
            if args.control and CONFIGS[config.partition("@")[0]].get("mode") in ("stochastic", "exact8"):
                runs.append(("control", args.seed + 1, 2 * STEPS))   # the random bits depend on the seed
        if args.phase in ("resume", "both"):
            runs.append(("resumed", args.seed + 1 if args.phase == "both" else args.seed, 2 * STEPS))
        for run, seed, steps in runs:
            resume = checkpoint(args.out, config) if run == "resumed" else None
            t = fit(args.out, config, run, seed, steps, resume=resume)
            children = children or list(getattr(t.strategy.launcher, "procs", []))
    return children


def main() -> int:
    args = worker_arguments(CONFIGS,
                            both="both: the first phase, then the resumed fits in the same processes (seed + 1)",
                            control="first phase: also fit the randomized configurations with seed + 1")
    torch.set_num_threads(1)
    children = train(args)
    shutdown()
    return max([0, *[abs(p.wait()) for p in children]])


if __name__ == "__main__":
    sys.exit(main())
