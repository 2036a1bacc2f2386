"""A step plan kept across steps: a fused kernel's launches prepared once, reused while nothing
they rely on changed.

A full step (:mod:`lowp.optim.step_plan`) checks every parameter, gradient, state and buffer,
plans the jobs and admits each slice into a kernel: tens of microseconds of Python per tensor,
the whole step on a model of many small tensors. After a full step whose every slice took the
kernel of a backend that keeps plans (``native``, ``triton``: :attr:`Kernel.keeps_plans
<lowp.optim.kernels.kernel.Kernel.keeps_plans>`), :meth:`CachedStep.build` keeps what that step
established: per job its prepared launches (:class:`~lowp.optim.kernels.native.kernel.Launch`:
entry point, pointer tables, sizes, parameter ids, coded scales;
:class:`~lowp.optim.kernels.triton.kernel.TritonLaunch`: the same tables on the device and the
block map), and a *signature* of everything the checks read. The next ``step()`` compares the
signature (:meth:`CachedStep.matches`) and, when it holds, runs the launches with the new
gradients: one call per variant, the non-finite check folded into it
(``nonfinite="skip_param"``: a tensor with a NaN or infinity in its gradient is left untouched;
``"skip_step"``: nothing is written; on the GPU a check kernel before the step kernel and one
read of its flags), and the stream keys made by the kernel (native) or in one vectorized pass
on the host (Triton).

``step_params`` (gradient release steps one parameter at a time) keeps a plan per parameter
list (:class:`Plans`), whose signature checks the listed parameters at their places in the
groups and the groups holding them instead of every group.

DTensor parameters (FSDP2, tensor parallel) take a plan too when the kernel stepped each one's
whole local box as one contiguous range of the global tensor (a ``Shard(0)`` shard, a replica;
an empty shard needs no launch: its step count advances with its job's) and its gradient is a
DTensor placed like it: the plan keeps the local tensors and the boxes'
offsets (the random streams). Their non-finite check must agree over the ranks, as a full
step's does (:func:`lowp.optim.collectives.agree`): each step checks the local gradients first and
all-reduces the flags, in the order of the parameters in the groups, the same collective a
full step makes (the DTensor parameters' step counts compared in it), so ranks whose plans hold
and ranks taking a full step agree; only when every flag holds does the kernel run (without its
own check). A skipped step is skipped here; a
parameter to skip hands the step, with the agreed flags, to a full step (:meth:`Plans.try_step`).

A per-tensor optimizer's shards whose sums a full step exchanges (StableAdamW under FSDP2,
:mod:`lowp.optim.sharded_sums`) take a plan too: the plan keeps each such slice without its
gradient and the kernel's pre-pass over them prepared, and each step, after the flags' agreement
and the remainder's gathers, exchanges the sums with the new gradients
(:meth:`CachedStep.exchange_sums`: the kept pre-pass makes the pieces, one exchange per mesh),
which the launches then read, as a full step does.

The DTensor parameters a full step gathers (a per-tensor optimizer's below the exchange's
threshold or with shards that are not contiguous ranges; block-scaled states of a
parameter whose shards split blocks, replicated by :func:`lowp.optim.sharding.coded_placements`)
are the plan's *remainder*: each step from the plan takes their full step too
(:class:`lowp.optim.step_plan.Remainder`): their checks, then the flags of all parameters agreed
in one collective, then their gathers (one all-gather, :func:`lowp.optim.sharding.gather_many`),
the collectives of a full step in its order; then their step on the gathered copies, the plan's
launches, and last the copies' shards written back, so that an error in their step (out of
memory) comes before any write. A plan is kept only when it holds at least one parameter of its own.

The signature, compared before anything is written (any difference: the full step, which
checks again and builds a new plan):

- the optimizer: its ``state`` mapping, ``param_groups`` and backend objects, and whether it
  keeps diagnostics (the kernel variants that count stalled elements);
- each group: its parameters (the same objects), and every option that is not a float (mode,
  state dtypes, block size, rounding, ...) and the spec's switches, equal; the floats (learning
  rate, weight decay, ...) are read anew and checked (``check_group``) every step;
- each stepped parameter, state, buffer and block-scale tensor: the same object (a DTensor:
  holding the same local tensor, ``_local_tensor``, and a parameter its layout, ``_spec``), at the same
  data pointer, on a storage of the same size (a storage freed and allocated again may return
  at the same address), with the same dtype, shape and version counter (``set_``, ``resize_``
  or ``as_strided_`` bump it; the kernels write without bumping it), and the step count
  the plan advanced it to;
- which parameters have a gradient, and for each gradient (a new tensor every step after
  ``zero_grad()``): a plain tensor on its parameter's device, strided and contiguous, with the
  dtype and shape of the plan, aligned, inside its storage, on a storage the step does not write
  (a DTensor parameter's: a DTensor with its parameter's mesh, placements and shape, whose local
  tensor is such a tensor).

Values never enter the signature: a step reads them, and a weight changed in place under
``torch.no_grad()`` only bumps its version counter (the next step then plans anew).
"""
from __future__ import annotations

import operator
from dataclasses import replace
from itertools import repeat
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeGuard, cast

import torch

from lowp.interrupts import deferred_interrupts
from lowp.optim import backends, collectives, sharded_sums, sharding
from lowp.optim.backends import FusedBackend
from lowp.optim.codes import scale_name
from lowp.optim.kernels import coded_slices
from lowp.optim.kernels.checks import Span, overlapping
from lowp.optim.kernels.kernel import CHECKS, Kernel, KernelLaunch, PiecesLaunch, gradient_factor
from lowp.optim.ordered_sum import Runs
from lowp.optim.slices import ParamSlice, StepContext, TensorSum
from lowp.optim.spec import OptimizerSpec
from lowp.optim.journal import note_stepped
from lowp.optim.stalled import Stalled, of_job
from lowp.optim.writeback import MODES

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class LowpOptimizer(backends.LowpOptimizer, Protocol):
    """What a cached plan reads and writes of the optimizer (:class:`lowp.optim.base.LowpOptimizer`)."""

    param_groups: list[dict[str, Any]]
    state: Any
    backend: Any
    seed: int
    nonfinite: str
    diagnostics_enabled: bool
    skipped_params: int
    skipped_steps: int
    _last_stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]]

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyper-parameters."""


class StepPlan(Protocol):
    """What a cached plan reads of a full step's plan (:class:`lowp.optim.step_plan.StepPlan`)."""

    jobs: dict[tuple, list[ParamSlice]]   # keyed by (group id, mode, step, dtype, device, names, share, coded)
    counters: dict[tuple, dict[int, dict[str, Any]]]   # per job: parameter id -> its state
    gathered: list[Any]

class Remainder(Protocol):
    """The full step of the parameters a plan leaves out (:func:`lowp.optim.step_plan.step_all`
    makes it): made after their checks, holding their local gradients; :meth:`plan` plans their
    step (gathering their full copies: collectives) without writing anything."""

    grads: list[torch.Tensor]

    def plan(self) -> Executable:
        """The planned full step of the remainder."""


class Executable(Protocol):
    """A planned full step of gathered copies (:class:`lowp.optim.step_plan.StepPlan`)."""

    def run_jobs(self, inv_scale: float | None, new_step: bool, update_weights: bool = True) -> None:
        """Step the gathered copies (nothing of the optimizer's own tensors is written)."""

    def write_back(self) -> None:
        """Write the stepped copies' shards and counters."""


__all__ = ["CachedStep", "Plans", "Remainder", "structure"]

_TENSOR = torch.Tensor
#: a plan's staged launches, per job: (the staged call, its launch, its members' positions)
Staged = list[list[tuple[Callable[[], Stalled], KernelLaunch, list[int]]]]
#: a kept slice's gradient between steps: none (a plan never holds a step's gradient)
_NO_GRAD = torch.empty(0)
_TENSOR_TYPE = {torch.Tensor}
_STRIDED_LAYOUT = {torch.strided}
# property and method readers for the signature's maps (:meth:`CachedStep.matches`)
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_LAYOUT = operator.attrgetter("layout")
_VERSION = operator.attrgetter("_version")
_STEP = operator.itemgetter("step")
_GET_DEVICE = torch.Tensor.get_device
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_NEG = torch.Tensor.is_neg
_DATA_PTR = torch.Tensor.data_ptr
_STORAGE_OFFSET = torch.Tensor.storage_offset
_UNTYPED_STORAGE = torch.Tensor.untyped_storage
_NBYTES = torch.UntypedStorage.nbytes
_STORAGE_PTR = torch.UntypedStorage.data_ptr
# a DTensor's own fields (torch.distributed.tensor.DTensor's __slots__): read as attributes, so a
# signature check is one C loop over the DTensors; public ``to_local()`` returns a fresh view of a
# parameter's local tensor at every call (torch >= 2.12)
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")
_PLACEMENTS = operator.attrgetter("placements")
_MESH = operator.attrgetter("device_mesh")


def _plain(t: Any) -> bool:
    """A plain tensor (or parameter): its memory is its own storage."""
    return type(t) is _TENSOR or type(t) is torch.nn.Parameter


def _target(owner: torch.Tensor, s: ParamSlice) -> torch.Tensor | None:
    """The tensor a plan writes for slice ``s`` of parameter ``owner``, when ``s`` is all of it:
    ``owner`` itself (a plain parameter), or the local tensor of a DTensor parameter whose
    gradient is a DTensor placed like it (the slice aliasing the local tensor whole); else
    ``None`` (a chunk, a gathered or redistributed step: no plan)."""
    if _plain(owner):
        return owner if s.param is owner and s.index.first() == 0 else None
    grad = owner.grad
    if not (_exact_dtensor(owner) and _exact_dtensor(grad)):
        return None
    local = owner._local_tensor
    if not _plain(local) or s.param.data_ptr() != local.data_ptr() or s.param.shape != local.shape \
            or s.numel != local.numel() or tuple(grad.placements) != tuple(owner.placements) \
            or not _same_mesh(grad.device_mesh, owner.device_mesh) or s.grad is not grad._local_tensor:
        return None
    return local


def _same_mesh(a: Any, b: Any) -> bool:
    """Device meshes ``a`` and ``b`` lay out the same ranks alike: the same object (FSDP2 makes a
    gradient with its parameter's mesh), or an equal one (``DeviceMesh.__eq__``: the same ranks,
    shape, dimension names and device type; a mesh made again in the same process, whose
    DTensors then carry another object)."""
    return a is b or a == b


def _local_of(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor a kernel reads for the state ``t``: ``t`` (plain) or a DTensor's local
    tensor; ``None`` for anything else."""
    if _plain(t):
        return t
    if _exact_dtensor(t) and _plain(t._local_tensor):
        return t._local_tensor
    return None


def _exact_dtensor(t: object) -> TypeGuard[DTensor]:
    """``t`` is a DTensor, not a subclass of one (whose fields a plan could not know)."""
    return type(t) is sharding.dtensor_type()


def _frozen(value: Any) -> Any:
    """``value`` as a hashable, comparable snapshot (dicts and lists by content)."""
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _frozen(v)) for k, v in value.items()), key=operator.itemgetter(0)))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


def structure(spec: OptimizerSpec | None, group: dict[str, Any]) -> tuple[Any, ...]:
    """What of ``group`` a step plan relies on: every option but ``params`` that is not a float
    (or a tensor: the hyper-parameters a step reads anew, learning rate, betas' entries, ...),
    integers included (``state_block`` sets the coded states' layout), and the spec's variant
    (state names and switches, which may depend on numbers: a weight decay of 0 or not)."""
    options = tuple((k, _frozen(v)) for k, v in group.items()
                    if k != "params" and not isinstance(v, (float, torch.Tensor)))
    return options, spec.variant(group) if spec is not None else None


class _Job:
    """One job of the plan: its group, mode, coded states and step, its launches (each with the
    positions of its members among the plan's stepped parameters), the positions of its empty
    members (an empty shard: no launch, its step count advances with the job's), the
    diagnostics entry, and its shards whose whole-tensor sums each step exchanges (``sums``: each
    one's position and its slice without a gradient, whose :class:`~lowp.optim.slices.TensorSum`
    its launch reads) with the kernel's passes making their pieces (``pieces``: each with its
    members' positions; ``None`` for a kernel without such a pass)."""

    def __init__(self, group: dict[str, Any], index: int, mode: str, coded: tuple, step: int, share: sharding.Share,
                 launches: list[tuple[KernelLaunch, list[int]]], numel: int, empty: list[int],
                 sums: list[tuple[int, ParamSlice]], pieces: list[tuple[PiecesLaunch, list[int]]] | None) -> None:
        self.group, self.index, self.mode, self.coded, self.step = group, index, mode, coded, step
        self.share, self.launches, self.numel, self.empty, self.sums = share, launches, numel, empty, sums
        self.pieces = pieces


class CachedStep:
    """The plan of the last full step, kept for the next ones (module docstring).

    Made by :meth:`build`; :meth:`run` takes a step from it when :meth:`matches` holds.

    Args:
        optimizer: the optimizer whose step it plans (its state, groups and backend are kept).
        kernel: the fused kernel of its backend (one that keeps plans).
        spec: the optimizer's spec.
        jobs: the jobs, each with its launches.
        stepped: the parameters stepped, in the order of the launches' member positions.
        targets: the tensor the kernel writes for each: the parameter, or a DTensor's local tensor.
        states: their state entries (whose ``"step"`` each step advances).
        owned: (state entry, name, tensor) of every state, buffer and block-scale tensor read
            (plain, or DTensors whose local tensors the kernel reads).
        grad_dtypes: each stepped parameter's gradient dtype (which chose its variant).
        subset: the parameters of a ``step_params`` call (gradient release) whose plan this is,
            in their order; default ``None``: a whole ``step()``'s plan.
        remainder: the DTensor parameters of a whole step's plan that each step takes in full,
            gathered (their shards split the blocks of their block-scaled states, or a per-tensor
            optimizer's), in the order of the groups; default none.
    """

    def __init__(self, optimizer: LowpOptimizer, kernel: Kernel, spec: OptimizerSpec, jobs: list[_Job],
                 stepped: list[torch.Tensor], targets: list[torch.Tensor], states: list[dict[str, Any]],
                 owned: list[tuple[dict, str, torch.Tensor]], grad_dtypes: list[torch.dtype],
                 subset: list[torch.Tensor] | None = None, remainder: Sequence[torch.Tensor] = ()) -> None:
        self.kernel, self.spec, self.jobs, self.subset = kernel, spec, jobs, subset
        self.state_map, self.groups, self.backend = optimizer.state, optimizer.param_groups, optimizer.backend
        self.count = optimizer.diagnostics_enabled
        self.group_params = [list(g["params"]) for g in self.groups]
        self.structures = [structure(spec, g) for g in self.groups]
        self.group_sizes = [len(g["params"]) for g in self.groups]
        if subset is not None:   # each parameter's place (group, index), which fixes its position over all groups
            where = {id(p): (gi, i) for gi, g in enumerate(self.groups) for i, p in enumerate(g["params"])}
            self.places = [where[id(p)] for p in subset]
            self.involved = [(self.groups[gi], self.structures[gi]) for gi in sorted({gi for gi, _ in self.places})]
        self.all_params = list(subset) if subset is not None else [p for g in self.groups for p in g["params"]]
        self.has_grad = [p.grad is not None for p in self.all_params]
        self.stepped, self.targets, self.states = stepped, targets, states
        self.steps = [st["step"] for st in states]
        self.shapes = [t.shape for t in targets]
        self.numels = [t.numel() for t in targets]
        self.owned_states = [st for st, _, _ in owned]
        self.owned_names = [name for _, name, _ in owned]
        self.owned_tensors = [t for _, _, t in owned]
        self.state_values = list(optimizer.state.values())
        self.grad_dtypes = grad_dtypes
        self.grad_devices = [t.get_device() for t in targets]   # -1: the CPU
        self.grad_sizes = [d.itemsize for d in grad_dtypes]
        self.grad_align = [size - 1 for size in self.grad_sizes]   # a pointer's low bits that must be 0
        self.dtypes = [t.dtype for t in targets]
        place = {id(p): i for i, p in enumerate(self.all_params)}
        self.stepped_at = [place[id(p)] for p in stepped]   # in the launches' order (jobs), not the groups
        self.remainder = list(remainder)
        self.remainder_meshes = [cast("DTensor", p).device_mesh for p in self.remainder]
        self.remainder_placements = [tuple(cast("DTensor", p).placements) for p in self.remainder]
        # the positions of the stepped parameters, then the remainder's, in the order of the groups
        # (the non-finite flags' all-reduce, which a full step makes over them all)
        self.remainder_at = [place[id(p)] for p in self.remainder]
        flagged = self.stepped_at + self.remainder_at
        self.group_order = sorted(range(len(flagged)), key=flagged.__getitem__)
        agreed = [[*stepped, *self.remainder][i] for i in self.group_order]
        self.agreement = collectives.agreement(agreed)
        # their states, whose step counts the agreement compares (a DTensor parameter's only, as a full step)
        self.counted = [optimizer.state[p] if not _plain(p) else None for p in agreed]
        # DTensors (parameters, states): each keeps its local tensor; a parameter its layout too
        # (its box picks the random streams; a state's layout is read by nothing the plan runs)
        self.wrappers = [t for t in (*stepped, *self.owned_tensors) if not _plain(t)]
        self.wrapped_locals = list(map(_LOCAL_TENSOR, self.wrappers))
        # the stepped DTensor parameters' positions, and what their gradients must be placed as
        self.sharded = [i for i, p in enumerate(stepped) if not _plain(p)]
        sharded = [cast("DTensor", stepped[i]) for i in self.sharded]
        self.specs = list(map(_SPEC, sharded))
        self.grad_placements = [tuple(p.placements) for p in sharded]
        self.grad_meshes = [p.device_mesh for p in sharded]
        self.global_shapes = [p.shape for p in sharded]
        local_tensors = [t if _plain(t) else cast("DTensor", t)._local_tensor for t in self.owned_tensors]
        self.tensors = targets + local_tensors   # every planned tensor (pointers, versions, sizes)
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.versions = [t._version for t in self.tensors]
        self.nbytes = [t.untyped_storage().nbytes() for t in self.tensors]
        # the storages the kernels write (an empty tensor's is never written: it may have no memory)
        self.written = {t.untyped_storage().data_ptr() for t in self.tensors if t.numel()}
        self.grad_empty = [not n for n in self.numels]   # an empty gradient may have no address
        self.total = sum(self.numels)
        self.calls = sum(len(job.launches) for job in jobs)
        # skip_step checks every gradient before the first write unless one call does all the
        # writing: an empty member's step count advances without a call, maybe before the call
        self.check_first = self.calls > 1 or any(job.empty for job in jobs)
        self.taken = 0

    @classmethod
    def build(cls, optimizer: LowpOptimizer, plan: StepPlan,
              subset: list[torch.Tensor] | None = None) -> CachedStep | None:
        """The cached plan of ``plan``, a full step just executed (of the ``step_params`` call over
        ``subset``, when given, whose parameters are plain), when every slice of it is a whole
        parameter of the groups (a plain one, or a DTensor's whole local tensor with a gradient
        placed like it: :func:`_target`) with plain or DTensor states (:func:`_local_of`), that took
        a kernel that keeps plans (no reference pipeline); else ``None``. The gathered DTensor
        parameters of a whole step's plan are its remainder, stepped in full by every step that
        takes the plan, once at least one parameter is planned. Never raises: a plan that cannot
        be made is no plan (the step it follows is done)."""
        try:
            return cls._build(optimizer, plan, subset)
        except Exception:   # noqa: BLE001 - only an optimization: the next step is a full one
            return None

    @classmethod
    def _build(cls, optimizer: LowpOptimizer, plan: StepPlan, subset: list[torch.Tensor] | None
               ) -> CachedStep | None:
        backend = optimizer.backend
        gathered = {id(full.param) for full, _, _ in plan.gathered}
        if not (type(backend) is FusedBackend and backend.kernel.keeps_plans) or (gathered and subset is not None):
            return None
        spec = optimizer.kernel_spec()
        if spec is None or not backend.kernel.supports(spec):
            return None
        groups = {id(g): (i, g) for i, g in enumerate(optimizer.param_groups)}
        flat = [p for g in optimizer.param_groups for p in g["params"]]   # a slice's param_id is its place here
        stepped: list[torch.Tensor] = []
        targets: list[torch.Tensor | None] = []
        states: list[dict[str, Any]] = []
        owned: list[tuple[dict, str, torch.Tensor]] = []
        grad_dtypes: list[torch.dtype] = []
        jobs = []
        for key, slices in plan.jobs.items():
            gid, mode, step, _, _, _, share, coded = key
            index, group = groups[gid]
            if not all(0 <= s.param_id < len(flat) for s in slices):
                return None
            slices = [s for s in slices if id(flat[s.param_id]) not in gathered]   # the remainder's
            if not slices:
                continue
            if len(plan.counters[key]) != len(slices):
                return None
            owners = [flat[s.param_id] for s in slices]
            made = [_target(p, s) for p, s in zip(owners, slices)]
            if any(t is None for t in made) or (subset is not None and not all(map(_plain, owners))):
                return None
            ctx = StepContext(group, MODES[mode], step, None, optimizer.seed, optimizer.diagnostics_enabled,
                              coded=coded)
            live = [s for s in slices if s.numel]   # an empty shard (rows fewer than ranks) needs no launch
            launches = _launches(backend.kernel, spec, ctx, live) if live else []
            if launches is None:
                return None
            first = len(stepped)
            position = {id(s): first + j for j, s in enumerate(slices)}
            for s, state, owner, target in zip(slices, plan.counters[key].values(), owners, made):
                names = [*s.states, *(n for n in (MODES[mode].buffer_name,) if n),
                         *(scale_name(c.name) for c in coded)]
                if not all(_local_of(state[name]) is not None for name in names) \
                        or optimizer.state.get(owner) is not state:
                    return None
                stepped.append(owner)
                targets.append(target)
                states.append(state)
                grad_dtypes.append(s.grad.dtype)
                owned.extend((state, name, state[name]) for name in names)
            summed = [s for s in live if s.tensor_sum is not None]
            passes = backend.kernel.pieces_launches(spec, ctx, summed) if summed else []
            jobs.append(_Job(group, index, mode, coded, step, share,
                             [(launch, [position[id(s)] for s in part]) for launch, part in launches],
                             sum(s.numel for s in slices), [position[id(s)] for s in slices if not s.numel],
                             [(position[id(s)], replace(s, grad=_NO_GRAD)) for s in slices
                              if s.tensor_sum is not None],
                             None if passes is None else [(call, [position[id(s)] for s in part])
                                                          for call, part in passes]))
        remainder = [p for p in flat if id(p) in gathered]
        if (gathered and not jobs) or len(remainder) != len(gathered) or not all(map(_exact_dtensor, remainder)):
            return None
        return cls(optimizer, backend.kernel, spec, jobs, stepped, cast(list[torch.Tensor], targets), states, owned,
                   grad_dtypes, subset, remainder)

    def matches(self, optimizer: LowpOptimizer) -> list[torch.Tensor] | None:
        """The gradients of the stepped parameters when the signature holds (module docstring),
        else ``None``. Checks each group's numbers (``check_group``), which raises as a full
        step would."""
        groups = self.groups
        if optimizer.state is not self.state_map or optimizer.param_groups is not groups \
                or optimizer.backend is not self.backend or optimizer.diagnostics_enabled != self.count \
                or [len(g["params"]) for g in groups] != self.group_sizes:
            return None
        if self.subset is None:
            for group, params, shape in zip(groups, self.group_params, self.structures):
                if not all(map(operator.is_, group["params"], params)):
                    return None
                optimizer.check_group(group)
                if structure(self.spec, group) != shape:
                    return None
        else:   # the parameters at their places (their positions pick their random streams), their groups
            if not all(groups[gi]["params"][i] is p for (gi, i), p in zip(self.places, self.subset)):
                return None
            for group, shape in self.involved:
                optimizer.check_group(group)
                if structure(self.spec, group) != shape:
                    return None
        every = list(map(_GRAD, self.all_params))
        if list(map(operator.is_not, every, repeat(None))) != self.has_grad:
            return None
        grads = list(map(every.__getitem__, self.stepped_at))
        if self.remainder:   # DTensor gradients placed like their parameters: local tensors without a collective
            rest = list(map(every.__getitem__, self.remainder_at))
            if set(map(type, rest)) != {sharding.dtensor_type()} \
                    or list(map(_PLACEMENTS, rest)) != self.remainder_placements \
                    or not all(map(_same_mesh, map(_MESH, rest), self.remainder_meshes)):
                return None
        wrappers = self.wrappers
        if wrappers and not all(map(operator.is_, map(_LOCAL_TENSOR, wrappers), self.wrapped_locals)):
            return None
        if self.sharded:   # DTensor gradients placed like their parameters: their local tensors
            if not all(map(operator.is_, map(_SPEC, map(self.stepped.__getitem__, self.sharded)), self.specs)):
                return None
            dgrads = list(map(grads.__getitem__, self.sharded))
            if set(map(type, dgrads)) != {sharding.dtensor_type()}:
                return None
            # FSDP2 makes each gradient with its parameter's own spec (mesh, placements, shape)
            if not all(map(operator.is_, map(_SPEC, dgrads), self.specs)) \
                    and (list(map(_PLACEMENTS, dgrads)) != self.grad_placements
                         or not all(map(_same_mesh, map(_MESH, dgrads), self.grad_meshes))
                         or list(map(_SHAPE, dgrads)) != self.global_shapes):
                return None
            for i, g in zip(self.sharded, map(_LOCAL_TENSOR, dgrads)):
                grads[i] = g
        # each property read over all gradients in one map (a C loop): the checks of a full step's
        # admission cost a tenth of their per-tensor form here
        if set(map(type, grads)) != _TENSOR_TYPE or set(map(_LAYOUT, grads)) != _STRIDED_LAYOUT \
                or list(map(_DTYPE, grads)) != self.grad_dtypes or list(map(_GET_DEVICE, grads)) != self.grad_devices \
                or list(map(_SHAPE, grads)) != self.shapes or not all(map(_IS_CONTIGUOUS, grads)) \
                or any(map(_IS_NEG, grads)):
            return None
        starts = list(map(_DATA_PTR, grads))
        storages = list(map(_UNTYPED_STORAGE, grads))
        ends = map(operator.mul, map(operator.add, map(_STORAGE_OFFSET, grads), self.numels), self.grad_sizes)
        if not all(map(operator.or_, starts, self.grad_empty)) or any(map(operator.and_, starts, self.grad_align)) \
                or not all(map(operator.le, ends, map(_NBYTES, storages))) \
                or not self.written.isdisjoint(map(_STORAGE_PTR, storages)):
            return None
        if self.subset is None:
            values = self.state_values
            if len(optimizer.state) != len(values) or not all(map(operator.is_, optimizer.state.values(), values)):
                return None
        elif not all(map(operator.is_, map(optimizer.state.get, self.stepped), self.states)):
            return None
        try:
            entries = list(map(operator.getitem, self.owned_states, self.owned_names))
            steps = list(map(_STEP, self.states))
        except KeyError:
            return None
        targets = self.targets
        if not all(map(operator.is_, entries, self.owned_tensors)) or steps != self.steps \
                or list(map(_DTYPE, targets)) != self.dtypes or list(map(_SHAPE, targets)) != self.shapes:
            return None
        tensors = self.tensors
        if list(map(_DATA_PTR, tensors)) != self.ptrs or list(map(_VERSION, tensors)) != self.versions \
                or list(map(_NBYTES, map(_UNTYPED_STORAGE, tensors))) != self.nbytes:
            return None
        return cast(list[torch.Tensor], grads)   # each checked to be a tensor above

    def agreed_flags(self, optimizer: LowpOptimizer, grads: list[torch.Tensor], checked: bool,
                     rest: Sequence[torch.Tensor] = ()) -> list[bool] | None:
        """The finite flags of ``grads`` (from :meth:`matches`) and of the remainder's local
        gradients ``rest`` agreed over the ranks (:func:`lowp.optim.collectives.agree_by`), in the
        order of the parameters in the groups, as a full step agrees them
        (:func:`lowp.optim.step_plan.finite_flags`), for a plan with DTensor parameters under a
        non-finite policy whose gradients are not ``checked``; ``None`` for the others (the kernel
        checks its own tensors, :meth:`run`)."""
        if not (self.sharded or self.remainder) or checked or optimizer.nonfinite == "off":
            return None
        def flags() -> list[bool]:
            local = optimizer.backend.finite_flags([*grads, *rest])
            return list(map(local.__getitem__, self.group_order))
        counts = [None if st is None else int(st.get("step", 0)) for st in self.counted]
        return collectives.agree_by(flags, self.agreement, optimizer.nonfinite == "skip_step", counts)

    def exchange_sums(self, optimizer: LowpOptimizer, grads: list[torch.Tensor], inv_scale: float | None,
                      failed: Exception | None = None) -> None:
        """The whole-tensor sums of the plan's shards of a per-tensor optimizer (StableAdamW under
        FSDP2) for the step with ``grads``, at each job's next step: the pieces by the kernel's
        passes the plan keeps (``_Job.pieces``: no admission, layout or pointer table made again;
        the plan's signature holds), exchanged by :func:`lowp.optim.sharded_sums.exchange_pieces`
        (one exchange per mesh: the collectives a full step makes at this point, after the flags
        and the remainder's gathers); for a kernel without such a pass, the kept slices with
        their new gradients through :func:`lowp.optim.sharded_sums.exchange`. Every sum is
        cleared first, so a launch never reads a sum of an earlier step; nothing else is
        written. ``failed``: this rank's error in staging the step (out of memory), raised after
        the exchange told it to the other ranks (here and now without sums to exchange)."""
        summed = [job for job in self.jobs if job.sums]
        if not summed:
            if failed is not None:
                try:
                    raise failed
                finally:   # the traceback holds this frame: no reference cycle through it
                    failed = None
            return
        for job in summed:
            for _, s in job.sums:
                cast(TensorSum, s.tensor_sum).total = None
        if any(job.pieces is None for job in summed):   # a kernel without a pass: the pieces from torch
            jobs = [(StepContext(job.group, MODES[job.mode], job.step + 1, inv_scale, optimizer.seed, self.count,
                                 coded=job.coded), [replace(s, grad=grads[i]) for i, s in job.sums]) for job in summed]
            try:
                sharded_sums.exchange(cast(sharded_sums.SumsOptimizer, optimizer), jobs, admitted=True, failed=failed)
            finally:
                failed = None
            return
        slices = {i: s for job in summed for i, s in job.sums}
        calls = [(job, call, members) for job in summed for call, members in cast(list, job.pieces)]
        empty = [i for i, s in slices.items() if not s.numel]   # an empty shard's pieces: none

        def make() -> list[Runs]:   # inside the exchange: a rank that fails here still takes part in it
            numbers: dict[tuple[int, int], dict[str, float]] = {}   # per group and step: jobs share them
            made = []
            for job, call, members in calls:
                if (id(job.group), job.step) not in numbers:
                    numbers[id(job.group), job.step] = self.spec.numbers(job.group, job.step + 1)
                made += call.call([grads[i] for i in members], numbers[id(job.group), job.step],
                                  gradient_factor(job.group, inv_scale))
            return made + [Runs.empty()] * len(empty)
        order = [i for _, _, members in calls for i in members] + empty
        try:
            sharded_sums.exchange_pieces([slices[i] for i in order], make, failed)
        finally:
            failed = None

    def _stage(self, grads: list[torch.Tensor], inv_scale: float | None, seed: int, check: int) -> Staged:
        """Every launch of every job staged at its next step count (:meth:`KernelLaunch.stage`: all
        a launch allocates), one list per job of (call, launch, members): a failure here comes
        before the first write and changes nothing."""
        staged = []
        made: dict[tuple[int, int], dict[str, float]] = {}   # the spec's numbers per group and step
        for job in self.jobs:
            step = job.step + 1
            if (id(job.group), step) not in made:
                made[id(job.group), step] = self.spec.numbers(job.group, step)
            factor = gradient_factor(job.group, inv_scale)
            staged.append([(launch.stage([grads[i] for i in members], made[id(job.group), step], factor,
                                         seed, step, check), launch, members)
                           for launch, members in job.launches])
        return staged

    def run(self, optimizer: LowpOptimizer, grads: list[torch.Tensor], inv_scale: float | None,
            checked: bool, new_step: bool = True, force_check: bool = False,
            rest: Executable | None = None) -> tuple[bool, bool]:
        """One step from the plan with ``grads`` (from :meth:`matches`): the exchange of its shards'
        sums (:meth:`exchange_sums`), the remainder's planned full step ``rest`` (gradients
        ``checked`` with them) on its gathered copies, then each job's launches at the next step
        count, then the remainder's write-back, with Ctrl-C held from the exchange until all are
        done (an error in the remainder's step, such as running out of memory on
        its full copies, comes before any write and changes nothing); the non-finite policy as the
        full step applies it (``checked``: the gradients are known to be finite; ``force_check``:
        a non-finite gradient is skipped even under ``nonfinite="off"``, as ``step_params`` with a
        ``grad_scale``). ``new_step``: this step starts the one ``diagnostics()`` reports (else it
        adds to it). A skipped parameter keeps its step count, which ends this plan (its jobs no
        longer agree). Returns (whether every gradient was finite, whether the plan still holds)."""
        policy = "off" if checked else optimizer.nonfinite
        if force_check and policy == "off":
            policy = "skip_param"
        if (rest is None) != (not self.remainder) or (rest is not None and policy != "off"):
            raise RuntimeError("cached step: a plan with a remainder runs it, with gradients checked beforehand")
        check = CHECKS[policy]
        if policy == "skip_step" and self.check_first:   # one call checks its own tensors only
            if not all(optimizer.backend.finite_flags(grads)):
                optimizer.skipped_steps += 1
                return False, True
            check = CHECKS["off"]
        finite = [True] * len(grads)
        staged: Staged = []
        failure = None
        # from the staging on, as a full step: Ctrl-C waits, and every rank that exchanged writes
        with deferred_interrupts():
            try:
                staged = self._stage(grads, inv_scale, optimizer.seed, check)
            except Exception as exc:   # told to the ranks of the sums' exchange, which then raises it
                failure = exc
            try:
                self.exchange_sums(optimizer, grads, inv_scale, failure)
            finally:
                failure = None   # the raised error's traceback holds this frame: no cycle keeps the staging alive
            if rest is not None:
                before = {k: list(v) for k, v in optimizer._last_stalled.items()}
                try:
                    rest.run_jobs(inv_scale, new_step)
                except BaseException:   # nothing else was written; neither are the diagnostics
                    optimizer._last_stalled = before
                    raise
                new_step = False   # the remainder's stalled counts start the step's
            stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]] = \
                {} if new_step else optimizer._last_stalled
            try:
                self._run_staged(staged, check, policy == "skip_step", finite, stalled)
            except BaseException as exc:
                note_stepped(exc, sum(st["step"] != old for st, old in zip(self.states, self.steps)),
                             len(self.states))
                raise
            if policy == "skip_step" and not all(finite):
                optimizer.skipped_steps += 1   # the only call wrote nothing
                return False, True
            everything = all(finite)
            self.steps = [st["step"] for st in self.states]
            optimizer._last_stalled = stalled
            optimizer.skipped_params += finite.count(False)
            self.kernel.fused_elements += self.total if everything else \
                sum(n for n, ok in zip(self.numels, finite) if ok)
            if rest is not None:
                rest.write_back()
            self.taken += 1
        return everything, everything

    def _run_staged(self, staged: Staged, check: int, skip_step: bool, finite: list[bool],
                    stalled: dict[int, list[tuple[Stalled, int, sharding.Share]]]) -> None:
        """Run the staged launches (:meth:`_stage`) job by job, each launch's counters advanced right
        after its writes (a later launch may fail: its Triton kernel's first-call compile) and each
        job's stalled count added to ``stalled``; the launches' non-finite flags into ``finite``.
        ``skip_step``: a non-finite gradient stops it before any counter advances (the plan's
        only call checked and wrote nothing)."""
        for job, launches in zip(self.jobs, staged):
            step = job.step + 1
            counts = []
            numel = job.numel   # the elements stepped: a skipped tensor's are not (as in a full step)
            for run, launch, members in launches:
                counts.append(run())
                if check != CHECKS["off"]:
                    for i, ok in zip(members, launch.finite):
                        finite[i] = bool(ok)
                if skip_step and not all(finite):
                    return
                for i in members:   # a launch's parameters count the step as soon as it wrote them
                    if finite[i]:
                        self.states[i]["step"] = step
                    else:
                        numel -= self.numels[i]
            for i in job.empty:
                self.states[i]["step"] = step
            job.step = step
            stalled.setdefault(job.index, []).append((of_job(counts, self.count), numel, job.share))


class Plans:
    """An optimizer's cached plans (:class:`CachedStep`) and when to make them: one for a whole
    ``step()`` and one per parameter list of ``step_params`` (gradient release steps one
    parameter at a time).

    A plan is made after a full step (:meth:`after_full_step`) and taken while it matches
    (:meth:`try_step`, :meth:`try_step_params`). A plan dropped before it was ever taken
    (something changes every step: a strided gradient, parameters that get a gradient every other
    step, states-only steps between a parameter's whole ones) doubles the number of full steps
    before the next one of its kind is made (at most :attr:`MAX_WAIT`), so such a loop pays for
    a plan's making (about one full step's checks) rarely; a plan taken resets the wait.

    Attributes:
        cached_steps: the steps (and ``step_params`` calls) taken from a cached plan, skipped
            ones (``"skip_step"``) included (a test's proof that they ran).
        agreed_steps: the steps whose plan (of DTensor parameters) agreed its non-finite flags
            over the ranks (:meth:`CachedStep.agreed_flags`), handed to a full step or not.
    """

    MAX_WAIT = 64
    #: the most ``step_params`` plans kept (one per distinct parameter list)
    MAX_SUBSETS = 1 << 16

    def __init__(self) -> None:
        self.current: CachedStep | None = None
        self.subsets: dict[tuple[int, ...], CachedStep] = {}
        self.cached_steps = 0
        self.agreed_steps = 0
        self._waits: dict[tuple[int, ...] | None, tuple[int, int]] = {}   # key -> (backoff, full steps left)

    def _take(self, key: tuple[int, ...] | None, plan: CachedStep, optimizer: LowpOptimizer
              ) -> list[torch.Tensor] | None:
        """The gradients when ``plan`` (of ``key``: ``None`` for a whole step) matches; else the
        plan is dropped, and when it was never taken its kind waits longer before the next."""
        grads = plan.matches(optimizer)
        if grads is None:
            if key is None:
                self.current = None
            else:
                del self.subsets[key]
            if plan.taken == 0:
                backoff = min(2 * self._waits.get(key, (0, 0))[0] + 1, self.MAX_WAIT)
                self._waits[key] = (backoff, backoff)
            return None
        self._waits.pop(key, None)
        return grads

    def try_step(self, optimizer: LowpOptimizer, inv_scale: float | None, checked: bool,
                 remainder: Callable[[list[torch.Tensor]], Remainder] | None = None
                 ) -> tuple[bool, list[bool] | None]:
        """Take the step from the cached plan when it matches. Returns (taken, flags): ``(True,
        None)`` when taken (or skipped whole: ``"skip_step"``); ``(False, None)``: the caller takes
        a full step; ``(False, flags)``: the caller takes a full step with these non-finite flags
        of the parameters with a gradient, already agreed over the ranks (a plan of DTensor
        parameters, one of which ``"skip_param"`` skips: the kernel cannot skip a tensor for
        another rank's shard).

        A plan with a remainder (:class:`CachedStep`) takes the step only with ``remainder``, the
        maker of its full step, called (the remainder's checks) before the flags are agreed, and
        its step planned (gathered) before the plan writes anything, so the collectives are a full
        step's, in its order: the flags of every parameter, the gathers, then the exchange of the
        shards' sums (:meth:`CachedStep.exchange_sums`)."""
        plan = self.current
        grads = None if plan is None else self._take(None, plan, optimizer)
        if plan is None or grads is None:
            return False, None
        if plan.remainder and remainder is None:
            self.current = None
            return False, None
        try:
            rest = remainder(plan.remainder) if remainder is not None and plan.remainder else None
            agreed = plan.agreed_flags(optimizer, grads, checked, rest.grads if rest is not None else ())
            if agreed is not None:
                self.agreed_steps += 1
            if agreed is not None and not all(agreed):
                if optimizer.nonfinite != "skip_step":
                    return False, agreed
                self.cached_steps += 1   # skipped whole, as a plain plan's skip_step (run)
                optimizer.skipped_steps += 1
                return True, None
            planned = rest.plan() if rest is not None else None   # gathers; writes nothing
            self.cached_steps += 1
            if not plan.run(optimizer, grads, inv_scale, checked or agreed is not None, rest=planned)[1]:
                self.current = None
        except BaseException:   # a failed step changed nothing; the next one is a full step, which checks again
            self.current = None
            raise
        return True, None

    def try_step_params(self, optimizer: LowpOptimizer, params: Sequence[torch.Tensor], inv_scale: float | None,
                        new_step: bool, force_check: bool) -> bool | None:
        """``step_params(params)`` from its cached plan when one matches: whether every gradient
        was finite; ``None``: the caller takes a full step."""
        key = tuple(map(id, params))
        plan = self.subsets.get(key)
        grads = None if plan is None else self._take(key, plan, optimizer)
        if plan is None or grads is None:
            return None
        self.cached_steps += 1
        try:
            finite, holds = plan.run(optimizer, grads, inv_scale, False, new_step, force_check)
        except BaseException:   # as try_step: the next call is a full one, which checks again
            self.subsets.pop(key, None)
            raise
        if not holds:
            del self.subsets[key]
        return finite

    def after_full_step(self, optimizer: LowpOptimizer, plan: StepPlan,
                        subset: Sequence[torch.Tensor] | None = None) -> None:
        """Keep the plan of a full step just executed (all gradients finite): a whole ``step()``'s
        or that of ``step_params(subset)``, unless its kind waits."""
        key = None if subset is None else tuple(map(id, subset))
        backoff, wait = self._waits.get(key, (0, 0))
        if wait > 0:
            self._waits[key] = (backoff, wait - 1)
            return
        if subset is None:
            self.current = CachedStep.build(optimizer, plan)
            return
        if len(self.subsets) >= self.MAX_SUBSETS:
            self.subsets.clear()
        made = CachedStep.build(optimizer, plan, list(subset))
        if made is not None:
            self.subsets[key] = made   # type: ignore[index]

    def drop(self) -> None:
        """Forget the whole step's plan (the next ``step()`` is a full one); the ``step_params``
        plans check their own signatures."""
        self.current = None


def _launches(kernel: Kernel, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
              ) -> Sequence[tuple[KernelLaunch, list[ParamSlice]]] | None:
    """The kernel's launches for a job's ``slices`` (:meth:`Kernel.launches`) when its
    admission takes every slice (the same checks as :class:`~lowp.optim.backends.FusedBackend`);
    ``None`` when any slice would not take it."""
    if ctx.coded:
        if not spec.elementwise or coded_slices.admitted(kernel, spec, ctx, slices)[1]:
            return None
    else:
        spans: list[Span] = []
        if not all(kernel.admits(spec, ctx, s, spans) for s in slices) or overlapping(spans):
            return None
    return kernel.launches(spec, ctx, slices)
