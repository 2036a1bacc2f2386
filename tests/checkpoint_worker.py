"""Workers for tests/test_checkpoint_atomic.py.

- ``python tests/checkpoint_worker.py loop ROOT``: one process (no process group) saves the states
  of steps 1 and 2 with :func:`lowp.distributed.checkpoint.save`, prints ``READY``, then saves
  steps 3, 4, ... (``keep=3``) until it is killed; the test sends SIGKILL at a random moment.
- :func:`fsdp_round_trip`: a rank function for ``run_local_group``: FSDP2-sharded parameters and
  lowp AdamW states saved and loaded through the helper on a gloo group.
- :func:`fsdp_layout_cast`: torch's own ``dcp.load`` into a template of another storage layout,
  refused alike on every rank.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
# imported before the rank joins its process group (this module is imported when the rank function
# is unpickled): torch.distributed.fsdp imported later binds the live default group as a default
# argument (torch.distributed.nn.functional) and keeps it alive past shutdown()
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lowp.distributed import checkpoint
from lowp.optim import AdamW

SHAPES = {"w": (384, 512), "h": (256, 256), "v": (1000,)}


def state_of(step: int) -> dict[str, Any]:
    """A deterministic state that differs in every tensor from one step to the next (about 1.4 MB)."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(SHAPES["w"], generator=g),
                      "h": torch.randn(SHAPES["h"], generator=g).bfloat16(),
                      "i": torch.arange(4096, dtype=torch.int64) * (step + 1)},
            "optim": {"v": torch.randn(SHAPES["v"], generator=g).double(), "step": torch.tensor(float(step))}}


def empty_state() -> dict[str, Any]:
    """A state of the same structure to load into (filled in place by DCP)."""
    return {"model": {"w": torch.zeros(SHAPES["w"]), "h": torch.zeros(SHAPES["h"], dtype=torch.bfloat16),
                      "i": torch.zeros(4096, dtype=torch.int64)},
            "optim": {"v": torch.zeros(SHAPES["v"], dtype=torch.float64), "step": torch.tensor(0.0)}}


def same_bits(a: Any, b: Any) -> bool:
    """``a`` and ``b`` have the same structure and bit-identical tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    return bool(a == b)


def loop(root: str) -> None:
    for step in (1, 2):
        checkpoint.save(state_of(step), root, step)
    print("READY", flush=True)
    for step in range(3, 100_000):
        checkpoint.save(state_of(step), root, step, keep=3)


# ---- 2 gloo ranks, FSDP2 ----------------------------------------------------------------------

def _build(world_size: int, **options: Any):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).bfloat16()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, AdamW(model.parameters(), lr=1e-2, seed=0, **options)


def _train(model, opt, step: int, rank: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank)).bfloat16()
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(model, opt) -> dict[str, torch.Tensor]:
    """Gathered copies of every parameter and optimizer state (a collective)."""
    from lowp.optim.sharding import gather
    out = {}
    for name, p in model.named_parameters():
        out[name] = gather(p.detach()).clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{k}"] = gather(v).clone()
    return out


def _load(world_size: int, root: Path, options: dict[str, Any] | None = None,
          **kw: Any) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _build(world_size, **(options or {}))
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    step = checkpoint.load(state, root, **kw)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step, _full(model, opt)


def fsdp_round_trip(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """:func:`_round_trip`, then :func:`lowp.distributed.shutdown` once its models are gone: how many
    process groups it left alive (0 expected) and how many threads this rank still runs."""
    import os

    from lowp.distributed import shutdown
    out = _round_trip(rank, world_size, folder)
    out["groups_alive"] = shutdown(timeout=60)
    out["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    return out


def _round_trip(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Save steps 2 and 3 of a sharded model through the helper, load them back into fresh models,
    then break step 3 and check that every rank falls back to step 2 or refuses alike."""
    import torch.distributed as dist
    root = Path(folder)
    model, opt = _build(world_size)
    snaps = {}
    for step in (1, 2, 3):
        _train(model, opt, step, rank)
        if step >= 2:
            model_sd, optim_sd = get_state_dict(model, opt)
            checkpoint.save({"model": model_sd, "optim": optim_sd}, root, step, keep=2)
            snaps[step] = _full(model, opt)
    out: dict[str, Any] = {"sharded": all(isinstance(p, DTensor) for p in model.parameters())}
    out["latest"], got = _load(world_size, root)
    out["latest_bits"] = same_bits(got, snaps[3])
    out["step2"], got = _load(world_size, root, step=2)
    out["step2_bits"] = same_bits(got, snaps[2])
    try:
        model_sd, optim_sd = get_state_dict(model, opt)
        checkpoint.save({"model": model_sd, "optim": optim_sd}, root, 3)
    except FileExistsError as exc:
        out["again"] = str(exc)
    try:
        checkpoint.save({"model": model_sd, "optim": optim_sd}, root, 10 + rank)
    except ValueError as exc:
        out["disagree"] = str(exc)
    dist.barrier()
    if rank == 0:     # a torn step 3: its marker gone
        (root / checkpoint.folder_name(3) / checkpoint.MARKER).unlink()
    dist.barrier()
    out["fallback"], got = _load(world_size, root)
    out["fallback_bits"] = same_bits(got, snaps[2])
    try:
        _load(world_size, root, step=3)
    except checkpoint.IncompleteCheckpointError as exc:
        out["explicit"] = str(exc)
    return out


def fsdp_layout_cast(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """torch's own route at 2 ranks: 8-bit states saved with ``coded_min_numel=0`` by ``dcp.save``,
    loaded by ``dcp.load`` into the template of an optimizer with the default threshold (16-bit
    states for these small parameters) then ``set_state_dict``: what each rank's refusal says,
    what its next step says, and whether the saving options load the same bits."""
    import torch.distributed.checkpoint as dcp
    coded = {"state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}}
    model, opt = _build(world_size, coded_min_numel=0, **coded)
    for step in (1, 2):
        _train(model, opt, step, rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    snap = _full(model, opt)
    out: dict[str, Any] = {}
    other, other_opt = _build(world_size, **coded)
    model_sd, optim_sd = get_state_dict(other, other_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    try:
        set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except ValueError as exc:
        out["refused"] = str(exc)
    try:
        _train(other, other_opt, 3, rank)
    except RuntimeError as exc:
        out["step"] = str(exc)
    model, opt = _build(world_size, coded_min_numel=0, **coded)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    out["bits"] = same_bits(_full(model, opt), snap)
    out["int8"] = opt.state[model[0].weight]["exp_avg"].dtype == torch.int8
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "loop":
        raise SystemExit("usage: checkpoint_worker.py loop ROOT")
    loop(sys.argv[2])
