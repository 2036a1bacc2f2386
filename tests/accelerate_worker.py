"""accelerate's FSDP2 path with a lowp AdamW on 2 CPU processes (gloo), run by
``tests/test_integration_accelerate.py`` under ``torchrun --nproc_per_node 2`` (``python -m
torch.distributed.run``), which sets the environment accelerate reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

accelerate 1.15 does not take its FSDP path on CPU: with ``Accelerator(cpu=True,
fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` the state is ``MULTI_CPU``
(``accelerate/state.py``, ``AcceleratorState.__init__``: ``distributed_type = FSDP`` is set only
when the type is one of ``MULTI_GPU``, ``MULTI_MLU``, ``MULTI_SDAA``, ``MULTI_MUSA``,
``MULTI_NPU``, ``MULTI_XPU``, ``MULTI_HPU``, ``MULTI_NEURON``), no error is raised, and ``prepare``
wraps the model in ``DistributedDataParallel``; without ``cpu=True`` on a host without an
accelerator, ``PartialState._prepare_backend`` finds no backend and every process trains alone
(``DistributedType.NO``). :func:`fsdp2_accelerator` therefore sets the distributed type to
``FSDP`` (in ``PartialState`` and ``AcceleratorState``, whose shared states accelerate copies
from one to the other) right after the ``Accelerator`` is built: from there on ``prepare``,
``save_state`` and ``load_state`` run accelerate's own FSDP2 code (``fsdp2_prepare_model``:
``fully_shard`` on a CPU mesh; ``save_fsdp_model`` / ``save_fsdp_optimizer``:
``get_optimizer_state_dict`` with the ``StateDictOptions`` of ``_prepare_sd_options`` and
``torch.distributed.checkpoint``; ``load_fsdp_optimizer``: ``get_optimizer_state_dict`` of the
fresh optimizer, ``dcp.load``, ``set_optimizer_state_dict``). Nothing it skips (fp8 and fp16
scaler set-up) applies to bf16 weights without mixed precision.

``--phase first``, per configuration: prepare (model, lowp AdamW, LR scheduler), train ``N``
steps, ``accelerator.save_state(<dir>)``, train ``N`` more ("reference"); with ``--control``, the
configurations that draw random bits train ``2N`` steps once more with seed + 1 ("control").
``--phase resume``: prepare a fresh model and optimizer built with ``--seed``,
``accelerator.load_state(<dir>)``, train ``N`` steps ("resumed"). ``--phase both``: the first
phase, then the resumed runs (seed + 1) in the same processes, after ``free_memory()``.

Each run leaves ``<out>/<config>-<run>-rank<r>.pt`` (losses, seeds, the accelerate state seen,
the scheduler's state); rank 0's also holds the gathered weights and optimizer state dict.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
# imported before the process group starts: torch.distributed.nn.functional (imported by
# torch.distributed.fsdp) binds the default group when imported (see lowp.distributed.shutdown)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule  # noqa: F401

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from lowp.distributed.shutdown import shutdown
from lowp.optim import AdamW
from stack_helpers import worker_arguments

STEPS, BATCH = 4, 8            # N; per rank
CONFIGS = {
    "defaults": {},            # mode="auto" (Kahan for bf16 weights), bf16 states
    "stochastic": {"mode": "stochastic"},
    # AdamW at about 5 bytes per parameter: one-byte remainder, int8 / uint8 block-scaled moments
    "exact8-codes": {"mode": "exact8", "state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                     "coded_min_numel": 0},
}


#: what accelerate chose in this process before the first override
_CHOSEN: dict = {}


def fsdp2_accelerator(state_dict_type: str) -> tuple[Accelerator, dict]:
    """An ``Accelerator`` with an FSDP2 plugin whose FSDP path runs on CPU (see the module
    docstring), and what accelerate chose on its own, before the first override in this process."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    _CHOSEN.setdefault("distributed_type", str(accelerator.distributed_type))
    _CHOSEN.setdefault("plugin_taken", getattr(accelerator.state, "fsdp_plugin", None) is plugin)
    if accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP) \
            and getattr(accelerator.state, "fsdp_plugin", None) is not plugin:
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator, dict(_CHOSEN)


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    return net.to(torch.bfloat16)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (0-based), the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 32, generator=g)
    y = torch.tanh(x @ torch.linspace(-1, 1, 32 * 8).reshape(32, 8) / 4)
    return x.to(torch.bfloat16), y


def build(accelerator: Accelerator, config: str, seed: int):
    net = model()
    optimizer = AdamW(net.parameters(), lr=1e-2, weight_decay=0.01, seed=seed, **CONFIGS[config])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** (s / 16))
    return accelerator.prepare(net, optimizer, scheduler)


def train(accelerator: Accelerator, net, optimizer, scheduler, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = batch(step, accelerator.process_index)
        loss = nn.functional.mse_loss(net(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def record(out: Path, accelerator: Accelerator, chosen: dict, config: str, run: str, seed: int, net, optimizer,
           scheduler, losses: list[float]) -> None:
    weights = accelerator.get_state_dict(net)     # FSDP2: full weights on rank 0 (a collective)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer_state = get_optimizer_state_dict(net, optimizer.optimizer, options=full)
    lowp = optimizer.optimizer                      # accelerate's AcceleratedOptimizer wraps it
    params = list(net.parameters())
    data = {"losses": losses, "seed": lowp.seed, "constructed_seed": seed, "chosen": chosen,
            "distributed_type": str(accelerator.distributed_type), "is_fsdp2": accelerator.is_fsdp2,
            "model_type": type(net).__name__, "optimizer_type": type(lowp).__module__ + "." + type(lowp).__qualname__,
            "dtypes": sorted({str(p.dtype) for p in params}),
            "placements": sorted({str(getattr(p, "placements", None)) for p in params}),
            "scheduler": scheduler.scheduler.state_dict(),
            "steps": sorted({int(s["step"]) for s in lowp.state.values()})}
    if accelerator.is_main_process:
        data.update(weights={k: v.clone() for k, v in weights.items()}, optimizer=optimizer_state)
    torch.save(data, out / f"{config}-{run}-rank{accelerator.process_index}.pt")


def state_dir(out: Path, config: str) -> Path:
    return out / f"state-{config}"


def run(args: argparse.Namespace) -> None:
    """Every run of ``args.phase``; everything holding the process group is gone when it returns."""
    for config in args.configs.split(","):
        name, _, layout = config.partition("@")
        accelerator, chosen = fsdp2_accelerator("FULL_STATE_DICT" if layout == "full" else "SHARDED_STATE_DICT")
        if args.phase in ("first", "both"):
            net, optimizer, scheduler = build(accelerator, name, args.seed)
            losses = train(accelerator, net, optimizer, scheduler, 0, STEPS)
            accelerator.save_state(str(state_dir(args.out, config)))
            losses += train(accelerator, net, optimizer, scheduler, STEPS, 2 * STEPS)
            record(args.out, accelerator, chosen, config, "reference", args.seed, net, optimizer, scheduler, losses)
            accelerator.free_memory(net, optimizer, scheduler)
            if args.control and CONFIGS[name].get("mode") in ("stochastic", "exact8"):
                net, optimizer, scheduler = build(accelerator, name, args.seed + 1)
                losses = train(accelerator, net, optimizer, scheduler, 0, 2 * STEPS)
                record(args.out, accelerator, chosen, config, "control", args.seed + 1, net, optimizer, scheduler,
                       losses)
                accelerator.free_memory(net, optimizer, scheduler)
        if args.phase in ("resume", "both"):
            seed = args.seed + 1 if args.phase == "both" else args.seed
            net, optimizer, scheduler = build(accelerator, name, seed)
            accelerator.load_state(str(state_dir(args.out, config)))
            losses = train(accelerator, net, optimizer, scheduler, STEPS, 2 * STEPS)
            record(args.out, accelerator, chosen, config, "resumed", seed, net, optimizer, scheduler, losses)
            accelerator.free_memory(net, optimizer, scheduler)
        del accelerator
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=False)   # the next configuration's plugin


def main() -> int:
    args = worker_arguments(CONFIGS, both="both: the first phase, then the resumed runs in the same processes",
                            control="first phase: also train the randomized configurations with seed + 1")
    torch.set_num_threads(1)
    run(args)
    shutdown()
    return 0


if __name__ == "__main__":
    assert "LOCAL_RANK" in os.environ, "run under torchrun: python -m torch.distributed.run --nproc_per_node 2 ..."
    assert not dist.is_initialized()
    sys.exit(main())
