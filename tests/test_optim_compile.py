"""``torch.compile(opt.step)`` keeps every mode's semantics: the lowp step is never traced (it
runs eagerly, fused kernels included), so sub-ulp progress is bit-identical to the eager step;
``fullgraph=True`` says why it cannot trace the step and what to do."""
from __future__ import annotations

import pytest
import torch

import lowp.optim as lo
from lowp.optim.codes import code_for, scale_name
from lowp.optim.kernels import native_available
from lowp.optim.registry import entries
from lowp.optim.writeback import MODES

#: every optimizer of the registry with its first example, at lr 1e-4 (sub-ulp steps, see _run)
OPTIMIZERS = [(e.cls, dict(e.examples[0], lr=1e-4)) for e in entries()]
BACKENDS = ["foreach"] + (["native"] if native_available() else [])
pytestmark = pytest.mark.usefixtures("one_thread")


def _run(cls, kw, mode, backend, compiled, steps):
    """``steps`` sub-ulp steps of one bf16 weight (ones: an update of 1e-4 is 1/40 of its ulp)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
    opt = cls([p], mode=mode, backend=backend, seed=5, **kw)
    step = torch.compile(opt.step) if compiled else opt.step
    for _ in range(steps):
        p.grad = (torch.rand(p.shape, generator=gen) + 0.5).bfloat16()
        step()
    return p, opt


def _held(p, opt):
    state = opt.state[p]
    if "remainder" in state:
        return MODES["exact"].load(p.detach(), state["remainder"])
    return p.detach().float() + (state["compensation"].float() if "compensation" in state else 0)


def _check(cls, kw, backend, steps):
    torch._dynamo.reset()
    for mode in MODES:
        (pe, oe), (pc, oc) = (_run(cls, kw, mode, backend, compiled, steps) for compiled in (False, True))
        assert torch.equal(pe, pc), (mode, backend)
        for name, value in oe.state[pe].items():
            other = oc.state[pc][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (mode, backend, name)
        if mode in ("kahan", "exact"):    # the sub-ulp progress is there, and the same
            assert not torch.equal(_held(pe, oe), torch.ones(4, 8)), (mode, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_is_bit_identical_to_eager_adamw(backend):
    _check(lo.AdamW, dict(lr=1e-4, weight_decay=0.1), backend, steps=50)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls, kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_compiled_step_is_bit_identical_to_eager_for_every_optimizer(cls, kw, backend):
    _check(cls, kw, backend, steps=50)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("states", [{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                                    {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint4}],  # type: ignore[attr-defined]
                         ids=["int8-uint8", "e4m3-uint4"])
def test_compiled_step_is_bit_identical_to_eager_with_block_scaled_states(backend, states):
    """Codes and their block scales too (every mode, the one-byte remainder of exact8 included)."""
    kw = dict(lr=1e-4, weight_decay=0.1, state_dtype=states, coded_min_numel=0)
    _check(lo.AdamW, kw, backend, steps=20)
    p, opt = _run(lo.AdamW, kw, "exact8", backend, True, steps=2)
    for name, dtype in states.items():   # held as codes (4-bit ones two to a byte) with their scales
        code = code_for(dtype)
        assert code is not None and opt.state[p][name].dtype == code.storage and scale_name(name) in opt.state[p]


def test_fullgraph_explains_why_the_step_is_not_traced():
    torch._dynamo.reset()
    p = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = lo.SGD([p], lr=1e-4)
    with pytest.raises(Exception, match="runs eagerly") as info:
        torch.compile(opt.step, fullgraph=True)()
    assert "fullgraph=False" in str(info.value)
    assert opt.state == {} or opt.state[p]["step"] == 0


@pytest.mark.slow
def test_a_compiled_training_step_graph_breaks_around_the_optimizer():
    torch._dynamo.reset()
    model = torch.nn.Linear(8, 4).bfloat16()
    opt = lo.AdamW(model.parameters(), lr=1e-4, seed=0)   # both alive: a default seed would be each one's own
    twin = torch.nn.Linear(8, 4).bfloat16()
    twin.load_state_dict(model.state_dict())
    opt_twin = lo.AdamW(twin.parameters(), lr=1e-4, seed=0)
    x = torch.randn(16, 8).bfloat16()

    def train_step(m, o):
        o.zero_grad()
        m(x).float().square().mean().backward()
        o.step()

    compiled = torch.compile(train_step)
    for _ in range(10):
        compiled(model, opt)
        train_step(twin, opt_twin)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["compensation"], opt_twin.state[b]["compensation"])
