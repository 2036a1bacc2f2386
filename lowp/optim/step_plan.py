"""One step of a lowp optimizer, whole per parameter: prepared, planned, executed.

1. **Prepare** (:func:`prepare`, :func:`prepare_subset`): every group's hyper-parameters and every
   (parameter, gradient, state, buffer) the step reads or writes are checked before anything
   changes, a gradient sharing memory with a weight the step writes included.
2. **Plan** (:class:`StepPlan`): the parameters with finite gradients (the ``nonfinite`` policy)
   get their missing states and buffers (zeros, or a mode switch's folded buffer,
   :mod:`lowp.optim.state_layout`; :func:`run` makes them inside the check whose flags the ranks
   agree on, so a failure there reaches every rank) and their sharded slices gathered, and are
   grouped into jobs;
   nothing a step reads is written, and on any error (a failed gather, an interrupt) every state
   entry and folded weight is put back.
3. **Execute** (:meth:`StepPlan.execute`): every job is first prepared by the optimizer's backend
   (:meth:`~lowp.optim.backends.Backend.prepare`: slices admitted to its kernel, the kernel's
   library built and loaded, its arguments checked), and the whole-tensor sums of sharded
   parameters of a per-tensor optimizer are exchanged (:mod:`lowp.optim.sharded_sums`); only then
   are weights and states written,
   job after job (:mod:`lowp.optim.backends`, which writes each weight back with its mode,
   :mod:`lowp.optim.writeback`), with Ctrl-C held until all are done (:mod:`lowp.interrupts`);
   each parameter's step counter advances right after the job that wrote its weight and states.

The native kernel's libraries are all loaded by then, the variants that a job's coded states
decoded outside the kernel will run included (:meth:`~lowp.optim.backends.Backend.prepare_decoded`),
and so is the native codec that decodes and encodes those states.
What remains is an error while the jobs write, on checked input: running out of memory for
temporaries (the reference pipeline's fp32 copies of slices a kernel does not take, coded states
decoded outside a kernel, a non-contiguous gradient's copy), or a kernel that compiles on its
first call (``compiled``; Triton's JIT on a launch's first signature). Every parameter is then
stepped whole or left as it was: the jobs before it are stepped, and within the failing job the
reference pipeline and the ``compiled`` kernel put back what they had written of the parameters
they had not finished (:mod:`lowp.optim.journal`), whose counters stay; the error says how many
were stepped. With every slice and coded state
taken by the ``native`` kernel the writes are the prepared kernel calls alone. :func:`step_all` is a
whole ``step()``, :func:`step_some` the ``step_params`` of gradient release
(:mod:`lowp.optim.release`); both run :func:`run`.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Protocol, Sequence, cast

import torch

from lowp.interrupts import deferred_interrupts
from lowp.optim import backends, collectives, preflight, sharded_sums, sharding
from lowp.optim.backends import Backend, get_backend
from lowp.optim.cached_step import Plans
from lowp.optim.codes import scale_name
from lowp.optim.hyper import real_value
from lowp.optim.journal import note_stepped
from lowp.optim.preflight import check_flag
from lowp.optim.slices import CodedState, ParamSlice, StepContext
from lowp.optim.stalled import Stalled
from lowp.optim.writeback import BUFFER_NAMES, MODES, WriteBack, resolve_mode

__all__ = ["Checked", "Remainder", "StepPlan", "prepare", "prepare_subset", "run", "step_all", "step_some"]


class LowpOptimizer(backends.LowpOptimizer, Protocol):
    """What a step reads and writes of the optimizer (:class:`lowp.optim.base.LowpOptimizer`,
    which imports this module)."""

    param_groups: list[dict[str, Any]]
    state: defaultdict[torch.Tensor, Any]
    nonfinite: str
    backend: Backend
    seed: int
    diagnostics_enabled: bool
    skipped_params: int
    skipped_steps: int
    _last_stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]]
    _positions: dict[torch.Tensor, tuple[int, int, int]]
    _released_by: Any
    _plans: Plans

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyper-parameters."""

    def shards_sums(self) -> bool:
        """Whether its per-tensor sums of sharded parameters are exchanged, not gathered."""

    def state_names(self, group: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
        """Names of the optimizer states of ``param``."""

    def coded_states(self, group: dict[str, Any], param: torch.Tensor) -> list[CodedState]:
        """The block-scaled states of ``param``."""

    def check_state(self, group: dict[str, Any], p: torch.Tensor, state: Mapping[str, Any], where: str,
                    coded_states: list[CodedState] | None = None) -> None:
        """Check the state entries of ``p``."""

    def init_state(self, group: dict[str, Any], p: torch.Tensor, mode: WriteBack,
                   coded_states: list[CodedState] | None = None) -> dict[str, Any]:
        """Create the missing state entries of ``p``."""

    def _finite_flags(self, grads: list[torch.Tensor], params: list[torch.Tensor], force: bool = False,
                      before: Callable[[list[bool]], None] | None = None) -> list[bool]:
        """:func:`finite_flags`, bound."""


class Checked(NamedTuple):
    """A parameter the step will update, checked by :func:`prepare`.

    Args:
        group: its parameter group.
        param: the parameter.
        mode: its write-back mode.
        param_id: its position over all groups (which picks its random streams).
        coded: the optimizer's ``coded_states`` of the parameter in its group, computed once per step.
    """

    group: dict[str, Any]
    param: torch.Tensor
    mode: WriteBack
    param_id: int
    coded: list[CodedState]


class _Undo:
    """What planning a step may change, kept to put it back: each parameter's state entries
    (a shallow copy: planning adds or replaces entries but writes no existing tensor) and the
    weights a mode switch folds a buffer into (:func:`~lowp.optim.writeback.ensure_buffer`)."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, dict[str, Any] | None]] = []
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []

    def remember(self, states: Mapping[torch.Tensor, dict[str, Any]], p: torch.Tensor, mode: WriteBack) -> None:
        """Keep ``p``'s state entries, and its weight when a buffer of another mode will be folded."""
        state = states.get(p)
        self.entries.append((p, None if state is None else dict(state)))
        if state and any(n in state for n in BUFFER_NAMES if n != mode.buffer_name):
            self.weights.append((p, sharding.local(p).detach().clone()))

    def restore(self, states: dict[torch.Tensor, dict[str, Any]], only: Sequence[torch.Tensor] | None = None) -> None:
        """Put back every remembered state entry and weight (``only``: those of these parameters)."""
        keep = None if only is None else {id(p) for p in only}
        for p, entries in reversed(self.entries):
            if keep is not None and id(p) not in keep:
                continue
            if entries is None:
                states.pop(p, None)
            else:
                states[p].clear()
                states[p].update(entries)
        for p, weight in self.weights:
            if keep is None or id(p) in keep:
                sharding.local(p).detach().copy_(weight)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous local elements (a DTensor keeps its placements)."""
    if sharding.is_dtensor(t):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(t.to_local().contiguous(), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.contiguous()


def finite_flags(optimizer: LowpOptimizer, grads: list[torch.Tensor], params: list[torch.Tensor],
                 force: bool = False, before: Callable[[list[bool]], None] | None = None) -> list[bool]:
    """Per (local) gradient: finite; for DTensor parameters finite on every rank, whose step counts
    are compared in the same all-reduces (:class:`~lowp.optim.collectives.CountsDiffer` on every
    rank when they differ). All ``True`` without a look under ``nonfinite="off"``, unless
    ``force``. ``before(flags)`` runs with this rank's own flags before they are agreed (the step
    makes its missing states there, :func:`run`): an error in it reaches the other ranks in the
    agreement's all-reduces (:class:`~lowp.optim.collectives.PeerFailed` there) instead of leaving
    them waiting in the step's later collectives (gathers, the exchange of sharded sums)."""
    def compute(flags: list[bool]) -> list[bool]:
        if before is not None:
            before(flags)
        return flags
    if optimizer.nonfinite == "off" and not force:
        return compute([True] * len(grads))
    return collectives.agree(lambda: compute(optimizer.backend.finite_flags(grads)), params,
                            optimizer.nonfinite == "skip_step", step_counts(optimizer, params))


def step_counts(optimizer: LowpOptimizer, params: Sequence[torch.Tensor]) -> list[int | None]:
    """The step count of each DTensor parameter of ``params`` (0 before its first step), ``None``
    for a plain tensor: what every rank that holds a parameter must hold alike."""
    return [None if not sharding.is_dtensor(p) else int(optimizer.state.get(p, {}).get("step", 0)) for p in params]


def _checked_param(optimizer: LowpOptimizer, group: dict[str, Any], p: torch.Tensor, index: int) -> Checked:
    """Check one parameter with a gradient (layout, gradient, mode, coded states, states and
    buffers); ``index`` is its position over all groups."""
    where = f"params[{index}]"
    preflight.check_param(p, where)
    if p.is_meta:
        raise ValueError(f"{where}: a meta tensor has no values to step; materialize the model (to_empty, "
                         f"then initialize it) before stepping")
    preflight.check_grad(p, p.grad, where)
    mode = resolve_mode(group["mode"], p)
    coded = optimizer.coded_states(group, p)
    optimizer.check_state(group, p, optimizer.state.get(p, {}), f"state[{index}]", coded)
    return Checked(group, p, mode, index, coded)


def prepare(optimizer: LowpOptimizer) -> list[Checked]:
    """Check everything the step will read or write, before anything changes: every group's
    hyper-parameters, and for each parameter with a gradient its layout, its mode, the
    gradient (shape, dtype, device), its coded states and its states and buffers. Returns the
    checked parameters to step."""
    todo = []
    index = -1
    for group in optimizer.param_groups:
        optimizer.check_group(group)
        for p in group["params"]:
            index += 1
            if p.grad is not None:
                todo.append(_checked_param(optimizer, group, p, index))
    preflight.check_grads_apart([t.param for t in todo], [f"params[{t.param_id}]" for t in todo])
    return todo


def _position(optimizer: LowpOptimizer, p: Any, where: str) -> tuple[int, int, int]:
    """(group index, index in the group, position over all groups) of parameter ``p``.

    Looked up in the optimizer's ``_positions``, rebuilt when it no longer matches
    ``param_groups`` (groups added, a checkpoint loaded); an error naming ``where`` when ``p`` is
    not a parameter of this optimizer."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected a parameter of this optimizer, got {type(p).__name__}")
    groups = optimizer.param_groups
    found = optimizer._positions.get(p)
    if found is None or found[0] >= len(groups) or found[1] >= len(groups[found[0]]["params"]) \
            or groups[found[0]]["params"][found[1]] is not p:
        flat = [(q, g, i) for g, group in enumerate(groups) for i, q in enumerate(group["params"])]
        optimizer._positions = {q: (g, i, n) for n, (q, g, i) in enumerate(flat)}
        found = optimizer._positions.get(p)
    if found is None:
        raise ValueError(f"{where}: expected a parameter of this optimizer, got another tensor")
    return found


def prepare_subset(optimizer: LowpOptimizer, params: Sequence[torch.Tensor]) -> list[Checked]:
    """:func:`prepare` for ``params`` only: the hyper-parameters of the groups holding them
    and each of them that has a gradient, in the order given."""
    positions = [_position(optimizer, p, f"params[{i}]") for i, p in enumerate(params)]
    if len({n for _, _, n in positions}) != len(positions):
        raise ValueError("params: expected distinct parameters, got one parameter twice")
    for g in sorted({g for g, _, _ in positions}):
        optimizer.check_group(optimizer.param_groups[g])
    todo = [_checked_param(optimizer, optimizer.param_groups[g], p, n) for p, (g, _, n) in zip(params, positions)
            if p.grad is not None]
    preflight.check_grads_apart([t.param for t in todo], [f"params[{t.param_id}]" for t in todo])
    return todo


def step_all(optimizer: LowpOptimizer) -> None:
    """A whole step, after the closure of ``step()``: nothing while gradient release steps the
    parameters during the backward pass, a skipped step when GradScaler found an infinity, else
    every parameter with a gradient (divided by GradScaler's scale when it hands one over)."""
    if optimizer._released_by is not None:
        if getattr(optimizer, "grad_scale", None) is not None:
            raise ValueError("scaler: a GradScaler stepped this optimizer while release_gradients steps it during "
                             "the backward pass, with gradients still scaled; pass the scaler to "
                             "release_gradients(opt, scaler=scaler) and keep scaler.update() after backward")
        return
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and float(found_inf) > 0:
        optimizer.skipped_steps += 1
        return
    grad_scale = getattr(optimizer, "grad_scale", None)
    inv_scale = None if grad_scale is None else float(grad_scale.double().reciprocal())
    # GradScaler hands over found_inf only after checking every gradient of this optimizer:
    # 0 means all are finite, and a second pass over them would cost about 10% of a fused step
    taken, agreed = optimizer._plans.try_step(optimizer, inv_scale, checked=found_inf is not None,
                                              remainder=functools.partial(Remainder, optimizer))
    if taken:
        return
    run(optimizer, prepare(optimizer), inv_scale, checked=found_inf is not None, new_step=True, keep_plan=True,
        agreed=agreed)


class Remainder:
    """The full step of the parameters a cached plan leaves out (its remainder: gathered DTensor
    steps, :class:`lowp.optim.cached_step.CachedStep`), made by the plan's step: checked as
    :func:`prepare_subset` checks them, with their local gradients (placed like the parameters,
    which the plan's signature checked: no collective) for the plan's non-finite flags.

    Args:
        optimizer: the optimizer stepped.
        params: the remainder's parameters, in the order of the groups, each with a gradient.
    """

    def __init__(self, optimizer: LowpOptimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.todo = prepare_subset(optimizer, params)
        self.grads = [sharding.local_grad(t.param) for t in self.todo]

    def plan(self) -> StepPlan:
        """Their step planned (states created, full copies gathered; nothing written), every
        gradient finite (the plan agreed their flags first). Every one is stepped on gathered
        copies (why the plan left it out), so its jobs write nothing live
        (:attr:`StepPlan.all_gathered`) and can run before the plan's own writes."""
        planned = StepPlan(self.optimizer, list(zip(self.todo, self.grads)))
        if not planned.all_gathered:
            raise RuntimeError("cached step: a remainder parameter is no longer stepped on gathered copies")
        return planned


def step_some(optimizer: LowpOptimizer, params: Sequence[torch.Tensor], grad_scale: float | None, new_step: bool,
              update_weights: bool) -> bool:
    """The optimizer's ``step_params`` (which documents the arguments) after checking them."""
    if grad_scale is not None:
        v = real_value(grad_scale)
        if v is None or not math.isfinite(v) or v <= 0:
            raise ValueError(f"grad_scale: expected a finite number > 0 or None, got {grad_scale!r}")
        grad_scale = 1.0 / v
    check_flag("new_step", new_step)
    check_flag("update_weights", update_weights)
    if not isinstance(params, (list, tuple)):   # a generator is read once, by the plan's key or by the checks
        try:
            params = list(params)
        except TypeError:
            raise TypeError(f"params: expected a sequence of parameters of this optimizer, got "
                            f"{type(params).__name__}") from None
    if update_weights:
        finite = optimizer._plans.try_step_params(optimizer, params, grad_scale, new_step, grad_scale is not None)
        if finite is not None:
            return finite
    return run(optimizer, prepare_subset(optimizer, params), grad_scale, checked=False, new_step=new_step,
               force_check=grad_scale is not None, update_weights=update_weights,
               keep_plan=update_weights, subset=params)


def run(optimizer: LowpOptimizer, todo: list[Checked], inv_scale: float | None, checked: bool, new_step: bool,
        force_check: bool = False, update_weights: bool = True, keep_plan: bool = False,
        subset: Sequence[torch.Tensor] | None = None, agreed: list[bool] | None = None) -> bool:
    """Step the checked ``todo`` (:func:`prepare`): the non-finite policy (skipped when the
    gradients are ``checked`` already; ``force_check`` skips non-finite ones even with
    ``nonfinite="off"``), with the missing states of the parameters this rank found finite made
    before the flags are agreed over the ranks (:func:`finite_flags`: running out of memory there
    makes every rank of the agreement raise, none waits in a later collective), taken back on any
    error before the plan is made and for the parameters another rank's flags skip. A step that
    makes no agreement (``nonfinite="off"``, gradients ``checked`` by a GradScaler, flags
    ``agreed`` by a cached plan) makes them without one, so there such a failure still leaves the
    other ranks waiting. Then a :class:`StepPlan` (nothing written) and its
    :meth:`~StepPlan.execute` (the writes, with Ctrl-C held until they are done). ``keep_plan``:
    keep the plan for the next steps (:meth:`lowp.optim.cached_step.Plans.after_full_step`), of a
    whole ``step()`` or of ``step_params(subset)``. ``agreed``: the non-finite flags of ``todo``,
    already agreed over the ranks by a cached plan (:meth:`~lowp.optim.cached_step.Plans.try_step`),
    so no second check or collective. Returns whether every checked gradient was finite."""
    if subset is None:
        optimizer._plans.drop()
    params = [t.param for t in todo]
    grads = [sharding.local_grad(p) for p in params]
    if agreed is not None and len(agreed) != len(todo):
        raise RuntimeError(f"step: {len(agreed)} agreed non-finite flags for {len(todo)} parameters with a gradient")
    made = _Undo()   # the states made for this step, taken back unless it plans them

    def make_states(flags: list[bool]) -> None:
        if optimizer.nonfinite == "skip_step" and not all(flags):
            return   # this rank skips the step: nothing to make
        for t, ok in zip(todo, flags):
            if ok:
                made.remember(optimizer.state, t.param, t.mode)
                optimizer.init_state(t.group, t.param, t.mode, t.coded)
    try:
        if agreed is not None or checked:
            finite = agreed if agreed is not None else [True] * len(todo)
            make_states(finite)
        else:   # the states made before the flags' agreement: a failure reaches every rank in it
            finite = optimizer._finite_flags(grads, params, force_check, make_states)
        if not all(finite) and optimizer.nonfinite == "skip_step":
            made.restore(optimizer.state)
            optimizer.skipped_steps += 1
            return False
        made.restore(optimizer.state, [p for p, ok in zip(params, finite) if not ok])   # skipped on another rank
        plan = StepPlan(optimizer, [(t, g) for t, g, ok in zip(todo, grads, finite) if ok])
    except BaseException:
        made.restore(optimizer.state)
        raise
    with deferred_interrupts():
        plan.execute(inv_scale, new_step, update_weights)
        optimizer.skipped_params += finite.count(False)
    if keep_plan and all(finite):
        optimizer._plans.after_full_step(optimizer, plan, subset)
    return all(finite)


class StepPlan:
    """The jobs of one step: the parameters of one group, mode, step count, dtype, device, state
    names, diagnostics share (:class:`~lowp.optim.sharding.Share`) and coded states run together.
    Each job, keyed by those (the group by its id and the mode by its name), has its slices (each
    with the flat block scales of its coded states), its coded states and the states whose
    counters advance with it;
    gathered DTensor steps are written back with their states and counts after all jobs.

    Planning creates missing states and buffers (zeros, or a mode switch's folded buffer) and
    makes coded states contiguous; it writes no weight, state value or counter that a step reads,
    and on any error (a failed gather, an interrupt) puts every state entry and folded weight
    back as it was.

    Args:
        optimizer: the optimizer to step.
        todo: its checked parameters (:func:`prepare`) with finite gradients, each with its local
            gradient.
    """

    def __init__(self, optimizer: LowpOptimizer, todo: list[tuple[Checked, torch.Tensor]]) -> None:
        self.optimizer = optimizer
        self.jobs: dict[tuple, list[ParamSlice]] = defaultdict(list)
        self.counters: dict[tuple, dict[int, dict[str, Any]]] = defaultdict(dict)   # parameter id -> state
        self.gathered: list[tuple[sharding.Gathered, dict[str, Any], int]] = []
        undo = _Undo()
        try:
            requests: list[sharding.SliceRequest] = []
            kept: list[tuple[dict[str, Any], tuple[str, ...]]] = []   # each one's state and state names
            for (group, p, mode, param_id, p_coded), grad in todo:
                undo.remember(optimizer.state, p, mode)
                state = optimizer.init_state(group, p, mode, p_coded)
                names = optimizer.state_names(group, p)
                for c in p_coded:   # the coded step addresses codes and scales flat
                    for entry in (c.name, scale_name(c.name)):
                        if not sharding.local(state[entry]).is_contiguous():
                            state[entry] = _contiguous(state[entry])
                requests.append((p, grad, {n: state[n] for n in names},
                                 state.get(mode.buffer_name) if mode.buffer_name else None, param_id,
                                 {c.name: state[scale_name(c.name)] for c in p_coded}))
                kept.append((state, names))
            made = sharding.make_slices(requests, optimizer.elementwise,   # the gathers
                                        sharded_sums.min_numel(cast(sharded_sums.SumsOptimizer, optimizer)))
            for ((group, p, mode, _, p_coded), _), (state, names), (piece, share, full) in zip(todo, kept, made):
                step = state["step"] + 1
                # one job per kind of storage: a group may hold parameters below coded_min_numel
                key = (id(group), mode.name, step, p.dtype, p.device, names, share, tuple(p_coded))
                self.jobs[key].append(piece)
                if full is None:
                    self.counters[key][piece.param_id] = state
                else:
                    self.gathered.append((full, state, step))
        except BaseException:
            undo.restore(optimizer.state)
            raise

    def execute(self, inv_scale: float | None, new_step: bool, update_weights: bool = True) -> None:
        """Run the jobs (:meth:`run_jobs`), then write the gathered copies back
        (:meth:`write_back`): weights, states and counters always agree, parameter by parameter."""
        self.run_jobs(inv_scale, new_step, update_weights)
        self.write_back()

    @property
    def all_gathered(self) -> bool:
        """Whether every parameter is stepped on gathered copies: :meth:`run_jobs` then writes
        nothing of the optimizer's own tensors, and an error in it changes nothing."""
        return not any(self.counters.values())

    def run_jobs(self, inv_scale: float | None, new_step: bool, update_weights: bool = True) -> None:
        """Run the jobs on the optimizer's backend (a states-only step: on the ``foreach``
        reference pipeline), every one prepared first (:meth:`~lowp.optim.backends.Backend.prepare`:
        a kernel's build, load or argument check that fails changes nothing), those of gathered
        copies only run first. Each parameter's step counter
        advances right after the job that wrote its weight and states (when a job fails part-way,
        those of the parameters it stepped whole, ``ctx.stepped``: the reference pipeline puts
        the others back, :mod:`lowp.optim.journal`); a gathered DTensor
        parameter's job writes its gathered copies only, whose shards and counter
        :meth:`write_back` writes."""
        optimizer = self.optimizer
        backend = optimizer.backend if update_weights else get_backend("foreach", optimizer.backend.chunk_size)
        groups = {id(g): (i, g) for i, g in enumerate(optimizer.param_groups)}
        # every job prepared (admitted, its kernels built, loaded and checked, its launches staged)
        # before the first writes, a failure told to the other ranks of the sums' exchange; the
        # jobs of gathered copies run first: an error in one of them (out of memory on the full
        # copies) comes before any write of the optimizer's own tensors
        jobs = []
        sharded: list[tuple[StepContext, list[ParamSlice]]] = []
        for key, slices in sorted(self.jobs.items(), key=lambda job: bool(self.counters.get(job[0]))):
            gid, mode_name, step, _, _, _, _, coded = key
            index, group = groups[gid]
            # a job of gathered copies only: a failure writes nothing of the optimizer's own, no journal
            ctx = StepContext(group, MODES[mode_name], step, inv_scale, optimizer.seed,
                              optimizer.diagnostics_enabled and update_weights, update_weights=update_weights,
                              coded=coded, stepped=set() if self.counters.get(key) else None)
            jobs.append((key, index, ctx, slices))
            if update_weights and any(s.tensor_sum is not None for s in slices):
                sharded.append((ctx, slices))
        prepared = []
        failure = None
        try:
            for key, index, ctx, slices in jobs:
                prepared.append((key, index, sum(s.numel for s in slices), ctx.stepped,
                                 backend.prepare(optimizer, ctx, slices)))
        except Exception as exc:   # told to the ranks of the sums' exchange, which then raises it
            failure = exc
        del jobs
        # the shards' sums, read only (a states-only step discards the update that reads them)
        try:
            sharded_sums.exchange(cast(sharded_sums.SumsOptimizer, optimizer), sharded, failed=failure)
        finally:
            failure = None   # the raised error's traceback holds this frame: no cycle keeps the prepared jobs alive
        del sharded   # no context outlives its job's call (its scratch buffers)
        if new_step and update_weights:
            optimizer._last_stalled = {}
        done = 0   # the optimizer's own parameters stepped so far (not those of gathered copies)
        while prepared:   # each call dropped once run: its context's scratch buffers go with it
            key, index, numel, stepped, call = prepared.pop(0)
            step, share = key[2], key[6]
            try:
                stalled = call()
            except BaseException as exc:   # those it stepped whole count the step, the others are as they were
                for param_id, state in self.counters[key].items():
                    if param_id in (stepped or ()):
                        state["step"] = step
                        done += 1
                note_stepped(exc, done, sum(map(len, self.counters.values())))
                raise
            for state in self.counters[key].values():
                state["step"] = step
            done += len(self.counters[key])
            if update_weights:
                optimizer._last_stalled.setdefault(index, []).append((stalled, numel, share))

    def write_back(self) -> None:
        """Each gathered DTensor parameter's shards of its stepped copies (weight, states,
        buffer) into its local tensors, then its step counter."""
        for full, state, step in self.gathered:
            full.write_back()
            state["step"] = step
