"""Rank functions for tests/test_checkpoint_routes.py, run by
:func:`lowp.distributed.launch.run_local_group` (spawned processes on a gloo group), and the case
definitions both sides share.

A case is one way of checkpointing a training run: the torch helper (``get/set_optimizer_state_dict``
with the model's own ``get/set_model_state_dict``, or ``get/set_state_dict``), its
:class:`~torch.distributed.checkpoint.state_dict.StateDictOptions`, the optimizer (lowp AdamW in
two configurations, or ``torch.optim.AdamW`` to tell torch's failures from lowp's), the module
(FSDP2 ``fully_shard`` or a plain module replicated on every rank) and where the checkpoint
lives between the save and the load:

- ``memory``: a deep copy handed to a fresh model and optimizer in the same process group (rank
  0's, sent to every rank, where only rank 0 holds a full dict: ``cpu_offload``);
- ``file``: ``torch.save`` of each rank's (full) dict, loaded by a fresh process group (rank 0's
  file on every rank where only rank 0 holds the full dict);
- ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` into the fresh model's own dict, in a
  fresh process group, possibly at another world size.

Every run trains :data:`STEPS` steps (one gradient element NaN at step 1, so that a skip counter
is saved), checkpoints, trains :data:`STEPS` more; the resumed run is built with another model
seed and optimizer seed, loads and trains the same :data:`STEPS` steps. Each rank returns, of
both runs, its local shards and the full (gathered) tensors of the weights and states, the
optimizer's counters and seed, for the test to compare bit for bit.
"""
from __future__ import annotations

import copy
import traceback
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

#: steps before the checkpoint, and again after it
STEPS = 2
#: the model seed and optimizer seed of the run that saves, and of the run that resumes
SAVE_SEED, LOAD_SEED = 1, 99
#: lowp AdamW configurations (keywords), and ``torch``: torch.optim.AdamW
CONFIGS: dict[str, dict[str, Any] | None] = {
    "default": {},   # mode kahan (auto), bf16 states rounded stochastically: random bits in play
    "exact8": {"mode": "exact8", "state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
               "coded_min_numel": 0},
    # the same with the biases (64 and 8 elements) below coded_min_numel: bf16 states beside codes
    "exact8-min": {"mode": "exact8", "state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                   "coded_min_numel": 256},
    "torch": None,
}
KINDS = ("fsdp", "replicated")
APIS = ("optim", "state_dict")   # get/set_optimizer_state_dict (+ model), get/set_state_dict
#: option flags, in the order of their names in a case id
FLAGS = ("full_state_dict", "cpu_offload", "broadcast_from_rank0", "flatten_optimizer_state_dict", "nonstrict")
SHORT = {"full_state_dict": "full", "cpu_offload": "cpu", "broadcast_from_rank0": "bcast",
         "flatten_optimizer_state_dict": "flat", "nonstrict": "nonstrict"}


class Case(NamedTuple):
    api: str
    flags: tuple[str, ...]   # a subset of FLAGS, in FLAGS' order
    config: str
    kind: str
    store: str               # memory, file or dcp
    #: set_state_dict with broadcast_from_rank0: the other ranks pass the model's keys (see :func:`resume`)
    keys: bool = True
    #: a control: the checkpoint loses lowp's extras (``"lowp"`` in its groups) before the load
    strip: bool = False

    @property
    def id(self) -> str:
        opts = "+".join(SHORT[f] for f in self.flags) or "default"
        return (f"{self.api}-{opts}-{self.config}-{self.kind}-{self.store}" + ("" if self.keys else "-nokeys")
                + ("-stripped" if self.strip else ""))

    def options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        kw = {f: True for f in self.flags if f != "nonstrict"}
        return StateDictOptions(strict="nonstrict" not in self.flags, **kw)


def option_sets() -> list[tuple[str, ...]]:
    """Every combination of the options that torch accepts (``broadcast_from_rank0`` needs
    ``full_state_dict``; ``_verify_options`` refuses it alone)."""
    out = []
    for mask in range(1 << len(FLAGS)):
        flags = tuple(f for i, f in enumerate(FLAGS) if mask >> i & 1)
        if "broadcast_from_rank0" in flags and "full_state_dict" not in flags:
            continue
        out.append(flags)
    return out


def store_for(flags: tuple[str, ...]) -> list[str]:
    """Where a route's checkpoint can live: a full dict in memory or in a file; a sharded dict
    in memory or through DCP."""
    return ["memory", "file"] if "full_state_dict" in flags else ["memory", "dcp"]


# ---- model, optimizer, training ---------------------------------------------------------------
def build(kind: str, config: str, seed: int):
    """A bf16 MLP (weights of 64 x 32 and 8 x 64: FSDP shards of whole blocks of 64; biases of 64
    and 8: blocks split, so their codes are replicated) initialised from ``seed``, and its
    optimizer with seed ``seed``."""
    import lowp.optim as lo
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).bfloat16()
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    kw = CONFIGS[config]
    if kw is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = lo.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, seed=seed, **kw)
    return model, opt


def train(model, opt, steps: range) -> None:
    """The same batch on every rank (FSDP's averaged gradient is then exact); at step 1 the first
    element of every rank's shard of the first weight's gradient is NaN (lowp skips that
    parameter on every rank; torch's AdamW would spread it, so it gets none)."""
    from lowp.optim.sharding import local
    for t in steps:
        g = torch.Generator().manual_seed(500 + t)
        x = torch.randn(16, 32, generator=g).bfloat16()
        y = torch.randn(16, 8, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        if t == 1 and not isinstance(opt, torch.optim.AdamW):
            local(next(model.parameters()).grad).view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)


def snapshot(model, opt) -> dict[str, Any]:
    """This rank's bits: local weights and states (every entry), the full tensors of both
    (gathered: they compare across world sizes), the optimizer's counters and seed."""
    from lowp.optim.sharding import gather, local
    out: dict[str, Any] = {}
    for i, p in enumerate(model.parameters()):
        entries = {f"p{i}": p.detach(), **{f"p{i}.{k}": v for k, v in opt.state.get(p, {}).items()}}
        for k, v in entries.items():
            if isinstance(v, torch.Tensor):
                out[k], out[f"full:{k}"] = local(v).clone(), gather(v).clone()
            else:
                out[k] = v
    for k in ("seed", "skipped_params", "skipped_steps"):
        if hasattr(opt, k):
            out[k] = getattr(opt, k)
    return out


# ---- the routes -------------------------------------------------------------------------------
def get_checkpoint(case: Case, model, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint import state_dict as dsd
    options = case.options()
    if case.api == "optim":
        return {"model": dsd.get_model_state_dict(model, options=options),
                "optim": dsd.get_optimizer_state_dict(model, opt, options=options)}
    msd, osd = dsd.get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def set_checkpoint(case: Case, model, opt, ckpt: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import state_dict as dsd
    options = case.options()
    if case.api == "optim":
        dsd.set_model_state_dict(model, ckpt["model"], options=options)
        dsd.set_optimizer_state_dict(model, opt, ckpt["optim"], options=options)
    else:
        dsd.set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                           options=options)


def _where(folder: Path, case: Case, world_size: int) -> Path:
    return folder / f"{case.id}-ws{world_size}"


def save(rank: int, world_size: int, case: Case, folder: Path) -> dict[str, Any]:
    """Train, checkpoint, train on (the reference); a ``memory`` case resumes right here too."""
    model, opt = build(case.kind, case.config, SAVE_SEED)
    train(model, opt, range(STEPS))
    ckpt = get_checkpoint(case, model, opt)
    out: dict[str, Any] = {"held": bool(ckpt["optim"])}
    where = _where(folder, case, world_size)
    if case.store == "dcp":
        import torch.distributed.checkpoint as dcp
        dcp.save(ckpt, checkpoint_id=str(where))
    elif case.store == "file":   # full dicts; with cpu_offload only rank 0 holds one
        where.mkdir(parents=True, exist_ok=True)
        if ckpt["optim"]:
            torch.save(ckpt, where / f"rank{rank}.pt")
    else:
        ckpt = copy.deepcopy(ckpt)
        if "cpu_offload" in case.flags and "full_state_dict" in case.flags:   # every rank reads rank 0's
            box = [ckpt if rank == 0 else None]
            torch.distributed.broadcast_object_list(box, src=0)
            ckpt = box[0]
    train(model, opt, range(STEPS, 2 * STEPS))
    out["reference"] = snapshot(model, opt)
    if case.store == "memory":
        out["resumed"] = resume(rank, case, lambda model, opt: ckpt)
    return out


def load(rank: int, world_size: int, case: Case, folder: Path, saved_at: int) -> dict[str, Any]:
    """A fresh model and optimizer (other seeds) load the checkpoint saved at ``saved_at`` ranks."""
    where = _where(folder, case, saved_at)

    def checkpoint(model, opt):
        if case.store == "dcp":
            import torch.distributed.checkpoint as dcp
            target = get_checkpoint(case, model, opt)   # the layout DCP loads into, in place
            dcp.load(target, checkpoint_id=str(where))
            return target
        own = where / f"rank{rank}.pt"   # rank 0's where this rank saved none (cpu_offload)
        return torch.load(own if own.exists() else where / "rank0.pt", weights_only=False)
    return {"resumed": resume(rank, case, checkpoint)}


def resume(rank: int, case: Case, checkpoint) -> dict[str, Any]:
    """Build with :data:`LOAD_SEED`, load ``checkpoint(model, opt)``, train the last :data:`STEPS`
    steps. With ``broadcast_from_rank0`` only rank 0 holds the checkpoint; the others pass empty
    dicts, except that ``set_state_dict`` gets the model's keys without values there (``keys``):
    torch 2.13's ``set_state_dict`` reads an empty ``model_state_dict`` as "no model"
    (``optim_only=not model_state_dict``), so that rank skips the model's broadcast that rank 0
    enters, and the group hangs, torch's own AdamW too (``test_torch_set_state_dict_hangs...``)."""
    model, opt = build(case.kind, case.config, LOAD_SEED)
    if "broadcast_from_rank0" in case.flags and rank != 0:
        keys = case.api == "state_dict" and case.keys
        ckpt = {"model": dict.fromkeys(model.state_dict()) if keys else {}, "optim": {}}
    else:
        ckpt = checkpoint(model, opt)
    if case.strip:
        for group in ckpt["optim"]["param_groups"]:
            del group["lowp"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_checkpoint(case, model, opt, ckpt)
    loaded_seed = getattr(opt, "seed", None)
    train(model, opt, range(STEPS, 2 * STEPS))
    return {**snapshot(model, opt), "loaded_seed": loaded_seed, "warnings": [str(w.message) for w in caught]}


def _guarded(fn, *args) -> dict[str, Any]:
    """``fn(*args)``, or the error it raised (type, message, the last frames)."""
    try:
        return fn(*args)
    except Exception as exc:   # the test judges each case's error
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=-6)}


def session(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One launch: ``save`` cases (train, checkpoint into ``folder``, train on; ``memory`` cases
    resume here), then ``load`` cases ``(case, world size it was saved at)``. Results by case id
    (``load`` ones suffixed with ``@<saved at>``)."""
    folder = Path(spec["folder"])
    out: dict[str, Any] = {"world_size": world_size}
    for case in spec.get("save", []):
        case = Case(*case)
        out[case.id] = _guarded(save, rank, world_size, case, folder)
    for case, saved_at in spec.get("load", []):
        case = Case(*case)
        out[f"{case.id}@{saved_at}"] = _guarded(load, rank, world_size, case, folder, saved_at)
    return out
