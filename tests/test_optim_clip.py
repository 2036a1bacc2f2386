"""clip_grad_norm_: the norm of the unscaled gradients and torch's clipping of them, for fp16
gradients that GradScaler.unscale_ refuses."""
from __future__ import annotations

import math

import pytest
import torch

from lowp.optim import AdamW
from lowp.optim.clip import clip_grad_norm_, grad_norm


def _params(dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in [(7, 5), (11,), (3, 4, 2)]]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.3 * scale).to(dtype)
    return params


def _scaler(scale: float = 65536.0) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))   # as a training loop's scaler.scale(loss) does: creates the scale
    return scaler


def test_torch_refuses_to_unscale_fp16_gradients():
    params = _params(torch.float16)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = _scaler()
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_clipping_scaled_gradients_equals_torch_clipping_the_unscaled_ones(dtype):
    scaler = _scaler(1024.0)
    scaled = _params(dtype, scale=1024.0)
    reference = [torch.nn.Parameter(p.detach().double()) for p in scaled]
    for r, p in zip(reference, scaled):
        r.grad = p.grad.double() / 1024.0
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5))
    norm = clip_grad_norm_(scaled, 0.5, scaler=scaler)
    assert math.isclose(norm, expected_norm, rel_tol=1e-6)
    tolerance = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-6}[dtype]
    for r, p in zip(reference, scaled):
        got = p.grad.double() / 1024.0
        assert p.grad.dtype == dtype
        assert float((got - r.grad).abs().max()) <= tolerance * float(r.grad.abs().max())
    assert math.isclose(grad_norm(scaled, scaler), 0.5, rel_tol=tolerance * 4)


def test_small_gradients_are_left_alone_and_the_norm_is_returned():
    params = _params(torch.float16)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 1e6)
    assert norm == pytest.approx(float(torch.linalg.vector_norm(torch.cat([b.double().flatten() for b in before]))))
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_overflowed_gradients_are_untouched_and_the_scaler_skips_the_step():
    params = _params(torch.float16, scale=1024.0)
    params[1].grad[3] = float("inf")
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    opt = AdamW(params, lr=0.1)
    scaler = _scaler(1024.0)
    assert clip_grad_norm_(params, 0.5, scaler=scaler) == math.inf
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert scaler.get_scale() < 1024.0 and opt.skipped_steps == 1


def test_fp16_training_step_with_clipping_matches_clipping_in_fp64():
    params = _params(torch.float16, scale=4096.0)
    unscaled = [p.grad.double() / 4096.0 for p in params]
    opt = AdamW(params, lr=1e-2, mode="kahan", state_dtype=torch.float32)
    scaler = _scaler(4096.0)
    clip_grad_norm_(params, 0.25, scaler=scaler)
    scaler.step(opt)
    total = float(torch.linalg.vector_norm(torch.cat([u.flatten() for u in unscaled])))
    for p, u in zip(params, unscaled):
        clipped = u * min(1.0, 0.25 / (total + 1e-6))
        assert torch.allclose(opt.state[p]["exp_avg"].double(), 0.1 * clipped, rtol=2e-3, atol=1e-9)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_max_norm_is_refused(bad):
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(_params(torch.float32), bad)


def test_bad_scaler_is_refused():
    with pytest.raises(TypeError, match="scaler"):
        clip_grad_norm_(_params(torch.float32), 1.0, scaler=2.0)
