"""Shared set-up of the fused-backend tests: a few parameters of awkward sizes, deterministic
gradients, and the reference run with a correctly rounded sqrt (ATen's CPU sqrt is not)."""
from __future__ import annotations

from typing import Any

import torch

import lowp.optim as lo
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.randomness import ElementIndex
from lowp.optim.writeback import MODES

SHAPES = [(37, 11), (300,), (4, 3, 5), (5000,)]


def make_params(dtype: torch.dtype = torch.bfloat16, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in shapes]


#: backends with kernels, whose instances count ``fused_elements`` and ``reference_elements``
FUSED_BACKENDS = ("compiled", "native", "triton")


def assert_fused(opt: Any, elements: int, fused: bool = True) -> None:
    """``opt``'s backend sent exactly ``elements`` element-steps through its kernels and none
    through the reference pipeline (``fused=False``: the other way round). Bit-identical results
    cannot tell the two apart: the reference is what the kernels are checked against."""
    got = (opt.backend.fused_elements, opt.backend.reference_elements)
    want = (elements, 0) if fused else (0, elements)
    assert got == want, f"backend {opt.backend.name!r}: (fused, reference) elements {got}, expected {want}"


def train(opt_class, backend: str, mode: str, steps: int = 4, dtype=torch.bfloat16, shapes=SHAPES,
          expect_fused: bool = True, **kw: Any) -> tuple[list[torch.Tensor], Any]:
    """``steps`` steps of ``opt_class`` on :func:`make_params` with seeded gradients. On a fused
    backend, every element of every step must have run through its kernels (``expect_fused``) or
    none of them (``expect_fused=False``, the fallbacks): :func:`assert_fused`."""
    params = make_params(dtype, shapes)
    opt = opt_class(params, backend=backend, mode=mode, seed=1, **kw)
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    if backend in FUSED_BACKENDS:
        assert_fused(opt, steps * sum(p.numel() for p in params), expect_fused)
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


def run_at_index(backend: str, mode: str, index: ElementIndex, n: int = 1000, chunk_size: int = 1 << 17,
                 steps: int = 2, **kw: Any) -> list[torch.Tensor]:
    """Two AdamW steps (bf16 weight and states, ``kw`` on top) on one slice of ``n`` elements whose
    global indices are ``index``, through ``backend`` directly (the optimizer's own step always
    gives whole tensors index 0): the weight and every state tensor afterwards. On a fused
    backend the kernel must have run every step (:func:`assert_fused`)."""
    gen = torch.Generator().manual_seed(7)
    p = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    opt = lo.AdamW([p], lr=1e-2, weight_decay=0.1, mode=mode, backend=backend, chunk_size=chunk_size, seed=3, **kw)
    group = opt.param_groups[0]
    state = opt.init_state(group, p, MODES[mode])
    for step in range(1, steps + 1):
        state["step"] = step
        ctx = StepContext(group, MODES[mode], step, seed=opt.seed)
        s = ParamSlice(p, torch.randn(p.shape, generator=gen).bfloat16(),
                       {name: state[name] for name in opt.state_names(group, p)},
                       state.get(MODES[mode].buffer_name) if MODES[mode].buffer_name else None,
                       param_id=0, index=index)
        opt.backend.run(opt, ctx, [s])
    if backend in FUSED_BACKENDS:
        assert_fused(opt, steps * n)
    return [p, *(v for v in state.values() if isinstance(v, torch.Tensor))]


def same_bits_or_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN of a 16- or 32-bit float tensor matches any NaN: the native
    kernel keeps a NaN's payload where it needs no guard against it (bf16 inputs), the kernels store
    the canonical 0x7FC0 where the reference's Kahan write-back stores 0xFFFF. One-byte tensors
    (codes) and integers compare by their bits."""
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[b.element_size()]
    if b.element_size() == 1 or not b.is_floating_point():
        return torch.equal(a.view(as_bits), b.view(as_bits))
    nan = b.isnan()
    return torch.equal(a.isnan(), nan) and torch.equal(a.view(as_bits)[~nan], b.view(as_bits)[~nan])
