"""Rank functions for tests/test_sharded.py, run by :func:`lowp.distributed.launch.run_local_group`
(spawned processes on a gloo group), and the case definitions both sides share.

Every case builds the same deterministic full tensors on every rank, shards them (FSDP2
``fully_shard`` or ``distribute_tensor``), runs lowp steps with the same full gradients on every
rank (so there is no reduction noise) and returns the full tensors (parameters and states,
gathered) for the test process to compare with a single-process run.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable

import torch

import lowp.optim as lo
from lowp.optim.registry import optimizers

SHAPES = [(6, 5), (7,), (3, 4)]   # 6 rows over 4 ranks leave rank 3 an empty shard
STEPS = 3
#: every registered optimizer with the first keyword set of its ``examples`` (lowp.optim.registry)
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {cls.__name__: (cls, dict(cls.examples[0]))
                                                     for cls in optimizers()}
MODES = ("kahan", "exact", "nearest")
BACKENDS = {"fused": {"fused": True}, "unfused": {"fused": False},   # native C++ / foreach on CPU
            "compiled": {"backend": "compiled"}}


def full_params(seed: int = 0) -> list[torch.Tensor]:
    """bf16 parameters of :data:`SHAPES` and one fp32 vector (updated plainly whatever the mode)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).bfloat16() for s in SHAPES] + [torch.randn(5, generator=g)]


def full_grads(step: int, nan_at: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """The gradients of step ``step`` (same on every rank); ``nan_at=(param, flat index, ...)`` puts a NaN there."""
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(s, generator=g).bfloat16() for s in SHAPES] + [torch.randn(5, generator=g)]
    if nan_at is not None:
        grads[nan_at[0]].view(-1)[nan_at[1]] = float("nan")
    return grads


def make_optimizer(name: str, params: list[torch.Tensor], mode: str, backend: str, **extra: Any):
    """States round to nearest except in stochastic mode, whose random bits are the point of its test."""
    cls, kwargs = OPTIMIZERS[name]
    rounding = "stochastic" if mode == "stochastic" else "nearest"
    return cls(params, mode=mode, seed=7, state_rounding=rounding, **kwargs, **BACKENDS[backend], **extra)


def run_steps(opt, params: list[torch.Tensor], set_grad, steps: range, nan_at=None,
              before_step: Callable[[Any, int], None] | None = None) -> None:
    """``nan_at = (param, flat index[, step])``: a NaN in that gradient at that step (default: the
    first); ``before_step(opt, t)`` runs before each step ``t``, its gradients set."""
    nan_step = steps.start if nan_at is None or len(nan_at) < 3 else nan_at[2]
    for t in steps:
        for p, g in zip(params, full_grads(t, nan_at if t == nan_step else None)):
            set_grad(p, g)
        if before_step is not None:
            before_step(opt, t)
        opt.step()


def snapshot(opt, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full plain copies of every parameter and state (a collective for DTensors); fp8 codes as
    their bytes (pickle cannot bring fp8 tensors back from a rank)."""
    from lowp.optim.sharding import gather
    out = {}
    for i, p in enumerate(params):
        out[f"p{i}"] = gather(p.detach()).clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                full = gather(v).clone()
                out[f"p{i}.{k}"] = full.view(torch.uint8) if full.dtype.itemsize == 1 else full
    return out


def reference(name: str, mode: str, backend: str, nan_at=None, nonfinite: str = "skip_param",
              steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The single-process run of a case on plain tensors."""
    params = [p.clone().requires_grad_() for p in full_params()]
    opt = make_optimizer(name, params, mode, backend, nonfinite=nonfinite)

    def set_grad(p, g):
        p.grad = g.clone()
    run_steps(opt, params, set_grad, range(steps), nan_at)
    out = snapshot(opt, params)
    out["diag"] = diagnostics(opt)
    out["elements"] = elements(opt)
    out["skipped"] = torch.tensor([opt.skipped_params, opt.skipped_steps])
    return out


def elements(opt) -> torch.Tensor:
    """(fused, reference) element-steps of a fused backend (its counters), (-1, -1) on others."""
    counts = [getattr(opt.backend, k, -1) for k in ("fused_elements", "reference_elements")]
    return torch.tensor(counts, dtype=torch.int64)


def diagnostics(opt) -> torch.Tensor:
    """Group 0's stalled fraction and compensation_rel (fp64)."""
    d = opt.diagnostics()[0]
    return torch.tensor([d["stalled_fraction"], d["compensation_rel"]], dtype=torch.float64)


# ---- rank side ----------------------------------------------------------------------------------
class Bag(torch.nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors])


def fsdp_params(world_size: int, full: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """:func:`full_params` (or ``full``: bf16 tensors and a last fp32 one) sharded by ``fully_shard``
    (bf16 and fp32 parameters in separate units)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    full = full_params() if full is None else full
    low, high = Bag(full[:-1]), Bag(full[-1:])
    fully_shard(low, mesh=mesh)
    fully_shard(high, mesh=mesh)
    return [*low.ws, *high.ws]


def tp_params(world_size: int, placement: str, full: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """:func:`full_params` (or ``full``) distributed with ``Shard(1)`` (matrices; vectors
    ``Shard(0)``) or ``Replicate()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for t in full_params() if full is None else full:
        pl = Replicate() if placement == "replicate" else Shard(1 if t.dim() > 1 else 0)
        out.append(torch.nn.Parameter(distribute_tensor(t, mesh, [pl], src_data_rank=None)))
    return out


def set_dtensor_grad(p, g) -> None:
    from torch.distributed.tensor import distribute_tensor
    p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)


def case_run(world_size: int, layout: str, name: str, mode: str, backend: str, nan_at=None,
             nonfinite: str = "skip_param", full_step_rank: int | None = None) -> dict[str, torch.Tensor]:
    """One case on DTensor parameters; ``full_step_rank``: that rank drops its cached plan before
    the last step, so it takes a full step while the others take theirs from a plan."""
    import torch.distributed as dist
    params = fsdp_params(world_size) if layout == "fsdp" else tp_params(world_size, layout)
    opt = make_optimizer(name, params, mode, backend, nonfinite=nonfinite)

    def drop(o, t: int) -> None:
        if t == STEPS - 1 and dist.get_rank() == full_step_rank:
            o._plans.drop()
    run_steps(opt, params, set_dtensor_grad, range(STEPS), nan_at, drop)
    out = snapshot(opt, params)
    out["diag"] = diagnostics(opt)
    out["skipped"] = torch.tensor([opt.skipped_params, opt.skipped_steps])
    out["elements"] = elements(opt)
    local_alias = all(p.to_local().data_ptr() == p._local_tensor.data_ptr() for p in params)
    shards = [opt.state[p]["exp_avg"].to_local().numel() for p in params if "exp_avg" in opt.state.get(p, {})]
    out["meta"] = torch.tensor([int(local_alias), sum(shards), int(opt.backend.name == "native"),
                                opt._plans.cached_steps, opt._plans.agreed_steps])
    return out


def _replicated_grads(opt, params: list[torch.Tensor], t: int) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor
    for p, g in zip(params, full_grads(t)):
        p.grad = distribute_tensor(g, p.device_mesh, [Replicate()], src_data_rank=None)


def _swapped_parameter(opt, params: list[torch.Tensor], t: int) -> None:
    from torch.distributed.tensor import DTensor
    p = params[0]
    twin = torch.nn.Parameter(DTensor.from_local(p.to_local().detach().clone(), p.device_mesh, p.placements,
                                                 shape=p.shape, stride=p.stride()))
    torch.utils.swap_tensors(p, twin)   # p keeps its identity (and its optimizer state) on a new local tensor
    set_dtensor_grad(p, full_grads(t)[0])


def _replaced_state(opt, params: list[torch.Tensor], t: int) -> None:
    from torch.distributed.tensor import DTensor
    state = opt.state[params[0]]
    old = state["exp_avg"]
    state["exp_avg"] = DTensor.from_local(old.to_local().clone(), old.device_mesh, old.placements,
                                          shape=old.shape, stride=old.stride())


#: changes before the last step that a cached plan of DTensor parameters must see (the step is
#: then a full one, whose result is the single-process run's)
PLAN_CHANGES = {"gradients placed otherwise": _replicated_grads, "parameter swapped": _swapped_parameter,
                "state replaced": _replaced_state}


def plan_change_case(world_size: int, change: str) -> dict[str, torch.Tensor]:
    """FSDP AdamW (kahan, native) for :data:`STEPS` steps with ``PLAN_CHANGES[change]`` before
    the last: the snapshot and the steps taken from a cached plan."""
    params = fsdp_params(world_size)
    opt = make_optimizer("AdamW", params, "kahan", "fused")
    for t in range(STEPS):
        for p, g in zip(params, full_grads(t)):
            set_dtensor_grad(p, g)
        if t == STEPS - 1:
            PLAN_CHANGES[change](opt, params, t)
        opt.step()
    out = snapshot(opt, params)
    out["cached"] = torch.tensor(opt._plans.cached_steps)
    return out


def grad_scaler_case(world_size: int, name: str, nan_at: tuple[int, ...] | None) -> dict[str, torch.Tensor]:
    """FSDP ``name`` (kahan, native) stepped by FSDP2's ``ShardedGradScaler`` (scale 16, gradients
    scaled by it; ``nan_at`` as in :func:`run_steps`): the snapshot, the skip counts and the
    (cached, agreed) steps of its plans. The scaler hands the optimizer ``found_inf``, agreed over
    the ranks, so a step from the plan makes no collective of its own (StableAdamW's: but the
    exchange of its sums, whose terms read the unscaled gradients)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    params = fsdp_params(world_size)
    opt = make_optimizer(name, params, "kahan", "fused", nonfinite="skip_step")
    scaler = ShardedGradScaler(device="cpu", init_scale=16.0)
    nan_step = None if nan_at is None else nan_at[2]
    for t in range(STEPS):
        for p, g in zip(params, full_grads(t, nan_at if t == nan_step else None)):
            set_dtensor_grad(p, g * 16)
        scaler.scale(torch.ones(()))   # a loss would be scaled here (the scaler starts its scale)
        scaler.step(opt)
        scaler.update()
    out = snapshot(opt, params)
    out["skipped"] = torch.tensor([opt.skipped_params, opt.skipped_steps])
    out["plans"] = torch.tensor([opt._plans.cached_steps, opt._plans.agreed_steps])
    return out


def plain_state_dict(name: str, mode: str, steps: int) -> dict[str, Any]:
    """``state_dict()`` of the single-process run after ``steps`` steps."""
    params = [p.clone().requires_grad_() for p in full_params()]
    opt = make_optimizer(name, params, mode, "fused")

    def set_grad(p, g):
        p.grad = g.clone()
    run_steps(opt, params, set_grad, range(steps))
    return opt.state_dict()


def state_dict_case(world_size: int, name: str, mode: str, plain_sd: dict[str, Any]) -> dict[str, Any]:
    """``opt.state_dict()`` / ``load_state_dict`` with sharded parameters, after 2 of :data:`STEPS`
    steps: the sharded dict into a fresh sharded optimizer, the single-process dict into a sharded
    optimizer, the sharded dict into a single-process optimizer; each then takes the last step."""
    params = fsdp_params(world_size)
    opt = make_optimizer(name, params, mode, "fused")
    run_steps(opt, params, set_dtensor_grad, range(STEPS - 1))
    sd = opt.state_dict()
    out = {"sharded_states": all(type(v).__name__ == "DTensor" for st in sd["state"].values()
                                 for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step")}
    from lowp.optim.sharding import gather
    plain = [gather(p.detach()).clone().requires_grad_() for p in params]
    for tag, source in (("resumed", sd), ("from_plain", plain_sd)):
        fresh = make_optimizer(name, params, mode, "fused")
        fresh.load_state_dict(source)
        weights = [p.detach().to_local().clone() for p in params]
        run_steps(fresh, params, set_dtensor_grad, range(STEPS - 1, STEPS))
        out[tag] = snapshot(fresh, params)
        for p, w0 in zip(params, weights):   # back to step 2 for the next variant
            p.detach().to_local().copy_(w0)
    single = make_optimizer(name, plain, mode, "fused")
    single.load_state_dict(sd)

    def set_grad(p, g):
        p.grad = g.clone()
    run_steps(single, plain, set_grad, range(STEPS - 1, STEPS))
    out["to_plain"] = snapshot(single, plain)
    return out


# ---- block-scaled states --------------------------------------------------------------------------
#: bf16 shapes in blocks of 32: whole blocks per FSDP shard at 2 ranks (rows; 32 of the 64-vector)
#: and per Shard(1) shard of (6, 64) and (3, 128); (5, 40) splits blocks under any sharding, and so
#: does the vector at 4 ranks (16 elements each): their codes are replicated
CODED_SHAPES = [(6, 64), (64,), (5, 40), (3, 128)]
CODED_STATES: dict[str, dict[str, torch.dtype]] = {
    "int8-uint4": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint4},  # type: ignore[attr-defined]
    "e4m3-uint8": {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint8}}
CODED_CASES = [(layout, states, backend) for layout in ("fsdp", "shard1") for states in CODED_STATES
               for backend in ("fused", "unfused")]


def coded_full(seed: int) -> list[torch.Tensor]:
    """Parameters (``seed`` 0) or a step's gradients: bf16 tensors of :data:`CODED_SHAPES` and
    an fp32 vector of 32."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).bfloat16() for s in CODED_SHAPES] + [torch.randn(32, generator=g)]


def coded_optimizer(params: list[torch.Tensor], states: str, backend: str = "fused", **extra: Any):
    """AdamW in Kahan mode with block-scaled states in blocks of 32, rounded stochastically."""
    extra = {"state_dtype": CODED_STATES[states], "coded_min_numel": 0, **BACKENDS[backend], **extra}
    return lo.AdamW(params, lr=1e-2, weight_decay=0.1, mode="kahan", seed=7, state_block=32, **extra)


def coded_steps(opt, params: list[torch.Tensor], set_grad, steps: range) -> None:
    for t in steps:
        for p, g in zip(params, coded_full(100 + t)):
            set_grad(p, g)
        opt.step()


def _set_plain_grad(p, g) -> None:
    p.grad = g.clone()


def coded_reference(states: str, backend: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The single-process run of a coded case on plain tensors."""
    params = [p.clone().requires_grad_() for p in coded_full(0)]
    opt = coded_optimizer(params, states, backend)
    coded_steps(opt, params, _set_plain_grad, range(steps))
    return snapshot(opt, params)


def coded_state_dict(states: str, steps: int, state_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``state_dict()`` of the single-process coded run after ``steps`` steps (with ``state_dtype``:
    of the same run with those float states instead, to be encoded on load)."""
    params = [p.clone().requires_grad_() for p in coded_full(0)]
    extra = {} if state_dtype is None else {"state_dtype": state_dtype}
    opt = coded_optimizer(params, states, **extra)
    coded_steps(opt, params, _set_plain_grad, range(steps))
    return opt.state_dict()


def coded_resumed(states: str, backend: str, sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The single-process coded run's weights after ``STEPS - 1`` steps, stepped once more by a
    fresh optimizer that loaded ``sd``."""
    params = [p.clone().requires_grad_() for p in coded_full(0)]
    coded_steps(coded_optimizer(params, states, backend), params, _set_plain_grad, range(STEPS - 1))
    fresh = coded_optimizer(params, states, backend)
    fresh.load_state_dict(sd)
    coded_steps(fresh, params, _set_plain_grad, range(STEPS - 1, STEPS))
    return snapshot(fresh, params)


def coded_case(world_size: int, layout: str, states: str, backend: str, plain_sds: dict[str, Any]
               ) -> dict[str, Any]:
    """The coded run on sharded parameters, its codes' placements, and its ``state_dict`` after
    ``STEPS - 1`` steps loaded into a fresh sharded and a single-process optimizer, plus the
    single-process dicts ``plain_sds`` (coded, and with bf16 states) loaded into sharded ones;
    each takes the last step."""
    full = coded_full(0)
    params = fsdp_params(world_size, full) if layout == "fsdp" else tp_params(world_size, layout, full)
    opt = coded_optimizer(params, states, backend)
    coded_steps(opt, params, set_dtensor_grad, range(STEPS - 1))
    sd = copy.deepcopy(opt.state_dict())   # the optimizer steps on: its dict holds the live states
    weights = [p.detach().to_local().clone() for p in params]
    coded_steps(opt, params, set_dtensor_grad, range(STEPS - 1, STEPS))
    out: dict[str, Any] = {"run": snapshot(opt, params), "elements": elements(opt),
                           "placements": [str(tuple(opt.state[p]["exp_avg_scale"].placements)) for p in params],
                           "local_codes": [opt.state[p]["exp_avg"].to_local().numel() for p in params],
                           "cached": opt._plans.cached_steps}
    for tag, source in (("resumed", sd), *plain_sds.items()):
        for p, w0 in zip(params, weights):   # back to the weights after STEPS - 1 steps
            p.detach().to_local().copy_(w0)
        fresh = coded_optimizer(params, states, backend)
        fresh.load_state_dict(source)
        coded_steps(fresh, params, set_dtensor_grad, range(STEPS - 1, STEPS))
        out[tag] = snapshot(fresh, params)
    from lowp.optim.sharding import gather
    for p, w0 in zip(params, weights):
        p.detach().to_local().copy_(w0)
    plain = [gather(p.detach()).clone().requires_grad_() for p in params]
    single = coded_optimizer(plain, states, backend)
    single.load_state_dict(sd)
    coded_steps(single, plain, _set_plain_grad, range(STEPS - 1, STEPS))
    out["to_plain"] = snapshot(single, plain)
    return out


#: the last step of the coded FSDP run of :func:`coded_plan_case`, whose cached plan leaves the
#: (5, 40) matrix and the fp32 vector (their shards split blocks) to a full step at every step:
#: (a NaN as (parameter, flat index) in rank 1's shard, or none; nonfinite; the rank whose plan is
#: dropped, or none; whether the (5, 40) matrix's gradient is replicated instead of sharded)
CODED_PLAN_CASES = [((2, 150), "skip_param", None, False, 0), ((2, 150), "skip_step", None, False, 0),
                    ((0, 300), "skip_param", 0, False, 0), (None, "skip_param", 1, False, 0),
                    (None, "off", None, False, 0), (None, "off", 0, False, 0), (None, "skip_param", None, True, 0),
                    (None, "skip_param", None, False, 256), ((2, 150), "skip_param", None, False, 256)]


def _coded_plan_run(opt, params: list[torch.Tensor], set_grad, nan_at: tuple[int, int] | None,
                    drop_rank: int | None = None, replicate: bool = False) -> None:
    import torch.distributed as dist
    for t in range(STEPS):
        last = t == STEPS - 1
        for i, (p, g) in enumerate(zip(params, coded_full(100 + t))):
            if last and nan_at is not None and i == nan_at[0]:
                g.view(-1)[nan_at[1]] = float("nan")
            if last and replicate and i == 2:
                from torch.distributed.tensor import Replicate, distribute_tensor
                p.grad = distribute_tensor(g, p.device_mesh, [Replicate()], src_data_rank=None)
            else:
                set_grad(p, g)
        if last and drop_rank is not None and dist.get_rank() == drop_rank:
            opt._plans.drop()
        opt.step()


def coded_plan_reference(nan_at: tuple[int, int] | None, nonfinite: str, coded_min_numel: int
                         ) -> dict[str, torch.Tensor]:
    """The single-process run of a :data:`CODED_PLAN_CASES` entry (int8 / uint4 states)."""
    params = [p.clone().requires_grad_() for p in coded_full(0)]
    opt = coded_optimizer(params, "int8-uint4", nonfinite=nonfinite, coded_min_numel=coded_min_numel)
    _coded_plan_run(opt, params, _set_plain_grad, nan_at)
    out = snapshot(opt, params)
    out["skipped"] = torch.tensor([opt.skipped_params, opt.skipped_steps])
    return out


def coded_plan_case(world_size: int, nan_at: tuple[int, int] | None, nonfinite: str, drop_rank: int | None,
                    replicate: bool, coded_min_numel: int) -> dict[str, torch.Tensor]:
    """A :data:`CODED_PLAN_CASES` entry on FSDP2 parameters: the snapshot, the skip counts, the
    (cached, agreed) steps of the plans and the size of the last plan's remainder."""
    params = fsdp_params(world_size, coded_full(0))
    opt = coded_optimizer(params, "int8-uint4", nonfinite=nonfinite, coded_min_numel=coded_min_numel)
    _coded_plan_run(opt, params, set_dtensor_grad, nan_at, drop_rank, replicate)
    out = snapshot(opt, params)
    out["skipped"] = torch.tensor([opt.skipped_params, opt.skipped_steps])
    out["plans"] = torch.tensor([opt._plans.cached_steps, opt._plans.agreed_steps])
    plan = opt._plans.current
    out["remainder"] = torch.tensor(-1 if plan is None else len(plan.remainder))
    return out


#: the threshold :func:`decode_run` raises after the first steps: the (64,), (5, 40) and fp32
#: (32,) parameters of :func:`coded_full` fall below it
DECODE_MIN_NUMEL = 256


def decode_run(opt, params: list[torch.Tensor], set_grad) -> dict[str, torch.Tensor]:
    """All but the last step with int8 / uint4 codes, then ``coded_min_numel`` raised to
    :data:`DECODE_MIN_NUMEL` and the optimizer's own ``state_dict`` loaded back (which decodes
    the small parameters' codes into 16-bit states), then the last step: its snapshot."""
    coded_steps(opt, params, set_grad, range(STEPS - 1))
    opt.param_groups[0]["coded_min_numel"] = DECODE_MIN_NUMEL
    opt.load_state_dict(opt.state_dict())
    coded_steps(opt, params, set_grad, range(STEPS - 1, STEPS))
    return snapshot(opt, params)


def decode_case(world_size: int) -> dict[str, torch.Tensor]:
    """:func:`decode_run` on FSDP2 parameters (sharded and replicated codes decoded)."""
    params = fsdp_params(world_size, coded_full(0))
    return decode_run(coded_optimizer(params, "int8-uint4"), params, set_dtensor_grad)


def per_tensor_coded_run(params: list[torch.Tensor], set_grad) -> dict[str, torch.Tensor]:
    """StableAdamW (a per-tensor RMS: every DTensor parameter stepped on gathered copies) with
    int8 / uint8 states for every size, :data:`STEPS` steps: its snapshot."""
    opt = lo.StableAdamW(params, lr=1e-2, weight_decay=0.1, seed=7, coded_min_numel=0, **BACKENDS["fused"],
                         state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8})
    coded_steps(opt, params, set_grad, range(STEPS))
    return snapshot(opt, params)


#: StableAdamW's sums exchanged between FSDP2 shards: shapes whose 2-rank (and 4-rank) row
#: boundaries fall inside a unit of 2**15 elements, inside a 16-element block (39,321 = 16 * 2,457 + 9)
#: and on a block edge (80,000), a small matrix, a one-row matrix (rank 0 holds all of it, the
#: others nothing) and an fp32 vector
SUMS_SHAPES = [(5, 13107), (3, 40000), (6, 5), (1, 40)]


def sums_full(seed: int) -> list[torch.Tensor]:
    """bf16 tensors of :data:`SUMS_SHAPES` and an fp32 vector: parameters (``seed`` 0) or a step's
    gradients, of mixed scales (the RMS clip is active on some tensors and steps)."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(s, generator=g) * 10.0 ** (seed % 3 - 1)).bfloat16() for s in SUMS_SHAPES]
    return out + [torch.randn(9, generator=g)]


#: (backend, the smallest parameter whose sum is exchanged: both thresholds of
#: lowp.optim.sharded_sums) of :func:`sums_case`: every sum exchanged, native and reference, then
#: 65,536 (the large parameter exchanged, the others gathered in the same step)
SUMS_RUNS = [("fused", 0), ("unfused", 0), ("fused", 1 << 16)]


def sums_run(params: list[torch.Tensor], set_grad, backend: str, threshold: int) -> dict[str, Any]:
    """StableAdamW (kahan, the native kernel or the reference) for :data:`STEPS` steps with the
    whole-tensor sums of :mod:`lowp.optim.sharded_sums` for parameters of at least ``threshold``
    elements: the snapshot, how many tensors ``gather_many`` received, how many shards' sums were
    exchanged and how many shards' terms torch computed (the others' pieces came from the kernel),
    the steps taken from the cached plan, how many native variants the steps after the first
    asked for that the first did not, how many native pieces passes they prepared (the plan
    keeps the first step's), and how many sums the C++ rebuild made."""
    from lowp.optim import sharded_sums, sharding
    from lowp.optim.kernels.native import kernel as native_kernel, rebuild as native_rebuild
    rebuilt = native_rebuild.CALLS[0]
    opt = lo.StableAdamW(params, lr=1e-2, weight_decay=0.1, seed=5, **BACKENDS[backend])
    counts = {"gathered": 0, "exchanged": 0, "torch terms": 0}
    variants: list[set] = [set()]   # the native variants each step asked for, step by step
    real_variant_for = native_kernel.variant_for
    prepared = [0]   # the native pieces passes each step prepared
    real_prepare = native_kernel.PiecesCall.__init__

    def prepare(self, *args, **kwargs):
        prepared[-1] += 1
        real_prepare(self, *args, **kwargs)

    def variant_for(*args, **kwargs):
        made = real_variant_for(*args, **kwargs)
        variants[-1].add(made)
        return made
    real_gather, real_exchange = sharding.gather_many, sharded_sums.exchange_pieces
    real_thresholds = sharded_sums.MIN_NUMEL, sharded_sums.CUDA_REFERENCE_MIN_NUMEL
    real_terms = lo.StableAdamW.tensor_terms

    def tensor_terms(self, group, grads, states, step):
        counts["torch terms"] += len(grads)
        return real_terms(self, group, grads, states, step)

    def gather_many(tensors):
        counts["gathered"] += len(tensors)
        return real_gather(tensors)

    def exchange_pieces(slices, make, failed=None):
        real_exchange(slices, make, failed)
        counts["exchanged"] += sum(s.tensor_sum.total is not None for s in slices)
    sharding.gather_many, sharded_sums.exchange_pieces = gather_many, exchange_pieces
    sharded_sums.MIN_NUMEL = sharded_sums.CUDA_REFERENCE_MIN_NUMEL = threshold
    lo.StableAdamW.tensor_terms = tensor_terms
    native_kernel.variant_for = variant_for
    native_kernel.PiecesCall.__init__ = prepare
    try:
        for t in range(STEPS):
            for p, g in zip(params, sums_full(100 + t)):
                set_grad(p, g)
            opt.step()
            variants.append(set())
            prepared.append(0)
    finally:
        native_kernel.variant_for = real_variant_for
        native_kernel.PiecesCall.__init__ = real_prepare
        sharding.gather_many, sharded_sums.exchange_pieces = real_gather, real_exchange
        sharded_sums.MIN_NUMEL, sharded_sums.CUDA_REFERENCE_MIN_NUMEL = real_thresholds
        lo.StableAdamW.tensor_terms = real_terms
    return {"snapshot": snapshot(opt, params), "counts": counts,
            "fused": opt.backend.fused_elements if backend == "fused" else -1, "cached": opt._plans.cached_steps,
            "new variants": len(set().union(*variants[1:]) - variants[0]), "prepared": prepared[:STEPS],
            "rebuilt": native_rebuild.CALLS[0] - rebuilt}


def sums_case(world_size: int) -> dict[str, Any]:
    """:func:`sums_run` of each of :data:`SUMS_RUNS` on FSDP2 parameters."""
    return {f"{backend}-{threshold}": sums_run(fsdp_params(world_size, sums_full(0)), set_dtensor_grad, backend,
                                               threshold) for backend, threshold in SUMS_RUNS}


#: where :func:`remainder_failure_case` makes the step fail: from the plan, in the remainder's full
#: step before it writes anything (its backend), or in the plan's own first launch, after the
#: remainder's step has encoded its gathered copies; or in a full step (the plan dropped), in the
#: job of the gathered copies
FAILURES = ("remainder", "launch", "full")


def remainder_failure_case(world_size: int, where: str) -> dict[str, Any]:
    """The finite, ``"skip_param"`` :data:`CODED_PLAN_CASES` run whose last step, taken from the
    plan, fails (``where``: :data:`FAILURES`; as running out of memory would): the error, whether
    every weight, state (codes and block scales included) and counter is as before that step, then
    the step taken again without the failure (its snapshot)."""
    params = fsdp_params(world_size, coded_full(0))
    opt = coded_optimizer(params, "int8-uint4", nonfinite="skip_param")

    def set_grads(t: int) -> None:
        for p, g in zip(params, coded_full(100 + t)):
            set_dtensor_grad(p, g)
    for t in range(STEPS - 1):
        set_grads(t)
        opt.step()
    set_grads(STEPS - 1)
    before = snapshot(opt, params)
    counters = [opt.state[p]["step"] for p in params]
    if where == "full":
        opt._plans.drop()
    cached = opt._plans.cached_steps
    # the remainder's full step goes through the backend (each job prepared, then called: the call
    # fails, a fault while the jobs write); the plan's first launch is an object of its own
    from lowp.optim.sharding import local
    prepare = opt.backend.prepare
    live = {local(p).data_ptr() for p in params}

    def fail():
        raise MemoryError(f"injected into the {where}")

    def failing_prepare(optimizer, ctx, slices):
        call = prepare(optimizer, ctx, slices)
        if where == "full" and any(s.param.data_ptr() in live for s in slices):
            return call   # a job of the rank's own shards
        return fail

    def failing_stage(*args, **kwargs):
        return fail   # staged (the remainder's step then runs), failing when it runs
    owner, name, failing = ((opt._plans.current.jobs[0].launches[0][0], "stage", failing_stage) if where == "launch"
                            else (opt.backend, "prepare", failing_prepare))
    setattr(owner, name, failing)   # an instance attribute over the class's method
    try:
        opt.step()
        error = ""
    except MemoryError as e:
        error = str(e)
    finally:
        delattr(owner, name)
    after = snapshot(opt, params)
    out: dict[str, Any] = {
        "error": error, "from_plan": opt._plans.cached_steps == cached + (where != "full"),
        "unchanged": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
        "counters": counters == [opt.state[p]["step"] for p in params]}
    opt.step()
    out["retried"] = snapshot(opt, params)
    return out


# ---- checkpoints ------------------------------------------------------------------------------
#: ``mode`` names a DCP case of this write-back mode with fp32 states; ``CODED`` one with
#: block-scaled states on a wider MLP whose blocks of 32 fit some shards and not others
CODED = "coded"


def mlp(dtype: torch.dtype = torch.bfloat16, coded: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    inputs, width, out = (32, 64, 8) if coded else (8, 16, 4)
    return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.GELU(),
                               torch.nn.Linear(width, out)).to(dtype)


def _dcp_optimizer(model: torch.nn.Module, mode: str):
    if mode == CODED:
        return lo.AdamW(model.parameters(), lr=1e-2, seed=3, state_block=32, fused=True,
                        state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
    return lo.AdamW(model.parameters(), lr=1e-2, mode=mode, seed=3, state_dtype=torch.float32, fused=True)


def plain_train(mode: str) -> dict[str, Any]:
    """The unsharded single-process run of :func:`train_save` (bf16 MLP, lowp AdamW)."""
    model = mlp(coded=mode == CODED)
    opt = _dcp_optimizer(model, mode)
    losses = _train(model, opt, range(4))
    return {"losses": losses, "model": _full_model(model), "optim": _full_optim(opt)}


def _dcp_model(world_size: int, mp: str | None = None, coded: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    model = mlp(torch.float32 if mp else torch.bfloat16, coded)
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": None}
    policy = MixedPrecisionPolicy() if mp is None else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=reduce_dtype[mp])
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _train(model, opt, steps: range) -> list[float]:
    losses = []
    for t in steps:
        g = torch.Generator().manual_seed(50 + t)
        x = torch.randn(12, model[0].in_features, generator=g)
        y = torch.randn(12, model[-1].out_features, generator=g)
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full_model(model) -> dict[str, torch.Tensor]:
    from lowp.optim.sharding import gather
    return {k: gather(v.detach()).clone() for k, v in model.state_dict().items()}


def _full_optim(opt) -> dict[str, torch.Tensor]:
    from lowp.optim.sharding import gather
    return {f"{i}.{k}": gather(v).clone() for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
            for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}


def train_save(rank: int, world_size: int, folder: str, mode: str, mp: str | None = None) -> dict[str, Any]:
    """Train 2 steps, save a DCP checkpoint, train 2 more; return the losses, final weights and states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = _dcp_model(world_size, mp, mode == CODED)
    opt = _dcp_optimizer(model, mode)
    losses = _train(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    dtypes = {k: str(v.dtype) for k, v in _full_optim(opt).items()}
    losses += _train(model, opt, range(2, 4))
    return {"losses": losses, "model": _full_model(model), "optim": _full_optim(opt), "dtypes": dtypes,
            "cached": opt._plans.cached_steps,
            "sharded": all(type(v).__name__ == "DTensor" for k, v in osd["state"][next(iter(osd["state"]))].items()
                           if isinstance(v, torch.Tensor) and k != "step")}   # step: a 0-dim int64 tensor


def load_continue(rank: int, world_size: int, folder: str, mode: str) -> dict[str, Any]:
    """Load the checkpoint into a fresh model and optimizer, train the last 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = _dcp_model(world_size, coded=mode == CODED)
    opt = _dcp_optimizer(model, mode)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dtypes = {k: str(v.dtype) for k, v in _full_optim(opt).items()}
    losses = _train(model, opt, range(2, 4))
    return {"losses": losses, "model": _full_model(model), "optim": _full_optim(opt), "dtypes": dtypes}


def session(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One launch of the ranks running everything ``spec`` lists (process start and torch's import
    are the cost of a launch).

    - ``steps``: cases of :func:`case_run`; their snapshots by position (a case of 7 entries
      names the rank that takes a full step while the others take a cached one);
    - ``save``: modes to train, checkpoint (into ``folder/<mode>-<world size>``) and continue;
      with ``reload`` also resumed right away in a fresh model and optimizer (same world size);
    - ``load``: checkpoints ``<mode>-<world size it was saved at>`` to resume here;
    - ``mp``: ``reduce_dtype`` names of mixed-precision runs (fp32 parameters, bf16 compute);
    - ``state_dict``: cases ``(optimizer, mode, single-process state_dict)`` of :func:`state_dict_case`;
    - ``coded``: cases of :func:`coded_case` with the single-process dicts it loads;
    - ``coded_plans``: cases of :func:`coded_plan_case`;
    - ``remainder_failure``: :func:`remainder_failure_case`;
    - ``decode``: :func:`decode_case`;
    - ``per_tensor_coded``: :func:`per_tensor_coded_run` on FSDP2 parameters;
    - ``sums``: :func:`sums_case`;
    - ``reduce_scatter``: :func:`reduce_scatter_checks`;
    - ``errors``: :func:`placement_errors`;
    - ``gather``: :func:`gather_checks`;
    - ``plan_changes``: cases of :func:`plan_change_case`;
    - ``grad_scaler``: the (optimizer, ``nan_at``) of cases of :func:`grad_scaler_case`.
    """
    torch.manual_seed(0)
    folder = Path(spec.get("folder", "."))
    out: dict[str, Any] = {"steps": [case_run(world_size, *c) for c in spec.get("steps", [])],
                           "save": {}, "load": {}, "mp": {}}
    for mode in spec.get("save", []):
        tag = f"{mode}-{world_size}"
        out["save"][mode] = train_save(rank, world_size, str(folder / tag), mode)
        if spec.get("reload"):
            out["load"][tag] = load_continue(rank, world_size, str(folder / tag), mode)
    for tag in spec.get("load", []):
        out["load"][tag] = load_continue(rank, world_size, str(folder / tag), tag.split("-")[0])
    for mp in spec.get("mp", []):
        out["mp"][mp] = train_save(rank, world_size, str(folder / f"mp-{mp}-{world_size}"), "kahan", mp)
    out["state_dict"] = [state_dict_case(world_size, *c) for c in spec.get("state_dict", [])]
    plain_sds = spec.get("coded_state_dicts", {})
    out["coded"] = [coded_case(world_size, *c, plain_sds.get(c[1], {})) for c in spec.get("coded", [])]
    out["coded_plans"] = [coded_plan_case(world_size, *c) for c in spec.get("coded_plans", [])]
    if spec.get("decode"):
        out["decode"] = decode_case(world_size)
    if spec.get("sums"):
        out["sums"] = sums_case(world_size)
    if spec.get("per_tensor_coded"):
        out["per_tensor_coded"] = per_tensor_coded_run(fsdp_params(world_size, coded_full(0)), set_dtensor_grad)
    if spec.get("remainder_failure"):
        out["remainder_failure"] = {where: remainder_failure_case(world_size, where) for where in FAILURES}
    if spec.get("reduce_scatter"):
        out["reduce_scatter"] = reduce_scatter_checks(rank, world_size)
    if spec.get("errors"):
        out["errors"] = placement_errors(world_size)
    if spec.get("gather"):
        out["gather"] = gather_checks(world_size)
        out["gather_many"] = gather_many_checks(world_size)
    out["plan_changes"] = {c: plan_change_case(world_size, c) for c in spec.get("plan_changes", [])}
    out["grad_scaler"] = [grad_scaler_case(world_size, *case) for case in spec.get("grad_scaler", [])]
    return out


def gather_checks(world_size: int) -> dict[str, tuple[bool, bool]]:
    """Per dtype, ``sharding.gather`` of a ``(6, 5)`` tensor split unevenly along dimension 1 (3 + 2
    columns on 2 ranks): (contiguous, equal to the full tensor bit for bit). int16 travels as bf16
    bits."""
    from lowp.optim.sharding import gather
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(30, dtype=torch.int16).reshape(6, 5) * 997
    out = {}
    for dtype in (torch.bfloat16, torch.int16):
        want = full.to(dtype) if dtype == torch.int16 else full.float().bfloat16()
        got = gather(distribute_tensor(want, mesh, [Shard(1)], src_data_rank=None))
        out[str(dtype)] = (got.is_contiguous(), torch.equal(got.view(want.dtype), want))
    return out


#: (global shape, dtype, placement) of gather_many's tensors: uneven and empty shards (the (2,)
#: vector at 4 ranks), both dimensions, the dtypes gloo cannot carry (int16, fp8), a replica
GATHER_MANY = [((6, 5), torch.bfloat16, "Shard(0)"), ((7,), torch.float32, "Shard(0)"),
               ((5, 40), torch.int8, "Shard(0)"), ((3, 5), torch.int16, "Shard(1)"),
               ((6, 5), torch.float8_e4m3fn, "Shard(0)"), ((2,), torch.uint8, "Shard(0)"),
               ((4, 3), torch.bfloat16, "Replicate()")]


#: a cap on :func:`sharding.gather_many`'s received bytes below all of :data:`GATHER_MANY`'s
#: messages at 2 and 4 ranks, above any one tensor's (the (5, 40) int8 codes: 128 bytes x 2
#: ranks, 80 x 4)
GATHER_CAP = 320


def gather_many_checks(world_size: int) -> dict[str, Any]:
    """``sharding.gather_many`` of :data:`GATHER_MANY` (plus a plain tensor) against
    ``sharding.gather`` of each: per tensor (bits equal, contiguous, dtype kept, a copy), the
    all-gathers it made (one, for all the sharded ones) and the most bytes one received, under
    the default cap, a cap of 1 byte and one of :data:`GATHER_CAP` bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lowp.optim import sharding
    mesh = init_device_mesh("cpu", (world_size,))
    tensors: list[torch.Tensor] = []
    for k, (shape, dtype, placement) in enumerate(GATHER_MANY):
        values = (torch.arange(math.prod(shape)).reshape(shape) * 37 + k) % 97 - 40
        full = values.to(dtype) if not dtype.is_floating_point else (values.float() / 8).to(dtype)
        pl = Replicate() if placement == "Replicate()" else Shard(int(placement[6]))
        tensors.append(distribute_tensor(full, mesh, [pl], src_data_rank=None))
    tensors.append(torch.arange(5.0))
    one_by_one = [sharding.gather(t).clone() for t in tensors]
    sharded = [sharding.local(t) for t in tensors[:-1]]   # the replica's too: gather copies it
    out = {}
    calls = [0, 0]   # all-gathers, the most bytes one received
    all_gather, limit = dist.all_gather, sharding.GATHER_BYTES

    def counted(received, *args, **kwargs):
        calls[0] += 1
        calls[1] = max(calls[1], sum(r.numel() * r.element_size() for r in received))
        return all_gather(received, *args, **kwargs)
    # a cap of 1 byte: each tensor alone
    for tag, cap in (("one", limit), ("capped", 1), ("bytes", GATHER_CAP)):
        calls[:] = [0, 0]
        dist.all_gather, sharding.GATHER_BYTES = counted, cap
        try:
            batched = sharding.gather_many(tensors)
        finally:
            dist.all_gather, sharding.GATHER_BYTES = all_gather, limit
        out[tag] = {"checks": [(torch.equal(g.view(torch.uint8), w.view(torch.uint8)), g.is_contiguous(),
                                g.dtype == w.dtype,
                                all(g.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in sharded))
                               for g, w in zip(batched, one_by_one)],
                    "all_gathers": calls[0], "received": calls[1]}
    return out


# ---- FSDP2 reduce-scatter ------------------------------------------------------------------------
RS_NUMEL = 1 << 14


def rs_input(rank: int, world_size: int) -> torch.Tensor:
    """fp32 reduce-scatter input of ``rank``: values over 2**-12 .. 2**12 and both signs."""
    g = torch.Generator().manual_seed(77 + rank)
    scale = torch.exp2(torch.randint(-12, 13, (world_size * RS_NUMEL,), generator=g).float())
    return torch.randn(world_size * RS_NUMEL, generator=g) * scale


def reduce_scatter_checks(rank: int, world_size: int) -> dict[str, Any]:
    """FP32ReduceScatter called directly (SUM and AVG, bf16 and fp32 outputs, nearest and
    stochastic compression) and the advisor's view of FSDP2 policies."""
    import torch.distributed as dist

    from lowp.distributed.advisor import advise_fsdp
    from lowp.distributed.fsdp import FP32ReduceScatter, set_fp32_reduce_scatter
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    x = rs_input(rank, world_size)
    for name, comm, op, dtype in [("sum", FP32ReduceScatter(), dist.ReduceOp.SUM, torch.float32),
                                  ("avg", FP32ReduceScatter(), dist.ReduceOp.AVG, torch.float32),
                                  ("sum_bf16", FP32ReduceScatter(), dist.ReduceOp.SUM, torch.bfloat16),
                                  ("stochastic", FP32ReduceScatter(stochastic=True, seed=5), dist.ReduceOp.SUM,
                                   torch.float32)]:
        result = comm.allocate((RS_NUMEL,), dtype=dtype, device=torch.device("cpu"))
        comm(result, x.to(dtype), group, dist.ReduceOp.SUM if op == dist.ReduceOp.SUM else op)
        out[name] = result
    # unbiasedness: 1 + 2**-10 lies between bf16 neighbours 1 and 1 + 2**-7
    tiny = torch.full((world_size * RS_NUMEL,), 1 + 2.0 ** -10)
    result = torch.empty(RS_NUMEL)
    FP32ReduceScatter(stochastic=True, seed=rank)(result, tiny, group, dist.ReduceOp.SUM)
    out["stochastic_tiny"] = result
    nearest = torch.empty(RS_NUMEL)
    FP32ReduceScatter()(nearest, tiny, group, dist.ReduceOp.SUM)
    out["nearest_tiny"] = nearest
    try:
        FP32ReduceScatter()(torch.empty(RS_NUMEL), x, group, dist._make_nccl_premul_sum(0.5))
    except ValueError as exc:
        out["premul_error"] = str(exc)
    # FSDP2 integration: fp32 parameters, bf16 compute, fp32 reduce through the custom comm; the
    # same batch on every rank makes the reduction exact, so it must equal the default path
    default = _dcp_model(world_size, "fp32")
    custom = _dcp_model(world_size, "fp32")
    advice_before = advise_fsdp(custom)
    comm = set_fp32_reduce_scatter(custom)
    for model in (default, custom):
        opt = lo.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, range(2))
    out["fsdp_default"], out["fsdp_custom"] = _full_model(default), _full_model(custom)
    out["fsdp_calls"] = comm.calls
    out["advice_fp32"] = advice_before
    out["advice_bf16_reduce"] = advise_fsdp(_dcp_model(world_size, "bf16"))
    out["advice_fp32_params_reduce_none"] = advise_fsdp(_dcp_model(world_size, "none"))
    out["advice_pure_bf16"] = advise_fsdp(_dcp_model(world_size))
    pure = _dcp_model(world_size)
    set_fp32_reduce_scatter(pure)
    out["advice_pure_bf16_fixed"] = advise_fsdp(pure)
    return out


def placement_errors(world_size: int) -> dict[str, Any]:
    """A ``Partial`` parameter is refused when the optimizer is built (the message and whether the
    parameter kept its bits); the warnings of a step of block-scaled states for a large parameter
    whose shards split blocks (``(3, 33000)``) and one whose shards hold whole blocks
    (``(2, 33024)``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.arange(6, dtype=torch.float32).bfloat16()
    p = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Partial()], run_check=False))
    try:
        lo.AdamW([p])
        message = ""
    except TypeError as exc:
        message = str(exc)
    uneven = torch.nn.Parameter(DTensor.from_local(torch.zeros(3), mesh, [Shard(0)],
                                                   run_check=False, shape=(8 * world_size,), stride=(1,)))
    try:
        lo.AdamW([uneven])
        off_rule = ""
    except ValueError as exc:
        off_rule = str(exc)
    import warnings

    from torch.distributed.tensor import distribute_tensor
    warned = {}
    for shape in ((3, 33000), (2, 33024)):
        q = torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=torch.bfloat16), mesh, [Shard(0)]))
        q.grad = distribute_tensor(torch.ones(shape, dtype=torch.bfloat16), mesh, [Shard(0)])
        opt = lo.AdamW([q], state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, coded_min_numel=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        warned[shape] = [(str(w.message), w.filename.rsplit("/", 1)[-1]) for w in caught]
    return {"partial": message, "unchanged": torch.equal(p.to_local(), local), "warned": warned,
            "off_rule": off_rule}
