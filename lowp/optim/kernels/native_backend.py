"""``backend="native"``: every elementwise optimizer rule (and StableAdamW, with a per-tensor
pre-pass) in every write-back mode through the hand-written AVX2 kernel ``native/step.cpp``, one
call per step and dtype signature over all parameters (multi-tensor), on torch's OpenMP threads
(``torch.get_num_threads()``).

It runs the same math as :mod:`~lowp.optim.kernels.rules` and :mod:`~lowp.optim.kernels.step`
(results bit-identical to the ``foreach`` reference in every mode: stochastic rounding draws the
counter-based bits of :mod:`lowp.optim.randomness` on every backend), compiles in about a
second per variant instead of Inductor's 10-40 s, and needs no ``torch.compile``. Cases without
a fused form run the reference pipeline, as on the compiled backend.
"""
from __future__ import annotations

import ctypes

import torch

from lowp.optim.backends import ParamSlice, StepContext
from lowp.optim.kernels.checks import PLAIN_TYPES, check_kernel_args, kernel_memory, plain, storage_fits
from lowp.optim.kernels.compiled import STREAMS, CompiledBackend, by_signature, slice_keys, step_values
from lowp.optim.kernels.native_build import DTYPE_CODES, finite_function, native_available, step_function
from lowp.optim.kernels.rules import Rule

__all__ = ["NativeBackend", "variant_macros", "macro_dtypes", "slice_dtypes"]

_RULE_IDS = {"adam": 0, "adamw": 0, "sgd": 1, "lion": 2, "radam": 3, "stableadamw": 4}
_MODE_IDS = {"nearest": 0, "stochastic": 1, "kahan": 2, "exact": 3}
_ROLES = 6  # weight, grad, buffer, up to three states
_FLOAT_CODES = {dtype: code for dtype, code in DTYPE_CODES.items() if dtype.is_floating_point}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def variant_macros(rule: Rule, ctx: StepContext, dtypes: tuple[torch.dtype | None, ...]) -> dict[str, int]:
    """The ``LOWP_*`` macros of the compiled variant for one step context and the dtypes of a
    slice (:func:`slice_dtypes`: weight, gradient, buffer or ``None``, then each state)."""
    cfg = list(rule.config(ctx.group)) + [False] * 3
    weight, grad, buffer, *states = dtypes
    macros = {"RULE": _RULE_IDS[rule.name], "MODE": _MODE_IDS[ctx.mode.name], "NSTATES": len(states),
              "W": DTYPE_CODES[weight], "G": DTYPE_CODES[grad], "B": DTYPE_CODES[buffer] if buffer else 0,
              "SR": ctx.group["state_rounding"] == "stochastic", "COUNT": ctx.count}
    macros.update({f"CFG{i}": bool(cfg[i]) for i in range(3)})
    macros.update({f"S{i}": DTYPE_CODES[states[i]] if i < len(states) else 0 for i in range(3)})
    return macros


def macro_dtypes(macros: dict[str, int]) -> tuple[torch.dtype | None, ...]:
    """The dtypes a variant reads, inverse of :func:`variant_macros`: (weight, gradient, buffer or
    ``None`` when its mode has none, one per state)."""
    buffer = _DTYPES[macros["B"]] if macros["MODE"] in (_MODE_IDS["kahan"], _MODE_IDS["exact"]) else None
    return (_DTYPES[macros["W"]], _DTYPES[macros["G"]], buffer,
            *(_DTYPES[macros[f"S{i}"]] for i in range(macros["NSTATES"])))


def slice_dtypes(s: ParamSlice) -> tuple[torch.dtype | None, ...]:
    """(weight, gradient, buffer or ``None``, states...) dtypes: what selects a variant per slice."""
    return (s.param.dtype, s.grad.dtype, s.buffer.dtype if s.buffer is not None else None,
            *(t.dtype for t in s.states.values()))


class NativeBackend(CompiledBackend):
    """Fused steps through the native CPU kernel; see the module docstring. ``fused_elements``
    counts the elements the kernel updated, ``reference_elements`` those that took the reference
    pipeline (:class:`~lowp.optim.kernels.compiled.CompiledBackend`)."""

    name = "native"
    min_numel = 1
    fp16_stochastic = True
    devices = ("cpu",)

    def __init__(self, chunk_size: int = 1 << 17) -> None:
        if not native_available():
            raise RuntimeError("backend='native': needs an x86-64 CPU with AVX2, FMA and F16C and a C++ "
                               "compiler (g++, c++ or clang++) on PATH")
        super().__init__(chunk_size)

    def fuses(self, rule: Rule | None) -> bool:
        """Every rule of :data:`~lowp.optim.kernels.rules.RULES`, StableAdamW's included."""
        return rule is not None and rule.name in _RULE_IDS

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool]:
        """The check of :class:`~lowp.optim.backends.Backend` in one native call over every
        fp32/bf16/fp16 CPU gradient in kernel memory (:func:`~lowp.optim.kernels.checks.kernel_memory`):
        an integer test of the exponent field, read once at memory speed (torch's ``aminmax``
        took 13-30% of a fused step, measured). Empty gradients are finite; tensor subclasses
        (DTensor) are checked one by one with their own ``isfinite``; other layouts by the
        reference check; a gradient whose storage is smaller than its shape is a ``ValueError``."""
        flags: list[bool | None] = [None] * len(grads)
        native = []
        for i, g in enumerate(grads):
            if type(g) not in PLAIN_TYPES:
                flags[i] = bool(torch.isfinite(g).all())
            elif g.numel() == 0:
                flags[i] = True
            elif g.is_cpu and kernel_memory(g, _FLOAT_CODES):
                native.append(i)
            elif plain(g) and not storage_fits(g):  # torch's own kernels would read past it too
                raise ValueError(f"grad: its storage holds {g.untyped_storage().nbytes()} bytes, fewer than its "
                                 f"shape {tuple(g.shape)} addresses (was the storage freed or resized?)")
        if native:
            found = (ctypes.c_uint8 * len(native))()
            finite_function()(len(native), (ctypes.c_void_p * len(native))(*(grads[i].data_ptr() for i in native)),
                              (ctypes.c_int64 * len(native))(*(grads[i].numel() for i in native)),
                              (ctypes.c_int32 * len(native))(*(_FLOAT_CODES[grads[i].dtype] for i in native)),
                              found, torch.get_num_threads())
            for i, ok in zip(native, found):
                flags[i] = bool(ok)
        others = [i for i, f in enumerate(flags) if f is None]
        for i, ok in zip(others, super().finite_flags([grads[i] for i in others])):
            flags[i] = ok
        return flags

    def run_fused(self, rule: Rule, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        names = list(slices[0].states)
        # the step's numbers in float64; the kernel rounds them to fp32 as step_numbers() does
        # (StableAdamW keeps lr, bc1 and wd in float64)
        h = (ctypes.c_double * 10)(*step_values(rule, ctx))
        stalled = sum(self.launch(variant_macros(rule, ctx, dtypes), members, names, h,
                                  [k for s in members for k in slice_keys(ctx, s)])
                      for dtypes, members in by_signature(slices, slice_dtypes).items())
        self.fused_elements += sum(s.numel for s in slices)
        return torch.tensor(stalled, dtype=torch.int64) if ctx.count else None

    @staticmethod
    def launch(macros: dict[str, int], members: list[ParamSlice], names: list[str],
               h: "ctypes.Array[ctypes.c_double]", keys: list[int]) -> int:
        """One kernel call over ``members`` (slices of one variant, each a contiguous range of its
        parameter) with their stream keys (:func:`slice_keys` of each, concatenated)."""
        check_kernel_args(members, names, macro_dtypes(macros))
        if len(keys) != len(members) * STREAMS:   # the kernel reads STREAMS keys per tensor
            raise RuntimeError(f"kernel call: {len(keys)} stream keys for {len(members)} tensors")
        fn = step_function(macros)
        n = len(members)
        grads = [s.grad if s.grad.is_contiguous() else s.grad.contiguous() for s in members]
        table = (ctypes.c_void_p * (_ROLES * n))()
        for j, (s, g) in enumerate(zip(members, grads)):
            tensors = [s.param, g, s.buffer, *(s.states[k] for k in names)]
            for role, t in enumerate(tensors):
                table[role * n + j] = t.data_ptr() if t is not None else None
        numel = (ctypes.c_int64 * n)(*(s.numel for s in members))
        offsets = (ctypes.c_int64 * n)(*(s.index.first() for s in members))
        return fn(n, table, numel, offsets, h, (ctypes.c_uint32 * len(keys))(*keys), torch.get_num_threads())
