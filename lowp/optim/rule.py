"""The elementwise rule of an optimizer, written once as a small expression graph.

A fused kernel runs an optimizer's update one element at a time, so the update is written as a
Python function over *symbols* instead of tensors::

    def adamw_rule(r: RuleArgs) -> RuleResult:
        m = lerp(r.s.exp_avg, r.g, r.n.one_minus_beta1)
        v = fma(r.n.one_minus_beta2 * r.g, r.g, r.s.exp_avg_sq * r.n.beta2)
        u = m / (sqrt(v) / r.n.sqrt_bias_correction2 + r.n.eps) * r.n.step_size
        return u, {"exp_avg": m, "exp_avg_sq": v}

:func:`trace` calls it once per variant (structural switches ``r.on.<name>`` are plain Python
bools, so an ``if`` on them picks the code path at trace time) and records a :class:`Program`:
the operations in order, which numbers they read and what they return. Each backend reads that
one description: :mod:`lowp.optim.kernels.compiled.rule` evaluates it on tensors (the
``torch.compile`` backend), :mod:`lowp.optim.kernels.native.source` writes it as AVX2 C++ and
:mod:`lowp.optim.kernels.triton.source` as a Triton function.

Every operation is one fp32 rounding with the meaning of ATen's CPU kernels, so a rule can mirror
the optimizer's ``torch._foreach_*`` reference rounding by rounding: ``fma(a, b, c)`` is
``a*b + c`` rounded once (ATen's vectorised ``addcmul`` and ``add(alpha=)`` are fused
multiply-adds), ``lerp`` is ATen's vectorised lerp, ``sqrt`` and ``/`` are correctly rounded,
``maximum`` propagates NaN and ``sign(NaN)`` is 0, as torch's CPU kernels.

Leaves: ``r.w`` (the fp32 weight), ``r.g`` (the fp32 gradient, already unscaled), ``r.s.<state>``
(each state as fp32), ``r.n.<number>`` (the step's numbers, computed on the host in float64 by
the spec's ``numbers`` and rounded once to fp32) and ``r.t.<number>`` (per-tensor numbers, from
a spec's per-tensor reduction). Python floats are constants.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

__all__ = ["Expr", "RuleArgs", "RuleResult", "Program", "trace", "fma", "sqrt", "where", "maximum", "sign",
           "lerp", "fp32", "OPS"]

Operand = Union["Expr", float, int]

#: Every operation a rule may use, with its arity: the emitters implement exactly these.
OPS: dict[str, int] = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "neg": 1, "fma": 3, "sqrt": 1, "maximum": 2, "sign": 1,
    "where": 3, "lt": 2, "le": 2, "gt": 2, "ge": 2, "and": 2, "or": 2, "not": 1,
}
#: Operations whose result is a condition (a lane mask), not a number.
CONDITIONS = frozenset({"lt", "le", "gt", "ge", "and", "or", "not"})
#: Leaf kinds: the weight or gradient ("input"), a state, a step number, a per-tensor number, a constant.
LEAVES = frozenset({"input", "state", "number", "tensor_number", "const"})


class Expr:
    """One node of a rule: an operation of :data:`OPS` on other nodes, or a leaf (:data:`LEAVES`)
    whose ``name`` says which input, state or number it is (``value`` for constants).

    Rules build nodes with operators and the functions of this module, which check operand kinds;
    the constructor itself checks nothing.

    Args:
        op: an operation of :data:`OPS` or a leaf kind of :data:`LEAVES`.
        args: the operand nodes of an operation, as many as :data:`OPS` says (default ``()``:
            a leaf).
        name: a leaf's name: ``"w"`` or ``"g"`` for ``"input"``, the state's or number's name
            otherwise (default ``""``: unused by operations and constants).
        value: a ``"const"`` leaf's number (default 0.0: unused by other nodes).
    """

    __slots__ = ("op", "args", "name", "value")

    def __init__(self, op: str, args: tuple["Expr", ...] = (), name: str = "", value: float = 0.0) -> None:
        self.op, self.args, self.name, self.value = op, args, name, value

    @property
    def is_condition(self) -> bool:
        """True for comparisons and their combinations (lane masks)."""
        return self.op in CONDITIONS

    def __repr__(self) -> str:
        if self.op in LEAVES:
            return repr(self.value) if self.op == "const" else f"{self.op}:{self.name}"
        return f"{self.op}({', '.join(map(repr, self.args))})"

    def __bool__(self) -> bool:
        raise TypeError("a rule cannot branch on tensor values (an `if` or `and`/`or` on a symbol); use where(), "
                        "& and | instead, or a structural switch r.on.<name>")

    # arithmetic
    def __add__(self, o: Operand) -> "Expr": return _node("add", self, o)
    def __radd__(self, o: Operand) -> "Expr": return _node("add", o, self)
    def __sub__(self, o: Operand) -> "Expr": return _node("sub", self, o)
    def __rsub__(self, o: Operand) -> "Expr": return _node("sub", o, self)
    def __mul__(self, o: Operand) -> "Expr": return _node("mul", self, o)
    def __rmul__(self, o: Operand) -> "Expr": return _node("mul", o, self)
    def __truediv__(self, o: Operand) -> "Expr": return _node("div", self, o)
    def __rtruediv__(self, o: Operand) -> "Expr": return _node("div", o, self)
    def __neg__(self) -> "Expr": return _node("neg", self)
    # comparisons and lane masks (no __eq__: nodes are compared by identity)
    def __lt__(self, o: Operand) -> "Expr": return _node("lt", self, o)
    def __le__(self, o: Operand) -> "Expr": return _node("le", self, o)
    def __gt__(self, o: Operand) -> "Expr": return _node("gt", self, o)
    def __ge__(self, o: Operand) -> "Expr": return _node("ge", self, o)
    def __and__(self, o: "Expr") -> "Expr": return _node("and", self, o)
    def __or__(self, o: "Expr") -> "Expr": return _node("or", self, o)
    def __invert__(self) -> "Expr": return _node("not", self)


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (ties to even; beyond the largest finite fp32 value
    plus half an ulp, an infinity), as a Python float: what a number or constant of a rule is in
    every kernel."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _lift(x: Operand) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Expr("const", value=float(x))
    raise TypeError(f"a rule operand must be a symbol or a Python number, got {type(x).__name__}")


def _node(op: str, *args: Operand) -> Expr:
    lifted = tuple(_lift(a) for a in args)
    wants_conditions = op in ("and", "or", "not")
    for a in lifted[1:] if op == "where" else lifted:
        if a.is_condition != wants_conditions:
            raise TypeError(f"{op}: expected {'conditions' if wants_conditions else 'numbers'}, got {a!r}")
    if op == "where" and not lifted[0].is_condition:
        raise TypeError(f"where: the first argument must be a condition (a comparison), got {lifted[0]!r}")
    return Expr(op, lifted)


def fma(a: Operand, b: Operand, c: Operand) -> Expr:
    """``a*b + c`` rounded once."""
    return _node("fma", a, b, c)


def sqrt(x: Operand) -> Expr:
    """The correctly rounded square root."""
    return _node("sqrt", x)


def where(condition: Expr, a: Operand, b: Operand) -> Expr:
    """``a`` where ``condition`` holds, else ``b``."""
    return _node("where", condition, a, b)


def maximum(a: Operand, b: Operand) -> Expr:
    """``torch.maximum``: the larger value, NaN if either is NaN."""
    return _node("maximum", a, b)


def sign(x: Operand) -> Expr:
    """``torch.sign`` on CPU: -1, 0 or 1, and 0 for NaN."""
    return _node("sign", x)


def lerp(start: Operand, end: Operand, weight: Operand) -> Expr:
    """ATen's vectorised CPU ``lerp``: ``fma(w, end - start, start)`` for ``w < 0.5``, else
    ``fma(w - 1, end - start, end)``. With ``weight`` a step number the choice is the same for
    every element, so the kernels decide it once per call."""
    w = _lift(weight)
    small = w < 0.5
    return fma(where(small, w, w - 1.0), _lift(end) - start, where(small, start, end))


class _Leaves:
    """Attribute access ``r.<kind>.<name>`` creating (once) the leaf of that name."""

    def __init__(self, kind: str, allowed: tuple[str, ...] | None) -> None:
        self._kind, self._allowed = kind, allowed
        self._made: dict[str, Expr] = {}

    def __getattr__(self, name: str) -> Expr:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._allowed is not None and name not in self._allowed:
            raise AttributeError(f"r.{self._kind[0]}.{name}: no {self._kind} of that name; this variant has "
                                 f"{', '.join(self._allowed) or 'none'}")
        if name not in self._made:
            self._made[name] = Expr(self._kind, name=name)
        return self._made[name]


class _Switches:
    """``r.on.<name>``: a structural switch, a plain bool at trace time."""

    def __init__(self, switches: Mapping[str, bool]) -> None:
        self._switches = dict(switches)

    def __getattr__(self, name: str) -> bool:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._switches[name]
        except KeyError:
            raise AttributeError(f"r.on.{name}: no switch of that name; the spec gives "
                                 f"{', '.join(self._switches) or 'none'}") from None


@dataclass
class RuleArgs:
    """What a rule function receives: ``w``, ``g``, ``s`` (states), ``n`` (step numbers), ``t``
    (per-tensor numbers) and ``on`` (structural switches); see the module docstring.

    Made by :func:`trace`; attribute access on ``s``, ``n`` and ``t`` creates the leaf of that
    name (an ``AttributeError`` for a name the variant does not have).

    Args:
        w: the ``"input"`` leaf of the fp32 weight.
        g: the ``"input"`` leaf of the fp32 gradient (unscaled, sign-flipped under ``maximize``).
        s: the states: ``s.<name>`` is the fp32 value of state ``name``.
        n: the step numbers: ``n.<name>`` is a number of the spec's ``numbers``.
        t: the per-tensor numbers: ``t.<name>`` is a number of the spec's ``tensor_numbers``.
        on: the structural switches: ``on.<name>`` is a plain bool of the spec's ``switches``.
    """

    w: Expr
    g: Expr
    s: Any
    n: Any
    t: Any
    on: Any


#: A rule returns the update ``u`` and the new value of every state.
RuleResult = tuple[Expr, Mapping[str, Expr]]
RuleFn = Callable[[RuleArgs], RuleResult]


#: One node of a traced program as plain data: ``(op, name, value, positions of its arguments)``.
Step = tuple[str, str, float, tuple[int, ...]]


@dataclass(frozen=True)
class Program:
    """A traced rule: ``nodes`` in evaluation order (each after its arguments, leaves included)
    and the same as plain data in ``steps``; the ``update`` and ``states`` (name -> node, in the
    variant's state order) it returns, with their positions; and the names of the step numbers
    and per-tensor numbers it reads, in first-use order (the position of a number in
    :attr:`numbers` is where the backends pack it); ``update_at`` and ``states_at`` are the
    positions of the outputs in :attr:`nodes`.

    Made by :func:`trace`, which keeps the fields consistent; the constructor checks nothing.

    Args:
        nodes: every node reachable from the outputs, each after its arguments.
        steps: :attr:`nodes` as plain data, ``(op, name, value, positions of the arguments)``.
        update: the node of the weight change ``u``.
        states: ``(state name, node of its new value)`` pairs, in the variant's state order.
        state_names: the variant's state names, in order.
        numbers: the step numbers the rule reads, in first-use order.
        tensor_numbers: the per-tensor numbers the rule reads, in first-use order.
        update_at: the position of :attr:`update` in :attr:`nodes`.
        states_at: the positions of the new states in :attr:`nodes`, in state order.
    """

    nodes: tuple[Expr, ...]
    steps: tuple[Step, ...]
    update: Expr
    states: tuple[tuple[str, Expr], ...]
    state_names: tuple[str, ...]
    numbers: tuple[str, ...]
    tensor_numbers: tuple[str, ...]
    update_at: int
    states_at: tuple[int, ...]

    def index(self) -> dict[int, int]:
        """``id(node) -> position`` in :attr:`nodes` (the emitters name temporaries by it)."""
        return {id(n): i for i, n in enumerate(self.nodes)}


def _order(roots: list[Expr]) -> list[Expr]:
    """Every node reachable from ``roots``, each after its arguments (iterative post-order)."""
    seen: set[int] = set()
    out: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            out.append(node)
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return out


def trace(rule: RuleFn, state_names: tuple[str, ...], switches: Mapping[str, bool],
          numbers: tuple[str, ...] | None = None, tensor_numbers: tuple[str, ...] | None = None) -> Program:
    """Run ``rule`` on symbols and record it (see :class:`Program`). ``numbers`` and
    ``tensor_numbers`` (when given) list the step and per-tensor numbers the rule may read."""
    states = _Leaves("state", state_names)
    args = RuleArgs(Expr("input", name="w"), Expr("input", name="g"), states, _Leaves("number", numbers),
                    _Leaves("tensor_number", tensor_numbers), _Switches(switches))
    update, new = rule(args)
    update = _lift(update)
    if set(new) != set(state_names):
        raise ValueError(f"rule {getattr(rule, '__name__', rule)!r}: returned the states {sorted(new)}, the "
                         f"variant has {list(state_names)}")
    outputs = [(name, _lift(new[name])) for name in state_names]
    for name, node in [("update", update), *outputs]:
        if node.is_condition:
            raise TypeError(f"rule output {name!r}: a condition, expected a number (use where())")
    nodes = _order([update, *(node for _, node in outputs)])
    index = {id(n): i for i, n in enumerate(nodes)}
    steps = tuple((n.op, n.name, n.value, tuple(index[id(a)] for a in n.args)) for n in nodes)
    used = [n.name for n in nodes if n.op == "number"]
    used_tensor = [n.name for n in nodes if n.op == "tensor_number"]
    return Program(tuple(nodes), steps, update, tuple(outputs), tuple(state_names), tuple(dict.fromkeys(used)),
                   tuple(dict.fromkeys(used_tensor)), index[id(update)], tuple(index[id(n)] for _, n in outputs))
