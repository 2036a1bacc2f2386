"""Per-tensor sums of parameters sharded over ranks, exchanged instead of gathering the tensors.

A per-tensor optimizer (StableAdamW: ``lr_t = lr / max(1, RMS_t)`` with ``RMS_t**2`` the mean of
``g**2 / max(v_hat, eps**2)`` over the tensor; Wortsman et al., 2023) needs one number of the
whole tensor before any element's step. On a DTensor parameter whose local box is one contiguous
range of the tensor (FSDP2's ``Shard(0)``), each rank has the terms of its range; the sum of the
whole tensor in :func:`~lowp.optim.ordered_sum.ordered_sum`'s order (what a single process and
every backend add) follows from each range's :func:`~lowp.optim.ordered_sum.pieces`: the sums of
the units and blocks the range holds whole, the raw terms of the at most two blocks it shares.
So per step and parameter a rank sends a few numbers per shard boundary (at most 2,047 block sums
and 15 terms on each side) instead of all-gathering the weight, gradient, states and buffer, and
steps its shard only; the result is the single process's, bit for bit.

:func:`exchange` runs before the step's first write (:meth:`lowp.optim.step_plan.StepPlan.run_jobs`)
and writes nothing. A shard the native kernel admits has its pieces made by the kernel's own
per-tensor pre-pass (``lowp_piece_sums`` over the shard's runs of units, blocks and single
elements; a cached plan keeps the prepared pass, :func:`exchange_pieces`); any other shard's
terms come from the optimizer's ``tensor_terms`` on the reference's fp32 working copies
(:func:`~lowp.optim.reference.working_grads`), the same bits. One exchange per mesh
(:func:`~lowp.optim.collectives.all_messages` over its sharded dimensions: one all-gather of
the messages, each with its length, padded to the last step's longest; a replica's ranks send
nothing to each other) carries the pieces of all its parameters, keyed by the parameter's
position in the groups (the same on every rank of the mesh), as runs of consecutive pieces
(:class:`~lowp.optim.ordered_sum.Runs`: at most five per shard, 32 bytes each, plus 8 per piece).
A shard smaller than a unit sends a sum per block of it (8 bytes per 16 elements); larger shards
one per unit they hold whole. Every rank rebuilds each sum from all the pieces, in C++ where the
native kernel builds (:func:`_set_totals`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol, Sequence, cast

import torch

from lowp.optim.backends import Backend, FusedBackend
from lowp.optim.collectives import Groups, PeerFailed, all_messages
from lowp.optim.kernels.checks import Span
from lowp.optim.kernels.kernel import Kernel, grad_factor, partition
from lowp.optim.kernels.native import rebuild as native_rebuild
from lowp.optim.ordered_sum import Pieces, Runs, rebuild_for
from lowp.optim.reference import working_grads
from lowp.optim.scratch import Scratch
from lowp.optim.slices import ParamSlice, StepContext, TensorSum
from lowp.optim.spec import OptimizerSpec
from lowp.optim.storage import working_copy

__all__ = ["exchange", "exchange_pieces", "ExchangeError", "min_numel", "MIN_NUMEL", "CUDA_REFERENCE_MIN_NUMEL"]

#: the smallest parameter whose sum is exchanged rather than gathered: 0, every one. The pieces of
#: all shards of a step are made together (the native kernel's pre-pass; the reference's
#: :class:`~lowp.optim.ordered_sum.Pieces`, one copy to the host), laid out and rebuilt together:
#: on 2 gloo ranks GPT-2's shapes / 8 step 1.6x faster than gathered with every sum exchanged on
#: the native kernel, 1.2-1.4x on the reference (``benchmarks/sharded_sums.py``)
MIN_NUMEL = 0
#: the same where the parameters are on a CUDA device, where no kernel makes the pieces (the
#: Triton kernel has no per-tensor pass: the reference computes each shard's terms, several
#: launches per shard, while an all-gather of a small parameter over NCCL is cheap); kept from
#: before the pieces were batched, not yet measured on a GPU
CUDA_REFERENCE_MIN_NUMEL = 1 << 16


class SumsOptimizer(Protocol):
    """What :func:`exchange` reads of the optimizer: its backend, the spec its kernels run and
    the terms of its sums (StableAdamW's ``tensor_terms``)."""

    backend: Backend
    param_groups: list[dict[str, Any]]

    def kernel_spec(self) -> OptimizerSpec | None:
        """The spec its fused kernels run, if any."""

    def tensor_terms(self, group: dict[str, Any], grads: list[torch.Tensor], states: dict[str, list[torch.Tensor]],
                     step: int) -> list[torch.Tensor]:
        """Per tensor, the fp32 terms of its sum before the step (nothing written)."""

    @classmethod
    def shards_sums(cls) -> bool:
        """Whether it exchanges its sums at all."""


def min_numel(optimizer: SumsOptimizer) -> int | None:
    """The smallest parameter whose sum ``optimizer`` exchanges (``None``: it exchanges none,
    :meth:`~lowp.optim.base.LowpOptimizer.shards_sums`): :data:`CUDA_REFERENCE_MIN_NUMEL` when any
    of its parameters is on a CUDA device (as :func:`~lowp.optim.backends.backend_for` decides:
    there no kernel makes the pieces, the native kernel being the CPU's), else :data:`MIN_NUMEL`.
    The same on every rank (its parameters' devices)."""
    if not optimizer.shards_sums():
        return None
    on_cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
    return CUDA_REFERENCE_MIN_NUMEL if on_cuda else MIN_NUMEL


def _admitted(kernel: Kernel, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
              ) -> tuple[list[ParamSlice], list[ParamSlice]]:
    """``slices`` split into those ``kernel`` admits and the others (nothing is written:
    admission's overlap record is dropped)."""
    spans: list[Span] = []
    return partition(slices, lambda s: kernel.admits(spec, ctx, s, spans))


def _pieces(optimizer: SumsOptimizer, ctx: StepContext, slices: list[ParamSlice], admitted: bool = False
            ) -> list[Runs]:
    """The pieces of each slice's terms, in the order of ``slices``: by the backend's kernel for
    the slices it admits and has a pass for (:meth:`Kernel.pieces_launches
    <lowp.optim.kernels.kernel.Kernel.pieces_launches>`: the native kernel's pre-pass), the others
    from the optimizer's ``tensor_terms`` on the reference's fp32 working copies (the same bits),
    one shard at a time, their pieces made together (:class:`~lowp.optim.ordered_sum.Pieces`: one
    copy to the host). ``admitted``: every slice is known to be the kernel's."""
    backend, spec = optimizer.backend, optimizer.kernel_spec()
    made = {id(s): Runs.empty() for s in slices if s.numel == 0}   # an empty shard
    rest = [s for s in slices if s.numel > 0]
    if isinstance(backend, FusedBackend) and spec is not None and backend.kernel.supports(spec) and rest:
        taken, others = (rest, []) if admitted else _admitted(backend.kernel, spec, ctx, rest)
        launches = backend.kernel.pieces_launches(spec, ctx, taken) if taken else None
        if launches is not None:
            numbers, factor = spec.numbers(ctx.group, ctx.step), grad_factor(ctx)
            for launch, members in launches:
                made.update(zip(map(id, members), launch.call([s.grad for s in members], numbers, factor)))
            rest = others
    if rest:
        pieces = Pieces([s.index.first() for s in rest], [s.numel for s in rest],
                        [cast(TensorSum, s.tensor_sum).numel for s in rest])
        scratch = Scratch()
        for s in rest:   # one shard at a time: the temporaries of one
            grads = working_grads(ctx, [s], scratch)
            states = {n: [working_copy(t)] for n, t in s.states.items()}
            [terms] = optimizer.tensor_terms(ctx.group, grads, states, ctx.step)
            pieces.add(terms)
        made.update(zip(map(id, rest), pieces.runs()))
    return [made[id(s)] for s in slices]


def exchange(optimizer: SumsOptimizer, jobs: Sequence[tuple[StepContext, list[ParamSlice]]],
             admitted: bool = False, failed: Exception | None = None) -> None:
    """Set ``tensor_sum.total`` of every slice of ``jobs`` that has a
    :class:`~lowp.optim.slices.TensorSum`, its pieces made from its terms (:func:`_pieces`, a
    job at a time) and exchanged (:func:`exchange_pieces`). ``admitted``: the backend's kernel
    took every slice of ``jobs`` in a step whose plan holds (a cached plan's: its tensors the
    same, its gradients checked), so its pieces pass takes them all without their admission
    again; default ``False``. ``failed``: this rank's error before the exchange (:func:`exchange_pieces`)."""
    parts = [(ctx, [s for s in slices if s.tensor_sum is not None]) for ctx, slices in jobs]
    parts = [(ctx, part) for ctx, part in parts if part]
    try:
        exchange_pieces([s for _, part in parts for s in part],
                        lambda: [runs for ctx, part in parts for runs in _pieces(optimizer, ctx, part, admitted)],
                        failed)
    finally:
        failed = None   # no reference cycle through the raised error's traceback


def exchange_pieces(slices: Sequence[ParamSlice], make: Callable[[], Sequence[Runs]],
                    failed: Exception | None = None) -> None:
    """Set ``tensor_sum.total`` of every one of ``slices`` (each with a
    :class:`~lowp.optim.slices.TensorSum`) from its pieces, ``make()`` (one per slice, in their
    order): one exchange of the pieces of all of them per mesh (over the process groups of the
    mesh's sharded dimensions, :func:`~lowp.optim.collectives.all_messages`, in the order of each
    mesh's first parameter), the whole tensors' sums rebuilt from every rank's pieces, all at once
    (:func:`~lowp.optim.ordered_sum.totals_from_pieces`). The ranks of a mesh call it with the same
    parameters (the collectives); a rank with no such slice makes no call, and neither does any
    other rank of its meshes (they step the same parameters).

    When this rank cannot make its pieces (``make`` raises: an error, out of memory), or failed
    before the exchange (``failed``: preparing its step's jobs), it still takes part in every
    exchange, sending a failure instead of its message, then raises its error: the ranks it
    exchanges with raise :class:`ExchangeError` rather than wait for it. Nothing is written
    either way."""
    if any(s.tensor_sum is None for s in slices):   # before any collective: the same on every rank
        raise ValueError("slices: expected shards that each have a TensorSum (an exchanged whole-tensor sum)")
    by_mesh: dict[Groups, list[int]] = {}
    for i, s in enumerate(slices):
        by_mesh.setdefault(cast(TensorSum, s.tensor_sum).groups, []).append(i)
    # meshes in the order of their first parameter in the groups, whatever the order of the jobs
    # (a full step's or a cached plan's): every rank of a mesh exchanges over the same groups in turn
    by_mesh = dict(sorted(by_mesh.items(), key=lambda mesh: min(slices[i].param_id for i in mesh[1])))
    made: Sequence[Runs] = ()
    failure: Exception | None = None
    try:
        if failed is not None:
            raise failed
        made = make()
        if len(made) != len(slices):
            raise RuntimeError(f"sharded sums: the pieces of {len(made)} shards, expected {len(slices)}")
    except Exception as exc:   # told to the other ranks below, raised after every exchange
        failure = exc
    failed_elsewhere = False
    for groups, at in by_mesh.items():
        mine = [(slices[i], made[i]) for i in at] if failure is None else []
        sent = None
        if failure is None and not failed_elsewhere:
            try:
                sent = _message(mine)
            except Exception as exc:   # out of memory: told to the others as a failure
                failure = exc
        everyone = all_messages(sent, groups)
        if everyone is None:
            failed_elsewhere = True
        elif failure is None:   # the same messages on every rank of the mesh: the same sums, or the same error
            try:
                _set_totals([s for s, _ in mine], everyone)
            except Exception as exc:   # told to the ranks of the later meshes as a failure
                failure = exc
    if failure is not None:
        try:
            raise failure
        finally:   # the traceback holds this frame: no reference cycle keeps the caller's memory alive
            failure = failed = None
    if failed_elsewhere:
        raise ExchangeError("sharded sums: another rank failed before its part of the exchange of per-tensor sums "
                            "(its own error says why); no rank wrote anything of this step")


def _message(made: list[tuple[ParamSlice, Runs]]) -> torch.Tensor:
    """What this rank sends of a mesh's pieces, float64: the run count ``r``, each run's
    ``(param_id, kind, first index, count)`` (``4 r`` numbers, exact: integers below 2**53), then
    every run's values in turn."""
    head = torch.cat([torch.zeros((0, 3), dtype=torch.int64), *(runs.head for _, runs in made)])
    ids = torch.tensor([s.param_id for s, _ in made], dtype=torch.int64)
    head = torch.cat([ids.repeat_interleave(torch.tensor([runs.head.shape[0] for _, runs in made],
                                                         dtype=torch.int64))[:, None], head], 1)
    return torch.cat([torch.tensor([head.shape[0]], dtype=torch.float64), head.reshape(-1).double(),
                      *(runs.values for _, runs in made)])


def _read_messages(everyone: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs ``(param_id, kind, first, count)`` (int64, ``[r, 4]``) and values of the messages
    (:func:`_message`) of every rank, end to end in ``everyone``; ``RuntimeError`` unless they
    read as such."""
    heads, values, at, end = [], [], 0, everyone.numel()
    while at < end:
        runs = float(everyone[at])
        if not (math.isfinite(runs) and runs == int(runs) and 0 <= runs <= (end - at - 1) // 4):
            raise RuntimeError(f"sharded sums: a message of {runs} runs with {end - at - 1} numbers after it")
        head = everyone[at + 1:at + 1 + 4 * int(runs)].view(-1, 4)
        ints = head.long()
        at += 1 + 4 * int(runs)
        if not torch.equal(ints.double(), head) or bool(((ints[:, 3] < 0) | (ints[:, 3] > end - at)).any()):
            raise RuntimeError("sharded sums: a run whose parameter, kind, index or count is not an integer, or whose "
                               "count is negative or larger than the message")
        count = sum(ints[:, 3].tolist())   # Python ints: no wrap-around
        if count > end - at:
            raise RuntimeError(f"sharded sums: a message of {count} pieces with {end - at} numbers left")
        heads.append(ints)
        values.append(everyone[at:at + count])
        at += count
    return torch.cat([torch.zeros((0, 4), dtype=torch.int64), *heads]), torch.cat([everyone[:0], *values])


def _set_totals(slices: list[ParamSlice], everyone: torch.Tensor) -> None:
    """Each slice's whole-tensor sum from every rank's message (:func:`_message`, end to end in
    ``everyone``): :func:`~lowp.optim.ordered_sum.totals_from_pieces` of all their runs at once,
    in C++ where the native kernel builds (:mod:`lowp.optim.kernels.native.rebuild`)."""
    numels = {s.param_id: cast(TensorSum, s.tensor_sum).numel for s in slices}
    ids = sorted(numels)
    head, values = _read_messages(everyone)
    position = torch.full((ids[-1] + 2,), -1, dtype=torch.int64)   # a parameter id's tensor; -1: not stepped here
    position[ids] = torch.arange(len(ids))
    tensor = position[head[:, 0].clamp(-1, ids[-1] + 1)]   # an id outside [0, ids[-1]] lands on the -1 at either end
    unknown = tensor < 0
    if unknown.any():
        raise RuntimeError(f"sharded sums: pieces of parameter {int(head[unknown][0, 0])}, which this rank does "
                           f"not step with an exchanged sum (every rank of a mesh must step the same parameters)")
    head[:, 0] = tensor
    rebuild = rebuild_for(head, [numels[i] for i in ids])   # kept from the last step when the runs are the same
    sums = native_rebuild.totals(rebuild, values) if native_rebuild.available() else rebuild.totals(values)
    totals = dict(zip(ids, sums.tolist()))
    for s in slices:
        cast(TensorSum, s.tensor_sum).total = totals[s.param_id]


class ExchangeError(PeerFailed):
    """Another rank failed before its part of the exchange of per-tensor sums: the step wrote nothing.

    Args:
        message: what failed, and that nothing was written.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
