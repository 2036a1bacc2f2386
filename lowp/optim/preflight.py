"""Checks that run before an optimizer changes anything: option types, parameter layouts,
gradients against their parameters, and saved or live states against what a step needs.

Every function raises ``TypeError``/``ValueError`` whose message starts with the name of the
argument or entry at fault (``maximize``, ``seed``, ``grad of params[3]``, ``state[2]['exp_avg']``,
...) and says what was expected; none of them modifies its inputs.
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["SEED_LIMIT", "STEP_LIMIT", "FLOAT_DTYPES", "check_flag", "check_seed", "check_param", "check_grad",
           "step_count", "check_saved", "check_tensor", "check_count", "check_disjoint", "check_grads_apart",
           "check_distinct", "extent", "storage_fits"]

#: Seeds are 64-bit: ``seed`` must lie in ``[0, SEED_LIMIT)``.
SEED_LIMIT = 1 << 64
#: Step counts are saved as int64 tensors: a count must be below ``STEP_LIMIT`` to be saved again.
STEP_LIMIT = 1 << 63
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def extent(t: torch.Tensor, contiguous: bool) -> int:
    """Elements from the first to one past the last one non-empty ``t`` addresses."""
    if contiguous:
        return t.numel()
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def storage_fits(t: torch.Tensor) -> bool:
    """Whether the storage of plain ``t`` holds every element ``t`` addresses: ``(offset +
    extent) * itemsize <= nbytes`` (a freed storage has 0 bytes; torch's own kernels would read
    or write past it, or crash)."""
    if t.numel() == 0:
        return True
    return bool((t.storage_offset() + extent(t, t.is_contiguous())) * t.element_size() <= t.untyped_storage().nbytes())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_strided(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN and t.layout == torch.strided and not t.is_meta


def _check_storage(t: torch.Tensor, where: str) -> None:
    if _plain_strided(t) and not storage_fits(t):
        raise ValueError(f"{where}: its storage holds {t.untyped_storage().nbytes()} bytes, fewer than its shape "
                         f"{tuple(t.shape)} addresses (was the storage freed or resized?)")


def check_disjoint(params: list[torch.Tensor], where: str = "params") -> None:
    """Distinct parameters must not share memory: a step would write the shared elements twice,
    with a result that depends on the order of the writes (torch.optim leaves this undefined).
    The same tensor twice is left to torch's own check of parameter groups."""
    spans = []
    for i, p in enumerate(params):
        if _plain_strided(p) and p.numel() and storage_fits(p):
            start = p.data_ptr()
            spans.append((start, start + extent(p, p.is_contiguous()) * p.element_size(), i, p))
    spans.sort(key=lambda span: span[:2])
    for (_, end, i, a), (start, _, j, b) in zip(spans, spans[1:]):
        if start < end and a is not b:
            i, j = sorted((i, j))
            raise ValueError(f"{where}[{i}] and {where}[{j}]: distinct parameters share memory (overlapping views "
                             f"of one tensor); give the optimizer tensors that own their elements, or one tensor")


def check_distinct(params: list[torch.Tensor], where: str = "params") -> None:
    """No tensor twice: one step would update it twice (torch.optim only warns within a group)."""
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        j = seen.setdefault(id(p), i)
        if j != i:
            raise ValueError(f"{where}[{j}] and {where}[{i}]: the same tensor twice; a step would update it twice. "
                             f"Give each parameter once")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + extent(t, t.is_contiguous()) * t.element_size()


def check_grads_apart(params: list[torch.Tensor], wheres: list[str]) -> None:
    """No gradient of ``params`` (each named by ``wheres``) shares memory with a parameter the
    step writes: the backends read gradients at different times relative to the writes (one
    tensor at a time, in batches, in one fused pass), so such a step has no single result."""
    owners: dict[int, list[int]] = {}   # storage address -> the parameters on it (checked dense and real)
    for i, p in enumerate(params):
        if type(p) in _PLAIN:
            owners.setdefault(p.untyped_storage().data_ptr(), []).append(i)
    for where, p in zip(wheres, params):
        g = p.grad
        if type(g) is not torch.Tensor:
            continue
        for j in owners.get(g.untyped_storage().data_ptr(), ()):
            if not (_plain_strided(g) and g.numel() and params[j].numel()):
                continue
            (a, b), (c, d) = _span(g), _span(params[j])
            if a < d and c < b:
                raise ValueError(f"grad of {where}: shares memory with {wheres[j]}, which the step writes; give "
                                 f"the parameter a gradient of its own (e.g. p.grad = p.grad.clone())")


def check_flag(name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be a bool (or ``None`` when allowed): ``maximize="no"`` is not false."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    expected = "True, False or None" if allow_none else "True or False"
    raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_seed(value: Any) -> int:
    """``value`` as a seed: an int in ``[0, 2**64)`` (not a bool); a 0-dim integer tensor is accepted."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed: expected an int in [0, 2**64), got {value!r}")
    return value


def check_count(name: str, value: Any) -> int:
    """A counter: an int >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return value


def check_param(p: Any, where: str) -> None:
    """A parameter the write-back can store into: a real floating-point tensor whose elements
    occupy distinct memory (an expanded or otherwise self-overlapping tensor cannot be written
    element by element)."""
    if not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: expected real floating-point tensors, got "
                        f"{getattr(p, 'dtype', type(p).__name__)}")
    if p.layout != torch.strided:
        raise TypeError(f"{where}: expected a dense (strided) tensor, got layout {p.layout}")
    _check_storage(p, where)
    if not p.is_contiguous() and torch._debug_has_internal_overlap(p) == 1:
        raise ValueError(f"{where}: its elements overlap in memory (an expanded or stride-0 view, strides "
                         f"{p.stride()}); pass a tensor that owns its elements, e.g. p.clone()")


def check_grad(p: torch.Tensor, g: Any, where: str) -> None:
    """``g`` can be the gradient of ``p``: a dense tensor of ``p``'s shape and device, of ``p``'s
    dtype or float32 (fp64 parameters: fp64 only, their pipeline does not mix dtypes)."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"grad of {where}: expected a tensor, got {type(g).__name__}")
    if g.layout != torch.strided:
        raise TypeError(f"grad of {where}: sparse gradients are not supported")
    if g.shape != p.shape:
        raise ValueError(f"grad of {where}: shape {tuple(g.shape)} does not match the parameter's shape "
                         f"{tuple(p.shape)}")
    if g.dtype != p.dtype and (g.dtype != torch.float32 or p.dtype == torch.float64):
        allowed = "" if p.dtype == torch.float64 else " nor torch.float32"
        raise ValueError(f"grad of {where}: dtype {g.dtype} is not the parameter's dtype {p.dtype}{allowed}")
    if g.device != p.device:
        raise ValueError(f"grad of {where}: on {g.device}, the parameter is on {p.device}")
    _check_storage(g, f"grad of {where}")


def step_count(value: Any, where: str) -> int:
    """A step counter as an int: an int >= 0, or a one-element tensor holding one (as
    ``torch.optim`` saves it: a float32 0-dim tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex():
        number = value.item()
        if isinstance(number, float) and math.isfinite(number) and number == int(number):
            number = int(number)
        value = number
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < STEP_LIMIT:
        raise ValueError(f"{where}: expected a step count (an int in [0, 2**63)), got {value!r}")
    return value


def check_saved(t: torch.Tensor, where: str) -> None:
    """A saved tensor that can be copied into an optimizer: dense (strided) and holding values
    (not on the meta device)."""
    if t.layout != torch.strided:
        raise TypeError(f"{where}: expected a dense tensor, got layout {t.layout}")
    if t.is_meta:
        raise ValueError(f"{where}: a meta tensor has no values to load (was the checkpoint saved from a model on "
                         f"the meta device?)")


def check_tensor(t: Any, where: str, shape: torch.Size, dtypes: tuple[torch.dtype, ...], device: torch.device,
                 key: str | None = None) -> None:
    """``t`` (entry ``key`` of ``where``, when given) is a dense tensor of ``shape`` on
    ``device`` with one of ``dtypes``, whose elements do not overlap in memory."""
    if isinstance(t, torch.Tensor) and t.shape == shape and t.dtype in dtypes and t.device == device \
            and t.layout == torch.strided and (t.is_contiguous() or torch._debug_has_internal_overlap(t) != 1) \
            and (not _plain_strided(t) or storage_fits(t)):
        return
    where = where if key is None else f"{where}[{key!r}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{where}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{where}: dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if t.device != device:
        raise ValueError(f"{where}: on {t.device}, expected {device}")
    _check_storage(t, where)
    raise ValueError(f"{where}: expected a dense tensor whose elements do not overlap in memory")
