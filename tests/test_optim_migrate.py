"""Checkpoints of torch.optim and optimi load into lowp optimizers and training continues as it
would have in the original library (fp32 weights: within fp32 rounding); lowp checkpoints go
back to torch.optim through ``to_torch_state_dict`` + ``full_precision_state_dict``."""
from __future__ import annotations

import copy

import optimi
import pytest
import torch

import lowp.optim as lo
from lowp.optim.convert import full_precision_state_dict, full_precision_weights
from lowp.optim.migrate import to_torch_state_dict
from optim_helpers import regression_steps



pytestmark = pytest.mark.usefixtures("one_thread")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)


def _continue_both(theirs, ours, kw, k=5, ours_kw=None):
    """k steps with ``theirs``, then k more with it and, from its checkpoint, with ``ours``."""
    a = _model()
    opt_a = theirs(a.parameters(), **kw)
    regression_steps(a, opt_a, k)
    b = copy.deepcopy(a)
    opt_b = ours(b.parameters(), **(ours_kw or {}))
    opt_b.load_state_dict(opt_a.state_dict())
    regression_steps(a, opt_a, k, start=k)
    regression_steps(b, opt_b, k, start=k)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    return opt_b


@pytest.mark.parametrize("theirs, ours, kw", [
    (torch.optim.AdamW, lo.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, lo.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, lo.AdamW, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.SGD, lo.SGD, dict(lr=1e-2, momentum=0.9)),
    (torch.optim.SGD, lo.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.RAdam, lo.RAdam, dict(lr=1e-2)),
])
def test_a_torch_checkpoint_continues_as_torch_would(theirs, ours, kw):
    opt = _continue_both(theirs, ours, kw)
    assert opt.param_groups[0]["lr"] == kw["lr"] and opt.param_groups[0]["mode"] == "auto"
    assert "foreach" not in opt.param_groups[0] and "capturable" not in opt.param_groups[0]
    assert all(type(s["step"]) is int for s in opt.state.values())


@pytest.mark.parametrize("theirs, ours, kw", [
    (optimi.AdamW, lo.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
    (optimi.Adam, lo.Adam, dict(lr=1e-2, weight_decay=1e-2, betas=(0.8, 0.95))),
    (optimi.Lion, lo.Lion, dict(lr=1e-3, weight_decay=0.1)),
])
def test_an_optimi_checkpoint_continues_as_optimi_would(theirs, ours, kw):
    opt = _continue_both(theirs, ours, dict(kw, foreach=False, triton=False))
    assert opt.param_groups[0]["betas"] == kw.get("betas", (0.9, 0.99))
    assert "kahan_sum" not in opt.param_groups[0] and "beta1" not in opt.param_groups[0]


def test_optimis_kahan_buffer_becomes_the_compensation():
    model = _model(torch.bfloat16)
    theirs = optimi.AdamW(model.parameters(), lr=1e-3, kahan_sum=True, foreach=False, triton=False)
    regression_steps(model, theirs, 3)
    sd = theirs.state_dict()
    ours = lo.AdamW(model.parameters())
    ours.load_state_dict(sd)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(ours.state[p]["compensation"], sd["state"][i]["kahan_comp"])
        assert ours.state[p]["step"] == 3 and ours.state[p]["exp_avg"].dtype == torch.bfloat16
    regression_steps(model, ours, 2, start=3)     # and it trains on
    assert all(s["step"] == 5 for s in ours.state.values())


def test_fp32_moments_of_bf16_weights_keep_their_dtype():
    a = _model()
    theirs = torch.optim.AdamW(a.parameters())
    regression_steps(a, theirs, 2)
    b = copy.deepcopy(a).bfloat16()
    ours = lo.AdamW(b.parameters())
    ours.load_state_dict(theirs.state_dict())
    regression_steps(b, ours, 1, start=2)
    assert all(s["exp_avg"].dtype == torch.float32 and "compensation" in s for s in ours.state.values())


@pytest.mark.filterwarnings("ignore:You are using weight_decay")
def test_checkpoints_of_the_other_weight_decay_kind_are_refused():
    a = _model()
    theirs = torch.optim.AdamW(a.parameters(), weight_decay=0.1)
    regression_steps(a, theirs, 1)
    ours = lo.Adam(a.parameters())
    with pytest.raises(ValueError, match="weight decay"):
        ours.load_state_dict(theirs.state_dict())
    assert not ours.state
    sd = optimi.AdamW(a.parameters(), lr=1e-3, decouple_lr=True, foreach=False, triton=False).state_dict()
    with pytest.raises(ValueError, match="decouple_lr"):
        lo.AdamW(a.parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="optimi"):
        lo.Adafactor(a.parameters()).load_state_dict(sd)


def test_the_way_back_to_torch_optim_continues_as_lowp_would():
    a = _model()
    ours = lo.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    regression_steps(a, ours, 5)
    b = _model()
    b.load_state_dict(full_precision_state_dict(a, ours))
    theirs = torch.optim.AdamW(b.parameters())
    theirs.load_state_dict(to_torch_state_dict(ours))
    regression_steps(a, ours, 5, start=5)
    regression_steps(b, theirs, 5, start=5)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


def test_the_way_back_from_bf16_kahan_carries_the_compensated_weights():
    a = _model(torch.bfloat16)
    ours = lo.AdamW(a.parameters(), lr=1e-3)
    regression_steps(a, ours, 5)
    b = _model()
    b.load_state_dict(full_precision_state_dict(a, ours))
    for p, w in zip(b.parameters(), full_precision_weights(ours)):
        assert torch.equal(p.detach(), w)
    theirs = torch.optim.AdamW(b.parameters())
    theirs.load_state_dict(to_torch_state_dict(ours))
    regression_steps(b, theirs, 2, start=5)
    assert all(float(s["step"]) == 7 for s in theirs.state.values())
