"""Lion, RAdam, StableAdamW and Adafactor: fp32 parity with torch.optim or an fp64 transcription
of the paper's update, and the shared modes/checkpoints on optimizers with unusual states."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import lowp.optim as lo
from lowp.optim.registry import optimizers

SHAPES = [(37, 11), (300,), (2, 6, 5), ()]


pytestmark = pytest.mark.usefixtures("one_thread")


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 0.1).to(dtype).requires_grad_() for s in SHAPES]


def _run(opt, params, steps, dtype=torch.float32, start=0):
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()


def _lion_reference(w, grads, lr, betas, wd):
    m = torch.zeros_like(w)
    for g in grads:
        c = betas[0] * m + (1 - betas[0]) * g
        w = w - lr * (torch.sign(c) + wd * w)
        m = betas[1] * m + (1 - betas[1]) * g
    return w


def _stableadamw_reference(w, grads, lr, betas, eps, wd):
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        rms = math.sqrt(float((g * g / v_hat.clamp(min=eps * eps)).mean()))
        lr_t = lr / max(1.0, rms)
        w = w - lr_t * (m_hat / (v_hat.sqrt() + eps) + wd * w)
    return w


def _adan_reference(w, grads, lr, betas, eps, wd, no_prox=False):
    """Xie et al. 2022, Algorithm 1 (with the authors' bias corrections and proximal decay)."""
    b1, b2, b3 = betas
    m, v, n = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w)
    previous = None
    for t, g in enumerate(grads, 1):
        diff = g - previous if previous is not None else torch.zeros_like(g)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * diff
        n = b3 * n + (1 - b3) * (g + b2 * diff) ** 2
        m_hat, v_hat, n_hat = m / (1 - b1 ** t), v / (1 - b2 ** t), n / (1 - b3 ** t)
        step = (m_hat + b2 * v_hat) / (n_hat.sqrt() + eps)
        w = w * (1 - lr * wd) - lr * step if no_prox else (w - lr * step) / (1 + lr * wd)
        previous = g
    return w


@pytest.mark.parametrize("cls, reference, kw", [
    (lo.Lion, _lion_reference, dict(lr=1e-3, betas=(0.9, 0.99))),
    (lo.Adan, _adan_reference, dict(lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8)),
    (lo.Adan, _adan_reference, dict(lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, no_prox=True)),
    (lo.StableAdamW, _stableadamw_reference, dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6)),
])
def test_fp32_matches_an_fp64_transcription_of_the_paper(cls, reference, kw):
    """The gradient scale jumps 30x at step 50, which makes StableAdamW's update clipping act."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 9, generator=gen) * 0.1
    grads = [torch.randn(64, 9, generator=gen) * (1.0 if t < 50 else 30.0) for t in range(100)]
    p = w0.clone().requires_grad_()
    opt = cls([p], weight_decay=0.1, **kw)
    for g in grads:
        p.grad = g
        opt.step()
    expected = reference(w0.double(), [g.double() for g in grads], wd=0.1, **kw)
    torch.testing.assert_close(p.detach().double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cls", optimizers(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["kahan", "exact", "stochastic"])
def test_bf16_modes_resume_bit_identically(cls, mode):
    a = _params(torch.bfloat16)
    kw = {k: v for k, v in cls.examples[0].items() if k != "lr"}
    opt_a = cls(a, mode=mode, seed=3, **kw)
    _run(opt_a, a, 4, torch.bfloat16)
    saved_params = [p.detach().clone() for p in a]
    saved = copy.deepcopy(opt_a.state_dict())
    _run(opt_a, a, 4, torch.bfloat16, start=4)
    b = [p.clone().requires_grad_() for p in saved_params]
    opt_b = cls(b, mode=mode, **kw)
    opt_b.load_state_dict(saved)
    _run(opt_b, b, 4, torch.bfloat16, start=4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls, low", [(lo.Lion, torch.bfloat16), (lo.RAdam, torch.bfloat16),
                                      (lo.StableAdamW, torch.bfloat16), (lo.Adafactor, torch.bfloat16),
                                      (lo.SGD, torch.bfloat16), (lo.AdamW, torch.bfloat16), (lo.Adan, torch.bfloat16),
                                      (lo.SGD, torch.float16), (lo.AdamW, torch.float16)])
def test_low_precision_kahan_tracks_fp32_closer_than_nearest(cls, low):
    """Same optimizer, same gradients: 16-bit weights with kahan stay nearer the fp32 run."""
    kw = dict(lr=1e-2, momentum=0.9) if cls is lo.SGD else dict(lr=1e-3) if cls is not lo.Adafactor else {}
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(32, 16, generator=gen)).to(low)
    grads = [torch.randn(32, 16, generator=gen).to(low) for _ in range(200)]
    finals = {}
    for mode, dtype in (("nearest", torch.float32), ("nearest", low), ("kahan", low)):
        p = w0.to(dtype, copy=True).requires_grad_()
        opt = cls([p], mode=mode, state_dtype=torch.float32, **kw)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        finals[(mode, dtype)] = p.detach().double()
    ref = finals[("nearest", torch.float32)]
    err_nearest = float((finals[("nearest", low)] - ref).norm())
    err_kahan = float((finals[("kahan", low)] - ref).norm())
    assert err_kahan < 0.5 * err_nearest, (err_kahan, err_nearest)


@pytest.mark.parametrize("make", [
    lambda p: lo.AdamW(p, lr=1, betas=(0, 0.5), eps=0, weight_decay=0),
    lambda p: lo.AdamW(p, lr=torch.tensor(1e-3)),
    lambda p: lo.Lion(p, betas=(0.0, 0.9), weight_decay=1),
    lambda p: lo.SGD(p, momentum=0, dampening=0),
    lambda p: lo.Adafactor(p, d=1, beta2_decay=0, eps=(0, 1)),
])
def test_integer_and_zero_hyper_parameters_are_still_accepted(make):
    p = torch.ones(3, requires_grad=True)
    opt = make([p])
    p.grad = torch.ones(3)
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), torch.ones(3))
