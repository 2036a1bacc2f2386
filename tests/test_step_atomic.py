"""A step or a load happens completely or not at all.

Faults are injected at every stage of ``step()`` (a step pre-hook, the closure, the checks, the
non-finite check, state creation, the gather of a slice, a mode switch's fold) and of
``load_state_dict()`` (the layout translation, the checks, the value checks), on every CPU
backend, with bf16 weights in two groups (two jobs), 16-bit and block-scaled (int8 / uint8)
states; afterwards every weight, state, buffer, counter and hyper-parameter holds the bits it
held before. Every job is prepared (a kernel's library built and loaded, its arguments checked)
before the first job writes, so a fault there changes nothing either. Within the writes
themselves Ctrl-C is held until the step is done, and a fault raised by a job's call leaves each
parameter either stepped (weight, states and counter) or untouched. A non-contiguous
block-scaled state is stepped like a contiguous one.
"""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowp.optim as lo
from lowp.optim import base, preflight, sharding
from lowp.optim.kernels import native_available
from optim_helpers import same_snapshot, snapshot

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["eager", "foreach"] + (["native"] if native_available() else [])
STATES = {"bf16": {}, "int8": {"state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                                    "coded_min_numel": 0}}


pytestmark = pytest.mark.usefixtures("one_thread")


class Injected(RuntimeError):
    """The fault the tests raise."""


def _setup(backend: str, states: str, mode: str = "kahan", optimizer: type = lo.AdamW, chunk_size: int | None = None,
           device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(*shape, generator=gen) * 0.1).bfloat16().to(device))
              for shape in ((8, 64), (64,), (3, 64), (5,))]
    opt = optimizer([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2,
                   weight_decay=0.1, mode=mode, backend=backend, seed=5, chunk_size=chunk_size, **STATES[states])

    def grads(step: int) -> None:
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16().to(device)
    for step in range(2):
        grads(step)
        opt.step()
    grads(2)
    opt._plans.drop()   # the next step is a full one (the cached plan's: test_cached_step_*)
    return opt, params


def _fail_on_call(monkeypatch, owner, name: str, call: int = 1) -> list[int]:
    """Make ``owner.name`` raise :class:`Injected` on its ``call``-th call (0-based)."""
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call + 1:
            raise Injected(f"injected into {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapper)
    return calls


#: the stages of a step before its writes: (what is patched, which call fails)
STAGES = {
    "check_group": (lambda: (base.LowpOptimizer, "check_group"), 1),
    "check_state": (lambda: (base.LowpOptimizer, "check_state"), 2),
    "grads_apart": (lambda: (preflight, "check_grads_apart"), 0),
    "finite_flags": (lambda: (base.LowpOptimizer, "_finite_flags"), 0),
    "init_state": (lambda: (base.LowpOptimizer, "init_state"), 2),
    "make_slices": (lambda: (sharding, "make_slices"), 0),
}


@pytest.mark.parametrize("states", list(STATES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_before_the_writes_changes_nothing(stage, backend, states, monkeypatch):
    opt, params = _setup(backend, states)
    before = snapshot(opt, params)
    target, call = STAGES[stage]
    calls = _fail_on_call(monkeypatch, *target(), call=call)
    with pytest.raises(Injected):
        opt.step()
    assert calls[0] == call + 1, "the fault was injected"
    assert same_snapshot(snapshot(opt, params), before)
    monkeypatch.undo()
    opt.step()   # and the step then runs as if nothing had happened
    reference, ref_params = _setup(backend, states)
    reference.step()
    assert same_snapshot(snapshot(opt, params), snapshot(reference, ref_params))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_and_closures_that_raise_change_nothing(backend):
    opt, params = _setup(backend, "bf16")
    before = snapshot(opt, params)

    def hook(optimizer, args, kwargs):
        raise Injected("pre-hook")
    handle = opt.register_step_pre_hook(hook)
    with pytest.raises(Injected):
        opt.step()
    handle.remove()

    def closure():
        raise Injected("closure")
    with pytest.raises(Injected):
        opt.step(closure)
    assert same_snapshot(snapshot(opt, params), before)


def test_a_new_state_created_before_a_fault_is_removed(monkeypatch):
    """The first step creates every state: a fault in the gathers, after the last parameter's
    states were made, leaves the optimizer without any, as before."""
    params = [torch.nn.Parameter(torch.randn(16).bfloat16()) for _ in range(3)]
    opt = lo.AdamW(params, lr=1e-2, backend="foreach", seed=1)
    for p in params:
        p.grad = torch.ones_like(p)
    _fail_on_call(monkeypatch, sharding, "make_slices", call=0)
    with pytest.raises(Injected):
        opt.step()
    assert not any(p in opt.state and opt.state[p] for p in params)


def test_a_fault_after_a_mode_switch_fold_puts_the_weight_back(monkeypatch):
    """kahan -> exact folds the compensation into the weight (writeback.ensure_buffer) while the
    step is planned; a later fault restores the weight and the compensation."""
    opt, params = _setup("foreach", "bf16")
    for g in opt.param_groups:
        g["mode"] = "exact"
    before = snapshot(opt, params)
    assert "compensation" in opt.state[params[0]]
    _fail_on_call(monkeypatch, sharding, "make_slices", call=0)
    with pytest.raises(Injected):
        opt.step()
    assert same_snapshot(snapshot(opt, params), before)


def _fail_in_the_call_of(monkeypatch, job: int) -> list[int]:
    """Make the call that ``Backend.prepare`` returns for the ``job``-th job (0-based) raise
    :class:`Injected` when it runs: a fault after every job was prepared."""
    original = lo.backends.Backend.prepare
    prepared = [0]

    def prepare(self, optimizer, ctx, slices):
        call = original(self, optimizer, ctx, slices)
        prepared[0] += 1
        if prepared[0] != job + 1:
            return call

        def failing():
            raise Injected(f"injected into the call of job {job}")
        return failing
    monkeypatch.setattr(lo.backends.Backend, "prepare", prepare)
    return prepared


@pytest.mark.parametrize("states", list(STATES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fault_preparing_a_later_job_changes_nothing(backend, states, monkeypatch):
    """Every job is prepared (admitted; a kernel's library built and loaded, its arguments
    checked) before the first writes: the second job's library failing to load leaves every
    weight, state and counter as it was, and the step then runs as if nothing had happened."""
    opt, params = _setup(backend, states)
    before = snapshot(opt, params)
    if backend == "native":
        from lowp.optim.kernels.native import kernel as native_kernel
        name = "coded_step_function" if states == "int8" else "step_function"
        calls = _fail_on_call(monkeypatch, native_kernel, name, call=1)
    else:   # the reference backends build nothing: their preparation itself fails
        calls = _fail_on_call(monkeypatch, lo.backends.Backend, "prepare", call=1)
    with pytest.raises(Injected):
        opt.step()
    assert calls[0] == 2, "the second job's preparation failed"
    assert same_snapshot(snapshot(opt, params), before)
    monkeypatch.undo()
    opt.step()
    reference, ref_params = _setup(backend, states)
    reference.step()
    assert same_snapshot(snapshot(opt, params), snapshot(reference, ref_params))


@pytest.mark.parametrize("states", list(STATES))
def test_a_jobs_temporaries_are_freed_before_the_next_job_runs(states, monkeypatch):
    """Preparing every job first keeps their calls, not their temporaries: when the second job
    runs, the first one's context (and the scratch buffers of its fp32 working copies) is gone,
    so a step's temporaries stay those of one job."""
    import weakref
    opt, _ = _setup("foreach", states)
    original = lo.backends.Backend.prepare
    contexts: list = []
    seen: list = []

    def prepare(self, optimizer, ctx, slices):
        call = original(self, optimizer, ctx, slices)
        contexts.append(weakref.ref(ctx))
        job = len(contexts) - 1

        def watched():
            seen.append([c() is not None for c in contexts[:job]])
            return call()
        return watched
    monkeypatch.setattr(lo.backends.Backend, "prepare", prepare)
    opt.step()
    assert seen == [[], [False]]


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernel's libraries")
def test_a_fault_loading_the_kernel_of_decoded_states_changes_nothing(monkeypatch):
    """StableAdamW's per-tensor reduction keeps its block-scaled states out of the kernel's own
    decoding: they are decoded, stepped by the plain variant and encoded while the job writes.
    That variant is built and loaded when the job is prepared, so the second job's failing to
    load changes nothing (before, the first job was stepped and the error came mid-write)."""
    from lowp.optim.kernels.native import kernel as native_kernel
    opt, params = _setup("native", "int8", optimizer=lo.StableAdamW)
    before = snapshot(opt, params)
    calls = _fail_on_call(monkeypatch, native_kernel, "step_function", call=1)
    with pytest.raises(Injected):
        opt.step()
    assert calls[0] == 2
    assert same_snapshot(snapshot(opt, params), before)
    monkeypatch.undo()
    opt.step()
    reference, ref_params = _setup("native", "int8", optimizer=lo.StableAdamW)
    reference.step()
    assert same_snapshot(snapshot(opt, params), snapshot(reference, ref_params))
    assert opt.backend.fused_elements > 0   # the decoded states took the kernel


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fault_in_a_job_leaves_each_parameter_stepped_or_untouched(backend, monkeypatch):
    """The second job's call fails, after both were prepared: the first group's parameters are
    exactly as a whole step leaves them (weights, states, counters), the second group's exactly
    as before."""
    opt, params = _setup(backend, "bf16")
    before = snapshot(opt, params)
    reference, ref_params = _setup(backend, "bf16")
    reference.step()
    after = snapshot(reference, ref_params)
    prepared = _fail_in_the_call_of(monkeypatch, job=1)
    with pytest.raises(Injected):
        opt.step()
    assert prepared[0] == 2
    now = snapshot(opt, params)
    for i in range(4):
        expected = after if i < 2 else before
        assert same_snapshot(now["weights"][i], expected["weights"][i]), i
        assert same_snapshot(now["state"][i], expected["state"][i]), i


@pytest.mark.parametrize("states", list(STATES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_during_the_writes_arrives_after_a_whole_step(backend, states, monkeypatch):
    """SIGINT sent while the first job runs: the step finishes every parameter, then
    ``KeyboardInterrupt`` is raised once."""
    opt, params = _setup(backend, states)
    reference, ref_params = _setup(backend, states)
    reference.step()
    original = lo.backends.Backend.prepare   # every job's one entry, coded states or not
    sent = []

    def prepare(self, optimizer, ctx, slices):
        call = original(self, optimizer, ctx, slices)

        def interrupting():
            if not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)
            return call()
        return interrupting
    monkeypatch.setattr(lo.backends.Backend, "prepare", prepare)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert sent
    assert same_snapshot(snapshot(opt, params), snapshot(reference, ref_params))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_contiguous_coded_state_is_stepped_like_a_contiguous_one(backend):
    opt, params = _setup(backend, "int8")
    reference, ref_params = _setup(backend, "int8")
    changed = 0
    for p in params[:1] + params[2:3]:     # the 2-d parameters: a transposed copy of the same values
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq"):
            t = state[key]
            if t.dim() == 2 and min(t.shape) > 1:
                state[key] = t.t().contiguous().t()
                assert not state[key].is_contiguous()
                changed += 1
    assert changed >= 2
    opt.step()
    reference.step()
    assert same_snapshot(snapshot(opt, params), snapshot(reference, ref_params))


def test_a_real_ctrl_c_from_outside_never_leaves_half_a_step():
    """A child steps a 120-tensor model in a loop while the parent sends SIGINT: after the
    interrupt every parameter has taken the same number of steps, and its counter says so."""
    code = textwrap.dedent("""
        import torch, lowp.optim as lo, sys
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(2048).bfloat16()) for _ in range(120)]
        opt = lo.AdamW(params, lr=1e-3, backend="foreach", seed=0)
        for p in params:
            p.grad = torch.randn_like(p)
        start = [p.detach().clone() for p in params]
        print("ready", flush=True)
        try:
            while True:
                opt.step()
        except KeyboardInterrupt:
            pass
        steps = {opt.state[p]["step"] for p in params}
        moved = {bool((p != s).any()) for p, s in zip(params, start)}
        print("steps", sorted(steps), "moved", sorted(moved), flush=True)
        sys.exit(0 if len(steps) == 1 and moved == {True} else 3)
    """)
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        import time
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0, out


def _fail_the_second_launch(monkeypatch, where: str) -> list[int]:
    """The native kernel's second launch staged in a step fails: when staged (``where="stage"``)
    or when it runs (``"call"``). Returns the count of launches staged (one item)."""
    from lowp.optim.kernels.native.kernel import Launch
    stage, staged = Launch.stage, [0]

    def failing_stage(self, *args, **kwargs):
        staged[0] += 1
        if staged[0] == 2 and where == "stage":
            raise Injected("injected into the second launch's stage")
        run = stage(self, *args, **kwargs)
        if staged[0] == 2:
            def failing_run():
                raise Injected("injected into the second launch's call")
            return failing_run
        return run
    monkeypatch.setattr(Launch, "stage", failing_stage)
    return staged


@pytest.mark.skipif("native" not in BACKENDS, reason="the cached plan runs the native kernel")
@pytest.mark.parametrize("where", ["stage", "call"])
def test_a_fault_in_a_cached_step_leaves_whole_parameters(where, monkeypatch):
    """A cached step whose second launch fails: when staged (``stage``: before any launch runs)
    nothing changes; when it runs (``call``, after the first job wrote) the first job's
    parameters are stepped whole (weights, states, step counts), the second's untouched, as in a
    full step."""
    opt, params = _setup("native", "bf16")
    opt.step()                    # a full step, which keeps its plan
    grads = [p.grad.clone() for p in params]
    before = snapshot(opt, params)
    assert len(opt._plans.current.jobs) == 2   # the two groups
    staged = _fail_the_second_launch(monkeypatch, where)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with pytest.raises(Injected, match=where):
        opt.step()
    assert staged[0] == 2
    after = snapshot(opt, params)
    if where == "stage":
        assert same_snapshot(after, before)
        return
    assert [opt.state[p]["step"] for p in params] == [4, 4, 3, 3]
    assert same_snapshot(after["weights"][2:], before["weights"][2:])
    assert same_snapshot({i: after["state"][i] for i in (2, 3)}, {i: before["state"][i] for i in (2, 3)})
    assert not same_snapshot(after["weights"][:2], before["weights"][:2])


@pytest.mark.parametrize("mode", ["kahan", "stochastic", "nearest", "exact", "exact8", "master"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_the_dtype_admission_of_decoded_slices_agrees_with_the_kernels(mode, rounding):
    """``fusable_dtypes`` (which decides, before a step writes, whose decoded slices' kernel
    variant to load) gives ``fusable``'s answer for every weight, gradient and state dtype, with
    the kernel rounding fp16 stochastically or not."""
    from lowp.optim.kernels.kernel import fusable, fusable_dtypes
    from lowp.optim.slices import ParamSlice, StepContext
    from lowp.optim.writeback import MODES
    floats = (torch.float32, torch.bfloat16, torch.float16)
    seen = set()
    for weight in floats:
        exact = mode in ("exact", "exact8")
        if (mode != "nearest" and weight == torch.float32) or (exact and weight != torch.bfloat16):
            continue   # the compensated modes take 16-bit weights, the exact ones bf16
        for grad in floats:
            for first in floats:
                for second in floats:
                    p = torch.zeros(64, dtype=weight)
                    opt = lo.AdamW([p], mode=mode, state_rounding=rounding)
                    group, wb = opt.param_groups[0], MODES[mode]
                    for kind in (wb.buffer_dtypes(weight) or (None,)) if wb.buffer_name else (None,):
                        buffer = None if kind is None else torch.zeros(64, dtype=kind)
                        s = ParamSlice(p, torch.zeros(64, dtype=grad), {"exp_avg": torch.zeros(64, dtype=first),
                                                                        "exp_avg_sq": torch.zeros(64, dtype=second)},
                                       buffer)
                        ctx = StepContext(group, wb, 1)
                        dtypes = (weight, grad, kind, first, second)
                        for fp16_stochastic in (False, True):
                            expected = fusable(ctx, s, fp16_stochastic=fp16_stochastic)
                            assert fusable_dtypes(ctx, dtypes, fp16_stochastic) == expected, (dtypes, fp16_stochastic)
                            seen.add(expected)
    # refusals appear where a rule applies: fp16 states rounded stochastically, or a mode that
    # rounds the weight stochastically given fp16 weights
    refuses = rounding == "stochastic" or (MODES[mode].stochastic_weight_dtype and not exact)
    assert seen == ({True, False} if refuses else {True})


@pytest.mark.skipif("native" not in BACKENDS, reason="the native codec")
@pytest.mark.parametrize("backend", ["foreach", "native"])
def test_the_codec_of_decoded_states_is_loaded_before_the_first_write(backend, monkeypatch):
    """Coded states that no kernel takes are decoded and encoded by the native codec while their
    job writes; its library is loaded when the job is prepared, before any job writes (a first
    use mid-write could fail after the earlier jobs were stepped). StableAdamW's states are always
    decoded outside the kernel; a plain job (16-bit states under coded_min_numel) comes first."""
    from lowp.optim.kernels.native import codec as native_codec
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).bfloat16()) for n in (64, 4096)]
    opt = lo.StableAdamW(params, lr=1e-2, backend=backend, seed=1,
                         state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8})
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    events: list[str] = []
    for name in ("decode_function", "encode_function"):
        original = getattr(native_codec, name)

        def recorded(*args, _original=original, _name=name):
            events.append(_name)
            return _original(*args)
        monkeypatch.setattr(native_codec, name, recorded)
    prepare = lo.backends.Backend.prepare

    def recorded_prepare(self, optimizer, ctx, slices):
        call = prepare(self, optimizer, ctx, slices)

        def run():
            events.append("call")
            return call()
        return run
    monkeypatch.setattr(lo.backends.Backend, "prepare", recorded_prepare)
    opt.step()
    assert events.count("call") == 2, events
    first_call = events.index("call")
    assert "decode_function" in events[:first_call] and "encode_function" in events[:first_call], events


class _FailAt(TorchDispatchMode):
    """Counts the torch operations run under it and raises ``torch.OutOfMemoryError`` at the
    ``k``-th (1-based; ``None``: never), as an allocation that fails would; the profiler's
    markers (torch's ``Optimizer.step`` wrapper opens and closes one) allocate nothing and are
    not counted."""

    def __init__(self, k: int | None = None) -> None:
        super().__init__()
        self.k, self.seen = k, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":
            return func(*args, **(kwargs or {}))
        self.seen += 1
        if self.seen == self.k:
            raise torch.OutOfMemoryError(f"injected at operation {self.k} ({func})")
        return func(*args, **(kwargs or {}))


#: configurations whose every slice the native kernel takes: block-scaled states coded in the
#: kernel (AdamW), a per-tensor reduction summed by it (StableAdamW)
NATIVE_WHOLE = {"adamw-bf16": (lo.AdamW, "bf16"), "adamw-int8": (lo.AdamW, "int8"),
                "stableadamw-bf16": (lo.StableAdamW, "bf16")}


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernel")
@pytest.mark.parametrize("plan", ["full", "cached"])
@pytest.mark.parametrize("case", list(NATIVE_WHOLE))
def test_an_operation_failing_anywhere_in_a_native_step_changes_nothing(case, plan):
    """An out-of-memory error injected at each torch operation of a step in turn, with every
    slice taken by the native kernel (two jobs; a full step with a strided gradient, whose copy
    the kernel reads, or a step from the cached plan): everything the writes need is allocated
    before the first of them (the gradient copies; the stalled counts stay host ints, added only
    when ``diagnostics()`` reads them), so each fault leaves every weight, state and counter as
    it was, and the next step gives the bits of a step that never failed."""
    optimizer, states = NATIVE_WHOLE[case]

    def setup():
        opt, params = _setup("native", states, optimizer=optimizer)
        if plan == "cached":
            opt.step()   # a full step keeps its plan: the next one takes it
            for p in params:
                p.grad = p.grad.clone()
        else:
            params[0].grad = params[0].grad.t().contiguous().t()
            assert not params[0].grad.is_contiguous()
        return opt, params

    opt, params = setup()
    cached = opt._plans.cached_steps
    counted = _FailAt()
    with counted:
        opt.step()
    assert opt.backend.reference_elements == 0 and opt.backend.fused_elements > 0   # the native kernel took it all
    assert opt._plans.cached_steps == cached + (plan == "cached")
    expected = snapshot(opt, params)
    raised = 0
    for k in range(1, counted.seen + 1):
        opt, params = setup()
        before = snapshot(opt, params)
        try:
            with _FailAt(k):
                opt.step()
        except torch.OutOfMemoryError:
            raised += 1
            assert same_snapshot(snapshot(opt, params), before), f"changed by a fault at operation {k}"
            opt.step()
        assert same_snapshot(snapshot(opt, params), expected), f"operation {k}"
    if plan == "cached" and states == "bf16":
        assert counted.seen == 0   # the plan's step is its kernel calls alone: nothing to fail
    else:
        assert raised >= counted.seen // 2 > 0, (raised, counted.seen)


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernel")
@pytest.mark.parametrize("plan", ["full", "cached"])
def test_a_failed_staging_frees_what_was_staged_at_once(plan, monkeypatch):
    """The second launch's staging fails (out of memory): the error is raised (after the sums'
    exchange has been told, here without one) and nothing keeps the first launch's staged
    gradient copy alive once the error is dropped, without the garbage collector (no reference
    cycle through the error's traceback): a retry after freeing memory has it back."""
    import gc
    import weakref

    from lowp.optim.kernels.native import kernel as native_kernel
    opt, params = _setup("native", "bf16")
    if plan == "cached":
        opt.step()   # keeps its plan, which takes contiguous gradients only: the copy is made here
        for p in params:
            p.grad = p.grad.clone()
    copies: list = []
    real_stage = native_kernel.Launch.stage

    def copying(g):
        copy = g.clone()   # as a strided gradient's copy
        copies.append(weakref.ref(copy))
        return copy

    def stage(self, *args, **kwargs):
        if copies:
            raise torch.OutOfMemoryError("injected into the second launch's staging")
        return real_stage(self, *args, **kwargs)
    monkeypatch.setattr(native_kernel, "kernel_grad", copying)
    monkeypatch.setattr(native_kernel.Launch, "stage", stage)
    before = snapshot(opt, params)
    gc.disable()
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            opt.step()
        del caught
        assert copies and all(ref() is None for ref in copies), "a staged copy outlived the failed step"
    finally:
        gc.enable()
    assert same_snapshot(snapshot(opt, params), before)


def _reference_faults(backend: str, states: str, device: str = "cpu") -> set[tuple[bool, ...]]:
    """A fault (out of memory) injected at each torch operation of a reference step in turn
    (chunks of 128 elements): each parameter is checked to be left exactly as before or exactly
    as a step that never failed leaves it, and the error to say how many were stepped; returns
    the (stepped per parameter) outcomes seen."""
    base, base_params = _setup(backend, states, chunk_size=128, device=device)

    def fresh():
        opt, params = copy.deepcopy((base, base_params))
        for p, q in zip(params, base_params):
            p.grad = q.grad.clone()
        return opt, params

    opt, params = fresh()
    before = snapshot(opt, params)
    counted = _FailAt()
    with counted:
        opt.step()
    after = snapshot(opt, params)
    outcomes = set()
    for k in range(1, counted.seen + 1):
        opt, params = fresh()
        try:
            with _FailAt(k):
                opt.step()
        except torch.OutOfMemoryError as exc:
            now = snapshot(opt, params)
            assert now["groups"] == before["groups"] and now["extras"] == before["extras"]
            stepped = []
            for i in range(len(params)):
                parts = (now["weights"][i], now["state"][i])
                stepped.append(same_snapshot(parts, (after["weights"][i], after["state"][i])))
                assert stepped[-1] or same_snapshot(parts, (before["weights"][i], before["state"][i])), \
                    f"parameter {i} left half-stepped by a fault at operation {k} of {counted.seen}"
            outcomes.add(tuple(stepped))
            notes = getattr(exc, "__notes__", [])   # the error says how many were stepped
            assert notes == ([f"lowp: the step failed while writing: {sum(stepped)} of 4 parameters were stepped "
                              "whole (weights, states and step count), the others are as they were"]
                             if any(stepped) and sys.version_info >= (3, 11) else []), (k, notes)
        else:
            assert same_snapshot(snapshot(opt, params), after), k
    # the parameters stepped are those written before the fault, in order: none (a fault before
    # the writes), the first (in the first job, after its first parameter), the first job's, ...
    assert all(o == tuple(i < sum(o) for i in range(4)) for o in outcomes), outcomes
    assert {(False,) * 4, (True, False, False, False), (True, True, False, False)} <= outcomes, outcomes
    return outcomes


@pytest.mark.parametrize("states", list(STATES))
@pytest.mark.parametrize("backend", ["foreach", pytest.param("eager", marks=pytest.mark.slow)])
def test_an_operation_failing_anywhere_in_a_reference_step_leaves_whole_parameters(backend, states):
    """An out-of-memory error injected at each torch operation of a step on the reference pipeline
    in turn (chunks of 128 elements: the (8, 64) weight is cut over several batches, and with
    block-scaled states over two pieces of whole blocks): the reference pipeline allocates as it
    writes, but each batch's writes are copied first and put back on a failure, and a parameter
    cut over several batches is held until its last one is written (:mod:`lowp.optim.journal`),
    so every parameter is left either exactly as before (weight, states, counter) or exactly as a
    step that never failed leaves it, the parameters of a job in order. Before, a fault inside a
    job left its parameters partly written with their counters behind."""
    _reference_faults(backend, states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("room", ["device", "host"])
def test_a_reference_step_on_the_gpu_keeps_whole_parameters(room, monkeypatch):
    """The same on CUDA tensors (``foreach``, int8 / uint8 states); with ``room="host"`` every flat
    copy the journal makes on the device fails (out of memory), so its copies go to the host, and
    are put back from there."""
    from lowp.optim import journal

    if room == "host":
        cat, inside = torch.cat, [False]

        def full_device_cat(tensors, *args, **kwargs):
            if inside[0] and tensors and tensors[0].is_cuda:
                raise torch.OutOfMemoryError("injected: no room on the device for the journal's copies")
            return cat(tensors, *args, **kwargs)

        save = journal.Journal.save

        def saving(self, writes):
            inside[0] = True
            try:
                save(self, writes)
            finally:
                inside[0] = False
        monkeypatch.setattr(torch, "cat", full_device_cat)
        monkeypatch.setattr(journal.Journal, "save", saving)
    _reference_faults("foreach", "int8", device="cuda")


def test_a_compiled_call_that_fails_leaves_whole_parameters(monkeypatch):
    """The ``compiled`` kernel steps chunk by chunk, and a call can fail after the calls before it
    wrote (its first call compiles; its outputs allocate): its chunks' writes are copied first and
    put back (:mod:`lowp.optim.journal`). Here the compiled function is replaced by one that
    writes every tensor of its chunk and fails on the fourth call, the last chunk of the (8, 64)
    weight cut into chunks of 128: that weight, its states and buffer (chunks 1-3 written) are put
    back whole; nothing else changed."""
    from lowp.optim.kernels.compiled import kernel as compiled

    opt, params = _setup("foreach", "bf16")
    opt.backend = lo.backends.get_backend("compiled")   # no compile: the calls are replaced below
    before = snapshot(opt, params)
    calls = []

    def function(*args, **kwargs):
        def call(p, g, buf, states, h, keys):
            calls.append(p.numel())
            for t in (p, buf, *states):
                t.fill_(len(calls))
            if len(calls) == 4:
                raise torch.OutOfMemoryError("injected in a compiled call")
            return torch.zeros((), dtype=torch.int32)
        return call

    monkeypatch.setattr(compiled, "CHUNK", 128)
    monkeypatch.setattr(compiled, "_function", function)
    monkeypatch.setattr(compiled, "_CALLED", set())
    with pytest.raises(torch.OutOfMemoryError, match="compiled call"):
        opt.step()
    assert calls == [128] * 4   # the kernel took the weight, and failed in its last chunk
    assert same_snapshot(snapshot(opt, params), before)


def test_a_compiled_call_that_compiles_after_known_ones_puts_back_the_whole_parameter(monkeypatch):
    """The compiled functions are kept (one static for whole chunks, one dynamic for remainders,
    as ``_function`` keeps them): a weight of 512 in chunks of 200 calls the static one twice and
    the dynamic one for its last 112, which fails (its compile); the second static call compiled
    nothing, yet its chunk goes back with the others: the parameter had a call to compile."""
    from lowp.optim.kernels.compiled import kernel as compiled

    opt, params = _setup("foreach", "bf16")
    opt.backend = lo.backends.get_backend("compiled")
    before = snapshot(opt, params)
    calls = []

    def kept(dynamic: bool):
        def call(p, g, buf, states, h, keys):
            calls.append((dynamic, p.numel()))
            for t in (p, buf, *states):
                t.fill_(len(calls))
            if dynamic:
                raise torch.OutOfMemoryError("injected in a compiling call")
            return torch.zeros((), dtype=torch.int32)
        return call
    functions = {False: kept(False), True: kept(True)}
    monkeypatch.setattr(compiled, "CHUNK", 200)
    monkeypatch.setattr(compiled, "_function", lambda *args, dynamic: functions[dynamic])
    monkeypatch.setattr(compiled, "_CALLED", set())
    with pytest.raises(torch.OutOfMemoryError, match="compiling call"):
        opt.step()
    assert calls == [(False, 200), (False, 200), (True, 112)]
    assert same_snapshot(snapshot(opt, params), before)


def test_the_compiled_kernel_copies_the_chunks_of_the_calls_that_compile(monkeypatch):
    """Only the first call of a compiled function with a given signature (device, dtypes) compiles:
    only those calls' chunks are copied first, so a step whose calls are all known adds no copies."""
    from lowp.optim import journal
    from lowp.optim.kernels.compiled import kernel as compiled

    opt, params = _setup("foreach", "bf16")
    opt.backend = lo.backends.get_backend("compiled")

    def call(p, g, buf, states, h, keys):
        return torch.zeros((), dtype=torch.int32)
    saved = []
    save = journal.Journal.save
    monkeypatch.setattr(journal.Journal, "save", lambda self, writes: saved.append(len(writes)) or save(self, writes))
    monkeypatch.setattr(compiled, "CHUNK", 128)
    monkeypatch.setattr(compiled, "_function", lambda *args, **kwargs: call)
    monkeypatch.setattr(compiled, "_CALLED", set())
    opt.step()
    first = len(saved)
    assert 0 < first < opt.backend.fused_elements // 128   # a few signatures, more chunks
    opt.step()
    assert len(saved) == first   # every call known: nothing copied


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernel")
@pytest.mark.parametrize("plan", ["full", "cached"])
def test_a_launch_failing_after_another_of_its_job_leaves_whole_parameters(plan, monkeypatch):
    """One job of two launches (a bf16 and an fp32 gradient: two kernel variants) whose second
    launch fails when it runs (as a Triton launch whose first-call compile fails would): the first
    launch's parameter is stepped whole and counts the step, the second is as it was, and the
    error says so; in a full step and in a cached plan's."""

    def setup():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter((torch.randn(64, generator=gen) * 0.1).bfloat16()) for _ in range(2)]
        params[1].grad_dtype = torch.float32   # an fp32 gradient (mixed-precision accumulation)
        opt = lo.AdamW(params, lr=1e-2, backend="native", seed=5)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            params[0].grad = torch.randn(64, generator=g).bfloat16()
            params[1].grad = torch.randn(64, generator=g)
            if step < 2:
                opt.step()
        if plan == "full":
            opt._plans.drop()
        return opt, params

    clean, clean_params = setup()
    clean.step()
    after = snapshot(clean, clean_params)
    opt, params = setup()
    before = snapshot(opt, params)
    cached = opt._plans.cached_steps
    staged = _fail_the_second_launch(monkeypatch, "call")
    with pytest.raises(Injected) as raised:
        opt.step()
    assert staged[0] == 2 and opt._plans.cached_steps == cached + (plan == "cached")   # one job, two launches
    now = snapshot(opt, params)
    stepped = [same_snapshot((now["weights"][i], now["state"][i]), (after["weights"][i], after["state"][i]))
               for i in range(2)]
    untouched = [same_snapshot((now["weights"][i], now["state"][i]), (before["weights"][i], before["state"][i]))
                 for i in range(2)]
    assert sorted(zip(stepped, untouched)) == [(False, True), (True, False)], (stepped, untouched)
    if sys.version_info >= (3, 11):
        assert "1 of 2 parameters were stepped whole" in "".join(raised.value.__notes__)
    monkeypatch.undo()
    for p, q in zip(params, clean_params):   # the plan is dropped; the next step is a full one again
        p.grad = q.grad.clone()
    opt.step()
