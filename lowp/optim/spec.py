"""``OptimizerSpec``: everything the backends need to know about one optimizer, in one place.

An optimizer module declares its spec next to its class (``spec = OptimizerSpec(...)`` in the class
body); the reference pipeline, the ``torch.compile``, native C++ and Triton kernels, the
checkpoint code and the generated tests all read it, so a new optimizer with fused kernels on
every backend is one new module (Adan in :mod:`lowp.optim.adan` is the worked example). A spec
holds:

- ``name``: the optimizer's id (kernel variants and cache entries are named after it);
- ``states(group)``: the state names of a parameter, in order (each shaped like the parameter);
- ``numbers(group, step)``: the step's scalars by name, in float64 on the host, exactly as the
  reference computes them (a new learning rate or step changes data, never compiled code);
- ``switches(group)``: the structural on/off choices by name (amsgrad, Nesterov, decoupled weight
  decay...): one compiled variant per distinct value;
- ``rule``: the elementwise update in the rule language of :mod:`lowp.optim.rule` (``None``
  when the update is not elementwise: every backend then runs the reference);
- optionally a per-tensor reduction (``tensor_sum``, an elementwise term whose sum over each
  tensor the native kernel computes first, in the order of :mod:`lowp.optim.ordered_sum`, which
  the reference update follows too, and ``tensor_numbers(numbers, total, numel)``, the
  per-tensor numbers made from it on the host), for updates such as StableAdamW's RMS clip.

The reference update itself stays a method of the optimizer class (a few ``torch._foreach_*``
calls, the definition that every kernel matches bit for bit).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from lowp.optim.rule import Expr, Program, RuleArgs, RuleFn, trace

__all__ = ["OptimizerSpec", "Numbers", "Switches"]

Numbers = dict[str, float]
Switches = dict[str, bool]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, described once; see the module docstring.

    Args:
        name: the optimizer's id, a Python identifier (it names kernel variants and cache
            entries); else ``ValueError``.
        states: ``states(group)``, the state names of a parameter of ``group``, in order.
        numbers: ``numbers(group, step)``, the step's scalars by name (float64, as the reference
            computes them).
        switches: ``switches(group)``, the structural choices by name (default: none); one
            compiled variant per distinct value.
        rule: the elementwise update in the rule language (:mod:`lowp.optim.rule`); default
            ``None``: every backend runs the reference update.
        tensor_sum: an elementwise term whose sum over each tensor the step needs first (default
            ``None``: elementwise optimizer). Given with ``tensor_numbers`` or not at all, else
            ``ValueError``.
        tensor_numbers: ``tensor_numbers(numbers, total, numel)``, the per-tensor numbers made
            on the host from the step numbers, a tensor's sum of ``tensor_sum`` and its element
            count (default ``None``).
        nonnegative: the states that are never negative (Adam's second moment), which unsigned
            block-scaled codes may hold (:mod:`lowp.optim.codes`); default: none.
    """

    name: str
    states: Callable[[dict[str, Any]], tuple[str, ...]]
    numbers: Callable[[dict[str, Any], int], Numbers]
    switches: Callable[[dict[str, Any]], Switches] = field(default=lambda group: {})
    rule: RuleFn | None = None
    tensor_sum: Callable[[RuleArgs], Expr] | None = None
    tensor_numbers: Callable[[Numbers, float, int], Numbers] | None = None
    nonnegative: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.tensor_sum is None) != (self.tensor_numbers is None):
            raise ValueError(f"spec {self.name!r}: tensor_sum and tensor_numbers go together")
        if not self.name.isidentifier():
            raise ValueError(f"spec name: expected an identifier (it names kernel variants), got {self.name!r}")

    @property
    def elementwise(self) -> bool:
        """True when the update of an element depends on that element alone (no per-tensor
        reduction): parameters may then be cut into chunks anywhere."""
        return self.tensor_sum is None

    def variant(self, group: dict[str, Any]) -> tuple[tuple[str, ...], tuple[tuple[str, bool], ...]]:
        """What selects the traced program for ``group``: its state names and switches."""
        return self.states(group), tuple(sorted((k, bool(v)) for k, v in self.switches(group).items()))

    def program(self, group: dict[str, Any]) -> Program:
        """The rule traced for ``group``'s variant (cached); ``ValueError`` when there is no rule."""
        if self.rule is None:
            raise ValueError(f"spec {self.name!r} has no elementwise rule")
        states, switches = self.variant(group)
        return _traced(self, states, switches)

    def reduction(self, group: dict[str, Any]) -> Program | None:
        """The per-tensor reduction term traced for ``group`` as a program whose ``update`` is the
        term (``None`` without one)."""
        if self.tensor_sum is None:
            return None
        states, switches = self.variant(group)
        return _traced_sum(self, states, switches)

    def step_numbers(self, program: Program, group: dict[str, Any], step: int) -> list[float]:
        """The numbers ``program`` reads, in its order, from :attr:`numbers` (float64)."""
        return self.pick(program.numbers, self.numbers(group, step))

    def pick(self, names: tuple[str, ...], values: Numbers) -> list[float]:
        """``values[name]`` for each of ``names`` (float64); ``KeyError`` naming the missing ones."""
        missing = [n for n in names if n not in values]
        if missing:
            raise KeyError(f"spec {self.name!r}: the rule reads the numbers {missing}, which numbers() does not give")
        return [float(values[n]) for n in names]


@lru_cache(maxsize=None)
def _traced(spec: OptimizerSpec, states: tuple[str, ...], switches: tuple[tuple[str, bool], ...]) -> Program:
    assert spec.rule is not None
    return trace(spec.rule, states, dict(switches))


@lru_cache(maxsize=None)
def _traced_sum(spec: OptimizerSpec, states: tuple[str, ...], switches: tuple[tuple[str, bool], ...]) -> Program:
    assert spec.tensor_sum is not None
    term = spec.tensor_sum
    return trace(lambda r: (term(r), {n: getattr(r.s, n) for n in states}), states, dict(switches))
