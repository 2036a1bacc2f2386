"""A traced optimizer rule (:class:`~lowp.optim.rule.Program`) evaluated on torch tensors, for the
``torch.compile`` backend: every operation becomes the torch operation with the same rounding
(``fma`` is Inductor's fused multiply-add prim, which only means one rounding under
:func:`torch.compile`; run eagerly it rounds twice).
"""
from __future__ import annotations

from typing import Callable

import torch

from lowp.optim.rule import Program

__all__ = ["evaluate"]


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a*b + c`` rounded once (Inductor's fma prim: ``std::fma``/``fmadd`` on CPU, ``tl.fma`` on
    CUDA). Imported lazily: ``torch._inductor`` takes seconds to import."""
    from torch._inductor import inductor_prims

    return inductor_prims.fma(a, b, c)


def _sign(x: torch.Tensor) -> torch.Tensor:
    """torch.sign as on CPU (0 for NaN, whatever the device's own kernel does)."""
    return torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, 0.0))


_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg, "fma": _fma,
    "sqrt": torch.sqrt, "maximum": torch.maximum, "sign": _sign, "where": torch.where, "lt": torch.lt,
    "le": torch.le, "gt": torch.gt, "ge": torch.ge, "and": torch.logical_and, "or": torch.logical_or,
    "not": torch.logical_not,
}


def evaluate(program: Program, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], h: torch.Tensor,
             tensor_numbers: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(u, new states)`` of ``program`` on fp32 tensors; ``h[k]`` (0-d fp32 tensors) is step
    number ``program.numbers[k]`` and ``tensor_numbers[k]`` per-tensor number ``k``."""
    leaves = {"w": w, "g": g}
    states_by_name = dict(zip(program.state_names, states))
    numbers = {name: h[k] for k, name in enumerate(program.numbers)}
    per_tensor = {name: tensor_numbers[k] for k, name in enumerate(program.tensor_numbers)} \
        if tensor_numbers is not None else {}
    values: list[torch.Tensor] = []
    for op, name, constant, args in program.steps:
        if op == "input":
            out = leaves[name]
        elif op == "state":
            out = states_by_name[name]
        elif op == "number":
            out = numbers[name]
        elif op == "tensor_number":
            out = per_tensor[name]
        elif op == "const":
            out = torch.full((), constant, dtype=torch.float32, device=w.device)
        else:
            out = _OPS[op](*(values[i] for i in args))
        values.append(out)
    return values[program.update_at], [values[i] for i in program.states_at]
