"""The native CPU backend (hand-written AVX2 kernel, lowp/optim/kernels/native/): bit for bit
against the reference pipeline for every elementwise optimizer x write-back mode and the dtypes
it supports (stochastic rounding included: every backend draws the bits of optim.randomness, the
same whatever the chunking, batching or grouping, across 2**32 too), tails and many tensors per
call, thread-count independence, the native non-finite check, checkpoints and the build cache.

Each variant compiles in about a second once per machine (then loads from the on-disk cache)."""
from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch

import lowp.optim as lo
from lowp.optim.backends import get_backend
from lowp.optim.kernels.native import build as native_build, kernel as native_kernel
from lowp.optim.kernels.native.source import variant_source
from lowp.optim.kernels.native.build import native_available
from lowp.optim.slices import StepContext
from lowp.optim.writeback import MODES
from lowp.optim.randomness import ElementIndex
from lowp.ulp import ulp
from safety_cases import set_grad
from fused_helpers import (SHAPES, assert_fused, assert_same_run, make_params, run_at_index,
                           train)


def _x86_with_avx2() -> bool:
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return {"avx2", "fma", "f16c"} <= set(flags) and shutil.which("g++") is not None


# The kernel exists for x86-64 with AVX2 only; everywhere else the fused option falls back (tested
# in test_fused.py). On such a machine, e.g. CI, every test here runs.
pytestmark = pytest.mark.skipif(not _x86_with_avx2(), reason="the native kernel needs x86-64 with AVX2 and g++")

FP32_STATES = dict(state_dtype=torch.float32)
# a 1-element tensor, a block of exactly 16, tails of 1 and 15, and one across two work units
NATIVE_SHAPES = [*SHAPES, (1,), (16,), (17,), (31,), (40000,)]


def reference(opt_class, mode, **kw):
    return train(opt_class, "foreach", mode, **kw)


def test_available_here():
    assert native_available()
    assert lo.AdamW([torch.zeros(8, dtype=torch.bfloat16)], fused=True).backend.name == "native"


@pytest.mark.parametrize("dtype,mode,extra", [
    (torch.bfloat16, "kahan", dict(state_rounding="nearest")),                          # bf16 states
    (torch.bfloat16, "nearest", dict(state_dtype=torch.float16, state_rounding="nearest")),  # fp16 states
    (torch.float16, "kahan", FP32_STATES),
    (torch.float16, "nearest", dict(state_rounding="nearest")),
    (torch.float32, "nearest", {}),
], ids=str)
def test_dtypes_bit_identical(dtype, mode, extra):
    kw = dict(lr=1e-2, weight_decay=0.1, steps=6, dtype=dtype, shapes=NATIVE_SHAPES, **extra)
    assert_same_run(train(lo.AdamW, "native", mode, **kw), reference(lo.AdamW, mode, **kw))


def test_fp32_gradients_of_bf16_weights_and_grad_scaler_factor():
    params = [torch.randn(s).bfloat16() for s in (100, 33)]
    runs = []
    for backend in ("native", "foreach"):
        ps = [p.clone() for p in params]
        opt = lo.AdamW(ps, lr=1e-2, backend=backend, state_dtype=torch.float32, seed=0)
        opt.grad_scale = torch.tensor(1024.0)  # what GradScaler sets: gradients are unscaled in the step
        for t in range(3):
            gen = torch.Generator().manual_seed(t)
            for p in ps:
                set_grad(p, torch.randn(p.shape, generator=gen) * 1024)  # fp32 gradients
            opt.step()
        runs.append((ps, opt))
    assert_same_run(*runs)
    assert_fused(runs[0][1], 3 * (100 + 33))


def test_many_tensors_in_one_call():
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(n),) for n in torch.randint(1, 700, (300,), generator=gen)]
    kw = dict(lr=1e-2, weight_decay=0.1, steps=3, shapes=shapes, **FP32_STATES)
    assert_same_run(train(lo.AdamW, "native", "kahan", **kw), reference(lo.AdamW, "kahan", **kw))


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float16)], ids=str)
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_stochastic_rounding_bit_identical_to_reference(mode, dtype, state_dtype):
    """Weights (stochastic mode), compensation (kahan) and states all rounded stochastically with
    the counter-based streams: the kernel equals the foreach reference bit for bit."""
    kw = dict(lr=1e-2, weight_decay=0.1, steps=4, dtype=dtype, state_dtype=state_dtype, shapes=NATIVE_SHAPES)
    native = train(lo.AdamW, "native", mode, **kw)
    assert_same_run(native, reference(lo.AdamW, mode, **kw))
    assert_same_run(native, train(lo.AdamW, "native", mode, **kw))  # reproducible from the seed


@pytest.mark.parametrize("mode", ["stochastic", "kahan", "exact8"])
def test_bits_do_not_depend_on_chunks_batches_groups_or_backend(mode):
    """The streams are keyed by parameter position and element index: chunk sizes, how slices are
    batched, and splitting the parameters over groups change nothing."""
    kw = dict(lr=1e-2, weight_decay=0.1, steps=3, shapes=NATIVE_SHAPES)
    native = train(lo.AdamW, "native", mode, **kw)
    assert_same_run(native, reference(lo.AdamW, mode, chunk_size=1000, **kw))
    assert_same_run(native, reference(lo.AdamW, mode, chunk_size=4096, **kw))
    eager = train(lo.AdamW, "eager", mode, chunk_size=3333, **kw)
    assert_same_run(native, eager)
    params = make_params(shapes=NATIVE_SHAPES)
    split = lo.AdamW([{"params": params[:3]}, {"params": params[3:]}], lr=1e-2, weight_decay=0.1, mode=mode,
                     backend="native", seed=1)
    for t in range(3):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        split.step()
    assert_fused(split, 3 * sum(p.numel() for p in params))
    for x, y in zip(params, native[0]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("mode", ["stochastic", "kahan", "exact8"])
def test_elements_across_two_to_the_32_equal_the_reference(mode):
    """A slice whose global indices run from 2**32 - 100 across 2**32 (in the middle of a 16-element
    block, so one block mixes both folds of the high bits): kernel and reference agree, with a
    reference chunk boundary inside too, and the bits differ from those of offset 0."""
    index = ElementIndex(offset=(1 << 32) - 100)
    native = run_at_index("native", mode, index)
    for ref in (run_at_index("foreach", mode, index), run_at_index("foreach", mode, index, chunk_size=64)):
        for x, y in zip(native, ref):
            assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(native, run_at_index("native", mode, ElementIndex())))


@pytest.mark.parametrize("below", [256, 255, 241, 16])
def test_groups_that_end_at_or_cross_two_to_the_32_equal_the_reference(below):
    """The step draws one set of stream keys per group of 256 elements unless the group crosses a
    multiple of 2**32: groups that end exactly at 2**32 - 1 (``below`` = 256) or one element past it
    (255), and blocks of 16 that do (241: the last block of the first group straddles; 16: the first
    block ends at it) give the reference's bits."""
    index = ElementIndex(offset=(1 << 32) - below)
    native = run_at_index("native", "stochastic", index, n=600)
    for x, y in zip(native, run_at_index("foreach", "stochastic", index, n=600)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_stochastic_rounding_of_specials_equals_the_reference(dtype):
    """Overflow to infinity, infinities, signed zeros, subnormals and NaNs with any payload: the
    kernel's rounding equals the reference's bit for bit, and every NaN stays a NaN."""
    finfo = torch.finfo(dtype)
    top = finfo.max + float(ulp(torch.tensor(finfo.max, dtype=torch.float64), "bf16" if dtype == torch.bfloat16
                                                                              else "fp16")) / 2
    x = torch.tensor([finfo.max, top, -top, 1e38, float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -3e-8, 6e-8, 1e-45,
                      1.0, -1.0 - 2.0 ** -12] * 8)
    bits = x.view(torch.int32)
    bits[-6:] = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC0FFFF, 0x7F80FFFF, -8388607], dtype=torch.int32)
    assert x[-6:].isnan().all()
    got = _stochastic_weights(x, dtype, "native")
    want = _stochastic_weights(x, dtype, "foreach")
    assert torch.equal(got.isnan(), x.isnan()) and torch.equal(want.isnan(), x.isnan())
    assert torch.equal(got.view(torch.int16)[~x.isnan()], want.view(torch.int16)[~x.isnan()])
    if dtype == torch.bfloat16:  # NaN bits: the top half of the fp32 NaN with the quiet bit set
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[:8].isinf().sum() >= 1  # top is half an ulp past the largest value: inf half the time


def test_stochastic_rounding_lands_on_a_neighbour_and_depends_on_the_seed():
    # one step from zero states: both runs add the same update u, one rounds w + u stochastically,
    # the other to nearest, so they are at most one bf16 ulp apart (and not always equal)
    stochastic = train(lo.AdamW, "native", "stochastic", steps=1, lr=1e-3)[0]
    nearest = train(lo.AdamW, "native", "nearest", steps=1, lr=1e-3)[0]
    for x, y in zip(stochastic, nearest):
        assert ((x.double() - y.double()).abs() <= ulp(y.double(), "bf16")).all()
    assert any(not torch.equal(x, y) for x, y in zip(stochastic, nearest))
    params = SHAPES
    other = lo.AdamW([torch.zeros(s, dtype=torch.bfloat16) + 0.1 for s in params], lr=1e-3, mode="stochastic",
                     backend="native", seed=2)
    same = lo.AdamW([torch.zeros(s, dtype=torch.bfloat16) + 0.1 for s in params], lr=1e-3, mode="stochastic",
                    backend="native", seed=1)
    for opt in (other, same):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.full(p.shape, 1e-3).bfloat16()
        opt.step()
        assert_fused(opt, sum(p.numel() for p in opt.param_groups[0]["params"]))
    assert any(not torch.equal(p, q) for p, q in zip(other.param_groups[0]["params"], same.param_groups[0]["params"]))


def test_result_does_not_depend_on_thread_count():
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(train(lo.AdamW, "native", "kahan", shapes=[(70000,), (5,), (40000,)], lr=1e-3))
    finally:
        torch.set_num_threads(before)
    assert_same_run(runs[0], runs[1])
    assert_same_run(runs[0], runs[2])


def test_native_finite_check_matches_reference():
    grads = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 15, 16, 17, 70000, 140000):
            for bad in (None, float("nan"), float("inf"), float("-inf")):
                g = torch.randn(n).to(dtype)
                if bad is not None:
                    g[(n * 7) // 11] = bad
                grads.append(g)
    grads += [torch.randn(10, 10).t(), torch.randn(5).double(),  # non-contiguous and fp64: torch's check
              torch.full((3,), 65504.0, dtype=torch.float16), torch.empty(0)]
    flags = get_backend("native").finite_flags(grads)
    assert flags == get_backend("foreach").finite_flags(grads)
    assert flags.count(False) == 3 * 6 * 3


def test_empty_gradients_leave_the_others_to_the_one_bulk_check(monkeypatch):
    from lowp.optim.kernels.native import kernel

    grads = [torch.randn(40), torch.empty(0), torch.tensor([1.0, float("nan")]).bfloat16(),
             torch.empty(0, dtype=torch.bfloat16).reshape(0, 3), torch.randn(7).half()]
    grads[0][3] = float("inf")
    grads[1].untyped_storage().resize_(0)    # an empty shard's gradient may have no memory at all
    monkeypatch.setattr(kernel, "kernel_memory", lambda *a: pytest.fail("per-tensor check"))
    assert get_backend("native").finite_flags(grads) == [False, True, False, True, True]


@pytest.mark.parametrize("policy", ["skip_param", "skip_step"])
def test_nonfinite_gradient_touches_nothing(policy):
    runs = []
    for backend in ("native", "foreach"):
        gen = torch.Generator().manual_seed(5)
        params = [torch.randn(s, generator=gen).bfloat16() for s in (100, 20000)]
        opt = lo.AdamW(params, lr=1e-2, backend=backend, nonfinite=policy, seed=2, **FP32_STATES)
        for t in range(3):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
                if t == 1 and i == 1:
                    p.grad[123] = float("nan")
            opt.step()
        runs.append((params, opt))
    assert_same_run(*runs)
    # step 2 skipped the NaN's parameter (skip_param) or every parameter (skip_step): the kernel ran the rest
    assert_fused(runs[0][1], 3 * 100 + 2 * 20000 if policy == "skip_param" else 2 * (100 + 20000))
    assert all(torch.isfinite(v).all() for v in runs[0][1].state[runs[0][0][1]].values() if isinstance(v, torch.Tensor)
               and v.is_floating_point())


@pytest.mark.parametrize("mode", ["kahan", "stochastic", "exact8"])
def test_checkpoint_resume_continues_bit_identically(mode):
    """The seed and the step counters define every stream: nothing else needs saving."""
    straight = train(lo.AdamW, "native", mode, steps=5, lr=1e-3)
    params, opt = train(lo.AdamW, "native", mode, steps=3, lr=1e-3)
    saved = opt.state_dict()
    resumed = lo.AdamW(params, lr=1e-3, backend="native", mode=mode, seed=123)
    resumed.load_state_dict(saved)
    for t in range(3, 5):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        resumed.step()
    assert_fused(resumed, 2 * sum(p.numel() for p in params))
    for x, y in zip(straight[0], params):
        assert torch.equal(x, y)


def sgd_source() -> str:
    """The generated source of plain SGD on fp32 tensors, nearest mode."""
    group = lo.SGD([torch.zeros(2)], lr=0.1).param_groups[0]
    ctx = StepContext(group, MODES["nearest"], 1)
    return variant_source("sgd", native_kernel.variant_for(lo.SGD.spec, ctx, (torch.float32, torch.float32, None)))


def test_build_cache_is_reused_and_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_LOADED", {})
    source = sgd_source()
    native_build.step_function(source)
    built = list((tmp_path / "kernels").glob("step-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_build, "_LOADED", {})
    native_build.step_function(source)  # a new process would load it from the cache
    assert built[0].stat().st_mtime_ns == stamp
    monkeypatch.setattr(native_build, "_LOADED", {})
    with pytest.raises(RuntimeError, match="compiling step failed"):  # no such dtype code: a static_assert fails
        native_build.step_function(source.replace("#define LOWP_W 0", "#define LOWP_W 7"))
    monkeypatch.setattr(native_kernel, "native_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend='native'"):
        lo.AdamW([torch.zeros(3)], backend="native")


@pytest.mark.parametrize("grad_dtype,state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=["all-bf16 (no NaN guard)", "fp32 inputs (NaN guard)"])
def test_unchecked_nan_and_inf_propagate_like_the_reference(grad_dtype, state_dtype):
    """With ``nonfinite="off"`` bad gradients reach the kernel: NaNs stay NaNs (an fp32 NaN with
    every payload bit set would turn into -0.0 under an unguarded bf16 rounding) and every other
    element equals the reference."""
    runs = []
    for backend in ("native", "foreach"):
        gen = torch.Generator().manual_seed(9)
        params = [torch.randn(s, generator=gen).bfloat16() for s in (64, 1000)]
        opt = lo.AdamW(params, lr=1e-2, backend=backend, mode="kahan", nonfinite="off", state_dtype=state_dtype,
                       state_rounding="nearest", seed=2)
        for t in range(3):
            for p in params:
                g = torch.randn(p.shape, generator=gen).to(grad_dtype)
                g[5 + t] = float("inf")
                g.view(torch.int32 if grad_dtype == torch.float32 else torch.int16)[20 + t] = \
                    0x7FFFFFFF if grad_dtype == torch.float32 else 0x7FFF  # NaN, all payload bits set
                set_grad(p, g)
            opt.step()
        if backend == "native":
            assert_fused(opt, 3 * (64 + 1000))
        runs.append([params, *(t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)
                               and t.is_floating_point())])
    native, ref = runs
    for x, y in zip([*native[0], *native[1:]], [*ref[0], *ref[1:]]):
        assert torch.equal(x.isnan(), y.isnan())
        assert x.isnan().any()
        assert torch.equal(x[~x.isnan()], y[~y.isnan()])


STABLE_SHAPES = [*SHAPES, (17,), (40000,)]  # the RMS is per tensor: no one-element tensors here


def stable_data(grad_scales: list[float]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial bf16 weights and, per step, bf16 gradients scaled by ``grad_scales[step]``."""
    gen = torch.Generator().manual_seed(4)
    params = [(torch.randn(s, generator=gen) * 0.1).bfloat16() for s in STABLE_SHAPES]
    grads = [[(torch.randn(s, generator=gen) * scale).bfloat16() for s in STABLE_SHAPES] for scale in grad_scales]
    return params, grads


def stable_run(backend: str, mode: str, grad_scales: list[float], **kw):
    params, grads = stable_data(grad_scales)
    opt = lo.StableAdamW(params, lr=1e-2, backend=backend, mode=mode, seed=1, **kw)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    if backend == "native":  # every element through the kernel, pre-pass and all
        assert_fused(opt, len(grads) * sum(p.numel() for p in params))
    return params, opt


@pytest.mark.parametrize("mode", ["nearest", "kahan", "exact", "exact8"])
def test_stableadamw_bit_identical_while_the_rms_clip_is_off(mode):
    # halving gradients keep g^2 below v_hat on average: RMS(g^2 / v_hat) < 1, lr_t = lr exactly
    kw = dict(state_dtype=torch.float32, weight_decay=0.1)
    scales = [0.5 ** t for t in range(6)]
    assert_same_run(stable_run("native", mode, scales, **kw), stable_run("foreach", mode, scales, **kw))


def test_stableadamw_clipped_steps_bit_identical():
    """A 100x larger gradient after a small one makes RMS(g^2 / v_hat) about sqrt(2) (beta2 =
    0.999), so lr_t = lr / RMS. The kernel and the reference add the tensor's g^2 / v_hat in one
    order (lowp.optim.ordered_sum) and take lr_t by one formula: the same bits."""
    kw = dict(state_dtype=torch.float32, betas=(0.9, 0.999))
    scales = [0.01, 1.0, 1.0]
    _, (g1, g2, _) = stable_data(scales)
    for a, b in zip(g1, g2):  # the clip is on at step 2 in every tensor (fp64, from the definition)
        v = 0.999 * 0.001 * a.double() ** 2 + 0.001 * b.double() ** 2
        assert (b.double() ** 2 / (v / (1 - 0.999 ** 2))).mean().sqrt() > 1.2
    assert_same_run(stable_run("native", "exact", scales, **kw), stable_run("foreach", "exact", scales, **kw))


def test_stableadamw_stochastic_reproducible_and_fused():
    a = stable_run("native", "stochastic", [1.0, 0.5])
    assert_same_run(a, stable_run("native", "stochastic", [1.0, 0.5]))
    assert not any(torch.equal(p, q) for p, q in zip(a[0], stable_data([1.0])[0]))  # (stable_run: all fused)


@pytest.mark.parametrize("mode", ["nearest", "kahan", "stochastic", "exact8"])
def test_zero_updates_count_as_stalled_like_the_reference(mode):
    """``stalled_fraction`` counts elements whose stored weight did not change, zero updates
    included (lowp.optim.writeback); a parameter with an all-zero gradient and no weight decay
    has u = 0 everywhere."""
    runs = []
    for backend in ("native", "foreach"):
        params = [torch.full((100,), 0.5, dtype=torch.bfloat16), torch.full((60,), 0.5, dtype=torch.bfloat16)]
        opt = lo.AdamW(params, lr=1e-2, weight_decay=0.0, backend=backend, mode=mode, state_rounding="nearest",
                       **FP32_STATES)
        params[0].grad = torch.zeros(100, dtype=torch.bfloat16)
        params[1].grad = torch.ones(60, dtype=torch.bfloat16)
        opt.step()
        if backend == "native":
            assert_fused(opt, 160)
        runs.append(opt.diagnostics()[0]["stalled_fraction"])
    assert runs[0] == runs[1] == pytest.approx(100 / 160)


def test_no_new_variant_across_steps_lr_changes_groups_and_sizes(monkeypatch):
    """A variant is one compiled kernel (built once per machine); the step's numbers are data."""
    variants = []
    source = native_kernel.variant_source
    monkeypatch.setattr(native_kernel, "variant_source",
                        lambda name, v: variants.append(source(name, v)) or source(name, v))
    params, opt = train(lo.AdamW, "native", "kahan", steps=1, lr=1e-3, weight_decay=0.01)
    first = set(variants)
    extra = [torch.randn(123, 7).bfloat16(), torch.randn(3).bfloat16()]
    opt.add_param_group({"params": extra, "lr": 3e-3, "weight_decay": 0.05})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    before = [p.clone() for p in extra]
    for _ in range(3):
        for p in [*params, *extra]:
            p.grad = torch.randn(p.shape).bfloat16()
        opt.step()
        sched.step()
    assert len(variants) > len(first) and set(variants) == first  # ran again, with the same variants only
    assert_fused(opt, 4 * sum(p.numel() for p in params) + 3 * sum(p.numel() for p in extra))
    assert all(not torch.equal(p, q) for p, q in zip(extra, before))


def _stochastic_weights(x: torch.Tensor, dtype: torch.dtype, backend: str, seed: int = 1) -> torch.Tensor:
    """SR(x) to ``dtype`` through ``backend``: SGD with lr 1 from a zero weight adds exactly
    ``-g = x`` (a NaN gradient passes through the product and the sum with its payload)."""
    w = torch.zeros(x.numel(), dtype=dtype)
    opt = lo.SGD([w], lr=1.0, mode="stochastic", backend=backend, seed=seed, nonfinite="off")
    set_grad(w, -x.float())
    opt.step()
    if backend == "native":
        assert_fused(opt, x.numel())
    return w


def _stochastic_fp16(x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """SR_fp16(x) through the kernel."""
    return _stochastic_weights(x, torch.float16, "native", seed)


def test_fp16_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    from lowp import quantize

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50000, generator=gen) * 10.0 ** torch.randint(-9, 5, (50000,), generator=gen).float()
    x = torch.cat([x, torch.tensor([65504.0, 65519.0, 65530.0, 1e6, -1e6, float("inf"), -float("inf"), 0.0, -0.0,
                                    6e-8, 3e-8, -1e-7, float("nan")])])
    r = _stochastic_fp16(x).float()
    down, up = (quantize(x, "fp16", mode=m).float() for m in ("down", "up"))
    assert ((r == down) | (r == up) | (r.isnan() & x.isnan())).all()  # overflow included: 1e6 -> inf
    n = 1 << 16
    for value, p_up, moved in [(1.0 + 2.0 ** -10 / 4, 0.25, lambda y: y > 1),    # a quarter ulp above 1
                               (2.0 ** -24 * 0.3, 0.3, lambda y: y > 0),        # subnormal range
                               (65504 + 32 * 0.5, 0.5, lambda y: y.isinf())]:   # half way to overflow
        freq = float(moved(_stochastic_fp16(torch.full((n,), value)).float()).float().mean())
        assert abs(freq - p_up) < 5 * (p_up * (1 - p_up) / n) ** 0.5


def test_fp16_weights_and_states_with_stochastic_rounding_are_fused(monkeypatch):
    variants = []
    source = native_kernel.variant_source
    monkeypatch.setattr(native_kernel, "variant_source", lambda name, v: variants.append(v) or source(name, v))
    kw = dict(lr=1e-3, dtype=torch.float16, state_dtype=torch.float16)  # fp16 states, stochastic rounding
    a = train(lo.AdamW, "native", "stochastic", **kw)
    assert any(v.mode == "stochastic" and v.weight == torch.float16 and v.states[0] == torch.float16
               and v.stochastic_states for v in variants)
    assert_same_run(a, train(lo.AdamW, "native", "stochastic", **kw))  # reproducible from the seed
    nearest = train(lo.AdamW, "native", "nearest", steps=1, **dict(kw, state_rounding="nearest"))[0]
    one = train(lo.AdamW, "native", "stochastic", steps=1, **kw)[0]
    for x, y in zip(one, nearest):  # one step from zero states: at most one fp16 ulp apart
        assert ((x.double() - y.double()).abs() <= ulp(y.double(), "fp16")).all()


def test_helpers_fail_when_the_kernel_is_refused(monkeypatch):
    """The proof that these tests prove something: with the kernel refusing every spec, each step
    silently takes the reference pipeline, bit-identical to it by design,
    and only the backend's element counts tell; every shared helper and check then fails."""
    kw = dict(lr=1e-2, weight_decay=0.1, steps=2, shapes=NATIVE_SHAPES, **FP32_STATES)
    fused = train(lo.AdamW, "native", "kahan", **kw)
    monkeypatch.setattr(native_kernel.NativeKernel, "supports", lambda self, spec: False)
    refused = train(lo.AdamW, "native", "kahan", expect_fused=False, **kw)
    assert_same_run(refused, train(lo.AdamW, "foreach", "kahan", **kw))  # equality alone cannot tell
    with pytest.raises(AssertionError, match="elements"):
        assert_fused(refused[1], fused[1].backend.fused_elements)
    with pytest.raises(AssertionError, match="elements"):
        train(lo.AdamW, "native", "kahan", **kw)
    with pytest.raises(AssertionError, match="elements"):
        run_at_index("native", "kahan", ElementIndex(), n=100, steps=1)
    with pytest.raises(AssertionError, match="elements"):
        stable_run("native", "kahan", [1.0])
    with pytest.raises(AssertionError, match="elements"):
        _stochastic_weights(torch.randn(64), torch.bfloat16, "native")


def test_the_library_reference_itself_equals_the_kernel_on_fp32_weights():
    """fp32 weights show every bit of the update: the reference's square roots must be correctly
    rounded as the kernel's are (torch's CPU sqrt is not, for about 0.6% of inputs)."""
    runs = []
    for backend in ("foreach", "native"):
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(77_000, generator=gen)
        opt = lo.AdamW([p], lr=1e-3, weight_decay=0.01, backend=backend, seed=1)
        for _ in range(3):
            p.grad = torch.randn(77_000, generator=gen)
            opt.step()
        runs.append(p)
    assert torch.equal(*runs)


FIVE_BYTES = dict(mode="exact8", state_dtype=dict(exp_avg=torch.int8, exp_avg_sq=torch.uint8))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) reads the built library")
@pytest.mark.parametrize("kw,lines", [({}, 5 * 8),   # weight, gradient, compensation, two states: 512 bytes each
                                      (FIVE_BYTES, 2 * 8 + 3 * 4)],   # bf16 weight, gradient; 1-byte remainder, codes
                         ids=["defaults", "5 bytes per parameter"])
def test_the_step_libraries_prefetch(tmp_path, monkeypatch, kw, lines):
    """The unit loops' software prefetch (step.h's prefetch_group) is in the built step, every
    64-byte line of every stream of a 256-element group (the loops unrolled): GCC deleted it
    silently twice (an out-of-line call with prefetches as its only effect: the whole group's,
    then the states' through for_states' lambda), which only a timing would have shown."""
    import subprocess

    monkeypatch.setenv("LOWP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_LOADED", {})
    p = torch.nn.Parameter(torch.randn(4096).bfloat16())
    p.grad = torch.randn(4096).bfloat16()
    opt = lo.AdamW([p], lr=1e-3, backend="native", **kw)
    opt.step()
    assert_fused(opt, 4096)
    (library,) = (tmp_path / "kernels").glob("step-*.so")
    listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    count = listing.count("prefetch")
    assert count >= lines and count % lines == 0, (count, lines)   # whole groups' worth
