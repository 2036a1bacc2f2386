"""The cached step plan (lowp.optim.cached_step): steps taken from it equal full steps bit for bit,
every change the signature covers sends the step back to the full path (which checks and raises
as before), and the non-finite policy folded into the native call behaves as the full step's."""
from __future__ import annotations

import pytest
import torch

import lowp.optim as lo
from lowp.optim.kernels.native.build import native_available
from safety_cases import set_grad

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native_available(), reason="the cached plan runs the native kernel")]

EIGHT_BIT = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
CONFIGS = {
    "defaults": dict(),
    "5 B/param": dict(mode="exact8", state_dtype=EIGHT_BIT, coded_min_numel=0),
    "fp32 states, nearest": dict(mode="nearest", state_dtype=torch.float32),
    "master": dict(mode="master"),
}


def make_params(seed: int = 0, shapes=((33, 17), (64,), (5, 3, 7), (1,)), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in shapes]


def set_grads(params, step: int, fresh: bool = True) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        g = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        if fresh or p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


def bits(opt, params) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        for _, v in sorted(opt.state[p].items()):
            out.append(v.clone() if torch.is_tensor(v) else torch.tensor(v))
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8)
                                                                       if x.dim() else x, y.view(-1).view(torch.uint8)
                                                                       if y.dim() else y) for x, y in zip(a, b))


def on_both(train):
    """``train(backend)`` -> (optimizer, parameters), on the native backend and on the foreach
    reference: the pairs a test compares."""
    return train("native"), train("foreach")


def run(backend: str, steps: int = 5, cls=lo.AdamW, fresh: bool = True, between=None, **options):
    params = make_params()
    opt = cls(params, **{"lr": 1e-2, "backend": backend, "seed": 0, **options})
    for t in range(steps):
        set_grads(params, t, fresh)
        if between is not None:
            between(opt, params, t)
        opt.step()
    return opt, params


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("fresh", [True, False], ids=["new gradients", "gradients kept"])
def test_cached_steps_equal_the_reference(config, fresh):
    """After the first (full) step every step is taken from the cached plan, bit for bit the
    foreach reference's."""
    native, p1 = run("native", fresh=fresh, **CONFIGS[config])
    reference, p2 = run("foreach", fresh=fresh, **CONFIGS[config])
    assert native._plans.cached_steps == 4
    assert same(bits(native, p1), bits(reference, p2))


@pytest.mark.parametrize("config", ["defaults", "5 B/param"])
def test_empty_parameters_are_planned_without_a_launch(config):
    """An empty parameter (an FSDP2 shard of a matrix with fewer rows than ranks, a zero-size
    tensor) needs no kernel call: the plan keeps it, advancing its step count with its job, and
    takes the other parameters' steps, the reference's bits."""
    shapes = ((33, 17), (0,), (64,), (0, 5))

    def train(backend: str):
        params = make_params(shapes=shapes)
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0, **CONFIGS[config])
        for t in range(5):
            set_grads(params, t)
            opt.step()
        return opt, params
    (native, p1), (reference, p2) = on_both(train)
    assert native._plans.cached_steps == 4
    plan = native._plans.current
    assert sum(len(job.empty) for job in plan.jobs) == 2 and plan.calls >= 1
    assert [native.state[p]["step"] for p in p1] == [5] * 4
    assert same(bits(native, p1), bits(reference, p2))


def test_a_skipped_step_leaves_empty_parameters_alone():
    """skip_step with an empty parameter in a group of its own (a job without a call) and a NaN in
    the one call's gradients: the whole step is skipped, the empty parameter's step count too."""
    params = make_params(shapes=((0,), (64,)))
    opt = lo.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, backend="native", seed=0,
                   nonfinite="skip_step")
    for t in range(3):
        set_grads(params, t)
        opt.step()
    plan = opt._plans.current
    assert opt._plans.cached_steps == 2 and plan.calls == 1 and plan.check_first
    params[1].grad[5] = float("nan")
    before = params[1].detach().clone()
    opt.step()
    assert opt._plans.cached_steps == 3 and opt.skipped_steps == 1
    assert [opt.state[p]["step"] for p in params] == [3, 3]
    assert torch.equal(params[1], before)


KERNEL_ENTRIES = [e for e in lo.registry.entries() if e.cls.spec is not None and e.cls.spec.rule is not None]


@pytest.mark.parametrize("entry", KERNEL_ENTRIES, ids=lambda e: e.name)
def test_every_optimizer_takes_cached_steps(entry):
    """Every optimizer of the registry with a kernel form: cached steps, the reference's bits."""
    kwargs = dict(entry.examples[0]) if entry.examples else {}
    kwargs.pop("backend", None)
    kwargs.pop("fused", None)
    native, p1 = run("native", cls=entry.cls, **kwargs)
    reference, p2 = run("foreach", cls=entry.cls, **kwargs)
    assert native._plans.cached_steps == 4
    assert same(bits(native, p1), bits(reference, p2))


def test_learning_rate_changes_are_read_every_step():
    def schedule(opt, params, t):
        opt.param_groups[0]["lr"] = 1e-2 / (t + 1)
    native, p1 = run("native", between=schedule)
    reference, p2 = run("foreach", between=schedule)
    assert native._plans.cached_steps == 4 and same(bits(native, p1), bits(reference, p2))


def _changes():
    """(name, change made before step 3, whether step 3 still takes the cached plan)."""
    def replace_state(opt, params):
        opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()

    def new_data(opt, params):
        params[1].data = params[1].data.clone()

    def in_place(opt, params):
        with torch.no_grad():
            params[2].mul_(1.0)

    def strided_grad(opt, params):
        params[0].grad = params[0].grad.t().contiguous().t()

    def mode_switch(opt, params):
        opt.param_groups[0]["mode"] = "stochastic"

    def state_step(opt, params):
        opt.state[params[3]]["step"] = 1

    def diagnostics_off(opt, params):
        opt.diagnostics_enabled = False

    def no_grad(opt, params):
        params[3].grad = None

    def fp32_grad(opt, params):
        set_grad(params[1], params[1].grad.float())

    def no_weight_decay(opt, params):
        opt.param_groups[0]["weight_decay"] = 0.0   # a switch of the traced rule

    return [("state replaced", replace_state, False), ("p.data replaced", new_data, False),
            ("weight written in place", in_place, False), ("strided gradient", strided_grad, False),
            ("mode switched", mode_switch, False), ("step count edited", state_step, False),
            ("diagnostics off", diagnostics_off, False), ("a gradient fewer", no_grad, False),
            ("fp32 gradient", fp32_grad, False), ("weight decay switched off", no_weight_decay, None),
            ("nothing", lambda opt, params: None, True)]


@pytest.mark.parametrize("name,change,cached", _changes(), ids=[c[0] for c in _changes()])
def test_a_change_takes_the_full_step(name, change, cached):
    """Each change the signature covers makes that step a full one, with the reference's bits."""
    results = []
    for backend in ("native", "foreach"):
        params = make_params()
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0)
        for t in range(6):
            set_grads(params, t)
            if t == 3:
                change(opt, params)
                before = opt._plans.cached_steps
            opt.step()
            if t == 3 and backend == "native" and cached is not None:
                assert opt._plans.cached_steps == before + cached
        results.append(bits(opt, params))
    assert same(*results)


def _bad_inputs():
    def wrong_shape(params):
        set_grad(params[0], torch.zeros(3, dtype=torch.bfloat16))

    def shares_weight(params):
        params[1].grad = params[1].detach()

    def freed(params):
        params[1].grad.untyped_storage().resize_(0)

    def freed_weight(params):
        params[2].untyped_storage().resize_(0)

    def shrunk_state(params):
        params[0]._lowp_opt.state[params[0]]["exp_avg"].untyped_storage().resize_(2)

    return [("gradient of another shape", wrong_shape, ValueError, "grad of params\\[0\\]"),
            ("gradient is the weight", shares_weight, ValueError, "shares memory"),
            ("gradient storage freed", freed, ValueError, "storage"),
            ("weight storage freed", freed_weight, ValueError, "storage"),
            ("state storage shrunk", shrunk_state, ValueError, "storage")]


@pytest.mark.parametrize("name,change,error,match", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_after_cached_steps_raise_as_the_full_step(name, change, error, match):
    """A bad input after cached steps gets the full step's error, and nothing is written."""
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend="native")
    for t in range(3):
        set_grads(params, t)
        opt.step()
    assert opt._plans.cached_steps == 2
    set_grads(params, 3)
    params[0]._lowp_opt = opt
    change(params)
    before = [p.detach().clone() for p in params[:1]]
    with pytest.raises(error, match=match):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params[:1]))


def test_a_bad_learning_rate_raises_from_the_cached_plan():
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend="native")
    for t in range(3):
        set_grads(params, t)
        opt.step()
    opt.param_groups[0]["lr"] = float("nan")
    before = bits(opt, params)
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert same(before, bits(opt, params))


@pytest.mark.parametrize("policy", ["skip_param", "skip_step", "off"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one variant", "two variants"])
@pytest.mark.parametrize("at", [3, 4], ids=["NaN, then a step", "NaN at the last step"])
def test_nonfinite_policies_folded_into_the_native_call(policy, mixed, at):
    """A NaN in one gradient at a cached step: the policy applies as in the full step (the
    reference's bits, counters, step counts and diagnostics: a skipped tensor's elements are not
    stepped ones); ``mixed`` adds an fp32 parameter (a second kernel call, so skip_step checks
    every gradient before either call); ``at``: the step of the NaN (at the last, the diagnostics
    report the cached step itself)."""
    def poison(opt, params, t):
        if t == at:
            params[1].grad[5] = float("nan")

    def build():
        params = make_params()
        if mixed:
            params.append(torch.nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(3))))
        return params

    def train(backend):
        params = build()
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0, nonfinite=policy)
        for t in range(5):
            set_grads(params, t)
            poison(opt, params, t)
            opt.step()
        return opt, params

    (native, p1), (reference, p2) = on_both(train)
    assert native._plans.cached_steps >= 2
    assert (native.skipped_params, native.skipped_steps) == (reference.skipped_params, reference.skipped_steps)
    assert [{k: str(v) for k, v in d.items()} for d in native.diagnostics()] == \
        [{k: str(v) for k, v in d.items()} for d in reference.diagnostics()]   # NaN as "nan"
    assert [native.state[p]["step"] for p in p1] == [reference.state[p]["step"] for p in p2]
    a, b = bits(native, p1), bits(reference, p2)
    if policy == "off":   # the NaN's payload: the kernel stores the default NaN (should become work)
        assert all(torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b))
        a, b = [x.nan_to_num(0.0) for x in a], [y.nan_to_num(0.0) for y in b]
    assert same(a, b)


def test_a_large_tensor_with_a_late_nan_is_left_whole():
    """A tensor of several work units whose last unit holds the NaN: the pre-pass finds it before
    any unit is written."""
    p = torch.nn.Parameter(torch.randn(200_000).bfloat16())
    q = torch.nn.Parameter(torch.randn(100).bfloat16())
    opt = lo.AdamW([p, q], lr=1e-2, backend="native")
    for _ in range(2):
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt.step()
    assert opt._plans.cached_steps == 1
    before = bits(opt, [p])
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    p.grad[-1] = float("inf")
    q_before = q.detach().clone()
    opt.step()
    assert opt._plans.cached_steps == 2 and opt.skipped_params == 1
    assert same(before, bits(opt, [p])) and not torch.equal(q_before, q.detach())


def test_grad_scaler_steps_take_the_cached_plan():
    """GradScaler's found_inf and scale reach the cached step (the gradient divided, no check)."""
    results = []
    for backend in ("native", "foreach"):
        params = make_params(dtype=torch.float32)
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0)
        for t in range(4):
            set_grads(params, t)
            for p in params:
                p.grad.mul_(1024.0)
            opt.grad_scale = torch.tensor(1024.0)
            opt.found_inf = torch.tensor(0.0)
            opt.step()
        results.append((opt, params))
    (native, p1), (reference, p2) = results
    assert native._plans.cached_steps == 3 and same(bits(native, p1), bits(reference, p2))


def test_resume_from_a_checkpoint_after_cached_steps():
    """state_dict after cached steps, loaded into a new optimizer: the continued run equals the
    uninterrupted one bit for bit (the loaded optimizer plans anew, then caches again)."""
    whole, p1 = run("native", steps=6)
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend="native", seed=0)
    for t in range(3):
        set_grads(params, t)
        opt.step()
    saved = opt.state_dict()
    opt2 = lo.AdamW(params, lr=1e-2, backend="native")
    opt2.load_state_dict(saved)
    for t in range(3, 6):
        set_grads(params, t)
        opt2.step()
    assert opt2._plans.cached_steps == 2
    assert same(bits(whole, p1), bits(opt2, params))


def test_a_plan_dropped_every_step_waits_before_the_next():
    """When the plan never matches (a strided gradient every step), plans are made ever more rarely."""
    made = []
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend="native")
    original = type(opt._plans).after_full_step

    def counting(self, optimizer, plan, subset=None):
        made.append(self._waits.get(None, (0, 0))[1] == 0)
        original(self, optimizer, plan, subset)
    opt._plans.after_full_step = counting.__get__(opt._plans)
    for t in range(40):
        set_grads(params, t)
        params[0].grad = params[0].grad.t().contiguous().t()
        opt.step()
    assert opt._plans.cached_steps == 0
    assert sum(made) <= 7   # made at steps 0, 2, 6, 14, 30, ... instead of 40 times


def _isas() -> list[str]:
    from lowp.optim.kernels.native import build
    return [name for name, (_, needed) in build.ISAS.items() if all(f in build._cpu_features() for f in needed)]


ISA_CONFIGS = {**{name: (lo.AdamW, options) for name, options in CONFIGS.items()},
               "fp16 stochastic": (lo.AdamW, dict(mode="stochastic", state_dtype=torch.float16)),
               "e4m3 / uint4, fp32 scales per 32": (lo.AdamW, dict(
                   state_dtype={"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.uint4}, state_block=32,
                   state_scale_dtype=torch.float32)),
               "e5m2 / uint8 to nearest, fp16 scales per 256": (lo.AdamW, dict(
                   mode="stochastic", state_dtype={"exp_avg": torch.float8_e5m2, "exp_avg_sq": torch.uint8},
                   state_rounding="nearest", state_block=256, state_scale_dtype=torch.float16)),
               "int4 / uint8, per 128": (lo.AdamW, dict(state_dtype={"exp_avg": torch.int4, "exp_avg_sq": torch.uint8},
                                                         state_block=128)),
               "StableAdamW (per-tensor sums)": (lo.StableAdamW, dict(state_dtype=torch.float32))}


@pytest.mark.skipif(len(_isas()) < 2, reason="this CPU has one instruction set of the native kernel")
@pytest.mark.parametrize("config", ISA_CONFIGS, ids=list(ISA_CONFIGS))
def test_every_instruction_set_builds_the_same_bits(config, monkeypatch):
    """The AVX2 and the AVX-512 builds (LOWP_NATIVE_ISA) step to the same bits, cached steps
    included, on tensors of several work units with tails (the per-tensor sums of StableAdamW
    add 16-element blocks in the same order at both vector widths)."""
    from lowp.optim.kernels.native import build
    cls, options = ISA_CONFIGS[config]
    results = []
    for name in _isas():
        monkeypatch.setenv("LOWP_NATIVE_ISA", name)
        assert build.isa() == name
        gen = torch.Generator().manual_seed(2)
        params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 4).exp().bfloat16()) for n in (70_001, 37, 1000)]
        opt = cls(params, lr=1e-2, backend="native", seed=0, **options)
        for t in range(4):
            set_grads(params, t)
            opt.step()
        assert opt._plans.cached_steps == 3
        results.append(bits(opt, params))
    assert all(same(results[0], r) for r in results[1:])


def test_an_instruction_set_the_cpu_lacks_is_refused(monkeypatch):
    from lowp.optim.kernels.native import build
    monkeypatch.setenv("LOWP_NATIVE_ISA", "sse2")
    with pytest.raises(ValueError, match="LOWP_NATIVE_ISA: expected one of"):
        build.isa()
    monkeypatch.setattr(build, "_cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("LOWP_NATIVE_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks avx512"):
        build.isa()
    monkeypatch.delenv("LOWP_NATIVE_ISA")
    assert build.isa() == "avx2"


@pytest.mark.parametrize("where", [(0, 0), (1, -1), (2, 70_000), (1, 0)], ids=["first, first", "second, last",
                                                                              "third, middle", "second, first"])
def test_the_pre_pass_skips_exactly_the_tensors_with_a_nan(where):
    """Three tensors of several work units (checked in the call's pre-pass) and a small one: a NaN
    anywhere skips exactly its tensor (the reference's bits)."""
    results = []
    for backend in ("native", "foreach"):
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16()) for n in (100_000, 150_001, 90_000)]
        params.append(torch.nn.Parameter(torch.randn(77, generator=gen).bfloat16()))
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0)
        for t in range(3):
            set_grads(params, t)
            if t == 2:
                params[where[0]].grad[where[1]] = float("nan")
            opt.step()
        results.append((opt, params))
    (native, p1), (reference, p2) = results
    assert native._plans.cached_steps == 2 and native.skipped_params == 1 == reference.skipped_params
    assert same(bits(native, p1), bits(reference, p2))


def test_a_kept_plan_holds_no_gradient_between_steps():
    """After a cached step and zero_grad(), the step's gradients are freed: the plan keeps
    pointers to weights and states only (peak memory as without it)."""
    import weakref
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend="native", seed=0)
    for t in range(3):
        set_grads(params, t)
        refs = [weakref.ref(p.grad) for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in refs), f"step {t}: a gradient outlived zero_grad"
    assert opt._plans.cached_steps == 2


def _release_run(backend: str, steps: int = 4, nan_at: int | None = None, grad_scale: float | None = None,
                 nonfinite: str = "skip_param"):
    """step_params over one parameter at a time, as gradient release does, with new gradients
    every step; the optimizer and its parameters."""
    params = make_params()
    opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0, nonfinite=nonfinite)
    finite = []
    for t in range(steps):
        set_grads(params, t)
        if nan_at is not None and t == nan_at:
            params[2].grad[3] = float("nan")
        for i, p in enumerate(params):
            if grad_scale is not None:
                p.grad.mul_(grad_scale)
            finite.append(opt.step_params([p], grad_scale=grad_scale, new_step=i == 0))
    return opt, params, finite


@pytest.mark.parametrize("case", ["plain", "grad_scale", "nan, skip_param", "nan, off with grad_scale",
                                  "nan, skip_step"])
def test_step_params_takes_a_cached_plan_per_parameter(case):
    """Gradient release's step_params([p]) calls take a cached plan per parameter after their first
    full step: the reference's bits, return values, counters and diagnostics."""
    kwargs = {"plain": {}, "grad_scale": {"grad_scale": 256.0}, "nan, skip_param": {"nan_at": 2},
              "nan, off with grad_scale": {"nan_at": 2, "grad_scale": 256.0, "nonfinite": "off"},
              "nan, skip_step": {"nan_at": 2, "nonfinite": "skip_step"}}[case]
    native, p1, f1 = _release_run("native", **kwargs)
    reference, p2, f2 = _release_run("foreach", **kwargs)
    assert native._plans.cached_steps >= 8
    assert f1 == f2
    assert (native.skipped_params, native.skipped_steps) == (reference.skipped_params, reference.skipped_steps)
    assert same(bits(native, p1), bits(reference, p2))
    assert native.diagnostics() == reference.diagnostics()


def test_release_gradients_steps_from_cached_plans():
    """release_gradients on a small model: every parameter's step after the first from its
    cached plan, the bits of the foreach backend."""
    results = []
    for backend in ("native", "foreach"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).bfloat16()
        opt = lo.AdamW(model.parameters(), lr=1e-2, backend=backend, seed=0)
        handle = lo.release_gradients(opt)
        for t in range(4):
            gen = torch.Generator().manual_seed(t)
            x, y = torch.randn(8, 16, generator=gen).bfloat16(), torch.randn(8, 4, generator=gen)
            ((model(x).float() - y) ** 2).mean().backward()
        handle.remove()
        results.append((opt, list(model.parameters())))
    (native, p1), (reference, p2) = results
    assert native._plans.cached_steps == 3 * len(p1)
    assert same(bits(native, p1), bits(reference, p2))


def test_step_params_between_states_only_steps_makes_plans_rarely():
    """Gradient release with accumulate="states": each parameter's whole step follows states-only
    steps that advance its count, so its plan never matches; plans are then made ever more rarely
    (and the bits stay the reference's)."""
    results = []
    for backend in ("native", "foreach"):
        params = make_params()
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0)
        built = [0]
        original = opt._plans.after_full_step

        def counting(optimizer, plan, subset=None, original=original, built=built):
            before = len(optimizer._plans.subsets)
            original(optimizer, plan, subset)
            built[0] += len(optimizer._plans.subsets) > before
        opt._plans.after_full_step = counting
        for t in range(40):
            set_grads(params, t)
            for p in params:
                opt.step_params([p], update_weights=t % 2 == 0)
        results.append((opt, params, built[0]))
    (native, p1, built), (reference, p2, _) = results
    assert native._plans.cached_steps == 0
    assert built <= 4 * 6   # per parameter at most 6 plans over its 20 whole steps (waits 1, 3, 7, 15...)
    assert same(bits(native, p1), bits(reference, p2))


@pytest.mark.parametrize("layout", ["dtypes interleaved", "step counts interleaved"])
def test_jobs_in_another_order_than_the_parameters_get_their_own_gradients(layout):
    """Jobs group parameters by dtype and step count, so the launches' order differs from the
    groups' (a bf16, an fp32, a bf16 parameter; or equal tensors whose step counts differ after a
    skipped NaN): every cached step hands each parameter its own gradient (the reference's bits)."""
    def train(backend):
        gen = torch.Generator().manual_seed(9)
        dtypes = [torch.bfloat16, torch.float32, torch.bfloat16] if layout == "dtypes interleaved" else \
            [torch.bfloat16] * 3
        params = [torch.nn.Parameter(torch.randn(64, generator=gen).to(d)) for d in dtypes]
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0)
        for t in range(6):
            set_grads(params, t)
            if layout == "step counts interleaved" and t == 1:
                params[1].grad[0] = float("nan")   # skipped: its step count falls one behind
            opt.step()
        return opt, params

    (native, p1), (reference, p2) = on_both(train)
    assert native._plans.cached_steps >= 3
    assert [native.state[p]["step"] for p in p1] == [reference.state[p]["step"] for p in p2]
    assert same(bits(native, p1), bits(reference, p2))


def test_a_new_block_size_is_not_stepped_from_the_old_plan():
    """state_block (an int option) is part of the plan's structure: changed between steps, the
    step is a full one, which reacts as it does without a plan."""
    outcomes = []
    for backend in ("native", "foreach"):
        params = make_params()
        opt = lo.AdamW(params, lr=1e-2, backend=backend, seed=0, state_dtype=EIGHT_BIT, coded_min_numel=0)
        for t in range(3):
            set_grads(params, t)
            opt.step()
        opt.param_groups[0]["state_block"] = 128
        set_grads(params, 3)
        before = opt._plans.cached_steps
        try:
            opt.step()
            outcome = ("stepped", bits(opt, params))
        except (ValueError, TypeError) as exc:
            outcome = ("raised", type(exc).__name__)
        outcomes.append(outcome)
        if backend == "native":
            assert opt._plans.cached_steps == before
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "stepped":
        assert same(outcomes[0][1], outcomes[1][1])
    else:
        assert outcomes[0] == outcomes[1]
