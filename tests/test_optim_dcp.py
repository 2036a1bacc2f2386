"""``torch.distributed.checkpoint`` resumes a lowp optimizer bit-identically: the extras (seed,
skip counters, stochastic-rounding generator) ride in every saved parameter group, which DCP
keeps, both for ``dcp.save({"optim": opt.state_dict()})`` and for ``get_state_dict`` /
``set_state_dict``; AdamW in every configuration, every optimizer of the registry through
``get_state_dict`` / ``set_state_dict``. Single process; a gloo group of world size 1 where DCP
needs one."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def _setup(mode, seed, state_dtype=None, cls=lo.AdamW, kw=None):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).bfloat16()
    kw = dict(lr=1e-3) if kw is None else kw
    return model, cls(model.parameters(), mode=mode, seed=seed, state_dtype=state_dtype, coded_min_numel=0, **kw)


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
