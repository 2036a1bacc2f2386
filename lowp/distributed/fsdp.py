"""FSDP2 (``torch.distributed.fsdp.fully_shard``) gradient reduce-scatter that sums in fp32.

FSDP2 reduce-scatters the gradients in ``MixedPrecisionPolicy.reduce_dtype`` (when ``None``,
``param_dtype`` before torch 2.15 and the parameter's ``grad_dtype`` from 2.15:
:func:`lowp.distributed.advisor.fsdp_reduce_dtype`): with bf16 that is a bf16 sum, rounded at every
hop of the backend's ring.
torch 2.13 exposes a hook for the collective, ``FSDPModule.set_custom_reduce_scatter``, taking an
object with the ``ReduceScatter`` interface of ``torch.distributed.fsdp._fully_shard._fsdp_api``
(``allocate`` a buffer, then ``__call__(output_tensor, input_tensor, group, op)``);
:func:`has_custom_reduce_scatter` checks that the running torch has both.
:class:`FP32ReduceScatter` implements it as the DDP hooks of :mod:`lowp.distributed.hooks` do:

    1. compress the flat gradient input to ``wire_dtype`` (bf16 by default; to nearest or
       stochastically),
    2. ``all_to_all_single``: rank r receives every rank's r-th shard (the same wire bytes as a
       ring reduce-scatter, ``(R - 1) / R`` of the input per rank),
    3. add the R shards in fp32 (``AVG``: divide by R in fp32),
    4. write the result in the output's dtype (one rounding, when ``reduce_dtype`` is bf16).

With ``reduce_dtype=torch.float32`` the gradient crosses the wire in bf16 (half the bytes of an
fp32 reduce-scatter) and arrives as an fp32 sum of the bf16 values; with ``reduce_dtype=bf16``
the only roundings are the compression and the final one, instead of ``R - 1`` bf16 additions.
FSDP's ``PREMUL_SUM`` op (a gradient divide factor other than R) is not supported: call
``set_force_sum_reduction_for_comms(True)`` and FSDP divides before/after a plain sum.

The collective runs to completion inside the call (no ``async_op``): simple and
deterministic, not overlapped with the backward pass.

:class:`lowp.distributed.compressed_fsdp.CompressedReduceScatter` shares steps 2-4
(:class:`FP32SumReduceScatter`) with an 8-bit wire and error feedback instead of step 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from lowp.distributed.hooks import _stream_seed
from lowp.rounding import quantize

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FP32ReduceScatter", "FP32SumReduceScatter", "set_fp32_reduce_scatter", "fsdp_modules", "param_groups",
           "has_custom_reduce_scatter", "install"]

try:   # the interface FSDPModule.set_custom_reduce_scatter takes; without it there is no hook
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch
    _ReduceScatterBase = object  # type: ignore[misc, assignment]

_WIRE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def has_custom_reduce_scatter() -> bool:
    """True when this torch's FSDP2 accepts a custom reduce-scatter (``set_custom_reduce_scatter``)."""
    from torch.distributed.fsdp import FSDPModule
    return _ReduceScatterBase is not object and hasattr(FSDPModule, "set_custom_reduce_scatter")


class FP32SumReduceScatter(_ReduceScatterBase):
    """What every lowp FSDP2 reduce-scatter shares: the argument checks, the all-to-all of one
    piece per rank, and the fp32 division and write-out (subclassed by :class:`FP32ReduceScatter`
    and :class:`lowp.distributed.compressed_fsdp.CompressedReduceScatter`)."""

    #: read by :func:`lowp.distributed.advisor.advise_fsdp`
    accumulates_in_fp32 = True

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer for FSDP to gather the gradient input into."""
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def _begin(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
               op: object) -> tuple[int, bool]:
        """``(R, average)`` after checking the sizes and ``op`` (``ValueError`` naming them), before
        anything is sent."""
        R = dist.get_world_size(group)
        n = input_tensor.numel()
        if n != R * output_tensor.numel():
            raise ValueError(f"input_tensor: expected {R} x the output's {output_tensor.numel()} elements, got {n}")
        if op == dist.ReduceOp.SUM:
            return R, False
        if op == dist.ReduceOp.AVG:
            return R, True
        raise ValueError(f"op: {type(self).__name__} supports SUM and AVG, got {op}; with a gradient divide "
                         "factor call set_force_sum_reduction_for_comms(True)")

    @staticmethod
    def _exchange(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``all_to_all_single`` of ``send`` (R equal pieces): rank r receives every rank's r-th piece."""
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received

    @staticmethod
    def _write(output_tensor: torch.Tensor, total: torch.Tensor, R: int, average: bool) -> None:
        """``total`` (the fp32 sum), divided by R in fp32 when averaging, into ``output_tensor`` in its dtype."""
        if average:
            total = total.div_(R)
        output_tensor.view(-1).copy_(total)


class FP32ReduceScatter(FP32SumReduceScatter):
    """FSDP2 reduce-scatter: ``wire_dtype`` on the wire, fp32 sum (see the module docstring).

    Install it with :func:`set_fp32_reduce_scatter`; one instance may serve every FSDP module.

    Args:
        wire_dtype: dtype the gradients cross the wire in: ``torch.bfloat16`` (default),
            ``torch.float16`` or ``torch.float32`` (no compression); anything else raises
            ``ValueError``. fp16 overflows beyond 65504, so use it with gradients known to be small.
        stochastic: compress with stochastic rounding instead of to nearest (default ``False``;
            converted with ``bool``). Unbiased, with one independent stream per rank and call,
            so components far below an ulp of their neighbours are not lost on average. No
            effect with an fp32 wire.
        seed: seed of the stochastic-rounding streams (default 0; converted with ``int()``, which
            raises for a value it cannot convert). The same seed gives the same bits on every run.
    """

    def __init__(self, wire_dtype: torch.dtype = torch.bfloat16, stochastic: bool = False, seed: int = 0) -> None:
        if wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"wire_dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.stochastic = bool(stochastic)
        self.seed = int(seed)
        self.calls = 0

    def _compress(self, values: torch.Tensor, rank: int) -> torch.Tensor:
        if not self.stochastic or self.wire_dtype == torch.float32:
            return values.to(self.wire_dtype)
        gen = torch.Generator(device=values.device).manual_seed(_stream_seed(self.seed, rank, self.calls))
        return quantize(values.to(torch.float32), self.wire_dtype, "stochastic", generator=gen).to(self.wire_dtype)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = dist.ReduceOp.SUM, async_op: bool = False) -> None:
        """Reduce-scatter ``input_tensor`` (R equal shards, flat) into ``output_tensor`` over
        ``group``: shard r of the fp32 sum (``op=AVG``: mean) of every rank's input goes to rank r.
        Synchronous whatever ``async_op`` says; ``op`` other than SUM/AVG and a size mismatch
        raise ``ValueError`` before anything is sent."""
        R, average = self._begin(output_tensor, input_tensor, group, op)
        send = self._compress(input_tensor.reshape(-1), dist.get_rank(group))
        received = self._exchange(send, group)
        self._write(output_tensor, received.view(R, -1).to(torch.float32).sum(dim=0), R, average)
        self.calls += 1
        return None


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` (itself included) that ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_fp32_reduce_scatter(model: torch.nn.Module, comm: FP32ReduceScatter | None = None) -> FP32ReduceScatter:
    """Install ``comm`` (default: a new :class:`FP32ReduceScatter`) on every FSDP module of
    ``model`` that owns parameters; returns it. Raises ``RuntimeError`` when this torch has no
    custom reduce-scatter hook, ``ValueError`` when ``model`` has no FSDP module."""
    comm = FP32ReduceScatter() if comm is None else comm
    if not isinstance(comm, FP32ReduceScatter):
        raise TypeError(f"comm: expected an FP32ReduceScatter, got {type(comm).__name__}")
    install(model, lambda name, module: comm)
    return comm


def install(model: torch.nn.Module, make: Callable[[str, FSDPModule], FP32SumReduceScatter]) -> list[str]:
    """``module.set_custom_reduce_scatter(make(name, module))`` for every FSDP module of ``model``
    that owns parameters (``name``: its name in ``model.named_modules()``, ``""`` for ``model``
    itself); returns the names. ``RuntimeError`` when this torch has no custom reduce-scatter hook,
    ``ValueError`` when ``model`` has no FSDP module."""
    if not has_custom_reduce_scatter():
        raise RuntimeError(f"torch {torch.__version__}: FSDP2 has no set_custom_reduce_scatter / ReduceScatter")
    names = {m: n for n, m in model.named_modules()}
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError("model: no module of it was sharded with fully_shard")
    done = []
    for m in modules:
        if param_groups(m):
            m.set_custom_reduce_scatter(make(names[m], m))
            done.append(names[m])
    return done


def param_groups(module: FSDPModule) -> list:
    """The parameter groups of FSDP module ``module`` (torch's internal ``FSDPParamGroup``s)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:   # torch < 2.13 keeps one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)
