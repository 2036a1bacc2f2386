"""Precision monitor: hooks on any ``nn.Module`` that record what casting to a low format would do.

For every module output (forward), every gradient flowing out of a module (backward,
``grad_output``) and every parameter gradient, the monitor keeps, over all calls: amax, the
smallest non-zero magnitude, the dynamic range ``log2(amax / min_nonzero)``, and the number of
values that would **overflow** (round beyond the format's largest value), **underflow to zero**
(non-zero values that round to zero; values that were zero already do not count) or become
**subnormal** (lose precision) when cast to the target format, plus NaN and inf counts.

Rounding thresholds for round-to-nearest-even, with ``u_top``/``u_low`` the spacing in the top
and bottom binade: a magnitude overflows beyond ``max + u_top/2`` (the midpoint itself overflows
when ``max`` has an odd last bit, as in IEEE formats, not in e4m3fn), underflows to zero at or
below ``u_low/2`` (without subnormals the neighbours of a tiny value are 0 and ``min_normal``,
so at or below ``min_normal/2``, as :func:`lowp.rounding.quantize` rounds) and is subnormal
between that and ``min_normal - u_low/2``. Saturating formats count overflow the same way: the
values are clamped, not kept.

Hooks exist only inside ``with PrecisionMonitor(model):`` (or between :meth:`attach` and
:meth:`detach`), so a model runs at full speed when the monitor is off.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lowp.formats import FloatFormat, get_format

__all__ = ["PrecisionMonitor", "TensorRecord", "REPORT_COLUMNS", "PHASES"]

#: The phases of a record: module outputs (forward); output and parameter gradients (backward).
PHASES = ("forward", "backward")

REPORT_COLUMNS = ["module", "phase", "tensor", "calls", "numel", "amax", "min_nonzero", "range_log2", "overflow_frac",
                  "underflow_frac", "subnormal_frac", "nan", "inf"]


@dataclass
class TensorRecord:
    """Statistics of one (module, phase, tensor) slot, accumulated over calls.

    :meth:`PrecisionMonitor.observe` creates and updates these; the counts are of elements.

    Args:
        module: qualified module name (or parameter name for ``param_grad``).
        phase: ``"forward"`` or ``"backward"`` (:data:`PHASES`).
        tensor: the slot, e.g. ``"output"``, ``"output[1]"``, ``"grad_output"``, ``"param_grad"``.
        calls: tensors observed so far (default 0).
        numel: elements observed so far (default 0).
        amax: largest finite magnitude seen (default 0.0).
        min_nonzero: smallest non-zero finite magnitude seen (default ``inf``: none yet).
        overflow: finite elements that round beyond the format's largest value
            (round-to-nearest-even).
        underflow: finite non-zero elements that round to zero in the format.
        subnormal: finite elements that round to a non-zero subnormal of the format (always 0
            for formats without subnormals).
        nan: NaN elements.
        inf: infinite elements.
    """

    module: str
    phase: str
    tensor: str
    calls: int = 0
    numel: int = 0
    amax: float = 0.0
    min_nonzero: float = math.inf
    overflow: int = 0
    underflow: int = 0
    subnormal: int = 0
    nan: int = 0
    inf: int = 0

    @property
    def range_log2(self) -> float:
        """``log2(amax / min_nonzero)`` over finite non-zero values (0 when there are none)."""
        if self.amax == 0 or math.isinf(self.min_nonzero):
            return 0.0
        return math.log2(self.amax / self.min_nonzero)

    def frac(self, count: int) -> float:
        """``count / numel`` (0.0 before any element was observed)."""
        return count / self.numel if self.numel else 0.0

    def row(self) -> list[object]:
        """The record as a row under :data:`REPORT_COLUMNS` (counts of overflow, underflow and
        subnormals as fractions; ``min_nonzero`` is ``None`` when no non-zero value was seen)."""
        return [self.module, self.phase, self.tensor, self.calls, self.numel, self.amax,
                None if math.isinf(self.min_nonzero) else self.min_nonzero, self.range_log2, self.frac(self.overflow),
                self.frac(self.underflow), self.frac(self.subnormal), self.nan, self.inf]


class PrecisionMonitor:
    """Record overflow/underflow risk of casting a model's activations and gradients to ``format``.

    Args:
        model: any ``nn.Module``; every submodule (``include`` filters by qualified name) is hooked.
            Anything else raises ``TypeError``.
        format: the target low-precision format (name, dtype or :class:`FloatFormat`; default
            ``"fp16"``). An unknown name raises ``ValueError``.
        backward: also record ``grad_output`` of each module and every parameter's gradient
            (default ``True``); a non-bool raises ``TypeError``.
        include: optional predicate on the qualified module name (the root module is labelled
            with its class name); ``None`` (default) hooks every module. A non-callable raises
            ``TypeError``.
        underflow_threshold: fraction in [0, 1] of underflowing (or subnormal) values above which
            a recommendation is made (default ``1e-3``); 0 flags any underflow, 1 never does.
            Values outside [0, 1] raise ``ValueError``, non-numbers (bools included) ``TypeError``.

    Nothing is hooked until :meth:`attach` or ``with``.

    Example::

        with PrecisionMonitor(model, "fp16") as mon:
            model(x).sum().backward()
        print(mon.report())
    """

    def __init__(self, model: nn.Module, format: "str | torch.dtype | FloatFormat" = "fp16", *, backward: bool = True,
                 include: Callable[[str], bool] | None = None, underflow_threshold: float = 1e-3) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(backward, bool):
            raise TypeError(f"backward: expected a bool, got {type(backward).__name__}")
        if include is not None and not callable(include):
            raise TypeError(f"include: expected None or a callable on module names, got {type(include).__name__}")
        if isinstance(underflow_threshold, bool) or not isinstance(underflow_threshold, (int, float)):
            raise TypeError(f"underflow_threshold: expected a number in [0, 1], got {underflow_threshold!r}")
        if not 0 <= underflow_threshold <= 1:
            raise ValueError(f"underflow_threshold: expected a fraction in [0, 1], got {underflow_threshold}")
        self.model = model
        self.format = get_format(format)
        self.backward = backward
        self.include = include
        self.underflow_threshold = underflow_threshold
        self.records: dict[tuple[str, str, str], TensorRecord] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        fmt = self.format
        top_ulp = 2.0 ** (fmt.emax - fmt.mantissa_bits)
        low_ulp = 2.0 ** (fmt.emin - fmt.mantissa_bits)
        # Midpoints, and whether round-to-nearest-even sends the midpoint itself across (the tie
        # goes to the neighbour with an even last bit: ±max is odd in IEEE formats, even in e4m3fn).
        self._overflow_at = fmt.max + top_ulp / 2
        self._overflow_tie = int(fmt.max / top_ulp) % 2 == 1
        # the tie goes to 0 (even); without subnormals the neighbours are 0 and min_normal
        self._underflow_at = (low_ulp if fmt.subnormals else fmt.min_normal) / 2
        self._normal_at = fmt.min_normal - low_ulp / 2  # the tie goes up to min_normal (even)

    # -- hooks ----------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> "PrecisionMonitor":
        """Register the hooks (idempotent)."""
        if self.attached:
            return self
        for name, module in self.model.named_modules():
            label = name or type(module).__name__
            if self.include is not None and not self.include(label):
                continue
            self._handles.append(module.register_forward_hook(self._forward_hook(label)))
            if self.backward:
                self._handles.append(module.register_full_backward_hook(self._backward_hook(label)))
        if self.backward:
            for pname, param in self.model.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_hook(self._param_hook(pname)))
        return self

    def detach(self) -> None:
        """Remove every hook: the model is back to zero overhead."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "PrecisionMonitor":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget every record (the hooks stay as they are)."""
        self.records.clear()

    def _forward_hook(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            for slot, t in _tensors(output, "output"):
                self.observe(label, "forward", slot, t)
        return hook

    def _backward_hook(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: object, grad_output: object) -> None:
            for slot, t in _tensors(grad_output, "grad_output"):
                self.observe(label, "backward", slot, t)
        return hook

    def _param_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.observe(name, "backward", "param_grad", grad)
        return hook

    # -- statistics -----------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, module: str, phase: str, tensor: str, t: torch.Tensor) -> None:
        """Add one tensor's statistics to the (module, phase, tensor) record.

        ``module`` and ``tensor`` are labels (non-empty strings), ``phase`` is one of
        :data:`PHASES`; an empty or non-floating-point ``t`` (integer outputs, masks) is ignored.
        """
        for name, label in (("module", module), ("tensor", tensor)):
            if not isinstance(label, str) or not label:
                raise TypeError(f"{name}: expected a non-empty str label, got {label!r}")
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point() or t.numel() == 0:
            return
        key = (module, phase, tensor)
        rec = self.records.get(key) or self.records.setdefault(key, TensorRecord(module, phase, tensor))
        a = t.detach().abs()
        a = a if a.dtype in (torch.float32, torch.float64) else a.float()
        fa = torch.nan_to_num(a, nan=0.0, posinf=0.0)  # finite magnitudes, non-finite ones as 0
        nonzero = fa > 0
        over = _beyond(fa, self._overflow_at, self._overflow_tie)
        under = nonzero & ~_beyond(fa, self._underflow_at, False)
        sub = nonzero & ~under & (fa < self._normal_at) if self.format.subnormals else torch.zeros_like(under)
        stats = torch.stack([torch.isnan(a).sum(), torch.isinf(a).sum(), over.sum(), under.sum(), sub.sum()]).double()
        extremes = torch.stack([fa.max(), torch.where(nonzero, fa, torch.full_like(fa, math.inf)).min()]).double()
        nan, inf, overflow, underflow, subnormal, amax, min_nonzero = torch.cat([stats, extremes]).tolist()  # one sync
        rec.calls += 1
        rec.numel += a.numel()
        rec.nan += int(nan)
        rec.inf += int(inf)
        rec.overflow += int(overflow)
        rec.underflow += int(underflow)
        rec.subnormal += int(subnormal)
        rec.amax = max(rec.amax, amax)
        rec.min_nonzero = min(rec.min_nonzero, min_nonzero)

    def advise(self, rec: TensorRecord) -> list[str]:
        """Recommendations for one record: keep in fp32, or rescale by a power of two."""
        if not isinstance(rec, TensorRecord):
            raise TypeError(f"rec: expected a TensorRecord, got {type(rec).__name__}")
        fmt = self.format
        out = []
        span = math.log2(fmt.max / fmt.min_subnormal if fmt.subnormals else fmt.max / fmt.min_normal)
        if rec.nan or rec.inf:
            out.append(f"non-finite values already present ({rec.nan} NaN, {rec.inf} inf): fix upstream")
        risky_low = (rec.frac(rec.underflow) > self.underflow_threshold
                     or rec.frac(rec.subnormal) > self.underflow_threshold)
        if rec.overflow:
            k = math.ceil(math.log2(rec.amax / fmt.max)) + 1
            if rec.min_nonzero * 2.0**-k < fmt.min_normal and rec.range_log2 > span:
                out.append(f"keep in fp32: dynamic range 2^{rec.range_log2:.0f} exceeds {fmt.name}'s 2^{span:.0f}")
            else:
                out.append(f"overflows {fmt.name} ({rec.overflow} values): rescale by 2^-{k} or keep in fp32")
        elif risky_low:
            k = math.floor(math.log2(fmt.max / rec.amax)) - 1 if rec.amax > 0 else 0
            if k >= 1:
                out.append(f"underflows {fmt.name} ({rec.underflow} to zero, {rec.subnormal} subnormal): "
                           f"rescale by 2^{k} (e.g. loss scaling) keeps amax below {fmt.max:g}")
            else:
                out.append(f"keep in fp32: values underflow {fmt.name} and there is no headroom to rescale")
        return out

    def report_rows(self) -> list[list[object]]:
        """One row per record, columns :data:`REPORT_COLUMNS`, in the order first seen."""
        return [rec.row() for rec in self.records.values()]

    def loss_scale_log2(self) -> int | None:
        """The largest ``k`` such that multiplying every recorded gradient by ``2**k`` overflows none
        (with a factor-2 margin): a static loss scale. None without backward records."""
        amax = max((r.amax for r in self.records.values() if r.phase == "backward"), default=0.0)
        return math.floor(math.log2(self.format.max / amax)) - 1 if amax > 0 else None

    def recommendations(self) -> list[str]:
        """``"<module> <phase> <tensor>: advice"`` lines for every record that needs attention, then
        the static loss scale when gradients underflow."""
        lines = []
        grads_underflow = False
        for rec in self.records.values():
            advice = self.advise(rec)
            grads_underflow |= rec.phase == "backward" and bool(advice)
            lines += [f"{rec.module} [{rec.phase} {rec.tensor}]: {a}" for a in advice]
        k = self.loss_scale_log2()
        if grads_underflow and k is not None and k > 0:
            lines.append(f"all gradients: a loss scale of 2^{k} is the largest that overflows no recorded gradient")
        return lines

    def report(self) -> str:
        """A terminal table of every record followed by the recommendations."""
        from lowp.report import text_table

        recs = self.recommendations()
        text = text_table(REPORT_COLUMNS, self.report_rows())
        return text + "\n\nRecommendations (target " + self.format.name + "):\n" + (
            "\n".join("- " + r for r in recs) if recs else "- none: every recorded tensor fits the format")


def _beyond(x: torch.Tensor, threshold: float, inclusive: bool) -> torch.Tensor:
    """``x >= threshold`` or ``x > threshold`` (exact: the thresholds are dyadic and fit fp32)."""
    return x >= threshold if inclusive else x > threshold


def _tensors(obj: object, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten a hook's output/grad structure into (slot name, tensor) pairs."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}[{i}]")
    elif isinstance(obj, dict):
        for k, item in obj.items():
            yield from _tensors(item, f"{prefix}[{k}]")
