"""The Triton step kernel of one optimizer variant, written from its spec as Python source.

Triton compiles functions from their source text, so the kernel of a traced rule
(:class:`~lowp.optim.rule.Program`) is generated as a small module: a ``@triton.jit`` function
``step_kernel`` with one pointer table per state (the number of states is the variant's, not a
fixed maximum), the rule's operations one line each (``tl.fma`` for fused multiply-adds,
``tl.sqrt_rn`` and ``tl.div_rn`` for correctly rounded square roots and divisions), and the
loads and state stores of :func:`lowp.optim.kernels.compiled.step.fused_step`, and the write-back mode's
Triton fragment (one kernel per mode). The helpers it calls live in
:mod:`~lowp.optim.kernels.triton.ops`.

One launch updates many parameters: each program handles ``BLOCK`` elements of one tensor, found
through per-launch tables (data pointers of each role, sizes, the global index of each tensor's
first element, the stream keys of each tensor, and a block list mapping program ids to
(tensor, start)), so small tensors do not pay a launch each. ``H`` holds the gradient factor,
then the rule's numbers; ``STALLED`` receives each program's count of weights that did not
move (summed on the host side by torch: no atomics on one address). With ``CHECK`` (1: a
parameter's, 2: the whole launch's), the flags ``FLAGS`` of the non-finite check
(:mod:`~lowp.optim.kernels.triton.finite`), launched just before, give a skipped tensor no
elements: every load and store is masked by ``offs < n``, so nothing of it is written.
"""
from __future__ import annotations

import functools
import math

from lowp.optim.codes import Code
from lowp.optim.rule import Program, fp32
from lowp.optim.writeback import MODES

__all__ = ["kernel_source", "code_constants"]

_BINARY = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "&", "or": "|"}
_CALLS = {"fma": "tl.fma", "sqrt": "tl.sqrt_rn", "div": "tl.div_rn", "maximum": "maximum", "sign": "sign",
          "where": "tl.where"}


def _literal(x: float) -> str:
    """A Python literal of ``x`` rounded to fp32 (what Triton makes of it)."""
    value = fp32(x)
    return repr(value) if value == value and abs(value) != math.inf else f"float({str(value)!r})"


def _rule_lines(program: Program) -> list[str]:
    """The rule, one assignment ``x<i> = ...`` per node (numbers load from ``H + 1 + k``)."""
    states = {n: i for i, n in enumerate(program.state_names)}
    numbers = {n: i for i, n in enumerate(program.numbers)}
    lines = []
    for i, (op, name, value, args) in enumerate(program.steps):
        refs = [f"x{a}" for a in args]
        if op == "input":
            expr = name
        elif op == "state":
            expr = f"s{states[name]}"
        elif op == "number":
            expr = f"tl.load(H + {1 + numbers[name]})"
        elif op == "const":
            expr = _literal(value)
        elif op in _BINARY:
            expr = f"({refs[0]} {_BINARY[op]} {refs[1]})"
        elif op == "neg":
            expr = f"(-{refs[0]})"
        elif op == "not":
            expr = f"({refs[0]} == 0)"
        elif op in _CALLS:
            expr = f"{_CALLS[op]}({', '.join(refs)})"
        else:
            raise ValueError(f"the Triton kernel has no form of the rule operation {op!r}")
        lines.append(f"    x{i} = {expr}")
    return lines


def code_constants(code: Code) -> tuple[str, str]:
    """The constexpr arguments that :func:`~lowp.optim.kernels.triton.ops.decode_code` and
    :func:`~lowp.optim.kernels.triton.ops.encode_code` take for ``code`` (after their tensors),
    as source text: ``(decode's, encode's)``."""
    m, emin = code.mantissa_bits, code.min_exponent
    kind = f"{code.signed}, {code.bits}, {code.storage.is_floating_point}, {m}, {1 - emin}"
    decode = f"{kind}, {2.0 ** (emin - m)!r}"
    encode = (f"{kind}, {2.0 ** emin!r}, {2.0 ** -m!r}, {2.0 ** (m - emin)!r}, {0.0 if code.signed else 1.0!r}, "
              f"{code.top!r}")
    return decode, encode


def _state_lines(j: int, code: Code | None) -> tuple[list[str], list[str]]:
    """(the lines that load state ``j`` as fp32 ``s<j>``, the call that stores ``x``): a plain
    state through its typed pointer, a coded one decoded from its code bytes and block scales."""
    if code is None:
        return ([f"    s{j}_ptr = tl.load(S{j} + t).to(tl.pointer_type(S{j}_T)) + offs",
                 f"    s{j} = widen(tl.load(s{j}_ptr, mask=mask), S{j}_T)"],
                [f"    store_state(s{j}_ptr, {{x}}, mask, index, keys, {j}, S{j}_T, SR{j})"])
    decode, encode = code_constants(code)
    return ([f"    c{j} = tl.load(S{j} + t).to(tl.pointer_type(tl.uint8))",
             f"    k{j} = tl.load(K{j} + t).to(tl.pointer_type(SC_T))",
             f"    s{j} = decode_code(c{j}, k{j}, offs, mask, {decode}, CB)"],
            [f"    if SR{j}:",
             f"        noise = random16(index, keys, {2 + j})",
             "    else:",
             "        noise = tl.zeros(offs.shape, dtype=tl.int32)",
             f"    encode_code(c{j}, k{j}, {{x}}, start, offs, n, mask, noise, SR{j}, {encode}, CB, SC_T, BLOCK)"])


def _indented(source: str) -> list[str]:
    """A mode's Triton fragment as lines of the kernel's body."""
    return ["    " + line for line in source.splitlines()]


@functools.lru_cache(maxsize=None)
def kernel_source(program: Program, mode: str, codes: tuple[Code | None, ...] = ()) -> str:
    """The module text of ``program``'s step kernel in write-back ``mode`` (its Triton fragment,
    :mod:`lowp.optim.writeback`; see the module docstring); ``codes``: per
    state, its block-scaled code (``None`` or left out: a plain state). A kernel with codes takes
    one more pointer table per coded state (``K<j>``, the block scales) and the constexprs
    ``SC_T`` (the scales' type) and ``CB`` (the code block), and holds its elements as a
    ``(BLOCK // CB, CB)`` tile, a row per code block, so the block maxima reduce along rows."""
    if program.tensor_numbers:
        raise ValueError("the Triton kernel has no per-tensor reduction pass")
    n = len(program.state_names)
    codes = codes + (None,) * (n - len(codes))
    coded = [j for j in range(n) if codes[j] is not None]
    states = [f"S{j}" for j in range(n)] + [f"K{j}" for j in coded]
    types = [f"S{j}_T: tl.constexpr" for j in range(n)]
    rounding = [f"SR{j}: tl.constexpr" for j in range(n)]
    rounding += ["SC_T: tl.constexpr", "CB: tl.constexpr"] if coded else []
    loads, stores = zip(*(_state_lines(j, codes[j]) for j in range(n))) if n else ((), ())
    write_back = MODES[mode]
    lines = [
        f'"""Generated by lowp.optim.kernels.triton.source: one optimizer variant\'s fused step, {mode} mode."""',
        "import triton",
        "import triton.language as tl",
        "",
        "from lowp.optim.kernels.triton.ops import decode_code, encode_code, maximum, random16, round_to, sign, "
        "stochastic_bf16, store_state, widen",
        "",
        "",
        "@triton.jit",
        "def step_kernel(P, G, B, " + "".join(f"{s}, " for s in states)
        + "SIZES, OFFSETS, BLOCK_TENSOR, BLOCK_START, H, KEYS, STALLED, FLAGS, P_T: tl.constexpr, "
        + "G_T: tl.constexpr, B_T: tl.constexpr, " + "".join(f"{t}, " for t in types + rounding)
        + "COUNT: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    t = tl.load(BLOCK_TENSOR + pid)",
        "    start = tl.load(BLOCK_START + pid)",
        "    n = tl.load(SIZES + t)",
        "    if CHECK == 1:  # skip_param: a tensor whose gradient holds a NaN or an infinity has no elements",
        "        n = tl.where(tl.load(FLAGS + 1 + t) != 0, 0, n)",
        "    if CHECK == 2:  # skip_step: no tensor has elements when one gradient does",
        "        n = tl.where(tl.load(FLAGS) != 0, 0, n)",
        ("    offs = start + tl.arange(0, BLOCK // CB)[:, None] * CB + tl.arange(0, CB)[None, :]  # a row per block"
         if coded else "    offs = start + tl.arange(0, BLOCK)"),
        "    mask = offs < n",
        "    index = tl.load(OFFSETS + t) + offs.to(tl.int64)",
        f"    keys = KEYS + t * {2 + n}  # the tensor's stream keys: weight, compensation, one per state",
        "    p_ptr = tl.load(P + t).to(tl.pointer_type(P_T)) + offs",
        "    g_ptr = tl.load(G + t).to(tl.pointer_type(G_T)) + offs",
        "    b_ptr = tl.load(B + t).to(tl.pointer_type(B_T)) + offs",
        *(line for lines in loads for line in lines),
        *_indented(write_back.triton_load),
        "    g = widen(tl.load(g_ptr, mask=mask), G_T) * tl.load(H)",
        *_rule_lines(program),
        f"    u = x{program.update_at}",
        *(line.format(x=f"x{at}") for lines, at in zip(stores, program.states_at) for line in lines),
        "    stalled = tl.zeros(offs.shape, dtype=tl.int32)",
        *_indented(write_back.triton_write),
        "    tl.store(p_ptr, new, mask=mask)",
        "    if COUNT:",
        "        tl.store(STALLED + pid, tl.sum(stalled))",
    ]
    return "\n".join(lines) + "\n"
