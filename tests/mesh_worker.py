"""Rank functions for tests/test_meshes.py: lowp's optimizers on DTensor parameters of meshes that
are not the whole default group, run by :func:`lowp.distributed.launch.run_local_group` on 4 gloo
ranks.

- ``stages``: pipeline parallelism's layout. A ``(pp, dp)`` mesh of 2 x 2 ranks; ranks 0-1 hold
  stage 0's parameters, ranks 2-3 stage 1's (other shapes, another number of them), each stage's
  sharded ``Shard(0)`` over its ``dp`` sub-mesh (FSDP2 per stage), each stage with its own
  optimizer. Nothing may pass between the stages.
- ``hsdp``: HSDP's layout, ``(Replicate(), Shard(0))`` on a ``(replicate, shard)`` mesh of 2 x 2;
- ``shard2d``: ``(Shard(0), Shard(0))`` on a 2 x 2 mesh: each rank one contiguous range, cut twice;
- ``submesh``: FSDP2 with tensor parallelism's meshes: a parameter on a ``(dp, tp)`` mesh
  (``(Shard(0), Shard(0))``) and one on its ``mesh["dp"]`` sub-mesh, which each ``tp`` column
  holds on its own; a NaN in the sub-mesh parameter of one column only must still make every rank
  skip the step under ``skip_step``.

Every rank builds the same full tensors and the same full gradients of its stage (no reduction
noise), and returns full copies of its stage's parameters and states for the test process to
compare with a single-process run of that stage, bit for bit.
"""
from __future__ import annotations

from typing import Any

import torch

import lowp.optim as lo

STEPS = 3
#: per stage, its parameters' shapes: parameters of at least 65,536 elements ((300, 300),
#: (3, 40000)), one just below ((5, 13107)), a small matrix and a vector; StableAdamW exchanges
#: the sums of those at or above ``sharded_sums.min_numel`` (0 on the native kernel) and gathers
#: the others
STAGE_SHAPES = [[(300, 300), (7,)], [(5, 13107), (3, 40000), (6, 5)]]
HSDP_SHAPES = [(4, 40000), (9, 9)]
#: (layout, optimizer, nonfinite policy, NaN at (stage, parameter, flat index, step) or None):
#: the NaN of ``stages`` is in stage 1's second parameter, in rank 2's shard only; the NaN of
#: ``hsdp`` and ``shard2d`` in the first parameter's last row, in rank 3's gradient only (not
#: its replica's on rank 1 under HSDP), so only the agreement over both mesh dimensions makes
#: every rank skip it
LAST_ROW = (0, 0, 3 * 40000 + 7, 1)
MESH_CASES = [("stages", "AdamW", "skip_param", (1, 1, 5, 1)), ("stages", "AdamW", "skip_step", (1, 1, 5, 1)),
              ("stages", "StableAdamW", "skip_param", None), ("stages", "Adafactor", "skip_param", None),
              ("hsdp", "AdamW", "skip_param", LAST_ROW), ("hsdp", "StableAdamW", "skip_param", None),
              ("shard2d", "AdamW", "skip_step", LAST_ROW), ("shard2d", "StableAdamW", "skip_param", None),
              ("submesh", "AdamW", "skip_step", (0, 1, 5, 1)), ("submesh", "StableAdamW", "skip_step", (0, 1, 5, 1))]
SUBMESH_SHAPES = [(8, 8192), (8, 8192)]   # sums exchanged on every backend (65,536 elements each)
#: per layout, the sizes of the process groups of each exchange of StableAdamW's sums of a step
EXCHANGE_GROUPS = {"stages": [[2]], "hsdp": [[2]], "shard2d": [[2, 2]], "submesh": [[2, 2], [2]]}


def shapes(layout: str, stage: int) -> list[tuple[int, ...]]:
    return {"stages": STAGE_SHAPES[stage], "submesh": SUBMESH_SHAPES}.get(layout, HSDP_SHAPES)


def full_params(layout: str, stage: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + stage)
    return [torch.randn(s, generator=g).bfloat16() for s in shapes(layout, stage)]


def full_grads(layout: str, stage: int, step: int, nan_at: tuple[int, int, int, int] | None
               ) -> list[torch.Tensor]:
    """Step ``step``'s gradients of a stage's parameters, of mixed scales (StableAdamW's clip
    is active on some), with a NaN at ``nan_at`` (stage, parameter, flat index, step)."""
    g = torch.Generator().manual_seed(100 * stage + step)
    grads = [(torch.randn(s, generator=g) * 10.0 ** (step % 3 - 1)).bfloat16() for s in shapes(layout, stage)]
    if nan_at is not None and nan_at[0] == stage and nan_at[3] == step:
        grads[nan_at[1]].view(-1)[nan_at[2]] = float("nan")
    return grads


def make_optimizer(name: str, params: list[torch.Tensor], nonfinite: str, **kw: Any):
    return getattr(lo, name)(params, lr=1e-2, weight_decay=0.1, seed=5, nonfinite=nonfinite, **kw)


def diagnostics(opt) -> list[float]:
    d = opt.diagnostics()[0]
    return [d["stalled_fraction"], d["compensation_rel"], d["skipped_params"], d["skipped_steps"]]


def run(opt, params: list[torch.Tensor], set_grad, layout: str, stage: int, nan_at) -> list[list[float]]:
    """:data:`STEPS` steps; the diagnostics after each."""
    out = []
    for t in range(STEPS):
        for p, g in zip(params, full_grads(layout, stage, t, nan_at)):
            set_grad(p, g)
        opt.step()
        out.append(diagnostics(opt))
    return out


def snapshot(opt, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    from lowp.optim.sharding import gather
    out = {}
    for i, p in enumerate(params):
        out[f"p{i}"] = gather(p.detach()).clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"p{i}.{k}"] = gather(v).clone()
    return out


def reference(layout: str, stage: int, name: str, nonfinite: str, nan_at) -> dict[str, Any]:
    """The single-process run of a stage (plain tensors)."""
    params = [p.clone().requires_grad_() for p in full_params(layout, stage)]
    opt = make_optimizer(name, params, nonfinite)

    def set_grad(p, g):
        p.grad = g.clone()
    diag = run(opt, params, set_grad, layout, stage, nan_at)
    return {"snapshot": snapshot(opt, params), "diagnostics": diag}


def mesh_case(rank: int, layout: str, name: str, nonfinite: str, nan_at) -> dict[str, Any]:
    """One case on this rank: its stage, the snapshot and diagnostics, and the collectives of the
    steps: per exchange of sums, the sizes of the groups it went over; the tensors gathered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lowp.optim import sharded_sums, sharding
    stage = rank // 2 if layout == "stages" else 0
    if layout == "stages":
        mesh, placements = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"], [Shard(0)]
    elif layout == "hsdp":
        mesh, placements = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), \
            [Replicate(), Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")), [Shard(0), Shard(0)]
    layouts = [(mesh, placements)] * len(shapes(layout, stage))
    if layout == "submesh":
        layouts[1] = (mesh["a"], [Shard(0)])
    params = [torch.nn.Parameter(distribute_tensor(p, m, pl, src_data_rank=None))
              for p, (m, pl) in zip(full_params(layout, stage), layouts)]
    opt = make_optimizer(name, params, nonfinite)
    seen: dict[str, list] = {"exchanges": [], "gathered": [0]}
    real_messages, real_gather = sharded_sums.all_messages, sharding.gather_many

    def all_messages(message, groups):
        seen["exchanges"].append([dist.get_world_size(g) for g in groups])
        return real_messages(message, groups)

    def gather_many(tensors):
        seen["gathered"][0] += len(tensors)
        return real_gather(tensors)

    def set_grad(p, g):
        p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)
    # the NaN: in the stage's gradients; under HSDP and shard2d on rank 3 only; under submesh on
    # the tp column 0 only (ranks 0 and 2)
    here = {"stages": True, "submesh": rank % 2 == 0}.get(layout, rank == 3)
    sharded_sums.all_messages, sharding.gather_many = all_messages, gather_many
    try:
        diag = run(opt, params, set_grad, layout, stage, nan_at if here else None)
    finally:
        sharded_sums.all_messages, sharding.gather_many = real_messages, real_gather
    return {"stage": stage, "snapshot": snapshot(opt, params), "diagnostics": diag,
            "min_numel": sharded_sums.min_numel(opt), **seen}


#: (optimizer, where rank 3 fails in step 1 of stage 1, backend): making StableAdamW's pieces of
#: the sums, its non-finite check of AdamW's gradients; in a load of its own state dict before the
#: step: translating it ("translate": lowp.optim.migrate.to_lowp_layout, which may dequantize a
#: third-party state), reading a group ("read"; both before the first agreement), checking a
#: state laid out again from ``Shard(1)`` (between the collectives that lay out the others),
#: checking the values (before the second agreement); preparing StableAdamW's step before the
#: sums' exchange ("stage": staging a kernel launch, the reference backend's preparation); making the
#: states of the first step ("states", at step 0: before the sums' exchange or the gathers, where
#: the other rank would wait, with the other rank's new states to take back); on the reference (a
#: full step) and on the native kernel (the step 1 of a cached plan)
FAILURES = [("StableAdamW", "pieces", "foreach"), ("StableAdamW", "pieces", "native"), ("AdamW", "flags", "foreach"),
            ("AdamW", "flags", "native"), ("AdamW", "load", "foreach"), ("AdamW", "translate", "foreach"),
            ("AdamW", "read", "foreach"), ("AdamW", "place", "foreach"), ("StableAdamW", "interrupt", "native"),
            ("StableAdamW", "stage", "native"), ("StableAdamW", "stage", "foreach"),
            ("StableAdamW", "states", "foreach"), ("Adafactor", "states", "foreach")]
#: the failures that happen in a load
LOADS = ("load", "translate", "read", "place")


def failure_case(rank: int, name: str, where: str, backend: str) -> dict[str, Any]:
    """``name`` on ``backend`` on the ``stages`` layout whose step 1 (with ``where`` in ``LOADS``: a load of
    its own state dict before it, then that load again on every rank) fails on rank 3 at ``where`` (as
    running out of memory would;
    ``"interrupt"``: a Ctrl-C arrives on rank 3 right after the sums' exchange, which the step
    holds until it is done): the error of each rank of that call, whether every parameter and
    state of the rank's stage is as before it, whether a cached plan was there to take the step,
    and the snapshot after stage 1 took the step (stage 0 steps on undisturbed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import signal

    from lowp.optim import base, checkpointing, sharded_sums
    from lowp.optim.kernels.native import kernel as native_kernel
    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None))
              for p in full_params("stages", stage)]
    opt = make_optimizer(name, params, "skip_param", fused=backend == "native")
    pieces = (native_kernel.PiecesCall, "call") if backend == "native" else (sharded_sums, "_pieces")   # the plan's
    owner, attribute = {"pieces": pieces, "flags": (opt.backend, "finite_flags"),
                        "load": (checkpointing, "_value_problem"), "translate": (base, "to_lowp_layout"),
                        "read": (type(opt), "check_group"), "states": (type(opt), "init_state"),
                        "place": (type(opt), "check_state"),
                        "interrupt": (sharded_sums, "exchange_pieces"),
                        # preparing the step's jobs, before the sums' exchange (the kernel's launches staged)
                        "stage": (native_kernel.Launch, "stage") if backend == "native"
                        else (type(opt.backend), "prepare")}[where]
    real = getattr(owner, attribute)
    out: dict[str, Any] = {"stage": stage, "error": None, "unchanged": None}

    def failing(*args, **kwargs):
        if where == "interrupt":
            real(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)
            return
        raise MemoryError(f"injected into rank 3's {where}")
    failing_step = 0 if where == "states" else 1
    for t in range(STEPS):
        for p, g in zip(params, full_grads("stages", stage, t, None)):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)], src_data_rank=None)
        if t == failing_step and stage == 1:
            before = snapshot(opt, params)
            out["planned"] = opt._plans.current is not None   # the step comes from the cached plan
            saved = opt.state_dict() if where in LOADS else None
            if where == "place":   # the matrices' states laid out along dimension 1: collectives on load
                saved["state"] = {k: {n: v.redistribute(mesh, [Shard(1)]) if v.dim() == 2 else v for n, v in e.items()}
                                  for k, e in saved["state"].items()}
            if rank == 3:
                setattr(owner, attribute, failing)
            try:
                opt.step() if saved is None else opt.load_state_dict(saved)
            except (Exception, KeyboardInterrupt) as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                setattr(owner, attribute, real)
            after = snapshot(opt, params)
            out["unchanged"] = sorted(before) == sorted(after) and all(
                torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)
            if where == "interrupt":   # the step was taken whole; the interrupt came after it
                continue
            if saved is not None:   # the same load on every rank now succeeds, and the run resumes from it
                opt.load_state_dict(saved)
        opt.step()
    out["snapshot"] = snapshot(opt, params)
    return out


def remainder_case(rank: int) -> dict[str, Any]:
    """StableAdamW on the native kernel on the ``stages`` layout with each stage's first parameter
    cut along dimension 1 (not a contiguous range: gathered, the cached plan's remainder) and the
    others along dimension 0 (their sums exchanged by the plan), on a mesh made again in this
    process: the steps taken from the plan, the snapshot, and whether the gathered parameter's
    gradient holds its parameter's mesh object (run again, torch's sharding cache hands the
    gradient an equal mesh of the first run)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    placements = [[Shard(1 if i == 0 else 0)] for i in range(len(shapes("stages", stage)))]
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, placed, src_data_rank=None))
              for p, placed in zip(full_params("stages", stage), placements)]
    opt = make_optimizer("StableAdamW", params, "skip_param", fused=True)
    for t in range(STEPS):
        for p, g, placed in zip(params, full_grads("stages", stage, t, None), placements):
            p.grad = distribute_tensor(g.clone(), mesh, placed, src_data_rank=None)
        opt.step()
    return {"stage": stage, "cached": opt._plans.cached_steps, "remainder": len(opt._plans.current.remainder),
            "snapshot": snapshot(opt, params), "same mesh": params[0].grad.device_mesh is params[0].device_mesh}


#: per exchange of :func:`messages_case`: each rank of a stage's message length (``None``: that
#: rank failed)
MESSAGE_LENGTHS = [(3, 4), (3, 4), (3, 9), (3, 4), (1, 2), (3, 4), (3, None), (0, 0)]


def messages_case(rank: int) -> dict[str, Any]:
    """:func:`lowp.optim.collectives.all_messages` over a new group of each stage's two ranks, with
    the lengths of :data:`MESSAGE_LENGTHS` (rank ``i`` of the group sends ``100 * exchange + 10 * i
    + arange``): per exchange what it returned and how many all-gathers it made."""
    import torch.distributed as dist

    from lowp.optim.collectives import all_messages
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank makes both, in turn
    group, i = groups[rank // 2], rank % 2
    calls = [0]
    real = dist.all_gather

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    got, gathers = [], []
    dist.all_gather = counted
    try:
        for k, lengths in enumerate(MESSAGE_LENGTHS):
            n = lengths[i]
            calls[0] = 0
            out = all_messages(None if n is None else 100.0 * k + 10 * i + torch.arange(n, dtype=torch.float64),
                               (group,))
            got.append(None if out is None else out.tolist())
            gathers.append(calls[0])
    finally:
        dist.all_gather = real
    return {"got": got, "gathers": gathers}


#: (layout, backend) of :func:`counts_case`: a full step's agreement (``foreach``), a cached plan's
#: (``native``), a parameter on a sub-mesh (``submesh``: on mesh["a"], next to one on the whole mesh)
COUNTS = [("stages", "foreach"), ("stages", "native"), ("submesh", "foreach")]
#: per layout of :data:`COUNTS`: the rank whose count is one ahead, of which parameter
AHEAD = {"stages": (3, 0), "submesh": (2, 1)}


def counts_case(rank: int, layout: str, backend: str) -> dict[str, Any]:
    """AdamW on ``backend`` on ``layout`` whose step 1 finds one rank's step count of a parameter
    one ahead of the others' (:data:`AHEAD`: as a step that failed part-way on that rank after
    stepping the parameter, and a loop that went on, would leave it; under ``stages`` in stage 1,
    under ``submesh`` the sub-mesh parameter in the column of ranks 0 and 2): the error of each
    rank of that step, whether every parameter, state and count it holds is as before it, whether
    a cached plan was there, and the snapshot after the run, the count put back (under ``stages``
    stage 0 steps on undisturbed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stage = rank // 2 if layout == "stages" else 0
    if layout == "stages":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
        layouts = [(mesh, [Shard(0)])] * len(shapes(layout, stage))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        layouts = [(mesh, [Shard(0), Shard(0)]), (mesh["a"], [Shard(0)])]
    params = [torch.nn.Parameter(distribute_tensor(p, m, placed, src_data_rank=None))
              for p, (m, placed) in zip(full_params(layout, stage), layouts)]
    opt = make_optimizer("AdamW", params, "skip_param", fused=backend == "native")
    out: dict[str, Any] = {"stage": stage, "error": None, "unchanged": None}
    ahead_rank, ahead = AHEAD[layout]
    involved = stage == 1 if layout == "stages" else True
    for t in range(STEPS):
        for p, g in zip(params, full_grads(layout, stage, t, None)):
            p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)
        if t == 1 and involved:
            out["planned"] = opt._plans.current is not None
            if rank == ahead_rank:
                opt.state[params[ahead]]["step"] += 1
            before = snapshot(opt, params), [opt.state[p]["step"] for p in params]
            try:
                opt.step()
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            after = snapshot(opt, params), [opt.state[p]["step"] for p in params]
            out["unchanged"] = sorted(before[0]) == sorted(after[0]) and before[1] == after[1] and all(
                torch.equal(before[0][k].view(torch.uint8), after[0][k].view(torch.uint8)) for k in before[0])
            if rank == ahead_rank:
                opt.state[params[ahead]]["step"] -= 1
        opt.step()
    out["snapshot"] = snapshot(opt, params)
    return out


def first_step_nan_case(rank: int) -> dict[str, Any]:
    """AdamW (``skip_param``, reference backend) on the ``stages`` layout whose first step has a
    NaN in stage 1's second parameter, in rank 2's shard only: rank 3 makes that parameter's states
    before the flags are agreed, then takes them back. The state keys of each parameter right
    after the first step, and the snapshot after every step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    stage = rank // 2
    nan_at = (1, 1, 5, 0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None))
              for p in full_params("stages", stage)]
    opt = make_optimizer("AdamW", params, "skip_param")
    out: dict[str, Any] = {"stage": stage}
    for t in range(STEPS):
        for p, g in zip(params, full_grads("stages", stage, t, nan_at)):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)], src_data_rank=None)
        opt.step()
        if t == 0:
            out["keys"] = [sorted(opt.state.get(p, {})) for p in params]
    out["snapshot"] = snapshot(opt, params)
    return out


def session(rank: int, world_size: int, cases: list) -> dict[str, Any]:
    assert world_size == 4, world_size
    return {"messages": messages_case(rank), "cases": [mesh_case(rank, *case) for case in cases],
            "first_step_nan": first_step_nan_case(rank),
            "failures": [failure_case(rank, *failure) for failure in FAILURES],
            "remainder": [remainder_case(rank) for _ in range(2)],
            "counts": [counts_case(rank, *case) for case in COUNTS]}
