"""The journal that keeps parameters whole on the reference pipeline (``lowp.optim.journal``):
what it copies, when it lets go, what it puts back. The step-level behaviour (a fault at every
torch operation of a step) is in ``test_step_atomic.py``."""
from __future__ import annotations

import pytest
import torch

from lowp.optim import journal
from lowp.optim.journal import Journal


def _tensors():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 5, generator=gen).bfloat16().t()   # not contiguous
    state = torch.randn(30, generator=gen)
    other = torch.randn(4, generator=gen).bfloat16()
    return weight, state, other


def test_a_failure_puts_back_every_piece_not_yet_whole():
    """Parameter 0 in two pieces (its second never written), parameter 1 in one: after the first
    batch parameter 1 is stepped and let go; a failure then puts parameter 0's first piece back,
    a strided view included, and leaves parameter 1 as written."""
    weight, state, other = _tensors()
    first = [weight.clone(), state.clone(), other.clone()]
    stepped: set[int] = set()
    j = Journal([0, 0, 1], stepped)
    j.save([(0, [weight, state[:15]]), (1, [other])])
    weight.fill_(7)
    state[:15].fill_(7)
    other.fill_(7)
    j.written([0, 1])
    assert stepped == {1} and set(j.held) == {0}
    j.save([(0, [state[15:]])])
    state[15:].fill_(9)   # the failing batch wrote part of its piece
    j.restore()
    assert torch.equal(weight, first[0]) and torch.equal(state, first[1]) and j.held == {}
    assert torch.equal(other, torch.full_like(other, 7))   # stepped whole before the failure: kept
    assert stepped == {1}


def test_a_parameter_whole_lets_go_of_its_copies():
    weight, state, _ = _tensors()
    stepped: set[int] = set()
    j = Journal([3, 3], stepped)
    j.save([(3, [state[:10]]), (3, [state[10:], weight])])
    j.written([3])
    assert 3 in j.held and not stepped
    j.written([3])
    assert j.held == {} and stepped == {3}


def test_without_a_set_it_copies_nothing(monkeypatch):
    """``stepped=None``: the caller keeps the parameters whole (the decoded states' step under
    the block-scaled one): no copy is made, nothing is recorded or put back."""
    weight, state, _ = _tensors()
    monkeypatch.setattr(journal, "_flat", lambda tensors: pytest.fail("copied"))
    j = Journal([0], None)
    j.save([(0, [weight, state])])
    weight.fill_(1)
    j.written([0])
    j.restore()
    assert j.held == {} and torch.equal(weight, torch.ones_like(weight))


def test_no_room_on_the_host_raises_before_any_write(monkeypatch):
    """On the CPU a copy that cannot be made raises (there is no other memory to go to): the
    caller's batch has not written yet."""
    weight, state, _ = _tensors()

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")
    monkeypatch.setattr(torch, "cat", full)
    j = Journal([0], set())
    with pytest.raises(torch.OutOfMemoryError):
        j.save([(0, [weight, state])])
    assert j.held == {}
