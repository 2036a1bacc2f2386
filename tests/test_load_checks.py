"""``load_state_dict`` refuses what it cannot resume from, naming the entry, and changes nothing.

Every optimizer of the registry: another optimizer's checkpoint, state keys that match no
parameter (string keys after a JSON round trip), entries no step reads, NaN or infinite states,
compensations and block scales, negative second moments and scales, step counts that could not
be saved again, meta and sparse tensors; and faults injected at each stage of a load.
"""
from __future__ import annotations

import copy

import pytest
import torch

import lowp.optim as lo
from lowp.optim import base, migrate
from lowp.optim.registry import optimizers

OPTIMIZERS = {cls.__name__: cls for cls in optimizers()}


pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(cls, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(4, 64, generator=gen) * 0.1).bfloat16()),
              torch.nn.Parameter((torch.randn(64, generator=gen) * 0.1).bfloat16())]
    opt = cls(params, lr=1e-3, backend="foreach", seed=3, **kw)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    return opt, params


def _bits(opt, params):
    out = []
    for p in params:
        out.append(p.detach().clone().view(torch.int16))
        for k, v in sorted(opt.state[p].items()):
            out.append((k, v.detach().clone().view(torch.uint8) if torch.is_tensor(v) and v.dim() else v))
    return out, (opt.seed, opt.skipped_params, opt.skipped_steps), repr(opt.param_groups)


def _same(a, b) -> bool:
    def eq(x, y):
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        if torch.is_tensor(x):
            return torch.equal(x, y)
        return x == y
    return eq(a, b)


def _refused(opt, params, sd, error, match):
    before = _bits(opt, params)
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    assert _same(_bits(opt, params), before)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_another_optimizers_checkpoint_is_refused(name):
    opt, params = _trained(OPTIMIZERS[name])
    for other in sorted(OPTIMIZERS):
        if other == name:
            continue
        theirs, _ = _trained(OPTIMIZERS[other])
        _refused(opt, params, theirs.state_dict(), ValueError, "checkpoint of|keeps no state")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_checkpoint_without_the_kind_but_with_foreign_states_is_refused(name):
    """Checkpoints of older lowp versions carry no kind: their state names give them away."""
    opt, params = _trained(OPTIMIZERS[name])
    sgd, _ = _trained(lo.SGD, momentum=0.9)
    sd = sgd.state_dict()
    for g in sd["param_groups"]:
        g["lowp"] = {k: v for k, v in g["lowp"].items() if k != "optimizer"}
    if name == "SGD":
        opt.load_state_dict(sd)
    else:
        _refused(opt, params, sd, ValueError, r"\['momentum_buffer'\]: .* keeps no state")


def test_string_keys_after_a_json_round_trip_are_refused_with_the_reason():
    opt, params = _trained(lo.AdamW)
    sd = opt.state_dict()
    sd["state"] = {str(k): v for k, v in sd["state"].items()}
    _refused(opt, params, sd, ValueError, r"\['0'\]: no parameter .* JSON")
    sd = opt.state_dict()
    sd["state"][7] = sd["state"][0]
    _refused(opt, params, sd, ValueError, r"\[7\]: no parameter")


def test_an_entry_no_step_reads_is_refused():
    opt, params = _trained(lo.AdamW)
    sd = opt.state_dict()
    sd["state"][0]["stat_avg"] = torch.zeros(4, 64)
    _refused(opt, params, sd, ValueError, r"\['stat_avg'\]")


CODED = {"state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}, "coded_min_numel": 0}


@pytest.mark.parametrize("options, key, value, match", [
    ({}, "exp_avg", float("nan"), "NaN"),
    ({}, "exp_avg_sq", float("inf"), "NaN or an infinity"),
    ({}, "exp_avg_sq", -1e-3, "negative"),
    ({}, "compensation", float("nan"), "NaN"),
    (CODED, "exp_avg_scale", float("nan"), "NaN"),
    (CODED, "exp_avg_sq_scale", -1.0, "negative"),
    ({"state_dtype": torch.float8_e4m3fn}, "exp_avg", float("nan"), "NaN"),
])
def test_values_a_step_cannot_use_are_refused(options, key, value, match):
    opt, params = _trained(lo.AdamW, **options)
    sd = copy.deepcopy(opt.state_dict())
    t = sd["state"][1][key]
    t.view(-1)[0] = torch.tensor(value).to(t.dtype)
    _refused(opt, params, sd, ValueError, rf"\[1\]\['{key}'\]: .*{match}")


@pytest.mark.parametrize("step", [2 ** 63 - 1, 2 ** 63, 2 ** 70])
def test_step_counts_that_cannot_be_saved_again_are_refused(step):
    opt, params = _trained(lo.AdamW)
    sd = opt.state_dict()
    sd["state"][0]["step"] = step
    _refused(opt, params, sd, ValueError, r"\['step'\]: expected a step count")


def test_meta_and_sparse_saved_tensors_are_refused_by_name():
    opt, params = _trained(lo.AdamW)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.empty(4, 64, device="meta")
    _refused(opt, params, sd, ValueError, r"\['exp_avg'\]: a meta tensor")
    sd = opt.state_dict()
    sd["state"][1]["exp_avg"] = torch.zeros(64).to_sparse()
    _refused(opt, params, sd, TypeError, r"\['exp_avg'\]: expected a dense tensor")


def test_a_good_checkpoint_still_loads_and_resumes_bit_for_bit():
    opt, params = _trained(lo.AdamW, **CODED)
    sd = copy.deepcopy(opt.state_dict())
    other, other_params = _trained(lo.AdamW, seed=1, **CODED)
    for p, q in zip(other_params, params):
        p.data.copy_(q.data)
    other.load_state_dict(sd)
    for a, b in ((opt, params), (other, other_params)):
        for p in b:
            p.grad = torch.ones_like(p)
        a.step()
    assert _same(_bits(opt, params)[0], _bits(other, other_params)[0])


@pytest.mark.parametrize("target", [(migrate, "to_lowp_layout"), (base.LowpOptimizer, "check_group"),
                                    (base.LowpOptimizer, "check_state"), (base.LowpOptimizer, "_recode_loaded"),
                                    (base.LowpOptimizer, "_value_problems")])
def test_a_fault_at_any_stage_of_a_load_changes_nothing(target, monkeypatch):
    opt, params = _trained(lo.AdamW, **CODED)
    other, _ = _trained(lo.AdamW, seed=1, **CODED)
    sd = other.state_dict()
    owner, name = target
    calls = []

    def fail(*args, **kwargs):
        calls.append(name)
        raise RuntimeError(f"injected into {name}")
    monkeypatch.setattr(owner if owner is not migrate else base, name, fail)
    before = _bits(opt, params)
    with pytest.raises(RuntimeError, match="injected"):
        opt.load_state_dict(sd)
    assert calls
    assert _same(_bits(opt, params), before)
