"""Accumulation into the optimizer states (``release_gradients(..., accumulate="states")``, optimi's
``optimizer_accumulation``) and the states-only step it is made of
(``step_params(..., update_weights=False)``).

- A states-only step writes the states a whole step writes, bit for bit, for every optimizer of
  the registry, every write-back mode and the 8-bit codes, against the fused native kernel; it
  leaves the weights, their write-back buffers and the diagnostics alone.
- Release with ``accumulate="states"`` equals the loop that takes those states-only steps by hand
  bit for bit, and no gradient outlives its backward pass.
- In fp32 it follows ``optimi.AdamW`` with ``gradient_release`` and ``optimizer_accumulation`` to
  float rounding, and differs from exact gradient accumulation (the approximation is real).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import lowp.optim as lo
from lowp.optim.registry import optimizers
from lowp.optim.writeback import MODES
from tests.test_optim_release import Net, loss_of, make

NATIVE = lo.backends.native_available()
SHAPES = [(37, 11), (300,), (4, 3, 5)]


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).bfloat16()) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], t: int) -> None:
    gen = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _codes(cls: type) -> dict[str, torch.dtype]:
    """8-bit block codes for every state of ``cls`` (uint8 for the nonnegative ones)."""
    group = cls([torch.zeros(1)], **cls.examples[0]).param_groups[0]
    return {n: torch.uint8 if n in cls.spec.nonnegative else torch.int8 for n in cls.spec.states(group)}


def _cases() -> list[Any]:
    cases = []
    for cls in optimizers():
        for mode in MODES:
            cases.append(pytest.param(cls, mode, {}, id=f"{cls.__name__}-{mode}"))
        if cls.spec is not None and cls.spec.rule is not None:
            cases.append(pytest.param(cls, "exact8", {"codes": True}, id=f"{cls.__name__}-exact8-codes"))
    return cases


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("cls,mode,extra", _cases())
def test_states_only_step_writes_the_states_of_a_whole_step(cls, mode, extra):
    backend = "native" if NATIVE else "foreach"
    extra = {"state_dtype": _codes(cls), "coded_min_numel": 0} if extra.get("codes") else {}
    params = _params()
    whole = cls(params, **cls.examples[0], mode=mode, backend=backend, seed=11, **extra)
    for t in range(2):   # whole steps first: write-back buffers and states that are not zero
        _set_grads(params, t)
        whole.step()
    folded_params = [torch.nn.Parameter(_bits(p)) for p in params]
    folded = cls(folded_params, **cls.examples[0], mode=mode, backend=backend, seed=11, **extra)
    folded.load_state_dict(copy.deepcopy(whole.state_dict()))
    _set_grads(params, 2)
    _set_grads(folded_params, 2)
    before = [{k: _bits(v) for k, v in folded.state[p].items() if isinstance(v, torch.Tensor)}
              for p in folded_params]
    weights = [_bits(p) for p in folded_params]
    stats = folded.diagnostics()
    whole.step()
    assert folded.step_params(folded_params, update_weights=False)
    buffer = MODES[mode].buffer_name
    for i, (p, q) in enumerate(zip(params, folded_params)):
        assert _same_bits(q.detach(), weights[i]), f"weight {i} changed"
        if buffer:
            assert _same_bits(folded.state[q][buffer], before[i][buffer]), f"{buffer} of {i} changed"
        assert folded.state[q]["step"] == whole.state[p]["step"] == 3
        for entry, value in whole.state[p].items():
            if isinstance(value, torch.Tensor) and entry != buffer:
                assert _same_bits(folded.state[q][entry], value), (i, entry)
    assert folded.diagnostics() == stats   # the last whole step is still what diagnostics report


def test_states_only_step_changes_the_states():
    """Guard against a vacuous comparison above: the moments do move."""
    params = _params()
    opt = lo.AdamW(params, lr=1e-2, seed=1)
    _set_grads(params, 0)
    opt.step_params(params, update_weights=False)
    assert all(opt.state[p]["exp_avg"].abs().sum() > 0 for p in params)
    assert all(opt.state[p]["step"] == 1 for p in params)


def test_update_weights_must_be_a_bool():
    params = _params()
    opt = lo.AdamW(params)
    _set_grads(params, 0)
    with pytest.raises(ValueError, match="update_weights: expected True or False"):
        opt.step_params(params, update_weights=1)
    assert not opt.state


def _hand_loop(net: Net, opt: lo.AdamW, cycles: int, k: int) -> None:
    """What ``accumulate="states"`` does, by hand: a states-only step per micro-batch, a whole
    step on the last one of each cycle."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for c in range(cycles):
        for j in range(k):
            loss_of(net, c * k + j).backward()
            if j < k - 1:
                opt.step_params(params, update_weights=False)
            else:
                opt.step()
            opt.zero_grad()


def _release_loop(net: Net, opt: lo.AdamW, cycles: int, k: int, accumulate: str,
                  live: list[int] | None = None) -> None:
    handle = lo.release_gradients(opt, accumulation_steps=k, accumulate=accumulate)
    for c in range(cycles):
        for j in range(k):
            loss_of(net, c * k + j).backward()
            if live is not None:
                live.append(sum(p.grad is not None for p in net.parameters()))
            if j == k - 1:
                opt.step()
                opt.zero_grad()
    handle.remove()


@pytest.mark.parametrize("backend", ["native", "foreach"] if NATIVE else ["foreach"])
@pytest.mark.parametrize("mode", ["kahan", "exact8", "stochastic"])
def test_release_with_states_accumulation_equals_the_hand_loop(mode, backend):
    net_a, opt_a = make(backend, mode)
    net_b, opt_b = make(backend, mode)
    live: list[int] = []
    _release_loop(net_a, opt_a, cycles=3, k=3, accumulate="states", live=live)
    _hand_loop(net_b, opt_b, cycles=3, k=3)
    assert live == [0] * 9   # no gradient outlives its backward pass
    for (name, p), q in zip(net_a.named_parameters(), net_b.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt_a.state[p].items():
            other = opt_b.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (name, key)
    assert opt_a.state[net_a.a]["step"] == 9   # every micro-batch is a step of the moments


def test_gradients_accumulation_still_holds_the_gradients():
    net, opt = make()
    live: list[int] = []
    _release_loop(net, opt, cycles=2, k=3, accumulate="gradients", live=live)
    assert live[0] >= 4 and live[2] == 0   # held through the cycle, freed by the stepping pass
    assert opt.state[net.a]["step"] == 2


def _peak_gradient_bytes(accumulate: str) -> int:
    net, opt = make()
    seen: list[int] = []

    def probe(_: torch.Tensor) -> None:
        seen.append(sum(q.grad.nbytes for q in net.parameters() if q.grad is not None))

    probes = [p.register_post_accumulate_grad_hook(probe) for p in net.parameters()]
    _release_loop(net, opt, cycles=1, k=3, accumulate=accumulate)
    for h in probes:
        h.remove()
    return max(seen)


def test_peak_gradient_memory_is_one_parameter():
    """Gradient bytes alive at each post-accumulate-grad hook (this probe's hooks run before the
    release's): with accumulate="states" the largest is one parameter's gradient, with
    "gradients" the whole model's by the last micro-batch."""
    peaks = {accumulate: _peak_gradient_bytes(accumulate) for accumulate in ("states", "gradients")}
    sizes = [p.numel() * p.element_size() for p in Net().parameters()]
    assert peaks["states"] == max(sizes)
    assert peaks["gradients"] == sum(sizes)


def test_accumulate_is_checked():
    net, opt = make()
    with pytest.raises(ValueError, match="accumulate: expected 'gradients'"):
        lo.release_gradients(opt, accumulation_steps=2, accumulate="moments")
    with pytest.raises(ValueError, match="max_norm: with accumulate='states'"):
        lo.release_gradients(opt, accumulation_steps=2, accumulate="states", max_norm=1.0)
    assert opt._released_by is None
    lo.release_gradients(opt, accumulation_steps=1, accumulate="states", max_norm=1.0).remove()


def test_states_accumulation_with_a_grad_scaler_reports_overflow_at_the_cycle_end():
    """Each micro-batch is unscaled with the scaler's scale (a power of two: the hand loop on
    unscaled losses gives the same bits); an overflow in the first micro-batch of a cycle skips
    that parameter's states-only step and reaches ``scaler.update()`` at the cycle's end."""
    net, opt = make(nonfinite="skip_param")
    reference_net, reference = make(nonfinite="skip_param")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    handle = lo.release_gradients(opt, accumulation_steps=2, scaler=scaler, accumulate="states")
    for c in range(2):
        for j in range(2):
            loss = loss_of(net, 2 * c + j)
            if c == 1 and j == 0:
                loss = loss * float("inf")   # an overflow in the first micro-batch of cycle 1
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if c == 0:
            assert scaler.get_scale() == 2.0 ** 10 and opt.skipped_params == 0
            _hand_loop(reference_net, reference, cycles=1, k=2)
            assert all(torch.equal(p, q) for p, q in zip(net.parameters(), reference_net.parameters()))
    handle.remove()
    assert scaler.get_scale() == 2.0 ** 9   # backed off once, for cycle 1's overflow
    assert opt.skipped_params > 0
    assert all(torch.isfinite(p.float()).all() for p in net.parameters())


def _optimi_run(k: int, cycles: int) -> list[torch.Tensor]:
    optimi = pytest.importorskip("optimi")
    net = Net().float()
    opt = optimi.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                       gradient_release=True, foreach=False, triton=False)
    optimi.prepare_for_gradient_release(net, opt)
    for c in range(cycles):
        for j in range(k):
            opt.optimizer_accumulation = j < k - 1
            x, y, side = _float_batch(c * k + j)
            ((net(x, side) - y) ** 2).mean().backward()
    optimi.remove_gradient_release(net)
    return [p.detach().clone() for p in net.parameters()]


def _float_batch(t: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    from tests.test_optim_release import batch
    x, y, side = batch(t)
    return x.float(), y, side


def _lowp_run(k: int, cycles: int, accumulate: str) -> list[torch.Tensor]:
    net = Net().float()
    opt = lo.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, backend="foreach", seed=1)
    handle = lo.release_gradients(opt, accumulation_steps=k, accumulate=accumulate)
    for c in range(cycles):
        for j in range(k):
            x, y, side = _float_batch(c * k + j)
            ((net(x, side) - y) ** 2).mean().backward()
        opt.step()
    handle.remove()
    return [p.detach().clone() for p in net.parameters()]


def test_fp32_states_accumulation_follows_optimi():
    """optimi's AdamW with optimizer_accumulation is the anchor: lowp's fp32 run stays within
    float rounding of it (optimi debiases its betas instead of the moments, another order of
    the same arithmetic), while exact gradient accumulation lands far from both."""
    ours = _lowp_run(3, 4, "states")
    theirs = _optimi_run(3, 4)
    exact = _lowp_run(3, 4, "gradients")
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    gap = max(float((a - c).abs().max()) for a, c in zip(ours, exact))
    close = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    assert gap > 1e-3 and close < gap / 100
