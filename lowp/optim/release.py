"""Gradient release: step each parameter during the backward pass and free its gradient.

:func:`release_gradients` registers a post-accumulate-grad hook
(:meth:`torch.Tensor.register_post_accumulate_grad_hook`) on every parameter of a lowp optimizer.
On the backward pass that completes a step, the hook steps its parameter as soon as the gradient
is accumulated (:meth:`~lowp.optim.base.LowpOptimizer.step_params`) and sets ``p.grad = None``,
so the gradients of the whole model never exist at once: the live gradient memory is about one
layer's instead of the model's (Zhao et al., *GaLore*, 2024, sec. 4, "per-layer weight updates";
Lv et al., *Full Parameter Fine-tuning for Large Language Models with Limited Resources* (LOMO),
2023, fuse the update into the backward pass the same way).

Each parameter is stepped with exactly the bookkeeping of a whole ``step()`` (checks first,
state creation, its own step count, its position over all groups as the ``param_id`` of its
stochastic-rounding streams), so a run with release equals the run without it bit for bit.

Backward passes are counted: with ``accumulation_steps=k`` the hooks leave the gradients of the
first ``k - 1`` backward passes to accumulate and step on the ``k``-th (``accumulate="gradients"``,
the default: exact gradient accumulation, but every gradient lives until the ``k``-th pass, as
without release). ``accumulate="states"`` holds no gradient across passes: each of the first
``k - 1`` passes takes a *states-only* step with its micro-batch's gradient (the moments and the
step count advance exactly as in a whole step; the weights and their write-back buffers stay) and
frees it, and the ``k``-th pass takes a whole step. This is optimi's ``optimizer_accumulation``
(Warner, optimi docs, "Optimizer Accumulation"; also the accumulation of Zhao et al., GaLore): an
approximation of gradient accumulation in which the moments average ``k`` micro-batch steps
instead of one step on the summed gradient (an exponential average then decays ``k`` times per
weight update, and Adam's second moment averages the squares of the micro-batch gradients rather
than the square of their mean). L2 weight decay (``Adam``) is part of each micro-batch's
gradient, as in a whole step; decoupled decay is part of the weight update only. At the end of a stepping
backward pass (an autograd engine callback), every parameter that still holds a gradient (one that
this pass did not reach, or one added to the optimizer later) is stepped too, so one release step
covers what one ``step()`` would. A backward pass that reaches none of the parameters does not
count.

With a :class:`torch.amp.GradScaler`, the step happens before ``scaler.step`` could look at the
gradients, so the hooks divide the scaler's current scale out themselves and skip each parameter
whose gradient overflowed (its update cannot wait for the other layers' verdict: those layers
have been stepped already); at the end of the stepping pass the scaler is told whether anything
overflowed, the record ``scaler.unscale_`` would leave, so ``scaler.step(opt)`` (which then only
calls the optimizer's ``step``, a no-op here) and ``scaler.update()`` behave as usual.

The handle also watches ``optimizer.step()`` (a step post-hook, :meth:`torch.optim.Optimizer.register_step_post_hook`):
a training loop that calls it announces where its accumulation cycles end, and when it comes after
a number of backward passes other than ``accumulation_steps`` (and other than 0) the hooks and the
loop disagree about the cycle: ``step()`` raises ``ValueError`` naming ``accumulation_steps``. That
is the earliest point it can be known: before the first ``step()`` nothing tells how many passes
the loop accumulates, so by then (with too few ``accumulation_steps``) the first cycle has been
stepped once per ``accumulation_steps`` passes instead of once; with too many, nothing has been
stepped yet. A loop that never calls ``step()`` is not checked.

Gradient clipping by the global norm needs every gradient before the first step, which release
never holds. ``max_norm`` offers the lagged approximation: each stepping pass measures the norm of
the gradients it steps (in float64, a chunk of the gradient at a time; divided by the scaler's
scale), and multiplies each gradient, before stepping it, by the coefficient
``min(1, max_norm / (norm + 1e-6))`` of :func:`torch.nn.utils.clip_grad_norm_` computed from the
*previous* stepping pass's norm. The first step after registration is not clipped; a non-finite
norm (an overflow) is reported but leaves the coefficient as it was. ``torch.nn.utils.clip_grad_norm_``
after the backward pass finds no gradients (the hooks freed them): it clips nothing and returns 0.

Data parallelism does not mix with it: DistributedDataParallel (and FSDP1, or a hand-written
all-reduce) averages the gradients across ranks after autograd has accumulated them, which is
after the hooks would have stepped with this rank's own gradient, so the ranks' weights would
drift apart without an error. DDP's buckets also hold every gradient for the all-reduce, so
there is no gradient memory to save. In a process whose default process group has more than one
rank, release therefore refuses unless ``local_gradients=True`` says that no data parallelism
reduces these gradients (tensor or pipeline parallelism alone); the check is repeated when a
backward pass begins, before anything is stepped, for a group initialized after the hooks.

Everything that can be checked before a step is checked when the hooks are registered (the
arguments, a parameter requiring grad, parameters with data) or when a stepping pass begins (the
scaler's scale, the gradients accumulated so far), before anything changes, raising an error
that names the argument (:mod:`lowp.optim.release_checks`). An exception
inside a backward pass (a user hook, the loss's backward, ``KeyboardInterrupt``, a gradient the
step refuses) propagates unchanged; the parameters that pass reached before it have been stepped
and cannot be taken back, the others keep their weights, and the pass is not counted. The next
backward pass starts afresh: the hooks notice that the autograd engine dropped the failed pass's
end-of-pass callback (it frees it, which a weak reference sees), so they do not take the new pass
for one nested inside the failed one. Parameters removed from the optimizer's groups after the
hooks were registered are left alone, as ``step()`` would leave them.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import torch
from torch.amp.grad_scaler import OptState
from torch.utils.hooks import RemovableHandle

from lowp.optim.base import LowpOptimizer, real_value
from lowp.optim.release_checks import (check_accumulate, check_arguments, check_clip, check_grads, check_norm_ranks,
                                       check_ranks, nested_error, scale_of)

__all__ = ["GradientRelease", "release_gradients"]


class GradientRelease:
    """The hooks of :func:`release_gradients` on one optimizer: ``remove()`` them, or use the
    handle as a context manager (removed on exit).

    While active, ``optimizer.step()`` only runs its closure (the parameters were stepped during
    the backward pass); after :meth:`remove` it steps again as usual, including gradients that
    were accumulating when the hooks were removed.

    Args:
        optimizer: the lowp optimizer whose parameters are stepped during the backward pass.
        accumulation_steps: backward passes per step, a positive int.
        scaler: the :class:`torch.amp.GradScaler` that scales the loss, or ``None``.
        local_gradients: ``True`` when no data parallelism reduces the gradients after backward;
            required when torch.distributed's default group has more than one rank.
        max_norm: clip by the previous stepping pass's global gradient norm (module docstring), or
            ``None``: no clipping, no norm measured.
        norm_type: the norm's order, as in :func:`torch.nn.utils.clip_grad_norm_`.
        accumulate: ``"gradients"`` or ``"states"``, where the first ``accumulation_steps - 1``
            passes of a cycle go (module docstring).
    """

    def __init__(self, optimizer: LowpOptimizer, accumulation_steps: int = 1,
                 scaler: torch.amp.GradScaler | None = None, local_gradients: bool = False,
                 max_norm: float | None = None, norm_type: float = 2.0, accumulate: str = "gradients") -> None:
        accumulation_steps = check_arguments(optimizer, accumulation_steps, scaler, local_gradients)
        self.max_norm, self.norm_type = check_clip(max_norm, norm_type)
        check_accumulate(accumulate, accumulation_steps, self.max_norm)
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.accumulate = accumulate
        self.scaler = scaler
        self.local_gradients = local_gradients
        #: Backward passes seen (that reached a parameter) since the hooks were registered.
        self.backward_passes = 0
        self._passes_at_step = 0   # backward_passes when optimizer.step() last returned
        self._cycles = 0   # step() calls that came after accumulation_steps passes
        self._grad_norm: float | None = None
        self._clip_coef = 1.0
        self._norms: list[torch.Tensor] = []   # each parameter's norm in the current stepping pass
        self._in_backward = False
        self._task = -1   # the autograd graph task of the current or last backward pass
        self._stepping = False   # this pass steps (its last pass of a cycle; every pass with accumulate="states")
        self._update_weights = False   # this pass ends a cycle: whole steps
        self._new_step = True
        self._grad_scale: float | None = None
        self._all_finite = True
        self._members: set[int] = set()   # ids of the optimizer's parameters during the current pass
        self._pass_end: Callable[[], Any] = lambda: None   # the current pass's end callback while it lives
        self._hooks: list[RemovableHandle] = []
        try:
            for p in (p for g in optimizer.param_groups for p in g["params"] if p.requires_grad):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
            self._hooks.append(optimizer.register_step_post_hook(self._after_step))
        except BaseException:
            self.remove()
            raise
        optimizer._released_by = self

    @property
    def active(self) -> bool:
        """``True`` until :meth:`remove`."""
        return self.optimizer._released_by is self

    @property
    def grad_norm(self) -> float | None:
        """The global norm (``norm_type``) of the gradients the last stepping pass stepped, before
        clipping and unscaled: what :func:`torch.nn.utils.clip_grad_norm_` would have returned
        before that ``step()``. ``None`` before the first stepping pass or without ``max_norm``;
        ``inf`` or ``nan`` after an overflow. The next stepping pass clips with the coefficient of
        the last finite one. Assigning a finite number >= 0 (the last value of a checkpointed run)
        sets the coefficient of the next step, so that a resumed run clips as the uninterrupted one."""
        return self._grad_norm

    @grad_norm.setter
    def grad_norm(self, value: float) -> None:
        norm = real_value(value, allow_tensor=True)
        if norm is None or not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"grad_norm: expected a finite number >= 0, got {value!r}")
        self._grad_norm = norm
        self._clip_coef = self._coefficient(norm)

    def _coefficient(self, norm: float) -> float:
        """``clip_grad_norm_``'s clamped coefficient for a total ``norm`` (1 without ``max_norm``)."""
        return 1.0 if self.max_norm is None else min(1.0, self.max_norm / (norm + 1e-6))

    def remove(self) -> None:
        """Remove the hooks: the optimizer steps in ``step()`` again. Gradients accumulated so
        far stay for that ``step()``. Removing twice does nothing."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.active:
            self.optimizer._released_by = None

    def __enter__(self) -> GradientRelease:
        """The handle itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove the hooks."""
        self.remove()

    def _begin_backward(self, members: set[int]) -> None:
        """First hook of a backward pass: does it step, with which scale; queue its end.
        ``members``: the ids of the optimizer's parameters now."""
        task = torch._C._current_graph_task_id()
        if task < self._task:   # task ids grow: an outer pass goes on after a nested one ended
            raise nested_error()
        check_ranks(self.local_gradients)   # a group initialized after the hooks were registered
        check_norm_ranks(self.max_norm)
        last = (self.backward_passes + 1) % self.accumulation_steps == 0
        stepping = last or self.accumulate == "states"
        enabled = self.scaler is not None and self.scaler.is_enabled()
        grad_scale = scale_of(self.scaler) if enabled and stepping else None  # type: ignore[arg-type]
        if stepping:
            check_grads(self.optimizer)
        self._task = task
        self._in_backward = True
        self._stepping = stepping
        self._update_weights = last
        self._new_step = True
        if self.backward_passes % self.accumulation_steps == 0:   # a cycle begins: overflows counted anew
            self._all_finite = True
        self._grad_scale = grad_scale
        self._norms = []
        self._members = members
        end = _PassEnd(self)
        self._pass_end = weakref.ref(end)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _step(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` as part of this backward pass's optimizer step and free their gradients;
        with ``max_norm``, measure their norms first and clip them with the previous pass's coefficient."""
        # a sparse gradient is left to step_params, which refuses it naming the parameter
        if self.max_norm is not None and all(p.grad is not None and p.grad.layout == torch.strided for p in params):
            self._norms.extend(_norm(p.grad, self.norm_type) for p in params)  # type: ignore[arg-type]
            if self._clip_coef < 1.0:   # clip_grad_norm_ multiplies by 1.0 too: a no-op
                for p in params:
                    p.grad.mul_(self._clip_coef)   # type: ignore[union-attr]
        self._all_finite &= self.optimizer.step_params(params, grad_scale=self._grad_scale, new_step=self._new_step,
                                                       update_weights=self._update_weights)
        self._new_step = False
        for p in params:
            p.grad = None

    def _hook(self, p: torch.Tensor) -> None:
        if not self.active:
            return
        try:
            # the engine frees the end callback of a pass that raised without running it: a pass
            # whose callback is gone is over, and this hook belongs to a new one
            if not self._in_backward or self._pass_end() is None:
                members = {id(q) for g in self.optimizer.param_groups for q in g["params"]}
                if id(p) not in members:   # removed from the optimizer: left alone, as step() would
                    return
                self._begin_backward(members)
            elif torch._C._current_graph_task_id() != self._task:
                raise nested_error()
            elif id(p) not in self._members:
                return
            if self._stepping:
                self._step([p])
        except BaseException:
            self._in_backward = False   # the engine drops the queued callback of a failed pass
            raise

    def _end_backward(self) -> None:
        """After the backward pass: count it; after a stepping one, step the parameters that
        still hold a gradient and report overflows to the scaler."""
        self._in_backward = False
        self.backward_passes += 1
        if not (self._stepping and self.active):
            return
        left = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if left:
            self._step(left)
        if self.max_norm is not None:
            self._end_norm()
        if self._grad_scale is not None and self._update_weights:
            _report_overflow(self.scaler, self.optimizer, not self._all_finite)  # type: ignore[arg-type]
            if not self._all_finite:   # scaler.step skips optimizer.step() after an overflow
                self._passes_at_step = self.backward_passes

    def _end_norm(self) -> None:
        """The stepping pass's global norm, from its parameters' norms (one host synchronization):
        kept as :attr:`grad_norm` and, when finite, the next pass's clipping coefficient."""
        norms = self._norms
        self._norms = []
        if not norms:
            return
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), self.norm_type)
        norm = float(total) / (self._grad_scale or 1.0)
        self._grad_norm = norm
        if math.isfinite(norm):
            self._clip_coef = self._coefficient(norm)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After ``optimizer.step()`` (its closure's backward pass included): it must close a cycle
        of ``accumulation_steps`` backward passes, or come after none."""
        if not self.active:
            return
        passes = self.backward_passes - self._passes_at_step
        self._passes_at_step = self.backward_passes
        if passes == 0:
            return
        if passes == self.accumulation_steps:
            self._cycles += 1
            return
        k = self.accumulation_steps
        since = "the previous step()" if self._cycles else "release_gradients"
        every = "after every backward pass" if k == 1 else f"every {k} backward passes"
        if passes > k:
            done = f"the hooks stepped the parameters {every}, {passes // k} times in this cycle instead of once"
        else:
            done = f"the hooks step the parameters {every}, so this cycle stepped nothing (its gradients accumulate)"
        batches = "1 micro-batch" if passes == 1 else f"{passes} micro-batches"
        raise ValueError(
            f"accumulation_steps: optimizer.step() came after {passes} backward pass{'es' if passes > 1 else ''} "
            f"since {since}, but the hooks were registered with accumulation_steps={k}: {done}. If every "
            f"optimizer step accumulates {batches} (transformers.Trainer's gradient_accumulation_steps="
            f"{passes}), remove() this handle and register release_gradients(opt, accumulation_steps={passes}); "
            f"every cycle must be that long (make the number of micro-batches of an epoch a multiple of it)")


class _PassEnd:
    """The end-of-pass callback queued with the autograd engine: calls ``_end_backward``. The
    engine frees it after the pass, run or (when the pass raised) not, so a weak reference to it
    tells whether the pass is still going."""

    def __init__(self, release: GradientRelease) -> None:
        self.release = release

    def __call__(self) -> None:
        self.release._end_backward()


#: Elements per chunk of a gradient whose norm is taken in float64: an 8 MiB copy at most.
_NORM_CHUNK = 1 << 20


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of ``grad`` as a float64 tensor on its device, taken in float64 chunk by
    chunk (the norm of the chunks' norms): a float32 reduction on the CPU drifts by about 1e-5 over
    a million elements, and a float64 copy of the whole gradient would cost four bytes per bf16
    element more than release saves."""
    flat = grad.reshape(-1)
    parts = [torch.linalg.vector_norm(c, norm_type, dtype=torch.float64) for c in flat.split(_NORM_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), norm_type)


def _report_overflow(scaler: torch.amp.GradScaler, optimizer: LowpOptimizer, found: bool) -> None:
    """Leave in ``scaler`` the record ``scaler.unscale_(optimizer)`` would: whether a gradient of
    ``optimizer`` overflowed, which ``scaler.update()`` reads to back off or grow the scale, and
    the stage that makes ``scaler.step(optimizer)`` use it instead of checking the (freed) gradients.
    GradScaler keeps this record in a private attribute; ``tests/test_optim_release.py`` pins it."""
    scale = scaler._scale
    device = scale.device if scale is not None else torch.device(scaler._device)
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {device: torch.full((), float(found), dtype=torch.float32, device=device)}
    state["stage"] = OptState.UNSCALED


def release_gradients(optimizer: LowpOptimizer, accumulation_steps: int = 1,
                      scaler: torch.amp.GradScaler | None = None, local_gradients: bool = False,
                      max_norm: float | None = None, norm_type: float = 2.0,
                      accumulate: str = "gradients") -> GradientRelease:
    """Step ``optimizer``'s parameters during the backward pass and free each gradient right
    after (module docstring); returns the handle that removes the hooks.

    ``optimizer.step()`` then only runs its closure and ``zero_grad()`` finds the stepped
    gradients freed already, so a training loop keeps its shape::

        release = release_gradients(opt, accumulation_steps=4)
        for i, (x, y) in enumerate(loader):
            loss_fn(model(x), y).backward()        # every 4th backward pass steps
            if (i + 1) % 4 == 0:
                opt.step()                         # no-op while released
                opt.zero_grad()
        release.remove()

    Args:
        optimizer: a lowp optimizer of plain (not DTensor, not meta) parameters, at least one of
            them requiring grad, whose ``nonfinite`` is ``"skip_param"`` or ``"off"``, without an
            active release.
        accumulation_steps: backward passes per step (default 1): the gradients of the first
            ``accumulation_steps - 1`` accumulate as usual and the last one steps. A positive int
            (a numpy integer too; not a bool). It must match the loop: an ``optimizer.step()``
            after another number of backward passes (but not 0) raises ``ValueError`` naming it
            and the count it saw (with ``transformers.Trainer``: its ``gradient_accumulation_steps``).
        scaler: the :class:`torch.amp.GradScaler` that scales the loss (default ``None``): the
            hooks unscale with its current scale, skip parameters whose gradient overflowed and
            report the overflow to it for ``scaler.update()``. Without it a scaled loss would
            step with scaled gradients. A stepping pass raises ``ValueError`` naming it, before
            any step, when it has scaled no loss yet or its scale is not a finite number > 0.
        local_gradients: ``True`` when no data parallelism (DistributedDataParallel, FSDP1, an
            all-reduce of the gradients) reduces the gradients after the backward pass. Required
            (``ValueError`` otherwise) when torch.distributed's default process group has more
            than one rank: release would step each rank with its own unaveraged gradient.
        max_norm: clip the gradients by their global norm, lagged by one step (default ``None``:
            no clipping). Each stepping pass measures the norm of its gradients
            (:attr:`GradientRelease.grad_norm`, for logging) and clips with the coefficient
            ``min(1, max_norm / (norm + 1e-6))`` of the previous stepping pass's norm, so the first
            step is unclipped. A number > 0; ``float('inf')`` measures without clipping. Refused
            (``ValueError``) in a multi-rank group, where the norm would be this rank's only.
            ``torch.nn.utils.clip_grad_norm_`` after backward finds the gradients freed and
            clips nothing: with ``transformers.Trainer`` set ``max_grad_norm=0`` and pass this.
        norm_type: the order of the norm (default 2.0), a number > 0 or ``float('inf')``.
        accumulate: ``"gradients"`` (default): the first ``accumulation_steps - 1`` passes of a
            cycle accumulate their gradients as usual (exact accumulation; every gradient lives
            until the last pass). ``"states"``: each of them takes a states-only step with its
            gradient and frees it, so no gradient outlives its layer's backward (optimi's
            ``optimizer_accumulation``, an approximation: module docstring). With a scaler, each
            pass is unscaled with the current scale and an overflow anywhere in the cycle is
            reported at its last pass. Refused with ``max_norm`` when ``accumulation_steps > 1``.

    Returns:
        The :class:`GradientRelease` handle (``remove()``, context manager).
    """
    return GradientRelease(optimizer, accumulation_steps, scaler, local_gradients, max_norm, norm_type, accumulate)
