"""Gradient release (lowp.optim.release): stepping each parameter in its post-accumulate-grad
hook equals the same training with ``optimizer.step()`` bit for bit (weights, states, stochastic
rounding streams, diagnostics), with accumulation, GradScaler and checkpoints; and the switch
refuses what it cannot honour before anything changes."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import lowp.optim as lo
from lowp.optim.base import LowpOptimizer
from lowp.optim.codes import code_for
from tests.nested_equal import assert_nested_equal

NATIVE = lo.backends.native_available()


class Net(torch.nn.Module):
    """A small bf16 MLP with a side branch that only some micro-batches use (its gradient is
    then left for the end-of-backward step)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter((torch.randn(16, 8, generator=gen) * 0.3).bfloat16())
        self.b = torch.nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))
        self.c = torch.nn.Parameter((torch.randn(4, 16, generator=gen) * 0.3).bfloat16())
        self.side = torch.nn.Parameter((torch.randn(4, 8, generator=gen) * 0.3).bfloat16())
        self.norm = torch.nn.Parameter(torch.ones(4))   # fp32: updated plainly in every mode

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.tanh(x @ self.a.t() + self.b) @ self.c.t()
        if side:
            h = h + x @ self.side.t()
        return h.float() * self.norm


def make(backend: str = "foreach", mode: str = "kahan", **kw: Any) -> tuple[Net, LowpOptimizer]:
    net = Net()
    groups = [{"params": [net.a, net.b]}, {"params": [net.c, net.side, net.norm], "lr": 3e-3}]
    return net, lo.AdamW(groups, lr=1e-2, weight_decay=0.1, mode=mode, backend=backend, seed=5, **kw)


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(1000 + t)
    return torch.randn(6, 8, generator=gen).bfloat16(), torch.randn(6, 4, generator=gen), t % 2 == 0


def loss_of(net: Net, t: int, scale: float = 1.0) -> torch.Tensor:
    x, y, side = batch(t)
    return ((net(x, side) - y) ** 2).mean() * scale


def train(net: Net, opt: LowpOptimizer, steps: int, k: int = 1, start: int = 0) -> None:
    """``steps`` optimizer steps of ``k`` micro-batches each, the usual loop (with release active,
    ``opt.step()`` and ``opt.zero_grad()`` are what it documents them to be)."""
    for s in range(start, start + steps):
        for m in range(k):
            loss_of(net, s * k + m).backward()
        opt.step()
        opt.zero_grad()


def assert_same(a: tuple[Net, LowpOptimizer], b: tuple[Net, LowpOptimizer]) -> None:
    assert_nested_equal(a[0].state_dict(), b[0].state_dict(), "model")
    assert_nested_equal(a[1].state_dict(), b[1].state_dict(), "optimizer")
    assert a[1].diagnostics() == b[1].diagnostics()


#: every mode on the foreach and the fused native backend, and the eager one once
CASES = [(mode, backend) for mode in ("kahan", "stochastic", "exact", "nearest")
         for backend in ("foreach", *(["native"] if NATIVE else []))] + [("kahan", "eager")]


@pytest.mark.parametrize("mode,backend", CASES)
def test_release_equals_step_bit_for_bit(backend, mode):
    plain = make(backend, mode)
    train(*plain, steps=4)
    released = make(backend, mode)
    with lo.release_gradients(released[1]) as handle:
        assert handle.active
        train(*released, steps=4)
    assert not handle.active and handle.backward_passes == 4
    assert_same(plain, released)
    steps = {name: released[1].state[p]["step"] for name, p in released[0].named_parameters()}
    assert steps == {"a": 4, "b": 4, "c": 4, "side": 2, "norm": 4}   # side: used every other step


def test_gradients_are_freed_during_backward():
    """Each gradient is gone right after its hook: never do all of them exist at once."""
    net, opt = make()
    live, most = set(), 0

    def count(p: torch.Tensor) -> None:   # registered first: runs before the release hook
        nonlocal most
        live.add(p)
        most = max(most, sum(q.grad is not None for q in net.parameters()))

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(count)
    with lo.release_gradients(opt):
        loss_of(net, 0).backward()
    assert len(live) == 5 and most == 1
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_accumulation_equals_micro_batches_and_one_step(mode):
    """k = 3 micro-batches; ``side`` is unused in the third, so it is stepped at the end of the
    backward pass; and a plain loop with a step every 3 backward passes matches."""
    plain = make(mode=mode)
    train(*plain, steps=3, k=3)
    released = make(mode=mode)
    handle = lo.release_gradients(released[1], accumulation_steps=3)
    for s in range(3):
        for m in range(3):
            loss_of(released[0], 3 * s + m).backward()
            stepped = m == 2
            assert all((p.grad is None) == stepped for p in released[0].parameters() if p is not released[0].side)
    handle.remove()
    assert_same(plain, released)


@pytest.mark.parametrize("backend", ["foreach", *(["native"] if NATIVE else [])])
@pytest.mark.parametrize("states", [{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                                    {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint4}],  # type: ignore[attr-defined]
                         ids=["int8-uint8", "e4m3-uint4"])
def test_release_with_block_scaled_states_and_one_byte_remainders(backend, states):
    """The memory configurations: each parameter's codes, scales and one-byte remainder are
    stepped in its hook, over 2 micro-batches, as one step would."""
    plain = make(backend, "exact8", state_dtype=states, coded_min_numel=0)
    train(*plain, steps=3, k=2)
    released = make(backend, "exact8", state_dtype=states, coded_min_numel=0)
    with lo.release_gradients(released[1], accumulation_steps=2):
        train(*released, steps=3, k=2)
    assert_same(plain, released)
    state = released[1].state[released[0].a]
    assert state["exp_avg"].dtype == code_for(states["exp_avg"]).storage and "exp_avg_scale" in state
    assert state["remainder8"].dtype == torch.int8 and state["remainder8"].count_nonzero() > 0


def test_checkpoint_round_trip_resumes_bit_identically():
    whole = make(mode="stochastic")
    with lo.release_gradients(whole[1]):
        train(*whole, steps=4)
    first = make(mode="stochastic")
    with lo.release_gradients(first[1]):
        train(*first, steps=2)
    saved = copy.deepcopy({"model": first[0].state_dict(), "optim": first[1].state_dict()})
    resumed = make(mode="stochastic")
    resumed[0].load_state_dict(saved["model"])
    resumed[1].load_state_dict(saved["optim"])
    with lo.release_gradients(resumed[1]):
        train(*resumed, steps=2, start=2)
    assert_same(whole, resumed)


def test_step_and_zero_grad_while_released_do_not_step_again():
    net, opt = make()
    handle = lo.release_gradients(opt)
    loss_of(net, 0).backward()
    before = copy.deepcopy(opt.state_dict())
    assert opt.step(lambda: torch.tensor(2.0)) == 2.0   # runs the closure only
    opt.step()
    opt.zero_grad()
    assert_nested_equal(before, opt.state_dict())
    closure_steps = make()
    with lo.release_gradients(closure_steps[1]):   # the closure's backward pass steps
        closure_steps[1].step(lambda: loss_of(closure_steps[0], 0).backward())
    handle.remove()
    assert_nested_equal(before, closure_steps[1].state_dict())


def test_remove_restores_step_mid_accumulation():
    """Hooks removed with two micro-batches accumulated: step() steps them as usual."""
    plain = make()
    train(*plain, steps=2, k=2)
    released = make()
    handle = lo.release_gradients(released[1], accumulation_steps=2)
    train(*released, steps=1, k=2)
    loss_of(released[0], 2).backward()
    handle.remove()
    handle.remove()
    loss_of(released[0], 3).backward()
    released[1].step()
    released[1].zero_grad()
    assert_same(plain, released)


def _scaled_run(release: bool, steps: int, poison: int | None) -> tuple[Net, LowpOptimizer, torch.amp.GradScaler]:
    """The usual GradScaler loop; at step ``poison`` the gradient of ``c`` becomes infinite."""
    net, opt = make(mode="stochastic")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    handle = lo.release_gradients(opt, scaler=scaler) if release else None
    for t in range(steps):
        hook = net.c.register_hook(lambda g: g * float("inf")) if t == poison else None
        scaler.scale(loss_of(net, t)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if hook is not None:
            hook.remove()
    if handle is not None:
        handle.remove()
    return net, opt, scaler


def test_gradscaler_matches_and_scale_follows():
    plain, released = _scaled_run(False, 5, None), _scaled_run(True, 5, None)
    assert_same(plain[:2], released[:2])
    assert released[2].get_scale() == plain[2].get_scale() == 2.0 ** 12   # grew twice


def test_gradscaler_unscale_after_a_released_pass_raises():
    """The pass has unscaled already: torch's clipping recipe cannot unscale a second time."""
    net, opt = make()
    scaler = torch.amp.GradScaler("cpu")
    with lo.release_gradients(opt, scaler=scaler):
        scaler.scale(loss_of(net, 0)).backward()
        with pytest.raises(RuntimeError, match="unscale_"):
            scaler.unscale_(opt)


def test_gradscaler_overflow_skips_that_parameter_and_backs_off():
    """Without release the whole step is skipped; with it only the overflowed parameter (the
    others were stepped before the overflow showed), and the scaler backs off alike."""
    clean = _scaled_run(True, 1, None)
    plain, released = _scaled_run(False, 2, 1), _scaled_run(True, 2, 1)
    assert released[2].get_scale() == plain[2].get_scale() == 2.0 ** 9
    assert plain[1].skipped_steps == 1 and released[1].skipped_params == 1
    assert torch.equal(released[0].c, clean[0].c)   # one step, from step 0 only
    assert released[1].state[released[0].c]["step"] == 1
    assert not torch.equal(released[0].a, clean[0].a) and released[1].state[released[0].a]["step"] == 2
    assert_nested_equal(plain[0].state_dict(), clean[0].state_dict())   # plain: step 1 skipped whole


def test_step_params_over_every_parameter_equals_step():
    plain = make(mode="stochastic")
    parts = make(mode="stochastic")
    for t in range(2):
        for net, _ in (plain, parts):
            loss_of(net, t).backward()
        plain[1].step()
        p = list(parts[0].parameters())
        assert parts[1].step_params(p[3:]) and parts[1].step_params(p[:3], new_step=False)
        for o in (plain[1], parts[1]):
            o.zero_grad()
    assert_same(plain, parts)


def test_refusals_change_nothing():
    net, opt = make()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    cases = [((sgd,), {}, TypeError, "optimizer"),
             ((opt,), {"accumulation_steps": 0}, ValueError, "accumulation_steps"),
             ((opt,), {"accumulation_steps": True}, ValueError, "accumulation_steps"),
             ((opt,), {"scaler": object()}, TypeError, "scaler"),
             ((opt,), {"local_gradients": 1}, TypeError, "local_gradients"),
             ((make(nonfinite="skip_step")[1],), {}, ValueError, "nonfinite")]
    for args, kw, error, name in cases:
        with pytest.raises(error, match=f"^{name}: "):
            lo.release_gradients(*args, **kw)
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    with lo.release_gradients(opt):
        with pytest.raises(RuntimeError, match="^optimizer: "):
            lo.release_gradients(opt)
    loss_of(net, 0).backward()
    before = copy.deepcopy(opt.state_dict())
    for args, kw, error, name in [(([torch.zeros(2)],), {}, ValueError, r"params\[0\]"),
                                  (([net.a, net.a],), {}, ValueError, "params"),
                                  (([1.0],), {}, TypeError, r"params\[0\]"),
                                  (([net.a],), {"grad_scale": 0.0}, ValueError, "grad_scale"),
                                  (([net.a],), {"new_step": 1}, ValueError, "new_step")]:
        with pytest.raises(error, match=f"^{name}: "):
            opt.step_params(*args, **kw)
    assert_nested_equal(before, opt.state_dict())



def _data_parallel_ranks(rank: int, world_size: int, store_file: str) -> dict[str, Any]:
    """On each rank of a real gloo group: release refused for a DDP model (nothing registered);
    allowed with ``local_gradients=True`` (equal to the plain step); and a group initialized
    after the hooks were registered stops the first backward pass before any step."""
    import torch.distributed as dist
    out: dict[str, Any] = {}
    net, opt = make()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    try:
        lo.release_gradients(opt)
    except ValueError as exc:
        out["refused"] = str(exc)
    out["nothing_registered"] = opt._released_by is None and not any(
        p._post_accumulate_grad_hooks for p in ddp.parameters())
    try:   # the norm would be this rank's only
        lo.release_gradients(make()[1], local_gradients=True, max_norm=1.0)
    except ValueError as exc:
        out["max_norm"] = str(exc)
    plain, local = make(), make()
    train(*plain, steps=2)
    with lo.release_gradients(local[1], local_gradients=True):
        train(*local, steps=2)
    assert_same(plain, local)
    out["local_equal"] = True
    dist.destroy_process_group()
    late = make()
    handle = lo.release_gradients(late[1])   # no group yet: accepted
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world_size), rank=rank, world_size=world_size)
    before = copy.deepcopy(late[0].state_dict())
    try:
        loss_of(late[0], 0).backward()
    except ValueError as exc:
        out["late"] = str(exc)
    out["late_unchanged"] = not late[1].state and all(
        torch.equal(v, before[k]) for k, v in late[0].state_dict().items())
    handle.remove()
    return out


def test_data_parallel_gradients_are_refused_before_anything_steps(tmp_path):
    """DDP averages gradients after the hooks would step: without the refusal each rank would
    step with its own gradient and the replicas would drift apart silently."""
    from lowp.distributed.launch import run_local_group
    results = run_local_group(_data_parallel_ranks, 2, str(tmp_path / "store"), timeout_s=30)
    for rank, out in enumerate(results):
        assert out["refused"].startswith(f"local_gradients: this process is rank {rank} of 2")
        assert "DistributedDataParallel" in out["refused"] and out["nothing_registered"]
        assert out["max_norm"].startswith(f"max_norm: this process is rank {rank} of 2")
        assert out["local_equal"]
        assert out["late"].startswith(f"local_gradients: this process is rank {rank} of 2")
        assert out["late_unchanged"]


class Checkpointed(Net):
    """``Net`` with one layer under activation checkpointing: the first (its pass runs after
    the outer pass has reached ``c`` and ``norm``) or the last (its pass runs first; ``norm`` is
    not used then)."""

    def __init__(self, reentrant: bool, last: bool = False) -> None:
        super().__init__()
        self.reentrant, self.last = reentrant, last

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        def first(v: torch.Tensor) -> torch.Tensor:
            return torch.tanh(v @ self.a.t() + self.b)

        def last(v: torch.Tensor) -> torch.Tensor:
            return (v @ self.c.t()).float()

        layer = last if self.last else first
        h = first(x) if self.last else x.requires_grad_()   # a reentrant checkpoint needs an input needing grad
        h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant)
        return h if self.last else last(h) * self.norm


@pytest.mark.parametrize("last", [False, True])
def test_activation_checkpointing_without_reentrant_passes_matches(last):
    runs = []
    for release in (False, True):
        net = Checkpointed(reentrant=False, last=last)
        opt = lo.AdamW(net.parameters(), lr=1e-2, mode="stochastic", seed=5)
        handle = lo.release_gradients(opt, accumulation_steps=2) if release else None
        train(net, opt, steps=2, k=2)
        runs.append((net, opt))
        if handle is not None:
            handle.remove()
    assert_same(*runs)


@pytest.mark.parametrize("last", [False, True])
def test_reentrant_backward_passes_are_refused(last):
    """Whether the nested pass's hooks fire after the outer pass's (``last=False``) or before
    them, a hook that sees a backward pass inside another raises, naming the way out."""
    net = Checkpointed(reentrant=True, last=last)
    opt = lo.AdamW(net.parameters(), lr=1e-2)
    with lo.release_gradients(opt), pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss_of(net, 1).backward()


def test_parameter_added_later_is_stepped_at_the_end_of_the_pass():
    """A group added after the hooks: its parameter (no hook) is stepped by the end-of-backward
    step, as ``step()`` would step it; its position over all groups keys its streams."""
    runs = []
    for release in (False, True):
        net = Net()
        opt = lo.AdamW([net.a, net.b, net.c], lr=1e-2, mode="stochastic", seed=5)
        handle = lo.release_gradients(opt) if release else None
        opt.add_param_group({"params": [net.side, net.norm], "lr": 3e-3})
        train(net, opt, steps=2)
        runs.append((net, opt))
        if handle is not None:
            assert not net.side._post_accumulate_grad_hooks
            handle.remove()
    assert_same(*runs)


def _staged_loss(net: Net, t: int, on_hidden: Any) -> torch.Tensor:
    """``loss_of`` with ``on_hidden`` hooked on the hidden activation: in backward it runs after
    ``c``, ``side`` and ``norm`` have their gradients and before ``a`` and ``b`` do."""
    x, y, side = batch(t)
    hidden = torch.tanh(x @ net.a.t() + net.b)
    hidden.register_hook(on_hidden)
    h = hidden @ net.c.t()
    if side:
        h = h + x @ net.side.t()
    return ((h.float() * net.norm - y) ** 2).mean()


@pytest.mark.parametrize("exc", [ValueError("user hook failed"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_an_exception_inside_backward_leaves_the_next_pass_working(exc):
    """The exception propagates unchanged; the parameters reached before it were stepped, the
    others keep their weights; the failed pass is not counted, and the next pass is not taken
    for one nested inside it (the engine dropped the failed pass's end callback)."""
    net, opt = make()
    a_before = net.a.detach().clone()

    def fail(grad: torch.Tensor) -> None:
        raise exc

    handle = lo.release_gradients(opt)
    with pytest.raises(type(exc)):
        _staged_loss(net, 0, fail).backward()
    assert torch.equal(net.a, a_before) and net.a not in opt.state and net.a.grad is None
    assert opt.state[net.c]["step"] == 1 and handle.backward_passes == 0
    train(net, opt, steps=1, start=1)
    assert handle.backward_passes == 1 and opt.state[net.a]["step"] == 1 and opt.state[net.c]["step"] == 2
    handle.remove()


def test_registration_refuses_what_no_pass_could_step():
    """Before any hook is registered: an optimizer none of whose parameters requires grad (it
    would never step: step() does nothing while released) and parameters on the meta device."""
    net, opt = make()
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="^optimizer: none of its parameters requires grad"):
        lo.release_gradients(opt)
    meta = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(ValueError, match=r"^params\[0\]: on the meta device"):
        lo.release_gradients(lo.AdamW(meta.parameters(), lr=1e-2))
    assert opt._released_by is None and not any(p._post_accumulate_grad_hooks for p in net.parameters())


@pytest.mark.parametrize("prepare, match", [
    (lambda scaler: None, "^scaler: it has not scaled a loss yet"),
    (lambda scaler: (scaler.scale(torch.ones(())), scaler.update(new_scale=0.0)), "^scaler: its scale is 0.0"),
], ids=["never-scaled", "zero-scale"])
def test_a_scaler_without_a_usable_scale_is_refused_before_any_step(prepare, match):
    net, opt = make()
    scaler = torch.amp.GradScaler("cpu")
    prepare(scaler)
    before = copy.deepcopy((net.state_dict(), opt.state_dict()))
    handle = lo.release_gradients(opt, scaler=scaler)
    with pytest.raises(ValueError, match=match):
        loss_of(net, 0).backward()
    assert_nested_equal(before, (net.state_dict(), opt.state_dict()))
    assert handle.backward_passes == 0
    handle.remove()


def test_integer_likes_and_parameters_removed_later():
    """A numpy integer is a count; a parameter removed from the optimizer's groups after the hooks
    were registered keeps its gradient, as step() would leave it."""
    import numpy as np

    plain, released = make(), make()
    handle = lo.release_gradients(released[1], accumulation_steps=np.int64(2))
    assert handle.accumulation_steps == 2 and type(handle.accumulation_steps) is int
    for o in (plain[1], released[1]):
        o.param_groups[0]["params"].pop(0)
    train(*plain, steps=2, k=2)
    train(*released, steps=2, k=2)
    handle.remove()
    assert_same(plain, released)
    assert torch.equal(released[0].a.grad, plain[0].a.grad)


# ---- optimizer.step() must close a cycle of accumulation_steps backward passes -------------------

def test_step_after_more_passes_than_accumulation_steps_raises_naming_the_fix():
    """transformers.Trainer with gradient_accumulation_steps=2 and the default accumulation_steps=1:
    the first step() is the earliest point the mismatch can be known; by then the first cycle has
    been stepped once per micro-batch."""
    net, opt = make()
    handle = lo.release_gradients(opt)
    loss_of(net, 0).backward()
    loss_of(net, 1).backward()
    match = r"^accumulation_steps: optimizer.step\(\) came after 2 backward passes since release_gradients, "
    with pytest.raises(ValueError, match=match + r".*accumulation_steps=1.*2 times in this cycle") as e:
        opt.step()
    assert "release_gradients(opt, accumulation_steps=2)" in str(e.value)
    assert opt.state[net.a]["step"] == 2 and opt.state[net.side]["step"] == 1   # side: used in pass 0 only
    handle.remove()


def test_step_after_fewer_passes_than_accumulation_steps_raises_before_anything_steps():
    net, opt = make()
    handle = lo.release_gradients(opt, accumulation_steps=2)
    loss_of(net, 0).backward()
    with pytest.raises(ValueError, match=r"^accumulation_steps: optimizer.step\(\) came after 1 backward pass "
                                         r"since release_gradients, .*stepped nothing") as e:
        opt.step()
    assert "release_gradients(opt, accumulation_steps=1)" in str(e.value)
    assert not opt.state and all(p.grad is not None for p in net.parameters())
    handle.remove()


def test_a_short_cycle_after_matching_ones_raises():
    """A last cycle shorter than the others (an epoch whose micro-batches do not fill it) would
    silently shift every later cycle: refused too, after the steps that matched."""
    net, opt = make()
    handle = lo.release_gradients(opt, accumulation_steps=2)
    train(net, opt, steps=2, k=2)
    loss_of(net, 4).backward()
    with pytest.raises(ValueError, match=r"^accumulation_steps: .* after 1 backward pass since the previous step"):
        opt.step()
    assert opt.state[net.a]["step"] == 2
    handle.remove()


def test_steps_matching_the_cycle_or_after_no_pass_are_accepted():
    """A plain loop (step after every pass, with accumulation_steps=1; a closure's backward pass
    counts), a step() after no pass, a loop that never calls step(), and GradScaler skipping
    step() after an overflow: none of them raises."""
    net, opt = make()
    with lo.release_gradients(opt):
        opt.step()                                          # before any pass
        train(net, opt, steps=2)
        opt.step()                                          # a second step() after no pass
        opt.step(lambda: loss_of(net, 2).backward())        # the closure's pass
        for t in range(3, 5):                               # never calling step()
            loss_of(net, t).backward()
    assert opt.state[net.a]["step"] == 5
    net, opt = make()
    with lo.release_gradients(opt, accumulation_steps=2):
        for t in range(4):
            loss_of(net, t).backward()
    assert opt.state[net.a]["step"] == 2
    released = _scaled_run(True, 4, 1)                      # scaler.step skips step() at the overflow
    assert released[1].skipped_params == 1


# ---- max_norm: clipping by the previous stepping pass's global norm -------------------------------

def _clipped_plain(steps: int, k: int, max_norm: float) -> tuple[Net, LowpOptimizer, list[float]]:
    """The reference: the plain loop clipping each step's gradients with torch's own
    clip_grads_with_norm_ and the previous step's total norm (torch's get_total_norm, in fp64)."""
    net, opt = make(mode="stochastic")
    norms: list[float] = []
    for s in range(steps):
        for m in range(k):
            loss_of(net, s * k + m).backward()
        params = [p for p in net.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
        if s:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norms[-2], dtype=torch.float64))
        opt.step()
        opt.zero_grad()
    return net, opt, norms


@pytest.mark.parametrize("k", [1, 2])
def test_max_norm_clips_with_the_previous_pass_norm(k):
    max_norm = 0.4
    *plain, norms = _clipped_plain(5, k, max_norm)
    assert sum(n > max_norm for n in norms[:-1]) >= 3                  # the clip was active
    released = make(mode="stochastic")
    seen = []
    with lo.release_gradients(released[1], accumulation_steps=k, max_norm=max_norm) as handle:
        assert handle.grad_norm is None
        for s in range(5):
            train(*released, steps=1, k=k, start=s)
            seen.append(handle.grad_norm)
    assert seen == pytest.approx(norms, rel=1e-12)
    assert_same(tuple(plain), released)
    unclipped = make(mode="stochastic")
    train(*unclipped, steps=5, k=k)
    assert not torch.equal(unclipped[0].a, released[0].a)


def test_max_norm_inf_measures_without_clipping_and_clip_grad_norm_sees_nothing():
    """torch.nn.utils.clip_grad_norm_ after a released pass finds every gradient freed: it
    returns 0 and clips nothing (what transformers.Trainer logs as grad_norm 0.0)."""
    plain = make()
    released = make()
    with lo.release_gradients(released[1], max_norm=float("inf")) as handle:
        for t in range(3):
            loss_of(plain[0], t).backward()
            expected = float(torch.nn.utils.get_total_norm([p.grad.double() for p in plain[0].parameters()
                                                            if p.grad is not None]))
            plain[1].step()
            plain[1].zero_grad()
            loss_of(released[0], t).backward()
            assert float(torch.nn.utils.clip_grad_norm_(released[0].parameters(), 1e-3)) == 0.0
            assert handle.grad_norm == pytest.approx(expected, rel=1e-12)
            released[1].step()
    assert_same(plain, released)


def test_max_norm_norm_type_and_chunked_norm():
    """norm_type as in clip_grad_norm_ (inf: the largest magnitude); a gradient over one chunk
    is measured chunk by chunk in fp64."""
    from lowp.optim import release
    g = torch.randn(3 * release._NORM_CHUNK + 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    for order in (2.0, 1.0, 3.0, float("inf")):
        expected = torch.linalg.vector_norm(g.double(), order)
        assert float(release._norm(g, order)) == pytest.approx(float(expected), rel=1e-13)
    net, opt = make()
    with lo.release_gradients(opt, max_norm=float("inf"), norm_type=float("inf")) as handle:
        twin = Net()
        loss_of(twin, 0).backward()
        loss_of(net, 0).backward()
    expected = max(float(p.grad.abs().max()) for p in twin.parameters() if p.grad is not None)
    assert handle.norm_type == float("inf") and handle.grad_norm == expected


def test_max_norm_with_gradscaler_is_unscaled_and_an_overflow_keeps_the_coefficient():
    """The norm is that of the unscaled gradients (a twin with the same weights and an unscaled
    loss gives it); an overflowed pass reports ``inf`` and the next pass clips as before it."""
    net, opt = make()
    twin = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    handle = lo.release_gradients(opt, scaler=scaler, max_norm=0.1)
    for t in range(3):
        twin.load_state_dict(net.state_dict())
        loss_of(twin, t).backward()
        expected = float(torch.nn.utils.get_total_norm([p.grad.double() for p in twin.parameters()
                                                        if p.grad is not None]))
        twin.zero_grad()
        coefficient = handle._clip_coef
        poison = net.c.register_hook(lambda g: g * float("inf")) if t == 1 else None
        scaler.scale(loss_of(net, t)).backward()
        scaler.step(opt)
        scaler.update()
        if poison is not None:
            poison.remove()
            assert handle.grad_norm == float("inf") and handle._clip_coef == coefficient
        else:
            assert handle.grad_norm == pytest.approx(expected, rel=1e-9)
            assert handle._clip_coef == pytest.approx(0.1 / (expected + 1e-6), rel=1e-9)
    handle.remove()


def test_grad_norm_assigned_on_resume_continues_bit_for_bit():
    whole = make(mode="stochastic")
    with lo.release_gradients(whole[1], max_norm=0.3):
        train(*whole, steps=4)
    first = make(mode="stochastic")
    with lo.release_gradients(first[1], max_norm=0.3) as handle:
        train(*first, steps=2)
        last = handle.grad_norm
    saved = copy.deepcopy({"model": first[0].state_dict(), "optim": first[1].state_dict()})
    resumed = make(mode="stochastic")
    resumed[0].load_state_dict(saved["model"])
    resumed[1].load_state_dict(saved["optim"])
    with lo.release_gradients(resumed[1], max_norm=0.3) as handle:
        handle.grad_norm = last
        train(*resumed, steps=2, start=2)
    assert_same(whole, resumed)


@pytest.mark.parametrize("kw, match", [
    ({"max_norm": 0.0}, "^max_norm: expected a number > 0"),
    ({"max_norm": -1}, "^max_norm: "),
    ({"max_norm": float("nan")}, "^max_norm: "),
    ({"max_norm": True}, "^max_norm: "),
    ({"max_norm": "1"}, "^max_norm: "),
    ({"max_norm": 1.0, "norm_type": 0}, "^norm_type: expected a number > 0"),
    ({"max_norm": 1.0, "norm_type": "2"}, "^norm_type: "),
])
def test_clip_arguments_are_refused_before_any_hook(kw, match):
    net, opt = make()
    with pytest.raises(ValueError, match=match):
        lo.release_gradients(opt, **kw)
    assert opt._released_by is None and not any(p._post_accumulate_grad_hooks for p in net.parameters())
    assert not opt._optimizer_step_post_hooks
    with lo.release_gradients(opt, max_norm=1.0) as handle:
        for bad in (-1.0, float("inf"), None, "1"):
            with pytest.raises(ValueError, match="^grad_norm: expected a finite number >= 0"):
                handle.grad_norm = bad  # type: ignore[assignment]
    assert not opt._optimizer_step_post_hooks
