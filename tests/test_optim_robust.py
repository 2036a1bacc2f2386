"""The optimizer API never crashes and is never silently wrong: what constructors refuse, the
preflight of ``step()`` (after any error, weights, states, counters and hyper-parameters are
bit for bit as before), checked all-or-nothing ``load_state_dict``, buffers created or folded
when a group switches mode, and what a torch.optim or optimi user passes."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import lowp.optim as lo
from lowp.optim.kernels import native_available
from lowp.optim.writeback import MODES
from optim_helpers import same_snapshot, snapshot

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def _two_groups(mode="kahan", steps=2, **kw):
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, 4, generator=gen).bfloat16().requires_grad_(), torch.randn(7, generator=gen).bfloat16()
         .requires_grad_()]
    b = [torch.randn(6, generator=gen).bfloat16().requires_grad_()]
    opt = lo.AdamW([{"params": a}, {"params": b, "lr": 1e-2}], lr=1e-3, mode=mode, seed=3, **kw)
    params = a + b
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    return opt, params


# ---- constructors refuse what can never work ----------------------------------------------
# (bad keyword values: every optimizer's error inputs in lowp/optim/registry.py, tests/test_optim_db.py)
def test_constructor_refuses_overlapping_parameters():
    expanded = torch.zeros(1, dtype=torch.bfloat16).expand(10).requires_grad_()
    with pytest.raises(ValueError, match=r"params\[0\].*overlap"):
        lo.AdamW([expanded])
    opt = lo.AdamW([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="overlap"):
        opt.add_param_group({"params": [expanded]})
    assert len(opt.param_groups) == 1
    for flag, other in ((lo.SGD, dict(momentum=0.9, nesterov="yes")), (lo.RAdam, dict(decoupled_weight_decay=1))):
        with pytest.raises(ValueError, match="nesterov|decoupled_weight_decay"):
            flag([torch.zeros(3, requires_grad=True)], **other)


def test_torch_user_arguments_are_accepted():
    model = torch.nn.Linear(4, 3).bfloat16()
    opt = lo.AdamW(model.named_parameters(), lr=1e-3, capturable=False, differentiable=False, fused=False,
                   foreach=True)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    opt.step()
    with pytest.raises(ValueError, match="params"):
        lo.AdamW([("w", model.weight), model.bias])
    # torch's checkpoint of named parameters loads, names and all
    ref = torch.optim.AdamW(torch.nn.Linear(4, 3).named_parameters())
    lo.AdamW(torch.nn.Linear(4, 3).named_parameters()).load_state_dict(ref.state_dict())


def test_kahan_sum_is_optimis_name_for_the_kahan_and_nearest_modes():
    p = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
    assert lo.AdamW(p, kahan_sum=True).param_groups[0]["mode"] == "kahan"
    assert lo.AdamW(p, kahan_sum=False).param_groups[0]["mode"] == "nearest"
    assert lo.AdamW(p, kahan_sum=True, mode="kahan").param_groups[0]["mode"] == "kahan"


def test_optimi_positional_order_is_caught():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.warns(UserWarning, match="positional order"):
        lo.AdamW(p, 1e-3, (0.9, 0.99), 1e-2, 1e-6)       # optimi: lr, betas, weight_decay, eps
    with pytest.warns(UserWarning, match="positional order"):
        lo.StableAdamW(p, 1e-3, (0.9, 0.99), 1e-2, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lo.AdamW(p, 1e-3, (0.9, 0.99), 1e-8, 1e-2)        # torch's order
        lo.Adam(p, lr=1e-3, eps=1e-2, weight_decay=0.1)


# ---- step(): nothing changes when it fails -------------------------------------------------
def _break_betas(opt, params):
    opt.param_groups[1]["betas"] = (1.5, -3)


def _break_maximize(opt, params):
    opt.param_groups[1]["maximize"] = "no"


def _break_layout(opt, params):
    params[2].data = torch.zeros(1, dtype=torch.bfloat16).expand(6)


def _break_grad_shape(opt, params):
    params[2].grad.data = torch.zeros(5, dtype=torch.bfloat16)


def _break_grad_dtype(opt, params):
    params[2].grad.data = torch.zeros(6, dtype=torch.float16)


def _break_state_shape(opt, params):
    opt.state[params[2]]["exp_avg"] = torch.zeros(5, dtype=torch.bfloat16)


def _break_state_dtype(opt, params):
    opt.state[params[2]]["exp_avg_sq"] = torch.zeros(6, dtype=torch.float64)


def _break_buffer(opt, params):
    opt.state[params[2]]["compensation"] = torch.zeros(3, dtype=torch.bfloat16)


def _break_step(opt, params):
    opt.state[params[2]]["step"] = -1


def _break_mode(opt, params):
    params[2].data = params[2].data.half()
    params[2].grad.data = params[2].grad.data.half()
    opt.param_groups[1]["mode"] = "exact"


def _break_state_code(opt, params):
    """A parameter without states yet (no gradient so far) in a group whose ``state_dtype``, changed
    after construction, asks for a code its state cannot hold (unsigned for Adam's first moment)."""
    del opt.state[params[2]]
    opt.param_groups[1]["state_dtype"] = {"exp_avg": torch.uint8}


BREAKERS = [
    (_break_betas, ValueError, r"betas\[0\]"),
    (_break_maximize, ValueError, "maximize"),
    (_break_layout, ValueError, r"params\[2\].*overlap"),
    (_break_grad_shape, ValueError, r"grad of params\[2\]: shape \(5,\) does not match the parameter's shape \(6,\)"),
    (_break_grad_dtype, ValueError, r"grad of params\[2\]: dtype"),
    (_break_state_shape, ValueError, r"state\[2\]\['exp_avg'\]: shape"),
    (_break_state_dtype, ValueError, r"state\[2\]\['exp_avg_sq'\]: dtype"),
    (_break_buffer, ValueError, r"state\[2\]\['compensation'\]"),
    (_break_step, ValueError, r"state\[2\]\['step'\]"),
    (_break_mode, TypeError, "mode"),
    (_break_state_code, ValueError, r"state_dtype\['exp_avg'\]: uint8 codes hold nonnegative states only"),
]


def _failing_step_changes_nothing(breaker, error, match, backend):
    """The fault sits in the second group: the first group must not have been stepped either."""
    opt, params = _two_groups(mode="stochastic" if breaker is _break_mode else "kahan", backend=backend)
    breaker(opt, params)
    before = snapshot(opt, params)
    with pytest.raises(error, match=match):
        opt.step()
    assert same_snapshot(before, snapshot(opt, params))


@pytest.mark.parametrize("breaker, error, match", BREAKERS)
def test_a_failing_step_changes_nothing_in_any_group(breaker, error, match):
    _failing_step_changes_nothing(breaker, error, match, "foreach")


@pytest.mark.skipif(not native_available(), reason="the native kernel needs x86-64 with AVX2 and a C++ compiler")
def test_a_failing_native_step_changes_nothing_and_never_reaches_the_kernel():
    """The same faults on the native backend, in a subprocess: a state of the wrong size that
    reached the C++ kernel would be written out of bounds."""
    code = ("import test_optim_robust as t\n"
            "for case in t.BREAKERS:\n"
            "    t._failing_step_changes_nothing(*case, 'native')\n"
            "print('all refused')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "all refused" in run.stdout, run.stderr[-3000:]


def test_float64_states_and_huge_seeds_no_longer_fail_at_every_step():
    p = torch.zeros(10, dtype=torch.bfloat16, requires_grad=True)
    opt = lo.AdamW([p], state_dtype=torch.float32, seed=2 ** 64 - 1, mode="stochastic")
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["step"] == 1 and opt.state[p]["exp_avg"].dtype == torch.float32


def _fp64_with_bf16(backend):
    """A bf16 group and an fp64 group whose group-wide ``state_dtype`` asks for fp32 moments."""
    low = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    wide = torch.ones(8, dtype=torch.float64, requires_grad=True)
    opt = lo.AdamW([{"params": [low]}, {"params": [wide], "state_dtype": torch.float32}], backend=backend)
    low.grad, wide.grad = torch.ones_like(low), torch.ones_like(wide)
    return opt, low, wide


@pytest.mark.parametrize("backend", ["foreach", "native"] if native_available() else ["foreach"])
def test_fp64_parameters_keep_fp64_states_whatever_the_group_asks(backend):
    """fp64 parameters run an fp64 pipeline: their states are fp64 (a group-wide fp32
    ``state_dtype`` used to fail in the middle of the step, after the bf16 group had moved)."""
    opt, low, wide = _fp64_with_bf16(backend)
    opt.step()
    assert opt.state[wide]["exp_avg"].dtype == torch.float64 and opt.state[low]["step"] == 1
    assert not torch.equal(wide, torch.ones_like(wide))


def test_an_fp32_gradient_of_an_fp64_parameter_is_refused_before_anything_moves():
    opt, low, wide = _fp64_with_bf16("foreach")
    wide.grad.data = torch.ones(8, dtype=torch.float32)   # torch refuses the plain assignment
    before = (low.detach().clone(), dict(opt.state))
    with pytest.raises(ValueError, match=r"grad of params\[1\]: dtype torch.float32 is not the parameter's"):
        opt.step()
    assert torch.equal(low, before[0]) and not opt.state


# ---- buffers follow the group's mode -------------------------------------------------------
def _sub_ulp_sgd(mode, steps=20):
    p = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    opt = lo.SGD([p], lr=1e-4, mode=mode)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p, opt


def test_switching_stochastic_to_kahan_or_exact_creates_the_buffer():
    for new, buffer in (("kahan", "compensation"), ("exact", "remainder")):
        p, opt = _sub_ulp_sgd("stochastic", 1)
        opt.param_groups[0]["mode"] = new
        p.grad = torch.ones_like(p)
        opt.step()
        assert buffer in opt.state[p] and opt.state[p]["step"] == 2


def test_kahan_to_exact_folds_the_compensation_exactly_and_back():
    p, opt = _sub_ulp_sgd("kahan")
    held = p.detach().float() + opt.state[p]["compensation"].float()
    assert not torch.equal(held, p.detach().float())     # the compensation holds sub-ulp progress
    opt.param_groups[0]["mode"] = "exact"
    opt.init_state(opt.param_groups[0], p, MODES["exact"])
    assert "compensation" not in opt.state[p]
    assert torch.equal(MODES["exact"].load(p.detach(), opt.state[p]["remainder"]), held)
    # exact -> kahan: theta + k is the fp32 master weight (here it fits the bf16 buffer)
    opt.param_groups[0]["mode"] = "kahan"
    opt.init_state(opt.param_groups[0], p, MODES["kahan"])
    assert "remainder" not in opt.state[p]
    assert torch.equal(p.detach().float() + opt.state[p]["compensation"].float(), held)
    # to nearest the buffer is dropped and the visible weight kept
    opt.param_groups[0]["mode"] = "nearest"
    w = p.detach().clone()
    opt.init_state(opt.param_groups[0], p, MODES["nearest"])
    assert "compensation" not in opt.state[p] and torch.equal(p.detach(), w)


# ---- load_state_dict: checked, all or nothing ----------------------------------------------
def _corrupt_betas(sd):
    sd["param_groups"][1]["betas"] = (1.5, -3)


def _corrupt_state_shape(sd):
    sd["state"][2]["exp_avg"] = torch.zeros(5, dtype=torch.bfloat16)


def _corrupt_state_dtype(sd):
    sd["state"][2]["exp_avg"] = torch.zeros(6, dtype=torch.float64)


def _fractional_step(sd):
    sd["state"][2]["step"] = 2.5


def _negative_step(sd):
    sd["state"][2]["step"] = -1


def _tensor_fractional_step(sd):
    sd["state"][2]["step"] = torch.tensor(2.5)


def _counter_type(sd):
    for g in sd["param_groups"]:
        g["lowp"] = dict(g["lowp"], skipped_steps="3")


def _seed_range(sd):
    for g in sd["param_groups"]:
        g["lowp"] = dict(g["lowp"], seed=2 ** 70)


def _group_count(sd):
    sd["param_groups"].pop()


def _group_size(sd):
    sd["param_groups"][0]["params"].pop()


def _bad_mode(sd):
    sd["param_groups"][1]["mode"] = "kahn"


def _bad_buffer(sd):
    sd["state"][0]["remainder"] = torch.zeros(5, 4, dtype=torch.float32)


@pytest.mark.parametrize("corrupt, match", [
    (_corrupt_betas, "betas"), (_corrupt_state_shape, r"\['exp_avg'\]: shape"),
    (_corrupt_state_dtype, r"\['exp_avg'\]: dtype"), (_fractional_step, "step"), (_negative_step, "step"),
    (_tensor_fractional_step, "step"), (_counter_type, "skipped_steps"), (_seed_range, "seed"),
    (_group_count, "parameter groups"), (_group_size, "parameters"), (_bad_mode, "mode"),
    (_bad_buffer, "remainder"),
])
def test_a_corrupt_checkpoint_is_refused_and_changes_nothing(corrupt, match):
    src, _ = _two_groups(steps=3)
    sd = copy.deepcopy(src.state_dict())
    corrupt(sd)
    opt, params = _two_groups(steps=1)
    opt.param_groups[0]["lr"] = 0.123
    before = snapshot(opt, params)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(sd)
    assert same_snapshot(before, snapshot(opt, params))


def test_a_tensor_step_is_accepted_and_converted():
    src, _ = _two_groups(steps=3)
    sd = copy.deepcopy(src.state_dict())
    sd["state"][2]["step"] = torch.tensor(3.0)
    opt, params = _two_groups(steps=1)
    opt.load_state_dict(sd)
    assert opt.state[params[2]]["step"] == 3 and type(opt.state[params[2]]["step"]) is int
    assert opt.seed == 3 and opt.param_groups[0]["lowp"] == {}   # the live key carries nothing


def test_the_loaded_state_dtype_is_kept_unless_the_group_names_one():
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    sd = {"state": {0: {"step": 2, "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}},
          "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                            "amsgrad": False, "maximize": False}]}
    opt = lo.AdamW([p])
    opt.load_state_dict(sd)
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    opt = lo.AdamW([p], state_dtype={"exp_avg": torch.bfloat16})
    opt.load_state_dict(sd)
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.state[p]["exp_avg_sq"].dtype == torch.float32
