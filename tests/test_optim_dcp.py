"""``torch.distributed.checkpoint`` resumes a lowp optimizer bit-identically: the extras (seed,
skip counters, stochastic-rounding generator) ride in every saved parameter group, which DCP
keeps, both for ``dcp.save({"optim": opt.state_dict()})`` and for ``get_state_dict`` /
``set_state_dict``; AdamW in every configuration, every optimizer of the registry through
``get_state_dict`` / ``set_state_dict``. Single process; a gloo group of world size 1 where DCP
needs one."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)

import lowp.optim as lo
from lowp.optim.registry import entries


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def _gloo(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("dcp") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def _setup(mode, seed, state_dtype=None, cls=lo.AdamW, kw=None, coded_min_numel=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).bfloat16()
    kw = dict(lr=1e-3) if kw is None else kw
    return model, cls(model.parameters(), mode=mode, seed=seed, state_dtype=state_dtype,
                      coded_min_numel=coded_min_numel, **kw)


def _train(model, opt, steps, start):
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(t)
        opt.zero_grad()
        model(torch.randn(32, 8, generator=gen).bfloat16()).float().square().mean().backward()
        if t == 1:     # one non-finite gradient, so that a skip counter is saved too
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()


def _assert_same(a_model, a_opt, b_model, b_opt):
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)
        for name, value in a_opt.state[p].items():
            other = b_opt.state[q][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name
    assert (a_opt.seed, a_opt.skipped_params, a_opt.skipped_steps) == (b_opt.seed, b_opt.skipped_params,
                                                                          b_opt.skipped_steps)


@pytest.mark.parametrize("mode,state_dtype", [("kahan", None), ("stochastic", None), ("kahan", CODED)],
                         ids=["kahan", "stochastic", "kahan-int8-states"])
def test_dcp_resume_is_bit_identical(mode, state_dtype, tmp_path, _gloo):
    """Block-scaled states (int8/uint8 codes and their bf16 scales) keep their dtypes too."""
    model, opt = _setup(mode, seed=1, state_dtype=state_dtype)
    _train(model, opt, 3, start=0)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dsd"))
    _train(model, opt, 3, start=3)
    assert opt.skipped_params == 1

    # way 1: opt.state_dict() in, opt.state_dict() out; torch's get_state_dict creates the fresh
    # optimizer's states, which DCP needs as the layout to load into
    fresh_model, fresh_opt = _setup(mode, seed=2, state_dtype=state_dtype)
    get_state_dict(fresh_model, fresh_opt)
    target = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "plain"))
    fresh_model.load_state_dict(target["model"])
    fresh_opt.load_state_dict(target["optim"])
    _train(fresh_model, fresh_opt, 3, start=3)
    _assert_same(model, opt, fresh_model, fresh_opt)
    if state_dtype is not None:
        assert fresh_opt.state[next(fresh_model.parameters())]["exp_avg"].dtype == torch.int8

    # way 2: get_state_dict / set_state_dict
    fresh_model, fresh_opt = _loaded(str(tmp_path / "dsd"), mode, seed=3, state_dtype=state_dtype)
    _train(fresh_model, fresh_opt, 3, start=3)
    _assert_same(model, opt, fresh_model, fresh_opt)


def _loaded(path, mode, seed, **setup):
    """A fresh model and optimizer (built with ``seed``) loaded from the DCP checkpoint at ``path``
    through ``get_state_dict`` / ``set_state_dict``."""
    model, opt = _setup(mode, seed, **setup)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt


@pytest.mark.parametrize("e", entries(), ids=lambda e: e.name)
def test_dcp_resumes_every_optimizer_of_the_registry(e, tmp_path, _gloo):
    """Each optimizer with its first example, through get_state_dict / set_state_dict."""
    model, opt = _setup("kahan", seed=1, cls=e.cls, kw=e.examples[0])
    _train(model, opt, 3, start=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    _train(model, opt, 3, start=3)
    assert opt.skipped_params == 1
    fresh_model, fresh_opt = _loaded(str(tmp_path), "kahan", seed=2, cls=e.cls, kw=e.examples[0])
    _train(fresh_model, fresh_opt, 3, start=3)
    _assert_same(model, opt, fresh_model, fresh_opt)



FP32_STATES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
BF16_STATES = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}


@pytest.mark.parametrize("saved,loading,cast", [
    (dict(state_dtype=CODED, coded_min_numel=0), dict(state_dtype=CODED, coded_min_numel=4096),
     "arrived as bfloat16, the dtype this optimizer's options give it, while the checkpoint's options "
     r"\(state_dtype=\{'exp_avg': 'int8', 'exp_avg_sq': 'uint8'\}, coded_min_numel=0\) store it as int8"),
    (dict(state_dtype=FP32_STATES, coded_min_numel=0), dict(state_dtype=BF16_STATES, coded_min_numel=0),
     "arrived as bfloat16, the dtype this optimizer's options give it, while the checkpoint's options "
     r"\(state_dtype=\{'exp_avg': 'float32', 'exp_avg_sq': 'float32'\}, coded_min_numel=0\) store it as float32"),
    (dict(state_dtype=CODED, coded_min_numel=4096), dict(state_dtype=CODED, coded_min_numel=0),
     "arrived as int8, the dtype this optimizer's options give it, while the checkpoint's options "
     r"\(state_dtype=\{'exp_avg': 'int8', 'exp_avg_sq': 'uint8'\}, coded_min_numel=4096\) store it as bfloat16"),
], ids=["codes-into-16-bit-states", "fp32-into-bf16-states", "values-into-codes-partial-load"])
def test_torch_dcp_load_into_a_template_of_another_layout_is_refused(saved, loading, cast, tmp_path, _gloo):
    """torch's route (``get_state_dict``, ``dcp.load``, ``set_optimizer_state_dict``) with a
    template built with other storage options than the saving run's: ``dcp.load`` casts each
    saved tensor into the template's (int8 codes land as their integer values in bf16 states,
    their scales dropped; fp32 moments rounded to bf16; with a partial-load planner, bf16 moments
    as int8 codes beside the template's scales) and restores the group's options as saved;
    before this check the load went through: codes re-encoded as numbers, moments silently
    rounded or decoded with other scales. Refused by name, the groups unchanged; the states, which ``dcp.load``
    wrote in place, are refused by the next step; the saving options load it bit for bit."""
    model, opt = _setup("kahan", seed=1, **saved)
    _train(model, opt, 3, start=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))

    other_model, other = _setup("kahan", seed=2, **loading)
    template = get_optimizer_state_dict(other_model, other)
    # writes into other's own states; a checkpoint of values lacks the codes' scales, which the
    # default planner refuses and a partial-load planner leaves as they are
    dcp.load({"optim": template}, checkpoint_id=str(tmp_path),
             planner=DefaultLoadPlanner(allow_partial_load=True) if saved["coded_min_numel"] else None)
    with pytest.raises(ValueError, match=rf"state_dict\['state'\]\['0\.weight'\]\['exp_avg'\]: {cast}: it looks "
                                         rf"cast into a template of this optimizer's layout"):
        set_optimizer_state_dict(other_model, other, template)
    weights = [p.clone() for p in other_model.parameters()]
    other_model(torch.randn(32, 8).bfloat16()).float().square().mean().backward()
    with pytest.raises(RuntimeError, match=r"step: this optimizer's states hold what a loader wrote into them from a "
                                           r"checkpoint of another storage layout"):
        other.step()
    assert copy.deepcopy(other)._overwritten is not None
    assert all(torch.equal(p, w) for p, w in zip(other_model.parameters(), weights))
    assert other.param_groups[0]["coded_min_numel"] == loading["coded_min_numel"]

    fresh_model, fresh = _loaded(str(tmp_path), "kahan", seed=3, **saved)
    _train(model, opt, 2, start=3)
    _train(fresh_model, fresh, 2, start=3)
    _assert_same(model, opt, fresh_model, fresh)


def test_mixed_layouts_in_another_parameter_order_load_as_saved(tmp_path, _gloo):
    """Under the default threshold a model's large weights keep codes and its small vectors
    16-bit states; an optimizer built over the parameters in another order (torch's route
    matches them by name), with a frozen parameter, loads each state as saved: the layout check
    is per parameter, from its own shape. The stochastic-rounding streams follow a parameter's
    position, so a resume is bit for bit in the saving order only."""
    def build(order):
        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 128),
                                    torch.nn.LayerNorm(128)).bfloat16()
        model[3].bias.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, lo.AdamW(params[::order], lr=1e-3, seed=5, state_dtype=CODED)
    model, opt = build(1)
    assert opt.state_dict()["param_groups"][0]["coded_min_numel"] == 4096
    _train_wide(model, opt, 3, start=0)
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.int8
    assert opt.state[model[2].bias]["exp_avg"].dtype == torch.bfloat16
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    fresh_model, fresh = build(-1)
    msd, osd = get_state_dict(fresh_model, fresh)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    set_state_dict(fresh_model, fresh, model_state_dict=msd, optim_state_dict=osd)
    assert len(fresh.state) == len(opt.state) == 5
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
        for name, value in opt.state.get(p, {}).items():
            assert torch.equal(value, fresh.state[q][name]) if torch.is_tensor(value) else value == fresh.state[q][name]
    _train_wide(fresh_model, fresh, 1, start=3)


def _train_wide(model, opt, steps, start):
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(t)
        opt.zero_grad()
        model(torch.randn(32, 8, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()


def test_lossless_casts_and_unnamed_dtypes_still_load(tmp_path, _gloo):
    """Not every dtype change is a lossy cast: bf16 moments loaded by ``dcp.load`` into an fp32
    template are exact (and stored as bf16 again, as the saved options name), and a checkpoint
    whose options name no dtype (its states keep their own, fp32 here) loads into an optimizer
    that names fp32 by ``load_state_dict``; both load, each state equal to the saved one."""
    model, opt = _setup("kahan", seed=1, state_dtype=BF16_STATES)
    _train(model, opt, 2, start=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"optim": osd}, checkpoint_id=str(tmp_path))
    wide_model, wide = _setup("kahan", seed=2, state_dtype=FP32_STATES)
    template = get_optimizer_state_dict(wide_model, wide)
    dcp.load({"optim": template}, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(wide_model, wide, template)
    for p, q in zip(model.parameters(), wide_model.parameters()):
        assert wide.state[q]["exp_avg"].dtype == torch.bfloat16 and torch.equal(opt.state[p]["exp_avg"],
                                                                                 wide.state[q]["exp_avg"])
    model, opt = _setup("kahan", seed=1)
    _train(model, opt, 2, start=0)
    sd = opt.state_dict()   # a lowp checkpoint with fp32 states and no state_dtype named
    for entry in sd["state"].values():
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg"].float(), entry["exp_avg_sq"].float()
    named_model, named = _setup("kahan", seed=3, state_dtype=FP32_STATES)
    named.load_state_dict(copy.deepcopy(sd))
    for i, q in enumerate(named_model.parameters()):
        assert named.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(named.state[q]["exp_avg"], sd["state"][i]["exp_avg"])


def test_other_refusals_of_the_optimizers_own_state_dict_leave_it_steppable(_gloo):
    """A refusal for another reason (a bad option) of a state dict made of the optimizer's own
    tensors changes nothing, and the optimizer steps on; changing the options and loading its own
    state dict (the documented conversion) converts."""
    model, opt = _setup("kahan", seed=1, state_dtype=CODED)
    _train(model, opt, 2, start=0)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="lr"):
        opt.load_state_dict({**sd, "param_groups": [{**sd["param_groups"][0], "lr": -1.0}]})
    assert opt._overwritten is None
    opt.step()
    for g in opt.param_groups:   # the conversion the refusal points to: 16-bit states under 4096 elements
        g["coded_min_numel"] = 4096
    opt.load_state_dict(opt.state_dict())
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in model.parameters())
    opt.step()
