"""Generic tests generated from the optimizer entries of the registry (lowp/optim/registry.py), as
torch's ``test_optim.py`` is from ``optim_db``: every optimizer, with nothing listed here.

- each error input raises its error type and message at construction, the parameters untouched;
  one whose keywords are hyper-parameters of a group raises at the step too when a group is given
  them after construction (as a scheduler would), every weight, state and counter unchanged;
- each example runs a few steps in every write-back mode (:data:`lowp.optim.writeback.MODES`),
  with its states in 16 bits and as block-scaled 8-bit codes, and resumes bit for bit both from
  its ``state_dict`` (loaded into a fresh optimizer built with another seed) and as a deep copy;
- an entry's known skips (:class:`lowp.optim.registry.Skip`) turn a case into a strict expected
  failure: the case must fail as the skip says.

:func:`test_a_new_optimizer_module_is_picked_up_by_every_generic_test` defines an optimizer in a
new module of ``lowp.optim`` and runs every case the generators make for it.
"""
from __future__ import annotations

import copy
import sys
import types
from typing import Any, Callable

import pytest
import torch

from lowp.optim.base import LowpOptimizer
from lowp.optim.codes import code_for, scale_name
from lowp.optim.registry import Entry, Example, Skip, entries, entry, optimizers
from lowp.optim.writeback import MODES
from fused_helpers import assert_same_run
from nested_equal import assert_nested_equal
from optim_helpers import same_snapshot, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

#: a matrix (factored by Adafactor) and a vector
SHAPES = [(6, 5), (7,)]


def make_params(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in SHAPES]


def set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def group_keys(e: Entry) -> set[str]:
    """The hyper-parameters a group of ``e``'s optimizer holds."""
    return set(e.cls(make_params(), seed=0).param_groups[0]) - {"params"}


def state_names(e: Entry, example: dict[str, Any]) -> list[str]:
    """The states ``example`` keeps for the parameters of :func:`make_params`."""
    params = make_params()
    opt = e.cls(params, seed=0, **example)
    group = opt.param_groups[0]
    return list(dict.fromkeys(n for p in params for n in opt.state_names(group, p)))


def codes(e: Entry, example: dict[str, Any]) -> dict[str, torch.dtype]:
    """Block-scaled 8-bit codes for every state of ``example``: uint8 (square roots) for those the
    spec declares nonnegative, int8 for the others."""
    nonnegative = e.cls.spec.nonnegative if e.cls.spec is not None else ()
    return {n: torch.uint8 if n in nonnegative else torch.int8 for n in state_names(e, example)}


# ---- the cases each generic test is generated with ------------------------------------------------
def _case(test: str, e: Entry, *values: Any, id: str) -> Any:
    """One case of generic test ``test``: a strict expected failure when ``e`` lists it as a skip."""
    skip = e.skip(test)
    marks = [pytest.mark.xfail(raises=skip.raises, reason=skip.reason, strict=True)] if skip else []
    return pytest.param(e, *values, id=f"{e.name}-{id}", marks=marks)


def error_cases(es: tuple[Entry, ...]) -> list[Any]:
    return [_case("test_error_inputs_raise_before_anything_changes", e, err, id=err.desc)
            for e in es for err in e.error_inputs]


def step_error_cases(es: tuple[Entry, ...]) -> list[Any]:
    return [_case("test_error_inputs_set_on_a_group_raise_at_the_step", e, err, id=err.desc)
            for e in es for keys in [group_keys(e)] for err in e.error_inputs if set(err.kwargs) <= keys]


def example_cases(es: tuple[Entry, ...]) -> list[Any]:
    return [_case("test_examples_resume_and_copy_bit_for_bit", e, example, mode, id=f"{example.desc}-{mode}")
            for e in es for example in e.examples for mode in MODES]


def codes_cases(es: tuple[Entry, ...]) -> list[Any]:
    return [_case("test_examples_with_block_scaled_codes", e, example, mode, id=f"{example.desc}-{mode}")
            for e in es for example in e.examples if state_names(e, example) for mode in MODES]


ENTRIES = entries()


# ---- the generic tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("e, err", error_cases(ENTRIES))
def test_error_inputs_raise_before_anything_changes(e, err):
    params = make_params(err.dtype)
    before = [p.clone() for p in params]
    with pytest.raises(err.error_type, match=err.match) as info:
        e.cls(params, **err.kwargs)
    assert info.type is err.error_type
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(params, before))


@pytest.mark.parametrize("e, err", step_error_cases(ENTRIES))
def test_error_inputs_set_on_a_group_raise_at_the_step(e, err):
    params = make_params(err.dtype)
    opt = e.cls(params, seed=1)
    set_grads(params, 0)
    opt.step()
    set_grads(params, 1)
    opt.param_groups[0].update(err.kwargs)
    before = snapshot(opt, params)
    with pytest.raises(err.error_type, match=err.match) as info:
        opt.step()
    assert info.type is err.error_type
    assert same_snapshot(snapshot(opt, params), before)


def _resume_and_copy(cls: type, example: dict[str, Any], mode: str) -> tuple[list[torch.Tensor], Any]:
    """Three steps of ``cls(**example)`` in ``mode``; the third is taken again by a fresh optimizer
    (another seed) that loaded the ``state_dict`` saved after two, and by a deep copy made then:
    all three must agree bit for bit. Returns the first run's parameters and optimizer."""
    params = make_params()
    start = [p.clone() for p in params]
    opt = cls(params, mode=mode, seed=1, **example)
    for t in range(2):
        set_grads(params, t)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    copied = copy.deepcopy((params, opt))
    resumed_params = [p.clone() for p in params]
    resumed = cls(resumed_params, mode=mode, seed=2, **example)
    resumed.load_state_dict(saved)
    for ps, o in ((params, opt), (resumed_params, resumed), copied):
        set_grads(ps, 2)
        o.step()
    for other in ((resumed_params, resumed), copied):
        assert_same_run((params, opt), other)
        assert_nested_equal(opt.state_dict(), other[1].state_dict())
    assert all(not torch.equal(p, q) for p, q in zip(params, start)), "the steps left a weight unchanged"
    return params, opt


@pytest.mark.parametrize("e, example, mode", example_cases(ENTRIES))
def test_examples_resume_and_copy_bit_for_bit(e, example, mode):
    _resume_and_copy(e.cls, example, mode)


@pytest.mark.parametrize("e, example, mode", codes_cases(ENTRIES))
def test_examples_with_block_scaled_codes(e, example, mode):
    """The states held as 8-bit codes with their block scales (32 elements a block)."""
    states = codes(e, example)
    params, opt = _resume_and_copy(e.cls, dict(example, state_dtype=states, state_block=32, coded_min_numel=0), mode)
    for name, dtype in states.items():
        code = code_for(dtype)
        assert code is not None
        held = [opt.state[p] for p in params if name in opt.state[p]]
        assert held and all(s[name].dtype == code.storage and scale_name(name) in s for s in held), name


GENERIC: dict[str, tuple[Callable[..., None], Callable[[tuple[Entry, ...]], list[Any]]]] = {
    f.__name__: (f, cases) for f, cases in [
        (test_error_inputs_raise_before_anything_changes, error_cases),
        (test_error_inputs_set_on_a_group_raise_at_the_step, step_error_cases),
        (test_examples_resume_and_copy_bit_for_bit, example_cases),
        (test_examples_with_block_scaled_codes, codes_cases)]}


# ---- the registry itself ---------------------------------------------------------------------------
def test_every_optimizer_has_an_entry_every_generic_test_runs():
    assert [e.cls for e in ENTRIES] == list(optimizers())
    assert {"SGD", "Adam", "AdamW", "Lion", "RAdam", "StableAdamW", "Adafactor", "Adan"} <= {e.name for e in ENTRIES}
    for name, (_, cases) in GENERIC.items():
        assert {case.values[0].name for case in cases(ENTRIES)} == {e.name for e in ENTRIES}, name


@pytest.mark.parametrize("e", ENTRIES, ids=lambda e: e.name)
def test_entries_are_described_and_their_skips_name_generic_tests(e):
    assert e.examples and all(x.desc for x in e.examples) and all(x.desc for x in e.error_inputs)
    assert [dict(x) for x in e.examples] == [dict(x) for x in e.cls.examples]   # the class's keyword sets
    assert len({x.desc for x in e.examples}) == len(e.examples)
    assert len({x.desc for x in e.error_inputs}) == len(e.error_inputs)
    assert all(skip.test in GENERIC and skip.reason for skip in e.skips)


def run_case(test: str, case: Any) -> None:
    """Run one generated case of generic test ``test`` as pytest would, its expected failure included."""
    fn = GENERIC[test][0]
    xfail = [m for m in case.marks if m.name == "xfail"]
    if xfail:
        with pytest.raises(xfail[0].kwargs["raises"]):
            fn(*case.values)
    else:
        fn(*case.values)


def _probe_module() -> types.ModuleType:
    """``lowp.optim._probe``: a new optimizer as its own module would add it (signSGD with momentum,
    ``m = lerp(m, g, 0.1)``, ``u = -lr sign(m)``; no spec: the reference update only)."""
    module = types.ModuleType("lowp.optim._probe")

    class SignMomentum(LowpOptimizer):
        """signSGD with momentum (a test optimizer).

        Args:
            params: the parameters.
            lr: learning rate.
            **options: the common options.
        """

        examples = (Example("default lr"), Example("large lr, maximizing", lr=0.05, maximize=True))
        skips = (Skip("test_examples_with_block_scaled_codes", "no spec: its states are not declared elementwise",
                      ValueError),)

        def __init__(self, params, lr: float = 1e-2, **options: Any) -> None:
            super().__init__(params, dict(lr=lr), **options)

        def state_names(self, group, param):
            return ("momentum",)

        def update(self, group, weights, grads, states, step):
            torch._foreach_lerp_(states["momentum"], grads, 0.1)
            return list(torch._foreach_mul([m.sign() for m in states["momentum"]], -float(group["lr"])))

    SignMomentum.__module__ = module.__name__
    module.SignMomentum = SignMomentum     # type: ignore[attr-defined]
    module.__all__ = ["SignMomentum"]      # type: ignore[attr-defined]
    return module


def test_a_new_optimizer_module_is_picked_up_by_every_generic_test(monkeypatch):
    module = _probe_module()
    cls = module.SignMomentum
    assert cls not in optimizers()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert cls in optimizers() and cls in [e.cls for e in entries()]
    probe = (entry(cls),)
    assert [x.desc for x in probe[0].error_inputs][:3] == ["negative lr", "nan lr", "bool lr"]
    for test, (_, cases) in GENERIC.items():
        generated = cases(probe)
        assert generated and all(case.id.startswith("SignMomentum-") for case in generated), test
        for case in generated:
            run_case(test, case)
    monkeypatch.delitem(sys.modules, module.__name__)
    assert cls not in optimizers()
