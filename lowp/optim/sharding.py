"""DTensor parameters (FSDP2 ``fully_shard``, tensor parallel ``distribute_tensor``) in lowp's
optimizers: local views, sharded states, and the few quantities that must be global.

A parameter ``p`` that is a :class:`~torch.distributed.tensor.DTensor` holds, on each rank, a
local tensor ``p.to_local()`` (a plain tensor aliasing the parameter's storage) that is one box
of the global tensor, given by the mesh and the placements (``Shard(d)`` or ``Replicate()`` per
mesh dimension). lowp keeps every state sharded like its parameter and runs the elementwise
work on the local boxes, so the kernels only ever see plain tensors. What is not elementwise
needs the other ranks:

- the non-finite check: an all-reduce (MIN) of the per-parameter flags of a step, so that
  ``skip_param`` / ``skip_step`` decide the same on every rank (:func:`lowp.optim.collectives.agree`);
- a per-tensor sum (StableAdamW's RMS) of a parameter sharded in contiguous ranges (FSDP2): each
  rank sends the pieces of the sum over its range, every rank adds them up in the one order of
  :mod:`lowp.optim.ordered_sum`, and the step runs on the local shards
  (:mod:`lowp.optim.sharded_sums`): an all-gather of the pieces, usually one per step (a few
  numbers per whole unit and per shard boundary);
- other updates that are not elementwise (Adafactor's factors and RMS clip, StableAdamW on other
  layouts or with coded states): the parameter, its gradient, states and buffer are all-gathered,
  the step runs on the full tensors exactly as on one process, and each rank keeps its box
  (:func:`make_slices`, :class:`Gathered`). This is bit-for-bit the unsharded step; the price is
  one all-gather of the tensors of all such parameters per step (:func:`gather_many`) and
  full-size temporaries;
- diagnostics: sums of counts and squares over ranks (:class:`Share`).

Each collective runs over the ranks of the parameters' device meshes
(:mod:`lowp.optim.collectives`), so the ranks of a mesh must step the same parameters (as FSDP2,
HSDP and tensor parallelism do), and other ranks (another pipeline stage) may step others.

Every element is placed by :class:`~lowp.optim.randomness.ElementIndex` (:func:`element_index`),
so stochastic rounding can draw the same bits for it at any sharding.
"""
from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence, TypeGuard, cast

import torch
import torch.distributed as dist

from lowp.optim.slices import ParamSlice, TensorSum
from lowp.optim.randomness import ElementIndex

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement
    from typing_extensions import TypeIs

__all__ = ["make_slices", "gather_many", "SliceRequest", "Gathered", "is_dtensor", "local", "new_state",
           "new_tensor", "coded_placements", "new_buffer", "element_index", "box_index", "box", "gather",
           "keep_local", "local_grad", "load_state", "place", "replicas", "MeshGroups", "Share",
           "check_placements", "dtensor_type"]


@functools.cache
def dtensor_type() -> type | None:
    """:class:`~torch.distributed.tensor.DTensor`, imported once (``None`` without
    ``torch.distributed``): a full step asks :func:`is_dtensor` about every tensor many times."""
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def is_dtensor(t: object) -> TypeIs[DTensor]:
    """True when ``t`` is a :class:`~torch.distributed.tensor.DTensor`."""
    kind = dtensor_type()
    return kind is not None and isinstance(t, kind)


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of ``t`` (``t`` itself when it is not a DTensor); it aliases ``t``'s
    storage, so writing it writes the parameter or state."""
    return t.to_local() if is_dtensor(t) else t


def check_placements(p: DTensor) -> None:
    """Raise ``TypeError`` unless every placement of the DTensor ``p`` is ``Shard(d)`` or
    ``Replicate()`` (the layouts whose local box :func:`box` computes), and ``ValueError`` unless
    its local shape is the box of ``Shard``'s rule (``torch.chunk``: what FSDP2 and tensor
    parallelism make). A layout built otherwise (``DTensor.from_local(..., run_check=False,
    shape=...)`` with other local sizes) would have its ranks disagree on the bytes of a gather."""
    from torch.distributed.tensor import Replicate, Shard
    for pl in p.placements:
        if type(pl) not in (Shard, Replicate):
            raise TypeError(f"params: DTensor placements must be Shard(d) or Replicate(), got {tuple(p.placements)}")
    have = tuple(local(p).shape)
    want, _ = _box_of(p.shape, p.device_mesh, p.placements)
    if have != tuple(want):
        raise ValueError(f"params: a DTensor of shape {tuple(p.shape)} placed {tuple(p.placements)} holds a local "
                         f"tensor of shape {have} where Shard's rule (torch.chunk) gives {tuple(want)}")


def _wrap(local_tensor: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local_tensor``."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local_tensor, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def new_state(p: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero state of ``shape`` and ``dtype`` for parameter ``p``: sharded like ``p`` when it has
    ``p``'s shape, replicated over ``p``'s mesh otherwise (Adafactor's row/column factors)."""
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=dtype, device=p.device)
    return new_tensor(p, shape, dtype, p.placements if tuple(shape) == tuple(p.shape) else _replicated(p))


def new_tensor(p: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement]
               ) -> DTensor:
    """A zero DTensor of global ``shape`` and ``dtype`` on the mesh and device of the DTensor
    ``p``, placed by ``placements`` (``TypeError`` when ``p`` is not a DTensor)."""
    from torch.distributed.tensor import DTensor
    if not is_dtensor(p):
        raise TypeError(f"p: expected a DTensor parameter, got {type(p).__name__}")
    mesh = p.device_mesh
    local_shape, _ = _box_of(shape, mesh, placements)
    return DTensor.from_local(torch.zeros(local_shape, dtype=dtype, device=local(p).device), mesh,
                              placements, run_check=False, shape=torch.Size(shape), stride=_strides(shape))


def coded_placements(p: DTensor, block: int) -> tuple[Placement, ...]:
    """The placements of the block-scaled states of the DTensor parameter ``p``
    (:func:`lowp.optim.codes.stored_shapes`): ``p``'s own when every rank's box of ``p`` consists of
    whole blocks of ``block`` consecutive elements of the row-major global tensor, so each rank
    keeps the codes and scales of its own elements; replicated otherwise, so that the blocks never
    depend on the sharding (every rank then keeps the whole state and steps the whole parameter).

    The boxes consist of whole blocks when the last dimension holds whole blocks and is split over
    at most one mesh dimension, into chunks of whole blocks (``ceil(n / ranks) % block == 0``); an
    unsplit last dimension means whole rows per rank. A replicated ``p``, or one sharded over
    mesh dimensions of one rank only (a box of the whole tensor; with flat states only along
    dimension 0, the one they have), keeps its placements. A ``p`` that is not a DTensor is a
    ``TypeError``."""
    from torch.distributed.tensor import Shard
    if not is_dtensor(p):
        raise TypeError(f"p: expected a DTensor parameter, got {type(p).__name__}")
    shape = tuple(p.shape)
    sharded = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    flat = not shape or shape[-1] % block != 0   # codes and scales stored flat (codes.stored_shapes)
    if all(p.device_mesh.size(i) == 1 for i, _ in sharded) \
            and not (flat and any(pl.dim % max(len(shape), 1) for _, pl in sharded)):
        return tuple(p.placements)   # nothing is split; flat states take Shard(0) only (they have one dimension)
    if flat:
        return _replicated(p)
    splits = [p.device_mesh.size(i) for i, pl in enumerate(p.placements)
              if isinstance(pl, Shard) and pl.dim % len(shape) == len(shape) - 1]
    if not splits or (len(splits) == 1 and math.ceil(shape[-1] / splits[0]) % block == 0):
        return tuple(p.placements)
    return _replicated(p)


def _replicated(p: DTensor) -> tuple[Placement, ...]:
    from torch.distributed.tensor import Replicate
    return (Replicate(),) * p.device_mesh.ndim


def _box_of(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of this rank's box of a DTensor of global ``shape``. Kept per
    (shape, mesh shape, this rank's coordinate in the mesh, placements), all it depends on: torch's
    computation took 40 us per parameter of every full step."""
    key = (tuple(shape), tuple(mesh.shape), tuple(mesh.get_coordinate() or ()), tuple(placements))
    try:
        found = _BOXES.get(key)
    except TypeError:   # a placement that cannot be hashed: computed every time
        return _computed_box(shape, mesh, placements)
    if found is None:
        if len(_BOXES) >= 4096:
            _BOXES.clear()
        found = _BOXES[key] = _computed_box(shape, mesh, placements)
    return found


def _computed_box(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`_box_of` as torch computes it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    local_shape, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return tuple(local_shape), tuple(offset)


#: :func:`_box_of`'s boxes, by their key
_BOXES: dict[tuple[object, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The row-major strides of ``shape``."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def new_buffer(p: torch.Tensor, init: Callable[[torch.Tensor], torch.Tensor | None]) -> torch.Tensor | None:
    """The write-back mode's buffer of ``p`` (``init`` runs on the local tensor), sharded like ``p``."""
    if not is_dtensor(p):
        return init(p.detach())
    buf = init(local(p).detach())
    return None if buf is None else _wrap(buf, p)


def box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of this rank's box of the DTensor ``t``."""
    return _box_of(t.shape, t.device_mesh, t.placements)


def element_index(t: torch.Tensor) -> ElementIndex:
    """Where the local elements of ``t`` sit in the whole tensor (:func:`box_index` of its box)."""
    if not is_dtensor(t):
        return ElementIndex()
    shape, offset = box(t)
    return box_index(tuple(shape), tuple(offset), tuple(t.shape))


def box_index(shape: tuple[int, ...], offset: tuple[int, ...], gshape: tuple[int, ...]) -> ElementIndex:
    """:class:`ElementIndex` of the box of local shape ``L = shape`` at ``O = offset`` in a
    row-major tensor of shape ``G = gshape`` (global strides ``S``).

    ``d`` is the last dimension with ``L_d < G_d``. The box is one contiguous range when every
    dimension before ``d`` has one local element; otherwise it is ``prod(L_{<d})`` runs of
    ``block = L_d * S_d`` elements every ``stride = S_{d-1}``, which needs the dimensions strictly
    between the first one and ``d`` to be whole.
    """
    strides = _strides(gshape)
    start = sum(o * s for o, s in zip(offset, strides))
    partial = [i for i, (n, g) in enumerate(zip(shape, gshape)) if n < g]
    if math.prod(shape) == 0 or not partial:
        return ElementIndex(offset=start)
    d = partial[-1]
    if math.prod(shape[:d]) <= 1:
        return ElementIndex(offset=start)
    if any(shape[i] < gshape[i] for i in range(1, d)):
        raise ValueError(f"params: a local box of shape {shape} at {offset} in {gshape} is not a strided "
                         f"range of the global tensor")
    return ElementIndex(offset=start, block=shape[d] * strides[d], stride=strides[d - 1])


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """The plain local gradient of ``p``: a DTensor gradient placed unlike ``p`` is redistributed
    first, a plain full gradient of a DTensor ``p`` is cut to this rank's box."""
    g = p.grad
    assert g is not None, "local_grad: the optimizer passes only parameters with a gradient"
    if not is_dtensor(p):
        return g.full_tensor() if is_dtensor(g) else g
    if not is_dtensor(g):
        return keep_local(g, p)
    if tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


#: while set, called right before each collective :func:`place` and :func:`gather` make
#: (:func:`announcing`)
_BEFORE_COLLECTIVE: ContextVar[Callable[[], None] | None] = ContextVar("lowp_before_collective", default=None)


@contextmanager
def announcing(before_collective: Callable[[], None]) -> Iterator[None]:
    """Within the block (in this thread or task), :func:`place` and :func:`gather` (and so
    :func:`load_state`) call ``before_collective()`` right before each collective they make: a
    load's :class:`~lowp.optim.collectives.FailTogether` round, so that a rank that failed
    between two of them is heard of before the next one instead of being waited for."""
    token = _BEFORE_COLLECTIVE.set(before_collective)
    try:
        yield
    finally:
        _BEFORE_COLLECTIVE.reset(token)


def _announce() -> None:
    callback = _BEFORE_COLLECTIVE.get()
    if callback is not None:
        callback()


def load_state(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of the checkpointed state ``value`` (plain or DTensor, any sharding) laid out for
    parameter ``p``: sharded like ``p`` when it has ``p``'s shape, replicated over ``p``'s mesh
    otherwise, a plain full tensor for a plain ``p``. The dtype is kept."""
    if not is_dtensor(p):
        return gather(value).to(device=p.device, copy=True)
    own_shape = tuple(value.shape) == tuple(p.shape)
    return place(value, p, value.shape, p.placements if own_shape else _replicated(p))


def place(value: torch.Tensor, p: torch.Tensor, shape: Sequence[int], placements: Sequence[Placement]) -> DTensor:
    """A copy of ``value`` (plain or DTensor, any placements; its elements in row-major order are
    those of a tensor of ``shape``) as a DTensor of global ``shape`` on ``p``'s mesh and device,
    placed by ``placements``. The dtype is kept. A DTensor of ``shape`` is redistributed; any other
    ``value`` is gathered whole first."""
    from torch.distributed.tensor import DTensor
    mesh = cast("DTensor", p).device_mesh
    shape = torch.Size(shape)
    if is_dtensor(value) and value.shape == shape:
        if tuple(value.placements) != tuple(placements):
            _announce()
            bits = _wire(value).redistribute(mesh, placements)
            return _wrap(local(bits).view(value.dtype).clone(), bits)
        return _wrap(local(value).clone(), value)
    full = gather(value).to(device=local(p).device).reshape(shape)
    local_shape, offset = _box_of(shape, mesh, placements)
    piece = _cut(full, local_shape, offset).clone()
    return DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape, stride=_strides(shape))


def gather(t: torch.Tensor) -> torch.Tensor:
    """The full plain tensor of the DTensor ``t`` (a plain ``t`` itself) (an all-gather; a copy),
    contiguous: torch 2.11 returns an unevenly sharded ``Shard(d)`` dimension (``d > 0``) as a view
    of the padded gather, whose rows the fused kernels cannot take. Dtypes that gloo cannot carry
    travel as bits (:func:`_wire`)."""
    if not is_dtensor(t):
        return t
    if all(map(_is_replicate, t.placements)):   # every rank holds it whole: no collective (and no
        return local(t).clone(memory_format=torch.contiguous_format)   # redistribution, 36 us); a copy
    _announce()
    return _wire(t).full_tensor().contiguous().view(local(t).dtype)


def _is_replicate(placement: Placement) -> bool:
    from torch.distributed.tensor import Replicate
    return type(placement) is Replicate


#: dtypes without gloo collectives -> a dtype of the same width that has them (only bits travel)
_WIRE_DTYPES = {torch.int16: torch.bfloat16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _wire(t: DTensor) -> DTensor:
    """The DTensor ``t`` itself, or for int16 and fp8 the same bits as a bf16 or uint8 DTensor
    (collectives copy them)."""
    wire = _WIRE_DTYPES.get(local(t).dtype)
    if wire is None:
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local(t).view(wire), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def keep_local(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's box of the full tensor ``full``, for the DTensor ``like`` (a view)."""
    shape, offset = box(like)
    return _cut(full, shape, offset)


def _cut(full: torch.Tensor, shape: Sequence[int], offset: Sequence[int]) -> torch.Tensor:
    """The box of ``shape`` at ``offset`` of ``full`` (a view)."""
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def replicas(t: torch.Tensor) -> int:
    """How many ranks hold the same local box of ``t`` (product of its replicated mesh sizes)."""
    if not is_dtensor(t):
        return 1
    from torch.distributed.tensor import Replicate
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if isinstance(pl, Replicate))


class MeshGroups:
    """Called with a DTensor ``t``: the process groups of the dimensions of its device mesh that
    hold more than one rank, in mesh order (only those along which ``t`` is sharded, with
    ``shards_only``: a replica's ranks hold the same box). Each mesh's groups are looked up once
    (a lookup costs about 5 us per dimension); keep one only while the tensors asked about are
    alive: it knows a mesh by its ``id``."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, tuple[bool, ...] | None], tuple[dist.ProcessGroup, ...]] = {}

    def __call__(self, t: DTensor, shards_only: bool = False) -> tuple[dist.ProcessGroup, ...]:
        """The groups of ``t``'s mesh (the class docstring)."""
        from torch.distributed.tensor import Shard
        mesh = t.device_mesh
        sharded = tuple(isinstance(pl, Shard) for pl in t.placements) if shards_only else None
        key = (id(mesh), sharded)
        groups = self._known.get(key)
        if groups is None:
            groups = self._known[key] = tuple(mesh.get_group(i) for i in range(mesh.ndim)
                                              if mesh.size(i) > 1 and (sharded is None or sharded[i]))
        return groups


class Share(NamedTuple):
    """How a rank's counts of a slice (diagnostics) add up to its parameter's: ``weight`` times
    each count, summed over the ranks of ``groups``. A plain tensor's counts are its rank's own
    (:data:`OWN`).

    Args:
        weight: 1 / the ranks that compute the same elements (0 for a plain tensor).
        groups: the process groups of the parameter's mesh (:class:`MeshGroups`).
    """

    weight: float
    groups: tuple[dist.ProcessGroup, ...]


#: the :class:`Share` of a plain tensor
OWN = Share(0.0, ())


@dataclass
class Gathered:
    """A step of a non-elementwise optimizer on full copies (``piece``) of the DTensor parameter
    ``param`` and its ``states`` / ``buffer`` / block ``scales``; :meth:`write_back` keeps this
    rank's box. The step writes the copies only.

    Args:
        piece: the full (gathered) parameter, gradient, states and flat block scales the step
            runs on.
        param: the sharded DTensor parameter the result goes back to.
        states: state name -> this rank's state tensor (sharded like ``param`` or replicated).
        buffer: this rank's write-back buffer (Kahan compensation or exact remainder), or ``None``.
        scales: coded state name -> this rank's block scales of it (placed like its codes).
    """

    piece: ParamSlice
    param: DTensor
    states: dict[str, torch.Tensor]
    buffer: torch.Tensor | None
    scales: dict[str, torch.Tensor]

    def write_back(self) -> None:
        """Copy this rank's box of the stepped full copies into the local shards (replicated
        states whole)."""
        local(self.param).copy_(keep_local(self.piece.param, self.param))
        pairs = [(self.states[n], self.piece.states[n]) for n in self.states]
        pairs += [(t, self.piece.scales[n].view(t.shape)) for n, t in self.scales.items()]
        if self.buffer is not None:
            assert self.piece.buffer is not None, "make_slices gathers the buffer with the parameter"
            pairs.append((self.buffer, self.piece.buffer))
        for t, full in pairs:   # replicated states (Adafactor's factors, codes of split blocks) are whole
            if _placed_like(t, self.param):
                full = keep_local(full, t)
            local(t).copy_(full)


def _placed_like(t: torch.Tensor, p: DTensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor placed like the DTensor ``p`` (so its local box is ``p``'s when
    it has ``p``'s shape)."""
    return is_dtensor(t) and tuple(t.placements) == tuple(p.placements)


#: One parameter of a step (:func:`make_slices`): the parameter, its local gradient, its states by
#: name, its write-back buffer (or ``None``), its position over all groups (``param_id``) and the
#: block scales of its coded states by state name (empty without codes).
SliceRequest = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, int,
                     dict[str, torch.Tensor]]


def make_slices(requests: Sequence[SliceRequest], elementwise: bool, sums_min_numel: int | None = None
                ) -> list[tuple[ParamSlice, Share, Gathered | None]]:
    """Per parameter of ``requests``: the :class:`ParamSlice` a backend runs, its :class:`Share`
    of the diagnostics' sums and, for a gathered step, what to write back.

    - plain ``p``: the tensors themselves, :data:`OWN` (counted on this rank only);
    - DTensor ``p``, elementwise optimizer, every DTensor state placed like ``p``: the local
      shards with their :class:`ElementIndex`, weight ``1 / replicas`` over the mesh's ranks (each
      element counted once);
    - DTensor ``p`` of at least ``sums_min_numel`` elements of a per-tensor optimizer that
      exchanges its sums (``sums_min_numel`` not ``None``:
      :meth:`~lowp.optim.base.LowpOptimizer.shards_sums`, the threshold
      :func:`lowp.optim.sharded_sums.min_numel`) whose local box is one contiguous range
      of the whole tensor (``Shard(0)``, FSDP2's layout), every state and the buffer DTensors
      placed like ``p``, no coded states: the local shards as above, with the whole tensor's
      :class:`~lowp.optim.slices.TensorSum` when the layout splits it over ranks (the ranks
      exchange the pieces of its sum before the step, :mod:`lowp.optim.sharded_sums`);
    - DTensor ``p``, another per-tensor optimizer or layout, or a state placed otherwise (the replicated codes of
      blocks that ``p``'s shards split, :func:`coded_placements`): full copies of the parameter,
      its gradient (``p.grad``), states, buffer and block scales, weight ``1 / the mesh's size``
      (every rank computes the whole tensor), so the step writes none of this rank's own tensors before
      :meth:`Gathered.write_back`. The full copies of all such parameters come from one
      :func:`gather_many`.

    Block scales reach the piece flat (:attr:`ParamSlice.scales`).
    """
    out: list[tuple[ParamSlice, Share, Gathered | None] | None] = []
    pending: list[tuple[int, SliceRequest]] = []
    groups = MeshGroups()
    for request in requests:
        p, grad, states, buffer, param_id, scales = request
        if not is_dtensor(p):
            out.append((ParamSlice(p, grad, states, buffer, param_id, scales=_flat(scales)), OWN, None))
            continue
        exchanged = not elementwise and sums_min_numel is not None and p.numel() >= sums_min_numel \
            and not scales and _sums_shard(p, (*states.values(), *([] if buffer is None else [buffer])))
        if exchanged or elementwise and all(_placed_like(t, p) for t in (*states.values(), *scales.values())
                                            if is_dtensor(t)):
            piece = ParamSlice(local(p), grad, {n: local(t) for n, t in states.items()},
                               None if buffer is None else local(buffer), param_id, element_index(p),
                               _flat({n: local(t) for n, t in scales.items()}),
                               TensorSum(p.numel(), groups(p, shards_only=True))
                               if exchanged and _split(p) else None)
            out.append((piece, Share(1.0 / replicas(p), groups(p)), None))
        else:
            assert p.grad is not None, "make_slices: the optimizer passes only parameters with a gradient"
            pending.append((len(out), request))
            out.append(None)
    wanted = [t for _, (p, _, states, buffer, _, scales) in pending
              for t in (p.detach(), p.grad, *states.values(), *([] if buffer is None else [buffer]), *scales.values())]
    fulls = iter(gather_many(cast(list[torch.Tensor], wanted)))
    for at, (p, _, states, buffer, param_id, scales) in pending:
        weight, grad = next(fulls), next(fulls)
        piece = ParamSlice(weight, grad, {n: next(fulls) for n in states}, None if buffer is None else next(fulls),
                           param_id)
        piece.scales = _flat({n: next(fulls) for n in scales})
        whole = cast("DTensor", p)
        out[at] = (piece, Share(1.0 / whole.device_mesh.size(), groups(whole)),
                   Gathered(piece, whole, states, buffer, scales))
    return cast(list[tuple[ParamSlice, Share, "Gathered | None"]], out)


def _sums_shard(p: DTensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a per-tensor optimizer may step ``p``'s local boxes with the sum exchanged: every
    rank's box is one contiguous range of the whole tensor (each placement replicates, or shards a
    dimension before which every dimension has one element: FSDP2's ``Shard(0)``), ``p`` is not
    float64 (whose sum is taken in float64), and every tensor of ``tensors`` is a DTensor placed
    like ``p`` with its shape. Judged from the layout alone, so every rank decides alike (a rank's
    own box may be empty, or the whole tensor)."""
    from torch.distributed.tensor import Shard
    contiguous = all(_is_replicate(pl) or type(pl) is Shard and math.prod(p.shape[:pl.dim]) <= 1
                     for pl in p.placements)
    return contiguous and p.dtype != torch.float64 \
        and all(_placed_like(t, p) and t.shape == p.shape for t in tensors)


def _split(p: DTensor) -> bool:
    """Whether ``p``'s layout cuts it into boxes of more than one rank (a ``Shard`` on a mesh
    dimension of two or more ranks), judged alike on every rank."""
    from torch.distributed.tensor import Shard
    return any(type(pl) is Shard and p.device_mesh.size(i) > 1 for i, pl in enumerate(p.placements))


def _flat(scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block scales as the coded step addresses them: flat views (each contiguous)."""
    return {n: t.view(-1) for n, t in scales.items()}


#: byte alignment of each tensor's bytes in :func:`gather_many`'s messages (any dtype's view)
_ALIGN = 16
#: the most bytes one all-gather of :func:`gather_many` receives, the messages of all ranks (held
#: next to the full copies cut from them); a tensor whose share alone is larger travels alone
GATHER_BYTES = 1 << 26


def _chunk(n: int, ranks: int, r: int) -> int:
    """The size of chunk ``r`` of ``n`` rows cut into ``ranks`` chunks as ``Shard`` cuts them
    (``torch.chunk``: chunks of ``ceil(n / ranks)``, the last ones shorter or empty)."""
    size = -(-n // ranks)
    return max(0, min(n, (r + 1) * size) - r * size)


def gather_many(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`gather` of each of ``tensors`` (the same full tensors, dtypes and copies), with one
    all-gather for the DTensors sharded along one dimension of a one-dimensional mesh (FSDP2's
    ``Shard(0)``) that share its process group and device, up to :data:`GATHER_BYTES` received by
    each rank (world size x the longest rank's message): each rank sends its local tensors'
    bytes back to back (each at a multiple of 16 bytes), padded to the longest rank's message,
    and every full tensor is its ranks' boxes
    concatenated along the sharded dimension (their sizes follow ``Shard``'s ``torch.chunk``
    rule). The others are gathered one by one first, in order; then the batches, in the order of
    their first tensor: every rank makes the same collectives for the same ``tensors``."""
    from torch.distributed.tensor import Shard
    out: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[dist.ProcessGroup, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if is_dtensor(t) and t.device_mesh.ndim == 1 and type(t.placements[0]) is Shard and t.dim() > 0:
            batches.setdefault((t.device_mesh.get_group(), t.device), []).append(i)
        else:
            out[i] = gather(t)
    for (group, device), members in batches.items():
        for part in _parts(tensors, members, dist.get_world_size(group)):
            _gather_batch(tensors, part, group, device, out)
    return cast(list[torch.Tensor], out)


def _parts(tensors: Sequence[torch.Tensor], members: list[int], ranks: int) -> list[list[int]]:
    """``members`` cut into runs whose messages from all ``ranks`` together stay within
    :data:`GATHER_BYTES`: each rank's message within ``GATHER_BYTES // ranks``, counting every
    tensor at its largest rank's share, aligned as :func:`_gather_batch` places it."""
    runs: list[list[int]] = []
    size = 0
    limit = GATHER_BYTES // ranks
    for i in members:
        t = tensors[i]
        dim = _shard_dim(t)
        share = -(-t.shape[dim] // ranks) * math.prod(t.shape) // max(t.shape[dim], 1) * t.element_size()
        share = -(-share // _ALIGN) * _ALIGN
        if not runs or size + share > limit:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += share
    return runs


def _shard_dim(t: torch.Tensor) -> int:
    """The dimension that the one ``Shard`` placement of the DTensor ``t`` splits."""
    from torch.distributed.tensor import Shard
    return cast(Shard, cast("DTensor", t).placements[0]).dim % t.dim()


def _gather_batch(tensors: Sequence[torch.Tensor], members: list[int], group: dist.ProcessGroup,
                  device: torch.device, out: list[torch.Tensor | None]) -> None:
    """One all-gather of :func:`gather_many` for ``tensors[i]``, ``i`` in ``members``, into ``out[i]``."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    mine = [local(tensors[i]) for i in members]   # to_local() costs about 10 us: once each
    dims = [_shard_dim(tensors[i]) for i in members]
    parts: list[list[tuple[int, int, tuple[int, ...]]]] = [[] for _ in range(ranks)]   # (offset, bytes, shape)
    ends = [0] * ranks
    for i, loc, dim in zip(members, mine, dims):
        shape = tuple(tensors[i].shape)
        for r in range(ranks):
            box_shape = (*shape[:dim], _chunk(shape[dim], ranks, r), *shape[dim + 1:])
            nbytes = math.prod(box_shape) * loc.element_size()
            parts[r].append((ends[r], nbytes, box_shape))
            ends[r] += -(-nbytes // _ALIGN) * _ALIGN
    send = torch.zeros(max(ends), dtype=torch.uint8, device=device)
    for loc, (offset, nbytes, shape) in zip(mine, parts[me]):
        if tuple(loc.shape) != shape:   # torch's Shard no longer cuts as torch.chunk: nothing is sent
            raise RuntimeError(f"gather_many: a local tensor of shape {tuple(loc.shape)}, expected {shape} "
                               f"by Shard's rule")
        send[offset:offset + nbytes].copy_(loc.contiguous().reshape(-1).view(torch.uint8))
    received = [torch.empty_like(send) for _ in range(ranks)]
    dist.all_gather(received, send, group=group)
    for k, (i, loc, dim) in enumerate(zip(members, mine, dims)):
        boxes = []
        for r in range(ranks):
            offset, nbytes, shape = parts[r][k]
            boxes.append(received[r][offset:offset + nbytes].view(loc.dtype).reshape(shape))
        out[i] = torch.cat(boxes, dim=dim)
