"""Bytes per parameter that an optimizer really allocates, measured on a real model.

A :class:`Footprint` splits the memory of training one parameter into weights, optimizer states,
extra precision (lowp's write-back buffers: ``compensation``, ``remainder``, ``remainder8``; fp32
master weights, error terms) and gradients, each in bytes per parameter. :func:`measure` builds it from a model and an
optimizer after a step: the sum of ``nbytes`` of every parameter, gradient and tensor in
``optimizer.state``, divided by the parameter count. Tensor subclasses that store their data in
inner tensors (torchao's quantized states) are counted through ``__tensor_flatten__``, whose inner
tensors hold the real bytes; their own ``nbytes`` reports the dtype they pose as.

:func:`lowp_footprints` measures every configuration of one lowp optimizer (weight dtype x
write-back mode x state dtype) on a probe model, the built-in demo model
(:class:`lowp.demo.model.CharLM`), so the figures follow what lowp allocates today.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lowp.optim.writeback import BUFFER_NAMES

__all__ = ["Footprint", "tensor_bytes", "measure", "probe_model", "lowp_optimizer", "lowp_configurations",
           "CODED_LAYOUTS", "takes_codes", "coded_state_dtype", "lowp_footprints", "LowpFootprint", "layout_on",
           "EXTRA_STATE_NAMES", "DTYPE_NAMES", "configuration_name"]

#: Short names of the weight and state dtypes in the rows of ``lowp memory``.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: State entries that hold extra weight precision rather than optimizer statistics: lowp's
#: write-back buffers (:data:`lowp.optim.writeback.BUFFER_NAMES`) and optimi's Kahan buffer.
EXTRA_STATE_NAMES = (*BUFFER_NAMES, "kahan_comp")


@dataclass(frozen=True)
class Footprint:
    """Bytes per parameter of one training configuration.

    Args:
        weights: the weights the model computes with.
        states: the optimizer's statistics (moments, factored second moments...).
        extra: extra weight precision: compensation or remainder buffers, fp32 master weights,
            error-correction terms.
        grads: the gradients.
    """

    weights: float
    states: float
    extra: float
    grads: float

    def total(self, with_grads: bool) -> float:
        """Bytes per parameter of weights + states + extra, plus the gradients when asked."""
        return self.weights + self.states + self.extra + (self.grads if with_grads else 0.0)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes that ``t`` occupies: ``t.nbytes`` for a plain tensor, the sum over the inner tensors
    of a wrapper subclass (``__tensor_flatten__``), recursively."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.nbytes


def measure(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> Footprint:
    """The :class:`Footprint` of ``params`` and ``optimizer`` as they are now (call it after a
    step, when the states exist): every tensor in ``optimizer.state`` counts, as ``extra`` when
    its key is one of :data:`EXTRA_STATE_NAMES`, else as a state (step counters stored as tensors
    included); gradients that are ``None`` count zero."""
    params = list(params)
    count = sum(p.numel() for p in params)
    if count == 0:
        raise ValueError("params: expected at least one parameter element, got none")
    weights = sum(tensor_bytes(p) for p in params)
    grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    states = extra = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if key in EXTRA_STATE_NAMES:
                    extra += tensor_bytes(value)
                else:
                    states += tensor_bytes(value)
    return Footprint(weights / count, states / count, extra / count, grads / count)


def probe_model(dtype: torch.dtype) -> torch.nn.Module:
    """The demo model (:class:`lowp.demo.model.CharLM` with its defaults) with every parameter
    in ``dtype`` and a gradient of the same dtype; the caller's random state is left alone."""
    from lowp.demo.model import CharLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CharLM().to(dtype)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
    return model


def lowp_optimizer(name: str) -> type:
    """The lowp optimizer class called ``name`` (any case), from :mod:`lowp.optim.registry`."""
    from lowp.optim.registry import optimizers

    found = {cls.__name__.lower(): cls for cls in optimizers()}
    if not isinstance(name, str) or name.lower() not in found:
        raise ValueError(f"optimizer: expected one of {', '.join(sorted(found))}, got {name!r}")
    return found[name.lower()]


#: Block-scaled state layouts (:mod:`lowp.optim.codes`) by name: the code of the states that may
#: be negative, and of the nonnegative ones (Adam's second moment).
CODED_LAYOUTS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "int8/uint8": (torch.int8, torch.uint8),
    "int8/uint4": (torch.int8, torch.uint4),  # type: ignore[attr-defined]
}


def takes_codes(cls: type) -> bool:
    """Whether the optimizer class can keep block-scaled states: a spec with an elementwise rule
    and states under its default hyper-parameters."""
    spec = getattr(cls, "spec", None)
    if spec is None or spec.rule is None:
        return False
    return bool(spec.states(cls([torch.zeros(1)]).param_groups[0]))


def coded_state_dtype(cls: type, layout: str) -> dict[str, torch.dtype]:
    """The ``state_dtype`` dict of the block-scaled ``layout`` (a key of :data:`CODED_LAYOUTS`)
    for the optimizer class ``cls``."""
    signed, nonnegative = CODED_LAYOUTS[layout]
    group = cls([torch.zeros(1)]).param_groups[0]
    spec = cls.spec  # type: ignore[attr-defined]
    return {n: nonnegative if n in spec.nonnegative else signed for n in spec.states(group)}


def lowp_configurations(cls: type | None = None) -> list[tuple[torch.dtype, str, torch.dtype | str | None]]:
    """(weight dtype, mode, state dtype) of every distinct lowp configuration: bf16 weights in
    every mode, fp16 weights in those that take them (``exact`` and ``exact8`` take bf16 only),
    fp32 weights once (they are updated plainly in every mode); each low-precision one with
    default (``None``) and fp32 states; and, for an optimizer class ``cls`` that
    :func:`takes_codes`, bf16 weights in every mode with each block-scaled layout (by its name
    in :data:`CODED_LAYOUTS`)."""
    from lowp.optim.writeback import MODES

    out: list[tuple[torch.dtype, str, torch.dtype | str | None]] = []
    for dtype in (torch.bfloat16, torch.float16):
        for mode, wb in MODES.items():
            if dtype in wb.dtypes:
                out += [(dtype, mode, None), (dtype, mode, torch.float32)]
    if cls is not None and takes_codes(cls):
        out += [(torch.bfloat16, mode, layout) for layout in CODED_LAYOUTS for mode in MODES]
    return out + [(torch.float32, "nearest", None)]


@dataclass(frozen=True)
class LowpFootprint:
    """One measured lowp configuration.

    Args:
        weight_dtype: the dtype of the weights.
        mode: the write-back mode the optimizer was built with (fp32 weights ignore it).
        state_dtype: the dtype the optimizer's states were created in, or the name of a
            block-scaled layout (:data:`CODED_LAYOUTS`).
        footprint: the bytes per parameter measured after one step.
        per_element: every state tensor has as many elements (or codes) as its parameter, so the
            bytes per parameter hold for any model (``False`` for Adafactor's factored second
            moments, whose size depends on the matrices' shapes: ``footprint`` is then that of the
            target model's shapes when one was given, else the probe's). A block-scaled layout is
            measured on the probe with codes for every tensor (``coded_min_numel=0``): the bytes
            per parameter of a large model, whose tensors below the default threshold (4096
            elements, kept in 16 bits) hold about 0.1% of its parameters; with a target model it
            is that model's own shapes under the default threshold.
    """

    weight_dtype: torch.dtype
    mode: str
    state_dtype: torch.dtype | str
    footprint: Footprint
    per_element: bool


def layout_on(cls: type, params: list[torch.Tensor], dtype: torch.dtype, mode: str,
              state_dtype: torch.dtype | dict[str, torch.dtype] | None) -> Footprint:
    """The :class:`Footprint` lowp's optimizer ``cls`` would have on parameters shaped like
    ``params``, without allocating: meta-device copies in ``dtype`` with meta gradients, whose
    states and buffers the optimizer's own ``init_state`` (what its first step calls) creates on
    the meta device, where ``nbytes`` is known and nothing is allocated."""
    from lowp.optim.writeback import resolve_mode

    copies = [torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta")) for p in params]
    opt = cls(copies, mode=mode, state_dtype=state_dtype)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.empty_like(p)
            opt.init_state(group, p, resolve_mode(group["mode"], p))
    return measure(copies, opt)


def configuration_name(cls: type, dtype: torch.dtype, mode: str, state_dtype: torch.dtype | str) -> str:
    """The row name of one configuration, e.g. ``lowp AdamW bf16 kahan, bf16 states`` (fp32
    weights: ``(any mode)``)."""
    states = state_dtype if isinstance(state_dtype, str) else DTYPE_NAMES[state_dtype]
    shown = "(any mode)" if dtype == torch.float32 else mode
    return f"lowp {cls.__name__} {DTYPE_NAMES[dtype]} {shown}, {states} states"


def lowp_footprints(optimizer: str, target: torch.nn.Module | None = None,
                    progress: Callable[[int, int, str], None] | None = None) -> list[LowpFootprint]:
    """Build lowp's ``optimizer`` on the probe model in every configuration of
    :func:`lowp_configurations`, take one step and :func:`measure` it. When its states are not
    shaped like the weights (``per_element`` false) or are block-scaled, and a ``target`` model is
    given (on any device, the meta device included), the footprint is that of the target's own
    shapes (:func:`layout_on`), since bytes per parameter then depend on the shapes. ``progress``, when
    given, is called before each configuration with (its number from 1, the number of
    configurations, its :func:`configuration_name`)."""
    from lowp.optim.base import default_state_dtype

    cls = lowp_optimizer(optimizer)
    out = []
    configurations = lowp_configurations(cls)
    for i, (dtype, mode, layout) in enumerate(configurations, start=1):
        if progress is not None:
            progress(i, len(configurations), configuration_name(cls, dtype, mode, layout or default_state_dtype(dtype)))
        coded = isinstance(layout, str)
        state_dtype = coded_state_dtype(cls, layout) if isinstance(layout, str) else layout
        model = probe_model(dtype)
        # the probe's small tensors would keep 16-bit states: codes for all give a large model's bytes.
        # The bytes a step leaves do not depend on the backend: the reference pipeline builds no
        # kernel (a fresh machine would compile one per configuration, about 30 s for AdamW's)
        opt = cls(model.parameters(), mode=mode, state_dtype=state_dtype, backend="foreach",
                  **({"coded_min_numel": 0} if coded else {}))
        opt.step()
        per_element = coded or all(v.numel() == p.numel() for p, s in opt.state.items()
                                   for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        footprint = measure(model.parameters(), opt)
        if target is not None and (coded or not per_element):
            footprint = layout_on(cls, list(target.parameters()), dtype, mode, state_dtype)
        out.append(LowpFootprint(dtype, mode, layout or default_state_dtype(dtype), footprint, per_element))
    return out
