"""Train lowp's demo byte-level language model with FSDP2 on CPU (gloo), bf16 weights and lowp AdamW,
with a torch.distributed.checkpoint (DCP) checkpoint half way.

    torchrun --nproc_per_node 2 examples/fsdp_train.py                # train, checkpoint at steps/2
    torchrun --nproc_per_node 2 examples/fsdp_train.py --resume       # resume from the latest checkpoint
    torchrun --nproc_per_node 2 examples/fsdp_train.py --states 8bit  # int8 / uint8 moments
    torchrun --nproc_per_node 2 examples/fsdp_train.py --reduce bf16  # FSDP's own bf16 reduce-scatter

Every rank trains on its own batches (data parallel); the weights, the moments and the Kahan
compensation are sharded over the ranks (``fully_shard``), and the optimizer works on each
rank's shards. A resumed run prints the same losses, bit for bit, as the steps after the
checkpoint in the first run. The global batch is drawn per sample, so the data is also the same
with another number of ranks (``--batch`` must be divisible by it; DCP reshards the
checkpoint), though the gradient's sums are then grouped differently.

``--checkpoint`` is a root folder: :mod:`lowp.distributed.checkpoint` writes each save into a fresh
hidden folder and renames it to ``step-<step>`` only once every rank's files and a completeness
marker are on disk, so a run killed while saving never leaves a checkpoint that loads as a mixture
of two steps; ``--resume`` loads the newest complete one and continues after its step. The run
ends with :func:`lowp.distributed.shutdown.shutdown` (a barrier, ``destroy_process_group`` and a
garbage collection once the model is gone), which keeps gloo's threads from outliving the
interpreter (they could abort the process at exit).

``--states 8bit`` / ``4bit`` keep the moments as block-scaled codes (int8 first moment, uint8 or
uint4 second moment, one bf16 scale per 64 elements): the codes of the weight matrices are sharded
with them (their rows hold whole blocks); the 64-element vectors keep bf16 states (the default
``coded_min_numel=4096``; with ``coded_min_numel=0`` their codes, whose 32-element shards would
split a block, are replicated: see docs/distributed.md).

The gradients of bf16 parameters are reduce-scattered in bf16 by FSDP2 (``reduce_dtype=None``
falls back to their dtype), rounded at every hop. By default the example installs lowp's
``FP32ReduceScatter`` instead (bf16 on the wire, an fp32 sum, one rounding); ``--reduce bf16``
keeps FSDP's own. Rank 0 prints what ``advise_fsdp`` says of the set-up before training.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lowp.demo.data import load_data
from lowp.distributed import checkpoint
from lowp.distributed.advisor import advise_fsdp
from lowp.distributed.fsdp import set_fp32_reduce_scatter
from lowp.distributed.shutdown import shutdown
from lowp.demo.model import CharLM
from lowp.optim import AdamW
from lowp.optim.convert import cast_model


#: ``--states`` -> AdamW's state_dtype
STATES: dict[str, object] = {
    "bf16": None,
    "8bit": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
    "4bit": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint4},  # type: ignore[attr-defined]
}


def parse_args() -> argparse.Namespace:
    """The example's command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="total optimizer steps (the checkpoint is at steps/2)")
    ap.add_argument("--batch", type=int, default=16, help="global batch size (divided over the ranks)")
    ap.add_argument("--mode", default="kahan", choices=["kahan", "exact", "exact8", "stochastic", "nearest"])
    ap.add_argument("--states", default="bf16", choices=sorted(STATES), help="the moments' storage")
    ap.add_argument("--reduce", default="fp32", choices=["fp32", "bf16"],
                    help="the gradients' reduce-scatter: lowp's fp32 sum of bf16 values, or FSDP's bf16 one")
    ap.add_argument("--checkpoint", default="lowp-fsdp-checkpoint",
                    help="checkpoint root folder: one step-NNNNNNNNN folder per save, each published atomically")
    ap.add_argument("--resume", action="store_true",
                    help="load the newest complete checkpoint under --checkpoint and train the steps after it")
    return ap.parse_args()


def build(mesh) -> torch.nn.Module:
    """The demo model in bf16, every block and then the whole model sharded over ``mesh``."""
    torch.manual_seed(0)
    model = cast_model(CharLM(dim=64, layers=2, heads=4, seq_len=64), torch.bfloat16, keep_types=(), keep_names=())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(data, step: int, args, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same global batch at any world size)."""
    xs, ys = [], []
    per_rank = args.batch // world
    for sample in range(rank * per_rank, (rank + 1) * per_rank):
        x, y = data.batch(1, 64, torch.Generator().manual_seed(step * 100_003 + sample))
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def train(args: argparse.Namespace) -> None:
    """Train on this rank of the process group (see the module docstring); everything holding the
    process group (model, optimizer, mesh) lives in this function and is gone when it returns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch: expected a multiple of the world size {world}, got {args.batch}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cpu", (world,))
    data = load_data(max_bytes=200_000)
    model = build(mesh)
    if args.reduce == "fp32":
        set_fp32_reduce_scatter(model)
    if rank == 0:
        print("\n".join(f"advisor: {w}" for w in advise_fsdp(model)) or "advisor: nothing to change", flush=True)
    opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), mode=args.mode, seed=0,
                state_dtype=STATES[args.states])
    half = args.steps // 2
    first = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        try:     # rank 0 picks the newest complete checkpoint; every rank loads that one (or raises alike)
            first = checkpoint.load(state, args.checkpoint)
        except FileNotFoundError as exc:
            raise SystemExit(f"--resume: {exc}") from None
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {args.checkpoint}/{checkpoint.folder_name(first)}", flush=True)
    for step in range(first, args.steps):
        x, y = batch(data, step, args, rank, world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        stalled = opt.diagnostics()[0]["stalled_fraction"]   # a collective: every rank calls it
        if rank == 0:
            print(f"step {step + 1:4d}  loss {float(total) / world:.6f}  stalled {stalled:.3f}", flush=True)
        if step + 1 == half and not args.resume:
            model_sd, optim_sd = get_state_dict(model, opt)
            # a fresh folder, published by a rename once complete; replace=True: a rerun from scratch
            # swaps in its own checkpoint of this step (atomically) instead of refusing
            folder = checkpoint.save({"model": model_sd, "optim": optim_sd}, args.checkpoint, step + 1, replace=True)
            if rank == 0:
                print(f"checkpoint saved to {folder}", flush=True)


def main() -> None:
    """Join the process group ``torchrun`` started, train, and leave it cleanly."""
    args = parse_args()
    dist.init_process_group("gloo")
    train(args)
    shutdown()     # a collective: a barrier, destroy_process_group(), the groups freed before the interpreter exits


if __name__ == "__main__":
    main()
