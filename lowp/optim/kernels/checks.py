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
  kind (the exact modes' remainders are integers, kahan's compensation floating-point), a storage
  too small for its tensor, a written tensor whose elements overlap (stride 0), a plain tensor
  mixed with a subclass tensor.

Tensors that overlap *each other* (parameters sharing memory) make the result depend on the
order of the writes: :func:`overlapping` finds them so the backend runs the whole batch in the
reference's order.
"""
from __future__ import annotations

import operator
from typing import Collection, Iterable, Sequence

import torch

from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.preflight import extent as _extent, storage_fits

__all__ = ["PLAIN_TYPES", "Span", "plain", "storage_fits", "kernel_memory", "all_kernel_memory", "check_slice",
           "check_kernel_args", "kernel_grad", "overlapping"]

#: Tensor types whose memory is their own storage (``nn.Parameter`` only adds autograd metadata).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_TENSOR, _PARAMETER = PLAIN_TYPES
_STRIDED = torch.strided


def plain(t: torch.Tensor) -> bool:
    """A plain strided tensor whose elements are stored as they read: no subclass, no sparse,
    mkldnn or nested layout, no lazy negation or conjugation bit."""
    return (type(t) in PLAIN_TYPES and t.layout is _STRIDED and not t.is_nested and not t.is_neg()
            and not t.is_conj())


def kernel_memory(t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> bool:
    """Whether ``t`` may be handed to a kernel as ``(data_ptr, numel)``: plain, not meta,
    contiguous, one of ``dtypes``, at least one element, non-null and element-aligned, inside
    its storage."""
    if not (plain(t) and not t.is_meta and t.dtype in dtypes and t.is_contiguous() and t.numel() > 0):
        return False
    start = t.data_ptr()
    return start != 0 and start % t.element_size() == 0 and storage_fits(t)


def all_kernel_memory(ts: Sequence[torch.Tensor], dtypes: Collection[torch.dtype]) -> bool:
    """Whether every tensor of ``ts`` is CPU :func:`kernel_memory` of one of ``dtypes``, each
    property read over all of them in one map (a C loop: on 500 small tensors about a fifth of
    the per-tensor form's 1 ms). ``False`` leaves the tensors to the per-tensor checks."""
    if not set(map(type, ts)) <= _PLAIN_SET or set(map(_LAYOUT, ts)) - {_STRIDED} \
            or any(map(_IS_NESTED, ts)) or any(map(_IS_NEG, ts)) or any(map(_IS_CONJ, ts)) \
            or not all(map(_IS_CPU, ts)) or not set(map(_DTYPE, ts)) <= set(dtypes) or not all(map(_NUMEL, ts)) \
            or not all(map(_IS_CONTIGUOUS, ts)):
        return False
    starts, sizes = list(map(_DATA_PTR, ts)), list(map(_ELEMENT_SIZE, ts))
    ends = map(operator.mul, map(operator.add, map(_STORAGE_OFFSET, ts), map(_NUMEL, ts)), sizes)
    return all(starts) and not any(map(operator.mod, starts, sizes)) \
        and all(map(operator.le, ends, map(_NBYTES, map(_UNTYPED_STORAGE, ts))))


_PLAIN_SET = set(PLAIN_TYPES)
_LAYOUT, _DTYPE = operator.attrgetter("layout"), operator.attrgetter("dtype")
_IS_NESTED, _IS_CPU = operator.attrgetter("is_nested"), operator.attrgetter("is_cpu")
_IS_NEG, _IS_CONJ, _IS_CONTIGUOUS = torch.Tensor.is_neg, torch.Tensor.is_conj, torch.Tensor.is_contiguous
_NUMEL, _DATA_PTR, _ELEMENT_SIZE = torch.Tensor.numel, torch.Tensor.data_ptr, torch.Tensor.element_size
_STORAGE_OFFSET, _UNTYPED_STORAGE = torch.Tensor.storage_offset, torch.Tensor.untyped_storage
_NBYTES = torch.UntypedStorage.nbytes


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


#: a byte range (start, end) of a tensor and whether the step writes it
Span = tuple[int, int, bool]


def _admit(name: str, t: torch.Tensor, param: torch.Tensor, param_type: type, param_cpu: bool, written: bool,
           dtypes: Sequence[torch.dtype], spans: list[Span] | None) -> bool:
    """One pass over tensor ``name`` of a slice (its weight ``param`` included): raise the errors
    of :func:`check_slice` for it, else return whether it is kernel memory of one of ``dtypes``
    (:func:`kernel_memory`). ``written``: the step writes it; its byte range goes to ``spans``."""
    kind = type(t)
    own = kind is _TENSOR or kind is _PARAMETER
    if (own and param_type is not _TENSOR and param_type is not _PARAMETER) or (not own and kind is not param_type):
        raise TypeError(f"{name}: a {kind.__name__} next to a {param_type.__name__} parameter; the "
                        f"gradient, states and buffer must be tensors of the parameter's kind")
    if t is not param:
        if not (param_cpu and t.is_cpu) and t.device != param.device:
            raise ValueError(f"{name}: expected a tensor on the parameter's device {param.device}, got {t.device}")
        if t.shape != param.shape:
            what = "gradient" if name == "grad" else "tensor"
            raise ValueError(f"{name}: a {what} of shape {_shape(t)} for a parameter of shape {_shape(param)}; "
                             f"the shapes must be equal")
    if not own or t.layout is not _STRIDED or t.is_nested or (not param_cpu and t.is_meta) or t.numel() == 0:
        return False  # (a tensor next to a CPU weight is on the CPU: checked above)
    contiguous = t.is_contiguous()
    size = t.element_size()
    nbytes = t.untyped_storage().nbytes()
    extent = _extent(t, contiguous)
    if (t.storage_offset() + extent) * size > nbytes:
        raise ValueError(f"{name}: its storage holds {nbytes} bytes, fewer than its shape {_shape(t)} addresses "
                         f"(was the storage freed or resized?)")
    start = t.data_ptr()
    if spans is not None:
        spans.append((start, start + extent * size, written))
    if not contiguous:
        if written and any(stride == 0 and length > 1 for length, stride in zip(t.shape, t.stride())):
            raise ValueError(f"{name}: several of its elements share one memory location (stride 0, e.g. an "
                             f"expanded view); an optimizer cannot write it")
        return False
    return t.dtype in dtypes and not t.is_neg() and start != 0 and start % size == 0


def _precision_error(name: str, t: torch.Tensor, param: torch.Tensor) -> TypeError:
    """The update computes in float64 for float64 weights and in float32 otherwise; a gradient or
    state on the other side cannot enter the same arithmetic (torch refuses to mix them)."""
    wide = param.dtype == torch.float64
    return TypeError(f"{name}: a {t.dtype} tensor for a {param.dtype} parameter; the update computes in "
                     f"{'float64' if wide else 'float32'}, so it must be "
                     f"{'float64' if wide else 'float32, bfloat16 or float16'}")


def check_slice(ctx: StepContext, s: ParamSlice, dtypes: Sequence[torch.dtype] = (),
                buffer_dtypes: Sequence[torch.dtype] = (), spans: list[Span] | None = None) -> tuple[bool, bool, bool]:
    """Raise for a slice that no backend can run correctly (see the module docstring), before
    anything is written: ``ValueError``/``TypeError`` naming ``params``, ``grad``, the state or
    the mode's buffer. Returns whether (the weight and every state, the gradient, the buffer or
    its absence) are kernel memory of ``dtypes`` (``buffer_dtypes`` for the buffer); appends the
    byte ranges of its plain tensors to ``spans``."""
    buffer_name = ctx.mode.buffer_name
    if buffer_name is not None and s.buffer is None:
        raise ValueError(f"{buffer_name}: mode {ctx.mode.name!r} needs its {buffer_name} buffer for this "
                         f"parameter, and the optimizer state has none")
    param = s.param
    facts = (param, type(param), param.is_cpu)
    wide = param.dtype == torch.float64
    weights = _admit("params", param, *facts, True, dtypes, spans)
    grad = _admit("grad", s.grad, *facts, False, dtypes, spans)
    if (s.grad.dtype == torch.float64) != wide:
        raise _precision_error("grad", s.grad, param)
    for name, t in s.states.items():
        weights = _admit(name, t, *facts, True, dtypes, spans) and weights
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point optimizer state, got {t.dtype}")
        if (t.dtype == torch.float64) != wide:
            raise _precision_error(name, t, param)
    buffer = s.buffer is None
    if s.buffer is not None:
        name = buffer_name or "buffer"
        buffer = _admit(name, s.buffer, *facts, True, buffer_dtypes, spans)
        integer = ctx.mode.integer_buffer
        if s.buffer.is_floating_point() == integer:
            kind = "an integer remainder" if integer else "a floating-point compensation"
            raise TypeError(f"{name}: mode {ctx.mode.name!r} needs {kind}, got {s.buffer.dtype}")
    return weights, grad, buffer


def check_kernel_args(slices: Iterable[ParamSlice], names: Sequence[str],
                      dtypes: tuple[torch.dtype | None, ...]) -> None:
    """The last check before a native kernel call over ``slices``.

    ``RuntimeError`` unless every
    tensor the variant reads, ``dtypes`` = (weight, gradient, buffer or ``None``, one per state in
    ``names``), is a plain CPU tensor of that dtype with the weight's (non-zero) number of
    elements, contiguous (but for the gradient, which the caller copies first) and aligned. (The
    storage bounds were checked by the admission, and nothing in between resizes a storage.)"""
    weight, grad, buffer, *states = dtypes
    if len(states) != len(names):
        raise RuntimeError(f"kernel call: {len(states)} state dtypes for states {list(names)}")
    expected = [weight, *states] + ([buffer] if buffer is not None else [])
    for s in slices:
        n = s.param.numel()
        written = [s.param, *(s.states.get(name) for name in names)] + ([s.buffer] if buffer is not None else [])
        bad = None if n > 0 and _plain_cpu(s.grad, grad, n) else "grad"
        for t, dtype in zip(written, expected):
            if bad is None and not (t is not None and _plain_cpu(t, dtype, n) and t.is_contiguous()
                                    and t.data_ptr() % t.element_size() == 0):
                bad = "a weight, state or buffer"
        if bad is not None:
            raise RuntimeError(f"kernel call: {bad} is not a CPU tensor of {n} elements of {dtypes} in plain "
                               f"contiguous memory; the admission checks should have sent it elsewhere")


def kernel_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient as a kernel reads it: ``g`` itself when contiguous and aligned to its element
    size, else a contiguous, aligned copy (a strided gradient; one at an odd address, such as a
    view of a byte buffer at an odd offset, whose every load would be misaligned, undefined
    behaviour in C++). Keep it alive until the kernel has read it."""
    if g.is_contiguous() and g.data_ptr() % g.element_size() == 0:
        return g
    return g.clone(memory_format=torch.contiguous_format)


def _plain_cpu(t: torch.Tensor | None, dtype: torch.dtype | None, n: int) -> bool:
    return (t is not None and (type(t) is _TENSOR or type(t) is _PARAMETER) and t.layout is _STRIDED and t.is_cpu
            and t.dtype == dtype and t.numel() == n)


def overlapping(spans: list[Span]) -> bool:
    """Whether a written byte range of ``spans`` (from :func:`check_slice`: weights, states and
    buffers) shares bytes with any other range (gradients may share memory with each other:
    they are only read). CPU and CUDA pointers of one process do not collide (unified addressing)."""
    spans.sort()
    end_any = end_written = 0
    for start, end, written in spans:
        if start < end_written or (written and start < end_any):
            return True
        end_any = max(end_any, end)
        if written:
            end_written = max(end_written, end)
    return False
