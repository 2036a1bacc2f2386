"""Admission checks: which tensors a fused kernel may receive as raw pointers.

The native and Triton kernels read and write a tensor through ``data_ptr()`` and ``numel()``
alone, so they need *kernel memory*: a plain tensor (``torch.Tensor`` or ``nn.Parameter``, no
``__torch_dispatch__`` subclass such as DTensor, whose ``data_ptr()`` is 0), strided layout, no
nested tensor, no lazy negation bit, C-contiguous, at least one element, a data pointer aligned
to the element size, and a storage that really holds ``numel`` elements from that pointer (a
storage freed with ``untyped_storage().resize_(0)``, as FSDP does, keeps its shape).

Three outcomes for a parameter slice (:func:`check_slice`, then the backend's own dtype rules):

- *kernel*: everything above holds, with the dtypes the kernel has a variant for;
- *reference*: the inputs are valid but not kernel memory (views with odd strides, unaligned or
  subclass tensors, other dtypes, no elements): the optimizer's reference pipeline runs them;
- *error* (``ValueError``/``TypeError`` naming the argument, raised before any tensor is
  written): inputs that no backend can run correctly: a gradient whose shape differs from its
  parameter's, tensors on another device, a missing compensation/remainder buffer, a state
  whose shape differs from the parameter's or that is not floating-point, a gradient or state
  in float64 for a weight that is not (or the reverse: the update cannot mix them), a buffer of the wrong
  kind (exact mode's remainder is an integer, kahan's compensation floating-point), a storage
  too small for its tensor, a written tensor whose elements overlap (stride 0), a plain tensor
  mixed with a subclass tensor.

Tensors that overlap *each other* (parameters sharing memory) make the result depend on the
order of the writes: :func:`overlapping` finds them so the backend runs the whole batch in the
reference's order.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from lowp.optim.backends import ParamSlice, StepContext

__all__ = ["PLAIN_TYPES", "plain", "storage_fits", "kernel_memory", "check_slice", "check_kernel_args", "overlapping"]

#: Tensor types whose memory is their own storage (``nn.Parameter`` only adds autograd metadata).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain(t: torch.Tensor) -> bool:
    """A plain strided tensor whose elements are stored as they read: no subclass, no sparse,
    mkldnn or nested layout, no lazy negation or conjugation bit."""
    return (type(t) in PLAIN_TYPES and t.layout is torch.strided and not t.is_nested and not t.is_neg()
            and not t.is_conj())


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last one ``t`` addresses (0 when it has none)."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel()
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def storage_fits(t: torch.Tensor) -> bool:
    """Whether the storage of plain ``t`` holds every element ``t`` addresses: ``(offset +
    extent) * itemsize <= nbytes``, with a non-null data pointer when there is any element."""
    extent = _extent(t)
    if extent == 0:
        return True
    storage = t.untyped_storage()
    return storage.data_ptr() != 0 and (t.storage_offset() + extent) * t.element_size() <= storage.nbytes()


def kernel_memory(t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> bool:
    """Whether ``t`` may be handed to a kernel as ``(data_ptr, numel)``: plain, contiguous, one
    of ``dtypes``, at least one element, element-aligned, inside its storage."""
    return (plain(t) and t.dtype in dtypes and t.is_contiguous() and t.numel() > 0
            and t.data_ptr() % t.element_size() == 0 and storage_fits(t))


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(name: str, t: torch.Tensor, param: torch.Tensor, written: bool) -> None:
    """The errors of :func:`check_slice` for one tensor of a slice (``param`` included)."""
    own = type(t) in PLAIN_TYPES
    if own != (type(param) in PLAIN_TYPES) or (not own and type(t) is not type(param)):
        raise TypeError(f"{name}: a {type(t).__name__} next to a {type(param).__name__} parameter; the "
                        f"gradient, states and buffer must be tensors of the parameter's kind")
    if t is not param and t.device != param.device:
        raise ValueError(f"{name}: expected a tensor on the parameter's device {param.device}, got {t.device}")
    if t is not param and t.shape != param.shape:
        what = "gradient" if name == "grad" else "tensor"
        raise ValueError(f"{name}: a {what} of shape {_shape(t)} for a parameter of shape {_shape(param)}; "
                         f"the shapes must be equal")
    if not own or t.layout is not torch.strided or t.is_nested or t.is_meta:
        return
    if not storage_fits(t):
        raise ValueError(f"{name}: its storage holds {t.untyped_storage().nbytes()} bytes, fewer than its shape "
                         f"{_shape(t)} addresses (was the storage freed or resized?)")
    if written and not t.is_contiguous() and any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        raise ValueError(f"{name}: several of its elements share one memory location (stride 0, e.g. an "
                         f"expanded view); an optimizer cannot write it")


def _check_precision(name: str, t: torch.Tensor, param: torch.Tensor) -> None:
    """The update computes in float64 for float64 weights and in float32 otherwise; a gradient or
    state on the other side cannot enter the same arithmetic (torch refuses to mix them)."""
    if (t.dtype == torch.float64) != (param.dtype == torch.float64):
        raise TypeError(f"{name}: a {t.dtype} tensor for a {param.dtype} parameter; the update computes in "
                        f"{'float64' if param.dtype == torch.float64 else 'float32'}, so it must be "
                        f"{'float64' if param.dtype == torch.float64 else 'float32, bfloat16 or float16'}")


def check_slice(ctx: StepContext, s: ParamSlice) -> None:
    """Raise for a slice that no backend can run correctly (see the module docstring), before
    anything is written: ``ValueError``/``TypeError`` naming ``params``, ``grad``, the state or
    the mode's buffer."""
    buffer_name = ctx.mode.buffer_name
    if buffer_name is not None and s.buffer is None:
        raise ValueError(f"{buffer_name}: mode {ctx.mode.name!r} needs its {buffer_name} buffer for this "
                         f"parameter, and the optimizer state has none")
    _check_tensor("params", s.param, s.param, True)
    _check_tensor("grad", s.grad, s.param, False)
    _check_precision("grad", s.grad, s.param)
    for name, t in s.states.items():
        _check_tensor(name, t, s.param, True)
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point optimizer state, got {t.dtype}")
        _check_precision(name, t, s.param)
    if s.buffer is not None:
        _check_tensor(buffer_name or "buffer", s.buffer, s.param, True)
        if s.buffer.is_floating_point() != (ctx.mode.name != "exact"):
            kind = "an integer remainder" if ctx.mode.name == "exact" else "a floating-point compensation"
            raise TypeError(f"{buffer_name or 'buffer'}: mode {ctx.mode.name!r} needs {kind}, got {s.buffer.dtype}")


def check_kernel_args(slices: Iterable[ParamSlice], names: Sequence[str], device: str,
                      dtypes: tuple[torch.dtype | None, ...]) -> None:
    """The last check before a kernel call over ``slices``: ``RuntimeError`` unless every tensor
    the variant reads, ``dtypes`` = (weight, gradient, buffer or ``None``, one per state in
    ``names``), is present with that dtype and the weight's number of elements on ``device``,
    and is kernel memory (:func:`kernel_memory`; a non-contiguous gradient, which the caller
    copies first, needs only to be plain and inside its storage)."""
    weight, grad, buffer, *states = dtypes
    if len(states) != len(names):
        raise RuntimeError(f"kernel call: {len(states)} state dtypes for states {list(names)}")
    for s in slices:
        roles = [("params", s.param, weight), ("grad", s.grad, grad),
                 *((n, s.states.get(n), dt) for n, dt in zip(names, states))]
        if buffer is not None:
            roles.append(("buffer", s.buffer, buffer))
        for role, t, dtype in roles:
            ok = (t is not None and t.device.type == device and t.numel() == s.param.numel()
                  and (kernel_memory(t, (dtype,)) if role != "grad" or t.is_contiguous()
                       else plain(t) and t.dtype == dtype and storage_fits(t)))
            if not ok:
                raise RuntimeError(f"kernel call: {role} is not a {device} tensor of {s.param.numel()} {dtype} "
                                   f"elements in plain contiguous memory; the admission checks should have "
                                   f"sent it to the reference path")


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``t`` addresses (a superset for strided views), ``None`` when empty."""
    extent = _extent(t)
    if extent == 0:
        return None
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def overlapping(slices: Iterable[ParamSlice]) -> bool:
    """Whether a tensor written by the step (weight, state, buffer) shares bytes with any other
    tensor of ``slices`` (gradients may share memory with each other: they are only read).
    Plain CPU/CUDA tensors only: a subclass's memory is not its own to compare."""
    spans: list[tuple[int, int, int, bool]] = []
    for s in slices:
        tensors = [(s.param, True), (s.grad, False), *((t, True) for t in s.states.values()),
                   *([(s.buffer, True)] if s.buffer is not None else [])]
        for t, written in tensors:
            if type(t) in PLAIN_TYPES and t.layout is torch.strided and not t.is_nested:
                span = _span(t)
                if span is not None:
                    spans.append((*span, t.get_device(), written))
    spans.sort()
    end_any: dict[int, int] = {}
    end_written: dict[int, int] = {}
    for start, end, device, written in spans:
        if start < end_written.get(device, 0) or (written and start < end_any.get(device, 0)):
            return True
        end_any[device] = max(end_any.get(device, 0), end)
        if written:
            end_written[device] = max(end_written.get(device, 0), end)
    return False
