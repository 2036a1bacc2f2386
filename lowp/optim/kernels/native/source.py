"""The C++ source of one native kernel variant, written from an optimizer's spec.

A variant is one translation unit: ``#define LOWP_*`` lines (dtype codes, the number of states
and of numbers, and what the write-back mode asks of the kernel: its C++ header
(``LOWP_MODE_HEADER``, which ``step.h`` includes: :mod:`lowp.optim.writeback`), the random
streams it draws and whether it needs the NaN guard), ``#include "vector.h"``, the spec's rule
written out as ``rule`` (and its per-tensor reduction term as ``reduction``), then
``#include "step.h"``. The rule
is the traced :class:`~lowp.optim.rule.Program`, one C++ statement per node, on the fp32
vectors of ``vector.h`` (``fma_`` and ``sqrt_`` are the hardware's single-rounding instructions;
the compiler contracts nothing else, ``-ffp-contract=off``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from lowp.optim.encodings import CODES
from lowp.optim.randomness import Stream
from lowp.optim.rule import Program, fp32
from lowp.optim.writeback import MODES

__all__ = ["Variant", "CodedLayout", "variant_source", "codec_source", "DTYPE_CODES"]

#: dtype codes of ``enum Dtype`` in ``native/vector.h``.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int16: 3, torch.int8: 4}


@dataclass(frozen=True)
class CodedLayout:
    """Block-scaled states decoded and encoded inside the kernel (``native/coded_step.h``).

    Args:
        kinds: per state, its ``CodeKind`` of ``native/codes.h``, or -1 for a plain state.
        scale: the scale dtype's code (``ScaleType`` of ``native/simd.h``).
        block: elements per block.
    """

    kinds: tuple[int, ...]
    scale: int
    block: int


@dataclass(frozen=True)
class Variant:
    """Everything that selects one compiled variant: the traced rule (and reduction), the
    write-back mode, the dtypes of weight, gradient, buffer (``None``: the mode has none) and
    states, stochastic state rounding and stalled-element counting.

    Two equal variants share one compiled kernel. The fields are not checked here: they are made
    by :func:`lowp.optim.kernels.native.kernel.variant_for` from a step context and a slice's dtypes.

    Args:
        program: the optimizer's rule traced for the group's variant (:meth:`OptimizerSpec.program
            <lowp.optim.spec.OptimizerSpec.program>`).
        reduction: the traced per-tensor reduction term (:meth:`OptimizerSpec.reduction
            <lowp.optim.spec.OptimizerSpec.reduction>`), ``None`` for an elementwise optimizer.
        mode: the write-back mode's name, a key of :data:`lowp.optim.writeback.MODES`.
        weight: the weight's dtype (fp32, bf16 or fp16).
        grad: the gradient's dtype (the weight's or fp32).
        buffer: the mode buffer's dtype (``compensation``: the weight's or fp32; ``remainder``:
            int16), ``None`` when the mode has no buffer.
        states: the dtype of each state, in the rule's state order (fp32, bf16 or fp16).
        stochastic_states: ``True`` rounds 16-bit states stochastically (the group's
            ``state_rounding="stochastic"``), ``False`` to nearest.
        count: ``True`` makes the kernel count the elements whose stored weight did not change.
        coded: the states kept as block-scaled codes (their entries of ``states`` are fp32, what
            the rule sees), ``None`` (default) for none.
    """

    program: Program
    reduction: Program | None
    mode: str
    weight: torch.dtype
    grad: torch.dtype
    buffer: torch.dtype | None
    states: tuple[torch.dtype, ...]
    stochastic_states: bool
    count: bool
    coded: CodedLayout | None = None

    @property
    def numbers(self) -> tuple[str, ...]:
        """The step numbers the kernel reads, in the order the host packs them: the rule's, then
        any that only the reduction reads."""
        extra = self.reduction.numbers if self.reduction is not None else ()
        return tuple(dict.fromkeys((*self.program.numbers, *extra)))

    @property
    def dtypes(self) -> tuple[torch.dtype | None, ...]:
        """(weight, gradient, buffer or ``None``, states...): what the kernel reads per slice."""
        return (self.weight, self.grad, self.buffer, *self.states)


def _float(x: float) -> str:
    """An fp32 C++ literal of ``x`` (hexadecimal: exact), after rounding it to fp32."""
    value = fp32(x)
    if value != value:
        return "bc(__builtin_nanf(\"\"))"
    return f"bc({value.hex()}f)" if abs(value) != math.inf else f"bc({'-' if value < 0 else ''}__builtin_inff())"


_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
           "and": "&", "or": "|"}
_CALLS = {"fma": "fma_", "sqrt": "sqrt_", "maximum": "maximum", "sign": "sign", "where": "select"}


def _uniform(program: Program) -> set[int]:
    """Positions of the nodes whose value is the same for every element: numbers, constants and
    operations on them only (computed once per work unit, not per block)."""
    out: set[int] = set()
    for i, (op, _, _, args) in enumerate(program.steps):
        if op in ("number", "tensor_number", "const") or (args and all(a in out for a in args)):
            out.add(i)
    return out


def _function(name: str, program: Program, number_order: tuple[str, ...], returns_states: bool) -> str:
    """``program`` as three pieces: ``struct name_uniform`` (its per-unit values), ``name_prepare(n,
    t, u)`` computing them from the step numbers ``n`` (number ``k`` of ``number_order`` is
    ``n.v[k]``) and the per-tensor numbers ``t``, and ``vf name(u, w, g, s[, out])`` per vector of lanes."""
    states = {n: i for i, n in enumerate(program.state_names)}
    numbers = {n: i for i, n in enumerate(number_order)}
    tensor_numbers = {n: i for i, n in enumerate(program.tensor_numbers)}
    uniform = _uniform(program)
    kept = [i for i in sorted(uniform) if any(i in args for j, (_, _, _, args) in enumerate(program.steps)
                                               if j not in uniform)
            or i in (program.update_at, *program.states_at)]
    slot = {i: k for k, i in enumerate(kept)}
    prepare: list[str] = []
    lines: list[str] = []

    def ref(i: int, inside_prepare: bool) -> str:
        if i in uniform and not inside_prepare:
            return f"u.{'c' if program.nodes[i].is_condition else 'v'}[{slot[i]}]"
        return f"x{i}"

    for i, node in enumerate(program.nodes):
        op, args = node.op, program.steps[i][3]
        inside = i in uniform
        if op == "input":
            expr = node.name
        elif op == "state":
            expr = f"s[{states[node.name]}]"
        elif op == "number":
            expr = f"n.v[{numbers[node.name]}]"
        elif op == "tensor_number":
            expr = f"t[{tensor_numbers[node.name]}]"
        elif op == "const":
            expr = _float(node.value)
        elif op in _BINARY:
            a, b = (ref(x, inside) for x in args)
            expr = f"(vi)({a} {_BINARY[op]} {b})" if node.is_condition else f"{a} {_BINARY[op]} {b}"
        elif op == "neg":
            expr = f"-{ref(args[0], inside)}"
        elif op == "not":
            expr = f"~{ref(args[0], inside)}"
        else:
            expr = f"{_CALLS[op]}({', '.join(ref(x, inside) for x in args)})"
        (prepare if inside else lines).append(f"  const {'vi' if node.is_condition else 'vf'} x{i} = {expr};")
        if i in slot:
            prepare.append(f"  u.{'c' if node.is_condition else 'v'}[{slot[i]}] = x{i};")
    if returns_states:
        lines += [f"  out[{j}] = {ref(at, False)};" for j, at in enumerate(program.states_at)]
    lines.append(f"  return {ref(program.update_at, False)};")
    count = max(1, len(kept))
    struct = f"struct {name}_uniform {{\n  vf v[{count}];\n  vi c[{count}];\n}};\n"
    head = f"static inline void {name}_prepare(const Numbers &n, const vf *t, {name}_uniform &u) {{\n"
    signature = f"const {name}_uniform &u, vf w, vf g, const vf *s" + (", vf *out" if returns_states else "")
    return (struct + head + "  (void)n; (void)t; (void)u;\n" + "\n".join(prepare) + "\n}\n"
            + f"static inline vf {name}({signature}) {{\n  (void)u; (void)w; (void)g; (void)s;\n"
            + "\n".join(lines) + "\n}\n")


@functools.lru_cache(maxsize=None)
def variant_source(spec_name: str, variant: Variant) -> str:
    """The translation unit of ``variant`` (see the module docstring; cached: the same text
    object, whose hash Python keeps, names the loaded library on every later call)."""
    state_codes = [DTYPE_CODES[d] for d in variant.states] + [0]
    mode = MODES[variant.mode]
    streams = mode.streams(variant.buffer)
    macros = {
        "MODE_HEADER": f'"{mode.native_header}"', "MODE_NAN_GUARD": int(mode.nan_guard(variant.buffer)),
        "MODE_WEIGHT_STREAM": int(Stream.WEIGHT in streams),
        "MODE_COMPENSATION_STREAM": int(Stream.COMPENSATION in streams),
        "W": DTYPE_CODES[variant.weight], "G": DTYPE_CODES[variant.grad],
        "B": DTYPE_CODES[variant.buffer] if variant.buffer is not None else 0, "NSTATES": len(variant.states),
        "STATE_TYPES": "{" + ", ".join(map(str, state_codes)) + "}", "SR": int(variant.stochastic_states),
        "COUNT": int(variant.count), "NUMBERS": len(variant.numbers),
        "TENSOR_NUMBERS": len(variant.program.tensor_numbers), "REDUCTION": int(variant.reduction is not None),
    }
    if variant.coded is not None:
        kinds = [*variant.coded.kinds, -1]
        macros.update(CODE_KINDS="{" + ", ".join(map(str, kinds)) + "}", CODE_SCALE=variant.coded.scale,
                      CODE_BLOCK=variant.coded.block)
    macros["WIDE"] = 1   # 512-bit vectors in an AVX-512 build (simd.h)
    parts = [f"// generated by lowp.optim.kernels.native.source: the {spec_name!r} optimizer, {variant.mode} mode",
             *(f"#define LOWP_{k} {v}" for k, v in macros.items()), '#include "vector.h"',
             _function("rule", variant.program, variant.numbers, True)]
    if variant.reduction is not None:
        parts.append(_function("reduction", variant.reduction, variant.numbers, False))
    parts.append('#include "step.h"')
    if variant.coded is not None:
        parts += ['#include "codes.h"', *_encoding_headers(), '#include "coded_step.h"']
    return "\n".join(parts) + "\n"


def _encoding_headers() -> list[str]:
    """The ``#include`` lines of every encoding's header (its ``Storage<KIND>``, :mod:`lowp.optim.encodings`)."""
    return [f'#include "{code.native_header}"' for code in CODES.values()]


@functools.lru_cache(maxsize=None)
def codec_source() -> str:
    """The translation unit of the block-scaled codec (``native/codes.cpp``) over every encoding."""
    kinds = ", ".join(str(code.kind) for code in CODES.values())
    return "\n".join(["// generated by lowp.optim.kernels.native.source: the codec of every encoding",
                      '#include "codes.h"', *_encoding_headers(), f"#define LOWP_CODE_KIND_LIST {kinds}",
                      '#include "codes.cpp"']) + "\n"
