"""The ``master`` write-back mode (lowp.optim.writeback.master): an fp32 master weight beside a
bf16 or fp16 weight, the mixed-precision recipe.

- Its master is, bit for bit, the weight of the same optimizer run on fp32 weights with the same
  gradients (the exact reference: the fp32 trajectory), and the visible weight is that master
  rounded to nearest, on every backend that runs it (the native kernel proven to have run).
- Mode switches carry the held value over (kahan's ``theta + k``, exact's pair), and
  ``load_full_precision`` / ``full_precision_weights`` put and read the master.
- The generic tests (test_registry, test_optim_db) pick the mode up from ``MODES`` on their own.
"""
from __future__ import annotations

import pytest
import torch

import lowp.optim as lo
from lowp.optim.writeback import MODES
from test_optim_core import trajectory_errors

NATIVE = lo.backends.native_available()
BACKENDS = ["foreach", "native"] if NATIVE else ["foreach"]
N = 3000


def _grads(dtype: torch.dtype, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(N, generator=gen) * 0.1).to(dtype) for _ in range(steps)]


def _start(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(N, generator=gen) * 0.5).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls,kw", [(lo.AdamW, dict(lr=1e-3, weight_decay=0.1)),
                                    (lo.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True))])
def test_master_is_the_fp32_run_bit_for_bit(cls, kw, dtype, backend):
    grads = _grads(dtype, 6)
    low = torch.nn.Parameter(_start(dtype))
    opt = cls([low], **kw, mode="master", backend=backend, state_dtype=torch.float32, seed=1)
    full = torch.nn.Parameter(_start(dtype).float())   # the same start, exactly
    ref = cls([full], **kw, backend="foreach", seed=1)
    for g in grads:
        low.grad, full.grad = g, g.float()
        opt.step()
        ref.step()
        master = opt.state[low]["master"]
        assert torch.equal(master.view(torch.int32), full.detach().view(torch.int32))
        assert torch.equal(low.detach(), full.detach().to(dtype))   # theta = rn(master)
    if backend == "native":
        assert opt.backend.fused_elements == 6 * N and opt.backend.reference_elements == 0
    assert torch.equal(lo.convert.full_precision_weights(opt)[0], full.detach())


def test_a_fresh_master_is_the_weight_and_mode_switches_carry_the_held_value():
    p = torch.nn.Parameter(_start(torch.bfloat16))
    opt = lo.AdamW([p], lr=1e-3, mode="kahan", seed=1)
    for g in _grads(torch.bfloat16, 3):
        p.grad = g
        opt.step()
    held = p.detach().float() + opt.state[p]["compensation"].float()
    opt.param_groups[0]["mode"] = "master"
    p.grad = _grads(torch.bfloat16, 1)[0]
    before = p.detach().clone()
    lo.writeback.ensure_buffer(p, opt.state[p], MODES["master"])
    assert "compensation" not in opt.state[p] and torch.equal(opt.state[p]["master"], held)
    assert torch.equal(p.detach(), before)
    opt.step()
    assert opt.state[p]["step"] == 4
    q = torch.nn.Parameter(_start(torch.float16))
    fresh = lo.AdamW([q], mode="master", weight_decay=0.0)   # a zero gradient: no change
    q.grad = torch.zeros_like(q)
    fresh.step()
    assert torch.equal(fresh.state[q]["master"], _start(torch.float16).float())


def test_load_full_precision_puts_the_master():
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(N, generator=gen)
    p = torch.nn.Parameter(t.half())
    opt = lo.AdamW([p], mode="master")
    lo.convert.load_full_precision(opt, [t])
    assert torch.equal(opt.state[p]["master"], t) and torch.equal(p.detach(), t.half())


def test_fp16_master_tracks_fp64_as_fp32_does():
    """300 AdamW steps on fp16 weights against an fp64 run: the held value of ``master`` is as
    close as fp32 arithmetic gets, closer than kahan's fp16 compensation (docs/memory.md has the
    numbers)."""
    errors = trajectory_errors(dtype=torch.float16, modes=("nearest", "kahan", "master"), held=True)
    assert errors["master"] < 1e-6 < errors["kahan"] < errors["nearest"] / 1000


def test_a_master_of_another_dtype_is_refused_before_the_step():
    p = torch.nn.Parameter(_start(torch.float16))
    opt = lo.AdamW([p], mode="master")
    p.grad = torch.ones_like(p)
    opt.step()
    opt.state[p]["master"] = opt.state[p]["master"].half()   # a master that lost its precision
    before = p.detach().clone()
    with pytest.raises((TypeError, ValueError), match="master"):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"] == 1
