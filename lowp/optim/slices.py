"""What a backend runs: :class:`ParamSlice` (one parameter, or a flat chunk of one, with its
gradient, states, write-back buffer and the block scales of its coded states) and
:class:`StepContext` (what all slices of one call share: the group, the write-back mode, the coded
states, the step number, the gradient scale and the random seed). Together they carry the whole
storage of a job, so a backend is called one way (:meth:`lowp.optim.backends.Backend.step`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lowp.optim.encodings import Code
from lowp.optim.randomness import ElementIndex, RandomStreams
from lowp.optim.scratch import Scratch
from lowp.optim.writeback import WriteBack

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ParamSlice", "StepContext", "CodedState", "TensorSum"]


@dataclass(frozen=True)
class CodedState:
    """A state kept as block-scaled codes (:mod:`lowp.optim.codes`): its name, its position in the
    state order (which picks its random stream) and its code.

    Args:
        name: the state's name.
        position: its index in the optimizer's state order.
        code: its :class:`~lowp.optim.encodings.code.Code`.
    """

    name: str
    position: int
    code: Code


@dataclass
class TensorSum:
    """The per-tensor sum (a spec's ``tensor_sum``, StableAdamW's RMS) of a parameter that other
    ranks hold parts of: the whole tensor's element count and, once the ranks have exchanged their
    pieces of it (:mod:`lowp.optim.sharded_sums`), the sum over the whole tensor in
    :func:`~lowp.optim.ordered_sum.ordered_sum`'s order. A step reads ``total`` in place of the sum
    of its local elements.

    Args:
        numel: elements of the whole tensor.
        groups: the process groups whose ranks hold its parts (its mesh's sharded dimensions,
            :class:`~lowp.optim.sharding.MeshGroups`), over which the pieces travel.
        total: the sum over the whole tensor (default ``None``: not exchanged yet).
    """

    numel: int
    groups: tuple[ProcessGroup, ...] = ()
    total: float | None = None


@dataclass
class ParamSlice:
    """One parameter (or a flat chunk of it) with everything its update touches.

    ``states`` maps state names to tensors (possibly of other dtypes than ``param``);
    ``buffer`` is the mode's compensation/remainder (``None`` for nearest/stochastic).
    ``param_id`` (the parameter's position in the flat list of all parameters of the optimizer)
    and ``index`` (where the local elements sit in the whole parameter) select the random
    streams of stochastic rounding (:mod:`lowp.optim.randomness`).

    Made by the optimizer's step, which has checked every tensor; the constructor checks nothing.

    Args:
        param: the weight (or a flat chunk of it), updated in place.
        grad: its gradient, the shape of ``param``, of its dtype or fp32 (read only).
        states: ``{state name: tensor}`` in the optimizer's state order, each updated in place
            (default: no states).
        buffer: the write-back mode's buffer, the shape of ``param`` (default ``None``: nearest
            and stochastic modes have none).
        param_id: the parameter's position over all groups of the optimizer (default 0).
        index: where the local elements sit in the whole parameter (default: a whole tensor,
            :class:`~lowp.optim.randomness.ElementIndex` ``()``).
        scales: the block scales of the states kept as codes (:attr:`StepContext.coded`), flat,
            by state name (default: none); those states hold the codes.
        tensor_sum: for a shard of a parameter of a per-tensor optimizer, its whole tensor's
            :class:`TensorSum` (default ``None``: the slice is the whole tensor, or the optimizer
            is elementwise).
    """

    param: torch.Tensor
    grad: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    buffer: torch.Tensor | None = None
    param_id: int = 0
    index: ElementIndex = field(default_factory=ElementIndex)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    tensor_sum: TensorSum | None = None

    @property
    def numel(self) -> int:
        """Elements of the slice."""
        return self.param.numel()

    def chunks(self, size: int) -> list["ParamSlice"]:
        """Flat views of at most ``size`` elements (the slice itself when it is small or not
        contiguous). Writing through a chunk writes the parameter and its states."""
        tensors = [self.param, *self.states.values(), *([self.buffer] if self.buffer is not None else [])]
        if self.numel <= size or not all(t.is_contiguous() and t.shape == self.param.shape for t in tensors):
            return [self]
        grad = self.grad.reshape(-1).split(size)
        states = {k: v.view(-1).split(size) for k, v in self.states.items()}
        buffer = self.buffer.view(-1).split(size) if self.buffer is not None else None
        return [ParamSlice(p, grad[i], {k: v[i] for k, v in states.items()}, buffer[i] if buffer else None,
                           self.param_id, self.index.shifted(i * size))
                for i, p in enumerate(self.param.view(-1).split(size))]


@dataclass
class StepContext:
    """What all slices of one backend call share.

    ``inv_scale`` unscales gradients (from :class:`torch.amp.GradScaler`), ``count`` asks the
    write-back for the stalled-element count, ``seed`` (the optimizer's) keys the random streams
    of stochastic rounding, ``scratch`` holds the temporaries that the batches of this call reuse.

    Args:
        group: the parameter group (hyper-parameters and options) of the slices.
        mode: the write-back mode (:class:`~lowp.optim.writeback.WriteBack`) of the slices.
        step: the step number of the slices' parameters, counting from 1 at their first step.
        inv_scale: the reciprocal of the GradScaler's scale, multiplied into every gradient
            (default ``None``: gradients are used as they are).
        seed: the optimizer's seed (default 0).
        count: ``True`` (default) asks for the stalled-element count, ``False`` for none.
        scratch: reusable temporaries of the reference pipeline (:mod:`lowp.optim.scratch`;
            default: a new, empty one).
        update_weights: ``True`` (default) writes the weights back; ``False`` writes the states
            only (a states-only step, :meth:`~lowp.optim.base.LowpOptimizer.step_params`).
        coded: the states kept as block-scaled codes, the same for every slice of the call
            (default: none).
        stepped: the ids of the parameters the call has stepped whole, filled as it writes (the
            reference pipeline and the ``compiled`` kernel keep the others whole,
            :mod:`lowp.optim.journal`): when a later part of the job fails, the step advances
            these parameters' counters and no other's (default: a new, empty set). ``None``: the
            caller keeps the parameters whole itself (the step of decoded block-scaled states,
            :mod:`lowp.optim.coded`): nothing is recorded or copied.
    """

    group: dict[str, Any]
    mode: WriteBack
    step: int
    inv_scale: float | None = None
    seed: int = 0
    count: bool = True
    scratch: Scratch = field(default_factory=Scratch, repr=False, compare=False)
    update_weights: bool = True
    coded: tuple[CodedState, ...] = ()
    stepped: set[int] | None = field(default_factory=set, repr=False, compare=False)

    def streams(self, s: ParamSlice) -> RandomStreams:
        """The random streams of slice ``s`` at this step."""
        return RandomStreams(self.seed, self.step, s.param_id, s.index)
