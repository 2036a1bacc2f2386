"""The checks of gradient release (:mod:`lowp.optim.release`), each raising an error that names
the argument at fault before anything is stepped.

When the hooks are registered (:func:`check_arguments`, :func:`check_clip`,
:func:`check_accumulate`): a lowp optimizer of plain, materialized parameters, at least one
requiring grad, without an active release and whose ``nonfinite`` policy can be honoured one
parameter at a time; a positive ``accumulation_steps``; a GradScaler or ``None``; a usable
``max_norm`` and ``norm_type`` (as :func:`torch.nn.utils.clip_grad_norm_` takes them), not with
``accumulate="states"``. When a stepping backward pass begins (:func:`check_grads`,
:func:`scale_of`, :func:`check_ranks`, :func:`check_norm_ranks`): the gradients accumulated so far,
the scaler's scale, and a process alone in torch.distributed's default group unless
``local_gradients`` says no data parallelism reduces its gradients (a group may be initialized
after the hooks were registered); :func:`nested_error` is the error of a pass nested in another.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch

from lowp.optim import preflight, sharding
from lowp.optim.base import LowpOptimizer
from lowp.optim.hyper import real_value

__all__ = ["check_arguments", "check_clip", "check_accumulate", "check_grads", "scale_of", "check_ranks",
           "check_norm_ranks", "nested_error"]


def scale_of(scaler: torch.amp.GradScaler) -> float:
    """The current scale of an enabled ``scaler``; raise naming it when no loss was scaled yet or
    the scale is not a finite number > 0 (dividing it out would give no usable gradient)."""
    if scaler._scale is None:
        raise ValueError("scaler: it has not scaled a loss yet (scaler.scale(loss) creates its scale), so the "
                         "gradients of this pass carry no scale to divide out; scale the loss of every backward "
                         "pass with it, or release without scaler=")
    scale = scaler.get_scale()
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scaler: its scale is {scale}; expected a finite number > 0 (set by "
                         f"scaler.update(new_scale=...)?)")
    return scale


def check_grads(optimizer: LowpOptimizer) -> None:
    """Before a stepping pass steps anything: the gradients accumulated so far (by earlier
    micro-batches, or set by hand) must be ones autograd can add this pass's gradient to and the
    step can use, or the pass would fail half-way, after stepping the parameters reached first."""
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        grad = p.grad
        if grad is None:
            continue
        preflight.check_grad(p, grad, f"params[{i}]")
        if not grad.is_contiguous() and torch._debug_has_internal_overlap(grad) == 1:
            raise ValueError(f"grad of params[{i}]: its elements overlap in memory (an expanded or stride-0 view, "
                             f"strides {grad.stride()}); autograd cannot add a gradient into it: set p.grad = "
                             f"p.grad.clone() or None")


def nested_error() -> RuntimeError:
    """The error of a backward pass that began inside another (the hooks cannot tell where the
    outer one ends)."""
    return RuntimeError("gradient release: a backward pass ran inside another (reentrant activation checkpointing, "
                        "torch.utils.checkpoint(..., use_reentrant=True)); the hooks cannot tell where the outer "
                        "pass ends. Use use_reentrant=False")


def check_ranks(local_gradients: bool) -> None:
    """Raise unless this process is alone in torch.distributed's default group or
    ``local_gradients`` says that nothing reduces its gradients after backward."""
    if local_gradients or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = torch.distributed.get_world_size()
    if world > 1:
        raise ValueError(
            f"local_gradients: this process is rank {torch.distributed.get_rank()} of {world}, and gradient release "
            "steps each parameter with the gradient autograd accumulated on this rank, before "
            "DistributedDataParallel, FSDP1 or an all-reduce of your own could average it: under data parallelism "
            "the ranks' weights would drift apart. (Under DDP release saves no memory either: its buckets hold "
            "every gradient.) Pass local_gradients=True only when no data parallelism reduces these gradients "
            "(tensor or pipeline parallelism alone); otherwise step with optimizer.step()")


def check_norm_ranks(max_norm: float | None) -> None:
    """Raise when ``max_norm`` is set in a process whose default group has more than one rank:
    the norm would be this rank's parameters' only (tensor or pipeline parallelism)."""
    if max_norm is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = torch.distributed.get_world_size()
    if world > 1:
        raise ValueError(
            f"max_norm: this process is rank {torch.distributed.get_rank()} of {world}, and the hooks measure the "
            "gradients of this rank's parameters only; the global norm over the model's shards or stages would need "
            "a collective the release hooks cannot run. Release without max_norm= (and clip by other means) in a "
            "multi-rank group")


def check_clip(max_norm: Any, norm_type: Any) -> tuple[float | None, float]:
    """Raise naming ``max_norm`` or ``norm_type`` unless they are usable; return them as floats."""
    norm = real_value(norm_type)
    if norm is None or math.isnan(norm) or norm <= 0:
        raise ValueError(f"norm_type: expected a number > 0 (float('inf') for the largest magnitude), "
                         f"got {norm_type!r}")
    if max_norm is None:
        return None, norm
    value = real_value(max_norm)
    if value is None or math.isnan(value) or value <= 0:
        raise ValueError(f"max_norm: expected a number > 0 (float('inf') measures grad_norm without clipping) "
                         f"or None, got {max_norm!r}")
    check_norm_ranks(value)
    return value, norm


def check_accumulate(accumulate: Any, accumulation_steps: int, max_norm: float | None) -> None:
    """Raise naming ``accumulate`` unless it is ``"gradients"`` or ``"states"``, or when states
    accumulation meets ``max_norm`` (no pass holds the cycle's gradient whose norm would clip it)."""
    if accumulate not in ("gradients", "states"):
        raise ValueError(f"accumulate: expected 'gradients' (hold the micro-batches' gradients until the last "
                         f"backward pass of a cycle) or 'states' (fold each micro-batch into the optimizer states, "
                         f"optimi's optimizer_accumulation), got {accumulate!r}")
    if accumulate == "states" and accumulation_steps > 1 and max_norm is not None:
        raise ValueError("max_norm: with accumulate='states' no backward pass holds the cycle's accumulated gradient, "
                         "so there is no global norm to clip it by (each micro-batch's gradient is folded into the "
                         "states and freed); release with accumulate='gradients' to clip, or without max_norm=")


def check_arguments(optimizer: Any, accumulation_steps: Any, scaler: Any, local_gradients: Any) -> int:
    """Raise naming the argument that :class:`GradientRelease` cannot work with; return
    ``accumulation_steps`` as an int."""
    if type(local_gradients) is not bool:
        raise TypeError(f"local_gradients: expected a bool, got {type(local_gradients).__name__}")
    if not isinstance(optimizer, LowpOptimizer):
        raise TypeError(f"optimizer: expected a lowp optimizer (lowp.optim.LowpOptimizer), got "
                        f"{type(optimizer).__name__}")
    integer = hasattr(accumulation_steps, "__index__") and not isinstance(accumulation_steps, (bool, torch.Tensor))
    steps = operator.index(accumulation_steps) if integer else None
    if steps is None or steps < 1:
        raise ValueError(f"accumulation_steps: expected an int >= 1, got {accumulation_steps!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    if optimizer._released_by is not None:
        raise RuntimeError("optimizer: its gradients are released already; remove() the first handle before "
                           "registering another")
    if optimizer.nonfinite == "skip_step":
        raise ValueError("nonfinite: 'skip_step' cannot be honoured with gradient release (the layers stepped "
                         "before a non-finite gradient appears cannot be taken back); use 'skip_param' or 'off'")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if sharding.is_dtensor(p):
            raise TypeError(f"params[{i}]: a DTensor; gradient release steps plain tensors only (FSDP2 "
                            f"reduce-scatters its gradients after the hooks would run)")
        if p.is_meta:
            raise ValueError(f"params[{i}]: on the meta device, without data to step; materialize the model "
                             f"(to_empty() and initialization) before release_gradients")
    if not any(p.requires_grad for p in params):
        raise ValueError("optimizer: none of its parameters requires grad, so no hook could be registered and "
                         "nothing would ever be stepped (step() does nothing while released); set requires_grad "
                         "before release_gradients (parameters frozen or unfrozen later are handled)")
    check_ranks(local_gradients)
    return steps
