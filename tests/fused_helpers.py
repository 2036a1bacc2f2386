"""Shared set-up of the fused-backend tests: a few parameters of awkward sizes, deterministic
gradients, and the reference run with a correctly rounded sqrt (ATen's CPU sqrt is not)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

SHAPES = [(37, 11), (300,), (4, 3, 5), (5000,)]


def make_params(dtype: torch.dtype = torch.bfloat16, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in shapes]


@contextlib.contextmanager
def correctly_rounded_sqrt() -> Iterator[None]:
    """Make ``torch._foreach_sqrt`` correctly rounded (through fp64, exact for fp32 inputs): the
    fused kernels use the hardware's correctly rounded sqrt, ATen's vectorised CPU sqrt is off by
    one ulp in about 20% of fp32 inputs (measured), so this is the reference to compare bits with."""
    original = torch._foreach_sqrt
    torch._foreach_sqrt = lambda xs: [x.double().sqrt().to(x.dtype) for x in xs]
    try:
        yield
    finally:
        torch._foreach_sqrt = original


def train(opt_class, backend: str, mode: str, steps: int = 4, dtype=torch.bfloat16, shapes=SHAPES,
          **kw: Any) -> tuple[list[torch.Tensor], Any]:
    params = make_params(dtype, shapes)
    opt = opt_class(params, backend=backend, mode=mode, seed=1, **kw)
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt


def assert_same_run(a: tuple, b: tuple) -> None:
    """Weights and every state tensor equal bit for bit, and the same diagnostics."""
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y), f"weights differ in {int((x != y).sum())} of {x.numel()} elements"
        for name, value in oa.state[x].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, ob.state[y][name]), f"state {name} differs"
    assert oa.diagnostics() == ob.diagnostics()
