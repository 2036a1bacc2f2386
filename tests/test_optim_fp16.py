"""fp16 weights train like fp32 with the default states: bf16 moments keep fp32's range, where
fp16 moments underflow (Adam's second moment of a 1e-5 gradient is 1e-10, below fp16's smallest
subnormal 6e-8)."""
from __future__ import annotations

import pytest
import torch

from lowp.optim import Adam, AdamW, RAdam
from lowp.optim.base import default_state_dtype
from lowp.optim.convert import cast_model


pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_state_dtype_is_bf16_for_fp16_weights_only():
    assert default_state_dtype(torch.float16) == torch.bfloat16
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert default_state_dtype(dtype) == dtype
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.ones(4, dtype=torch.float16)
    opt = AdamW([p])
    opt.step()
    assert {opt.state[p][n].dtype for n in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert opt.state[p]["compensation"].dtype == torch.float16
    explicit = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    explicit.grad = torch.ones(4, dtype=torch.float16)
    opt = AdamW([explicit], state_dtype=torch.float16)
    opt.step()
    assert opt.state[explicit]["exp_avg_sq"].dtype == torch.float16


@pytest.mark.parametrize("cls", [Adam, AdamW, RAdam])
def test_small_fp16_gradients_take_adam_sized_steps_with_the_default_states(cls):
    """A constant 1e-5 gradient: Adam's step is about lr. With fp16 moments ``v`` underflows to 0
    after every step, so each step sees only the fresh ``(1 - beta2) g**2`` and, after bias
    correction, ``v_hat = g**2 / t``: step t is sqrt(t) times too large (10x at t = 100)."""
    steps = {}
    for state_dtype in (None, torch.float16, torch.float32):
        p = torch.nn.Parameter(torch.zeros(256, dtype=torch.float16))
        opt = cls([p], lr=1e-3, weight_decay=0.0, state_dtype=state_dtype)
        for _ in range(100):
            held = p.float() + opt.state[p]["compensation"].float() if opt.state else p.float()
            p.grad = torch.full((256,), 1e-5, dtype=torch.float16)
            opt.step()
        steps[state_dtype] = float((p.float() + opt.state[p]["compensation"].float() - held).abs().mean())
    assert steps[None] == pytest.approx(steps[torch.float32], rel=0.02)
    assert steps[torch.float16] > 5 * steps[torch.float32]


def _train(dtype: torch.dtype, scaler: bool, steps: int = 200, state_dtype: object = None) -> float:
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    torch.manual_seed(1)
    model = cast_model(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)), dtype)
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, state_dtype=state_dtype)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if scaler else None
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        opt.zero_grad()
        if amp is not None:
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
        else:
            loss.backward()
            opt.step()
    x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return float(((model(x.to(dtype)).float() - teacher(x)) ** 2).mean())


@pytest.mark.parametrize("scaler", [False, True])
def test_fp16_mlp_with_defaults_ends_within_half_a_percent_of_fp32(scaler):
    fp32 = _train(torch.float32, False)
    fp16 = _train(torch.float16, scaler)
    assert abs(fp16 / fp32 - 1) < 0.005, (fp16, fp32)


CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def test_fp16_mlp_with_8bit_states_and_a_gradscaler_ends_within_half_a_percent_of_fp32():
    """int8 / uint8 block-scaled moments under a GradScaler: the codes see unscaled gradients."""
    fp32 = _train(torch.float32, False)
    fp16 = _train(torch.float16, True, state_dtype=CODED)
    assert abs(fp16 / fp32 - 1) < 0.005, (fp16, fp32)


def test_an_overflowed_step_leaves_codes_scales_and_weights_as_they_were():
    p = torch.nn.Parameter(torch.linspace(-1, 1, 300, dtype=torch.float16))
    opt = AdamW([p], lr=1e-2, state_dtype=CODED, coded_min_numel=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for inf in (False, True):
        before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
        weights = torch.linspace(-1, 1, 300) * (float("inf") if inf else 1.0)
        opt.zero_grad()
        scaler.scale((p.float() * weights).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(p.detach(), before[0])
    assert before[1].keys() >= {"exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "compensation"}
    for name, value in before[1].items():
        assert torch.equal(value, opt.state[p][name]), name
    assert opt.state[p]["step"] == 1 and opt.skipped_steps == 1
    assert opt.state[p]["exp_avg"].dtype == torch.int8 and scaler.get_scale() == 2.0 ** 7
