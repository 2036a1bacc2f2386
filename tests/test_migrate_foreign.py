"""Checkpoints of torchao's low-bit optimizers (tensor-subclass states) and of heavyball load into
lowp optimizers through ``lowp.optim.migrate.to_lowp_layout``: converted to plain dense tensors,
or refused inside ``load_state_dict`` with an error naming the entry, nothing changed.

torchao and heavyball run on the CPU here with their compilers switched off (torchao compiles its
step with ``fullgraph=True``, heavyball its kernels with max-autotune: eager is the same math and
takes seconds). Stand-in subclasses cover the generic detection without either package."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import lowp.optim as lo
from lowp.optim.codes import scale_name
from optim_helpers import regression_steps

CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(dtype=torch.bfloat16, width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)).to(dtype)


def _snapshot(opt):
    return copy.deepcopy({"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                          "state": {i: dict(opt.state[p]) for i, p in enumerate(opt.param_groups[0]["params"])
                                    if p in opt.state}})


def _assert_unchanged(opt, before):
    after = _snapshot(opt)
    assert after["groups"] == before["groups"]
    assert after["state"].keys() == before["state"].keys()
    for i, entry in before["state"].items():
        for name, value in entry.items():
            got = after["state"][i][name]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value


def _plain_copy(sd):
    """``sd`` with every state decoded to a plain tensor by hand (the reference for the loader)."""
    def plain(v):
        return v.dequantize() if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor else v
    return {"state": {k: {n: plain(v) for n, v in e.items()} for k, e in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


# ---- stand-ins: a torchao-like coded subclass, and subclasses lowp cannot read ----------------------------------
class CodedStandIn(torch.Tensor):
    """Mimics torchao's ``OptimState8bit``: uint8 codes of the tensor's shape, one fp32 scale per
    block, a 256-entry code table; every other operation is unimplemented, as there."""

    @staticmethod
    def __new__(cls, codes, scale, qmap):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.bfloat16, device=codes.device)

    def __init__(self, codes, scale, qmap):
        self.codes, self.scale, self.qmap = codes, scale, qmap

    @classmethod
    def encode(cls, x, block=32):
        qmap = torch.linspace(-1, 1, 256)
        blocks = x.float().reshape(-1, block)
        scale = blocks.abs().amax(1).clamp_min(1e-12)
        codes = ((blocks / scale[:, None] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return cls(codes.reshape(x.shape), scale, qmap)

    def dequantize(self):
        return (self.qmap[self.codes.int()].reshape(self.scale.numel(), -1) * self.scale[:, None]).reshape(self.shape)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} dispatch: attempting to run unimplemented operator {func}")


class BrokenStandIn(CodedStandIn):
    def dequantize(self):
        raise RuntimeError("its code table is missing")


class OpaqueStandIn(torch.Tensor):
    """A subclass with no decoder of its own."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} dispatch: {func}")


def _torch_checkpoint(model, steps=3):
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-3)
    regression_steps(model, theirs, steps)
    return theirs.state_dict()


@pytest.mark.parametrize("state_dtype", [None, CODED])
def test_a_coded_stand_in_subclass_is_decoded_on_load(state_dtype):
    model = _model()
    sd = _torch_checkpoint(model)
    sd["state"][0]["exp_avg"] = CodedStandIn.encode(sd["state"][0]["exp_avg"])
    sd["state"][0]["exp_avg_sq"] = CodedStandIn.encode(sd["state"][0]["exp_avg_sq"])
    plain = _plain_copy(sd)
    ours = lo.AdamW(model.parameters(), state_dtype=state_dtype, coded_min_numel=0)
    ours.load_state_dict(sd)
    reference = lo.AdamW(model.parameters(), state_dtype=state_dtype, coded_min_numel=0)
    reference.load_state_dict(plain)
    p0 = next(model.parameters())
    for name in ("exp_avg", "exp_avg_sq"):
        assert type(ours.state[p0][name]) is torch.Tensor
        if state_dtype is None:
            assert ours.state[p0][name].dtype == torch.float32
            assert torch.equal(ours.state[p0][name], sd["state"][0][name].dequantize())
        else:
            assert torch.equal(ours.state[p0][name], reference.state[p0][name])
            assert torch.equal(ours.state[p0][scale_name(name)], reference.state[p0][scale_name(name)])
    assert isinstance(sd["state"][0]["exp_avg"], CodedStandIn)      # the input is left as it was
    regression_steps(model, ours, 2, start=3)
    assert all(s["step"] == 5 for s in ours.state.values())


@pytest.mark.parametrize("bad, error, reason", [
    (lambda v: OpaqueStandIn(v.shape), TypeError, "tensor subclass .*OpaqueStandIn.*dequantize"),
    (lambda v: BrokenStandIn.encode(v), ValueError, "dequantize\\(\\) failed .*code table is missing"),
])
def test_a_subclass_that_cannot_be_decoded_is_refused_by_name(bad, error, reason):
    model = _model()
    sd = _torch_checkpoint(model)
    sd["state"][2]["exp_avg_sq"] = bad(sd["state"][2]["exp_avg_sq"])
    ours = lo.AdamW(model.parameters(), lr=0.5)
    regression_steps(model, ours, 1)
    before = _snapshot(ours)
    with pytest.raises(error, match=re.escape("state_dict['state'][2]['exp_avg_sq']") + ".*" + reason):
        ours.load_state_dict(sd)
    _assert_unchanged(ours, before)


def test_a_two_tensor_state_is_refused_by_name():
    from torch.testing._internal.two_tensor import TwoTensor

    model = _model()
    sd = _torch_checkpoint(model)
    v = sd["state"][1]["exp_avg"]
    sd["state"][1]["exp_avg"] = TwoTensor(v, v.clone())
    ours = lo.AdamW(model.parameters())
    with pytest.raises(TypeError, match=re.escape("state_dict['state'][1]['exp_avg']: a tensor subclass") +
                       ".*TwoTensor"):
        ours.load_state_dict(sd)
    assert not ours.state


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_torch_tensor_is_dequantized():
    model = _model(torch.float32)
    sd = _torch_checkpoint(model)
    v = sd["state"][0]["exp_avg"]
    sd["state"][0]["exp_avg"] = torch.quantize_per_tensor(v, float(v.abs().max()) / 127, 0, torch.qint8)
    ours = lo.AdamW(model.parameters())
    ours.load_state_dict(sd)
    assert torch.equal(ours.state[model[0].weight]["exp_avg"], sd["state"][0]["exp_avg"].dequantize())


def test_wrapped_state_dicts_are_named():
    model = _model()
    ours = lo.AdamW(model.parameters())
    with pytest.raises(ValueError, match="torchao's CPUOffloadOptimizer"):
        ours.load_state_dict({"offloaded": [_torch_checkpoint(_model())]})
    with pytest.raises(ValueError, match="heavyball's SplitOpt"):
        ours.load_state_dict({"optimizers": []})


# ---- torchao ------------------------------------------------------------------------------------------------------
def _torchao():
    try:   # torchao pairs with torch versions: one that does not fit may fail with other errors than ImportError
        import torchao.optim
    except Exception as e:
        pytest.skip(f"torchao.optim does not import here ({type(e).__name__}: {e})")
    return torchao.optim


def _ao_run(monkeypatch, cls, model, steps, **kw):
    """torchao's optimizer trained ``steps`` steps, its step run eagerly (no compiler)."""
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", lambda fn, **_: fn)
        theirs = cls(model.parameters(), lr=1e-3, **kw)
        regression_steps(model, theirs, steps)
    return theirs


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
@pytest.mark.parametrize("state_dtype", [None, CODED])
def test_a_torchao_low_bit_checkpoint_converts(monkeypatch, name, state_dtype):
    ao = _torchao()
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    model = _model()
    theirs = _ao_run(monkeypatch, getattr(ao, name), model, 3, block_size=64)
    sd = theirs.state_dict()
    subclass = {"AdamW8bit": OptimState8bit, "AdamW4bit": OptimState4bit, "AdamWFp8": OptimStateFp8}[name]
    assert type(sd["state"][0]["exp_avg"]) is subclass and type(sd["state"][1]["exp_avg"]) is torch.Tensor
    plain = _plain_copy(sd)
    ours = lo.AdamW(model.parameters(), state_dtype=state_dtype, coded_min_numel=0)
    ours.load_state_dict(sd)
    reference = lo.AdamW(model.parameters(), state_dtype=state_dtype, coded_min_numel=0)
    reference.load_state_dict(plain)
    for i, p in enumerate(model.parameters()):
        assert ours.state[p]["step"] == 3
        for n in ("exp_avg", "exp_avg_sq"):
            assert type(ours.state[p][n]) is torch.Tensor
            if state_dtype is None or n not in CODED:     # kept as decoded: fp32 (plain bf16 ones stay bf16)
                assert torch.equal(ours.state[p][n], plain["state"][i][n])
                assert ours.state[p][n].dtype == (torch.float32 if i == 0 else torch.bfloat16)
            else:                                         # lowp's codes of the decoded values, to nearest
                assert ours.state[p][n].dtype == CODED[n]
                assert torch.equal(ours.state[p][n], reference.state[p][n])
                assert torch.equal(ours.state[p][scale_name(n)], reference.state[p][scale_name(n)])
    regression_steps(model, ours, 2, start=3)
    assert all(s["step"] == 5 for s in ours.state.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_torchao_checkpoint_takes_the_step_torchao_would_take(monkeypatch):
    """fp32 weights: the step after the load uses the decoded moments in both libraries (torchao
    encodes them only after the step), so one step agrees within fp32 rounding."""
    ao = _torchao()
    a = _model(torch.float32)
    theirs = _ao_run(monkeypatch, ao.AdamW8bit, a, 4, weight_decay=0.1)
    b = copy.deepcopy(a)
    ours = lo.AdamW(b.parameters(), lr=1e-3)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["weight_decay"] == 0.1
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", lambda fn, **_: fn)
        regression_steps(a, theirs, 1, start=4)
    regression_steps(b, ours, 1, start=4)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7)


def test_torchao_adamw_with_bf16_stochastic_rounding_loads(monkeypatch):
    ao = _torchao()
    model = _model()
    theirs = _ao_run(monkeypatch, ao._AdamW, model, 3, bf16_stochastic_round=True)
    sd = theirs.state_dict()
    ours = lo.AdamW(model.parameters())
    ours.load_state_dict(sd)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(ours.state[p]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])
        assert ours.state[p]["exp_avg"].dtype == torch.bfloat16 and ours.state[p]["step"] == 3
    regression_steps(model, ours, 2, start=3)


@pytest.fixture
def _gloo(tmp_path):
    """A one-process gloo group for this test only (later tests start their own)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_torchao_state_inside_a_dtensor_is_decoded_locally(_gloo):
    _torchao()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torchao.optim.subclass_8bit import OptimState8bit

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 64).bfloat16(), mesh, [Shard(0)]))
    local = OptimState8bit.zeros((64, 64), signed=True, block_size=64, dtype=torch.bfloat16)
    local.copy_(torch.randn(64, 64) * 1e-3)
    state = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
    sd = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": state, "exp_avg_sq": torch.zeros(64, 64) + 1e-6}},
          "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                            "amsgrad": False}]}
    ours = lo.AdamW([p])
    ours.load_state_dict(sd)
    loaded = ours.state[p]["exp_avg"]
    assert isinstance(loaded, DTensor) and type(loaded.to_local()) is torch.Tensor
    assert torch.equal(loaded.to_local(), local.dequantize())
    assert type(sd["state"][0]["exp_avg"].to_local()) is OptimState8bit


# ---- heavyball ----------------------------------------------------------------------------------------------------
def _heavyball(monkeypatch):
    try:   # heavyball 3 needs Python 3.11 (numpy >= 2.3.4): not installed on 3.10
        import heavyball as hb
    except Exception as e:
        pytest.skip(f"heavyball does not import here ({type(e).__name__}: {e})")
    monkeypatch.setattr(hb.utils, "compile_mode", None)   # eager kernels (the same math)
    return hb


def _hb_run(hb, model, steps, cls=None, **kw):
    theirs = (cls or hb.AdamW)(model.parameters(), **{"lr": 1e-2, **kw})
    regression_steps(model, theirs, steps)
    return theirs


def _hb_name(sd, name):
    return next(k for k in sd["state"][0][0] if re.fullmatch(f"update_by_adam_{name}(_[0-9]+)?", k))


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
def test_a_heavyball_adamw_checkpoint_converts(monkeypatch, storage_dtype):
    hb = _heavyball(monkeypatch)
    model = _model(torch.float32, width=6)
    theirs = _hb_run(hb, model, 5, weight_decay=0.1, storage_dtype=storage_dtype)
    sd = theirs.state_dict()
    before = copy.deepcopy(sd)
    ours = lo.AdamW(model.parameters())
    ours.load_state_dict(sd)
    group = ours.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-2, (0.9, 0.99), 0.1)
    assert "step_count" not in group and "caution" not in group and "base_lr" not in group
    for i, p in enumerate(model.parameters()):
        s = ours.state[p]
        assert s["step"] == 5
        for name, beta in (("exp_avg", 0.9), ("exp_avg_sq", 0.99)):
            saved = sd["state"][i][0][_hb_name(sd, name)]
            assert s[name].dtype == getattr(torch, storage_dtype)
            assert torch.equal(s[name], (saved.float() * (1 - beta ** 5)).to(saved.dtype))
    for i, entry in before["state"].items():        # the input is left as it was
        for name, value in entry[0].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(sd["state"][i][0][name], value)
    regression_steps(model, ours, 1, start=5)
    assert all(s["step"] == 6 for s in ours.state.values())


def test_a_heavyball_checkpoint_continues_as_heavyball_would(monkeypatch):
    """fp32 weights: heavyball divides by max(sqrt(v_hat), eps), lowp by sqrt(v_hat) + eps, a
    relative difference of eps / sqrt(v_hat) per step."""
    hb = _heavyball(monkeypatch)
    a = _model(torch.float32, width=6)
    theirs = _hb_run(hb, a, 5, weight_decay=0.1)
    b = copy.deepcopy(a)
    ours = lo.AdamW(b.parameters())
    ours.load_state_dict(theirs.state_dict())
    regression_steps(a, theirs, 5, start=5)
    regression_steps(b, ours, 5, start=5)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


def test_a_heavyball_1x_foreach_adamw_layout_converts(monkeypatch):
    """heavyball before 3.0 (``ForeachAdamW``): names without the transform index, no
    ``step_count`` (the step sits in the first parameter's view state), ``foreach`` and the
    warmed-up ``lr`` beside ``base_lr``."""
    hb = _heavyball(monkeypatch)
    model = _model(torch.float32, width=6)
    sd = _hb_run(hb, model, 5, warmup_steps=2).state_dict()
    new = copy.deepcopy(sd)
    del new["heavyball"]
    for g in new["param_groups"]:
        del g["step_count"], g["multi_tensor"]
        g.update(foreach=True, lr=g["base_lr"] / 2)   # as if saved during a warmup: base_lr is the rate
    for entry in new["state"].values():
        entry[0] = {re.sub(r"_[0-9]+$", "", k): v for k, v in entry[0].items()}
    assert [entry[0].get("step") for entry in new["state"].values()] == [5, None, None, None]
    ours = lo.AdamW(model.parameters())
    ours.load_state_dict(new)
    assert ours.param_groups[0]["lr"] == 1e-2 and "foreach" not in ours.param_groups[0]
    reference = lo.AdamW(model.parameters())
    reference.load_state_dict(sd)
    for p in model.parameters():
        assert ours.state[p]["step"] == 5
        assert torch.equal(ours.state[p]["exp_avg"], reference.state[p]["exp_avg"])
        assert torch.equal(ours.state[p]["exp_avg_sq"], reference.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("change, where, reason", [
    (dict(caution=True), "param_groups[0]", "caution=True"),
    (dict(mars=True), "param_groups[0]", "mars=True"),
    (dict(palm=True), "param_groups[0]", "palm=True"),
    (dict(ecc="bf16+8"), "param_groups[0]", "ecc='bf16+8' (error-corrected storage)"),
    (dict(warmup_steps=10), "param_groups[0]", "step 3 of heavyball's 10-step learning-rate warmup"),
])
def test_heavyball_options_lowp_lacks_are_refused(monkeypatch, change, where, reason):
    hb = _heavyball(monkeypatch)
    model = _model(torch.float32, width=6)
    sd = _hb_run(hb, model, 3, **change).state_dict()
    ours = lo.AdamW(model.parameters(), lr=0.5)
    regression_steps(model, ours, 1)
    before = _snapshot(ours)
    with pytest.raises(ValueError, match=re.escape(f"state_dict: {where}") + ".*" + re.escape(reason)):
        ours.load_state_dict(sd)
    _assert_unchanged(ours, before)


def test_other_heavyball_optimizers_and_layouts_are_refused_by_entry(monkeypatch):
    hb = _heavyball(monkeypatch)
    model = _model(torch.float32, width=6)
    ours = lo.AdamW(model.parameters())
    sgd = _hb_run(hb, model, 2, cls=hb.SGD).state_dict()
    name = next(k for k in sgd["state"][0][0] if k not in ("step", "is_initialized"))
    with pytest.raises(ValueError, match=re.escape(f"state_dict['state'][0][0][{name!r}]: a heavyball state")):
        ours.load_state_dict(sgd)
    clipped = _hb_run(hb, _model(torch.float32, width=6), 2, update_clipping="l2_clip_").state_dict()
    with pytest.raises(ValueError, match=re.escape("state_dict['state'][0][0]['scale_by_adam_exp_avg_0']: "
                                                   "heavyball's unfused Adam")):
        ours.load_state_dict(clipped)
    sd = _hb_run(hb, _model(torch.float32, width=6), 2).state_dict()
    split = copy.deepcopy(sd)
    split["state"][1][1] = dict(split["state"][1][0])
    with pytest.raises(ValueError, match=re.escape("state_dict['state'][1]: heavyball cut this parameter into the "
                                                   "views [0, 1]")):
        ours.load_state_dict(split)
    assert not ours.state
    with pytest.raises(ValueError, match="heavyball checkpoint can be loaded into lowp's AdamW .*not SGD"):
        lo.SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(sd)
    wd = _hb_run(hb, _model(torch.float32, width=6), 2, weight_decay=0.1).state_dict()
    with pytest.raises(ValueError, match=r"param_groups\[0\] uses decoupled .*weight decay"):
        lo.Adam(model.parameters()).load_state_dict(wd)
